"""The engine's KV budget in tokens follows kv_cache_dtype: the same memory holds 2x the tokens in bfloat16 and
256 / 80 = 3.2x in int8 at head_dim 64 (a scale of 4 bytes per 16 numbers), target and drafter alike; bad values
are refused by name."""
import pytest

pytest.importorskip("transformers", reason="the tiny random models come from transformers (pip install '.[test]')")

from specserve.config import EngineConfig  # noqa: E402
from specserve.llm import LLM  # noqa: E402
from tests.tiny_models import save_hf_folder, tiny_hf_model  # noqa: E402

BUDGET = 8 << 20
ROW_BYTES = {"auto": 256, "bfloat16": 128, "int8": 80}  # one kv head's key (or value) of one token, head_dim 64


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny target with head_dim 64 and a draft model of the same shape."""
    root = tmp_path_factory.mktemp("kv_budget")
    shape = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    return (save_hf_folder(tiny_hf_model("llama", **shape), root / "target"),
            save_hf_folder(tiny_hf_model("llama", seed=9, **shape), root / "draft"))


def _num_blocks(folder, kv_cache_dtype, spec=None) -> int:
    llm = LLM(model=folder, kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=BUDGET, max_model_len=128,
              speculative_config=spec)
    return llm.llm_engine.kv_cache_manager.num_blocks


@pytest.mark.parametrize("with_drafter", [False, True])
def test_the_same_memory_holds_more_tokens(folders, with_drafter):
    target, draft = folders
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2} if with_drafter else None
    layers = 2 * (2 if with_drafter else 1)  # the target's 2 layers, and the draft model's
    for kv_cache_dtype, row in ROW_BYTES.items():
        per_block = 2 * layers * 16 * row  # keys and values, 16 tokens a block, one kv head
        assert _num_blocks(target, kv_cache_dtype, spec) == BUDGET // per_block, kv_cache_dtype
    fp32 = _num_blocks(target, "auto", spec)
    assert _num_blocks(target, "bfloat16", spec) == 2 * fp32
    assert 3.15 < _num_blocks(target, "int8", spec) / fp32 < 3.25


@pytest.mark.parametrize("bad", ["fp8", "float32", "INT8", None])
def test_bad_values_are_refused_naming_the_field_and_the_choices(bad):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of 'auto', 'bfloat16', 'int8'"):
        EngineConfig(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(kv_cache_dtype=bad)

