"""With a seed, speculation never changes the output: on the default model a seeded request's tokens are a
function of its prompt, its sampling parameters and its seed only, under every speculative method (none
included), alone or among other requests, after earlier requests warmed the drafter's state (the suffix tree,
auto's choices, the prefix cache), and through preemption."""
import pytest

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

ENGINE = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128, kv_cache_memory_bytes=64 << 20)
SEEDED = [SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0.7, top_k=20, seed=12, max_tokens=40, ignore_eos=True)]
PROMPT = "Repeat this list twice: apples, pears, plums, cherries. apples, pears, plums, cherries. apples,"
OTHERS = ["Write a haiku about the sea.", "List the first ten prime numbers:", PROMPT]
OTHER_PARAMS = [SamplingParams(temperature=0.9, max_tokens=30), SamplingParams(temperature=0, max_tokens=24),
                SamplingParams(temperature=1.0, top_k=5, max_tokens=36, seed=99)]
FIXED = {"num_speculative_tokens": 4, "adaptive_draft_length": False}  # drafts every step, on any host


def _methods(default_gguf_path):
    return {
        "ngram": {"method": "ngram", "prompt_lookup_min": 2, **FIXED},
        "suffix": {"method": "suffix", **FIXED},
        "draft_model": {"method": "draft_model", "model": default_gguf_path, "quantization": "int8", **FIXED},
        "eagle3": {"method": "eagle3", **FIXED},
        "auto": {"method": "auto", "adaptive_draft_length": False},
    }


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Each seeded request alone on an engine without speculation."""
    llm = LLM(**ENGINE)
    return [llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0].token_ids for p in SEEDED]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("method", ["none", "ngram", "suffix", "draft_model", "eagle3", "auto"])
def test_a_seeded_request_gets_the_same_tokens_under_every_method(reference, default_gguf_path, method):
    spec = None if method == "none" else _methods(default_gguf_path)[method]
    llm = LLM(speculative_config=spec, **ENGINE)
    alone = [_tokens(llm.generate([PROMPT], p, use_tqdm=False))[0] for p in SEEDED]
    llm.generate(OTHERS, OTHER_PARAMS, use_tqdm=False)  # warms the suffix tree, auto's rates, the prefix cache
    batched = _tokens(llm.generate(OTHERS[:2] + [PROMPT, PROMPT], OTHER_PARAMS[:2] + SEEDED, use_tqdm=False))[2:]
    assert alone == reference and batched == reference
    if spec is not None:
        assert llm.get_metrics().num_drafts > 0, "nothing was drafted: the test would prove nothing"


def test_a_seeded_request_keeps_its_tokens_through_preemption(reference):
    """A KV cache too small for the batch: requests are preempted and recomputed, seeded ones included."""
    llm = LLM(speculative_config={"method": "suffix", **FIXED},
              **dict(ENGINE, max_model_len=256, kv_cache_memory_bytes=12 << 20))  # ~270 tokens of KV
    prompts = [PROMPT, PROMPT] + [f"Count from {i} to {i + 30}:" for i in range(6)]
    params = SEEDED + [SamplingParams(temperature=0.8, max_tokens=60, ignore_eos=True)] * 6
    outputs = _tokens(llm.generate(prompts, params, use_tqdm=False))
    assert llm.get_metrics().num_preemptions > 0
    assert outputs[:2] == reference
