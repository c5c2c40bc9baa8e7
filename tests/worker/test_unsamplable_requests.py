"""Requests whose next token cannot be drawn under their own rules, end to end on a tiny random Llama: an ended
grammar under min_tokens emits EOS and stops there, as in vLLM (never a token outside the grammar), and logits that extreme penalties turn
into inf/NaN fail their request alone, with a message, while the batch-mates get the tokens they get without it.
With and without speculation (the rejection sampler's path)."""
import pytest

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.worker.test_structured import ENGINE, _peaked_model, _prompts, _save_with_tokenizer

CHOICE = StructuredOutputsParams(choice=["the quick brown fox", "the lazy dog", "a cat"])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _save_with_tokenizer(_peaked_model(), tmp_path_factory.mktemp("tiny_llama_unsamplable"))


def _spec(folder: str, method: str | None) -> dict | None:
    if method is None:
        return None
    return {"method": "draft_model", "model": folder, "num_speculative_tokens": 3, "adaptive_draft_length": False}


@pytest.mark.parametrize("method", [None, "draft_model"])
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 7)], ids=["greedy", "seeded"])
def test_an_ended_grammar_stops_at_eos_before_min_tokens(folder, method, temperature, seed):
    llm = LLM(model=folder, speculative_config=_spec(folder, method), **ENGINE)
    free = SamplingParams(temperature=temperature, seed=seed, max_tokens=20, structured_outputs=CHOICE)
    held = SamplingParams(temperature=temperature, seed=seed, max_tokens=20, min_tokens=12, structured_outputs=CHOICE)
    prompts = _prompts(3)
    for plain, out in zip(llm.generate(prompts, free, use_tqdm=False), llm.generate(prompts, held, use_tqdm=False)):
        ids, eos = plain.outputs[0].token_ids, plain.outputs[0].token_ids[-1]
        assert plain.outputs[0].finish_reason == "stop" and len(ids) < 12  # the grammar ended, then EOS
        assert out.outputs[0].token_ids == ids and ids[-1] == eos
        assert out.outputs[0].text == plain.outputs[0].text and out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("method", [None, "draft_model"])
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 7)], ids=["greedy", "seeded"])
def test_logits_made_infinite_by_a_penalty_fail_their_request_alone(folder, method, temperature, seed):
    llm = LLM(model=folder, speculative_config=_spec(folder, method), **ENGINE)
    mates = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=0.9, seed=3, max_tokens=12)]
    extreme = SamplingParams(temperature=temperature, seed=seed, max_tokens=12, repetition_penalty=1e-40)
    prompts = _prompts(3)
    alone = llm.generate(prompts[1:], mates, use_tqdm=False)
    outputs = llm.generate(prompts, [extreme] + mates, use_tqdm=False)
    failed = outputs[0]
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert "sampling" in failed.error and "repetition_penalty=1e-40" in failed.error, failed.error
    assert [o.outputs[0].token_ids for o in outputs[1:]] == [o.outputs[0].token_ids for o in alone]
    assert llm.get_metrics().num_engine_restarts == 0
