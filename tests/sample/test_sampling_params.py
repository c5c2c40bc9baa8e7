"""SamplingParams: vLLM defaults, normalisation, and a ValueError naming each bad field."""

import pytest

from specserve.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert p.num_speculative_tokens is None and not p.ignore_eos


def test_normalisation():
    p = SamplingParams(top_k=-1, stop="###", stop_token_ids=(3, 4))
    assert p.top_k == 0 and p.stop == ["###"] and p.stop_token_ids == [3, 4]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n must be >= 1, got 0"),
    (dict(temperature=-1), "temperature must be >= 0, got -1"),
    (dict(top_p=0), "top_p must be in (0, 1], got 0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(top_k=-2), "top_k must be >= 0 (or -1 to disable), got -2"),
    (dict(min_p=1.1), "min_p must be in [0, 1], got 1.1"),
    (dict(seed=1.5), "seed must be an int or None, got 1.5"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0, got 0"),
    (dict(max_tokens=0), "max_tokens must be >= 1 or None, got 0"),
    (dict(min_tokens=-1), "min_tokens must be >= 0, got -1"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens must be <= max_tokens (4), got 5"),
    (dict(logprobs=-1), "logprobs must be in [0, 20] or None, got -1"),
    (dict(logprobs=21), "logprobs must be in [0, 20] or None, got 21"),
    (dict(prompt_logprobs=0), "prompt_logprobs must be None (not supported yet), got 0"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be ints >= 0, got -1"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of ints or None, got 5"),
    (dict(stop=[""]), "stop must be non-empty strings, got ''"),
    (dict(stop=7), "stop must be a str, a list of str or None, got 7"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens must be >= 0 or None, got -1"),
])
def test_invalid_values_name_field_and_range(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value) == message


def test_sampling_type():
    assert SamplingParams(temperature=0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6, seed=3).is_greedy
    assert SamplingParams(temperature=0.5).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.5, seed=3).sampling_type == SamplingType.RANDOM_SEED


def test_clone_is_deep():
    p = SamplingParams(stop=["x"], stop_token_ids=[1])
    q = p.clone()
    q.stop.append("y")
    q.stop_token_ids.append(2)
    assert p == SamplingParams(stop=["x"], stop_token_ids=[1]) and q != p
