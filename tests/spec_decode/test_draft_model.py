"""Draft-model configuration errors are caught at start, with a message saying what is wrong."""
import pytest

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from tests.tiny_models import tiny_hf_model


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    tiny_hf_model("llama").save_pretrained(str(tmp_path))  # vocabulary of 160, the target's is 49152
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(max_model_len=256, speculative_config={"method": "draft_model", "model": str(tmp_path)})


def test_a_missing_draft_model_path_is_refused():
    with pytest.raises((ValueError, FileNotFoundError), match="nowhere"):
        LLM(max_model_len=256, speculative_config={"method": "draft_model", "model": "/nowhere/draft"})


def test_drafting_time_is_measured_on_decode_steps_only(default_gguf_path):
    """The step that finishes a prompt has the drafter catch up on the whole prompt, a one-off cost
    per request that must not be priced into every later draft token."""
    llm = LLM(max_model_len=256, speculative_config={
        "method": "draft_model", "model": default_gguf_path, "num_speculative_tokens": 2,
        "adaptive_draft_length": False})
    runner = llm.llm_engine.runner
    seen = []
    observe = runner.draft_policy.observe_drafting
    runner.draft_policy.observe_drafting = lambda n, s: (seen.append(n), observe(n, s))
    calls = []
    propose = runner.proposer.propose
    runner.proposer.propose = lambda inputs: (calls.append(len(inputs.target_token_ids)), propose(inputs))[1]
    out = llm.generate([{"prompt_token_ids": list(range(1, 60))}],
                       SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    assert out.metrics.num_drafts > 1 and calls[0] == 59  # the first call came with the whole prompt
    # every drafting call but the one right after the prefill, each with the 2 drafts it made
    assert len(seen) == len(calls) - 1 and set(seen) == {2}
