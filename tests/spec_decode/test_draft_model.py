"""Draft-model configuration errors are caught at start, with a message saying what is wrong."""
import pytest

from specserve.llm import LLM
from tests.tiny_models import tiny_hf_model


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    tiny_hf_model("llama").save_pretrained(str(tmp_path))  # vocabulary of 160, the target's is 49152
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(max_model_len=256, speculative_config={"method": "draft_model", "model": str(tmp_path)})


def test_a_missing_draft_model_path_is_refused():
    with pytest.raises((ValueError, FileNotFoundError), match="nowhere"):
        LLM(max_model_len=256, speculative_config={"method": "draft_model", "model": "/nowhere/draft"})
