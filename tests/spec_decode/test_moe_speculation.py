"""Speculation on mixture-of-experts targets stays lossless: greedy output token for token that of plain
decoding with n-gram and suffix lookup, a draft model (dense, and MoE) and EAGLE-3 with a random head. A
verification step's rows route to different experts, so this checks the grouping by expert, not only the
one-row decode."""
from __future__ import annotations

import pytest
import torch

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from tests.models.drafter_checkpoints import write_eagle3
from tests.models.test_moe import greedy_tokens
from tests.tiny_models import save_hf_folder, tiny_hf_model

ENGINE = dict(max_model_len=128, max_num_batched_tokens=24, block_size=8, max_num_seqs=4)
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
K = 3  # drafts per step


def _prompts() -> list[dict]:
    """Mixed lengths; two repeat a pattern, so lookup proposers find matches from the start."""
    g = torch.Generator().manual_seed(0)
    pattern = torch.randint(3, 150, (6,), generator=g).tolist()
    random = [torch.randint(3, 150, (n,), generator=g).tolist() for n in (5, 30)]
    return [{"prompt_token_ids": p} for p in (pattern * 3, random[0], random[1], pattern * 5)]


def _token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict:
    """Per family: (transformers model, folder, plain greedy tokens)."""
    out = {}
    for kind, overrides in (("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1])),
                            ("qwen2_moe", dict(num_hidden_layers=3)), ("mixtral", dict(num_hidden_layers=3))):
        hf = tiny_hf_model(kind, **overrides)
        folder = save_hf_folder(hf, tmp_path_factory.mktemp(kind))
        out[kind] = (hf, folder, _token_ids(LLM(model=folder, **ENGINE).generate(_prompts(), PARAMS, use_tqdm=False)))
    return out


def _speculate(folder: str, spec: dict) -> tuple[list[list[int]], object]:
    # A fixed draft length: the adaptive policy may stop drafting in a busy batch, and these tests need drafts.
    llm = LLM(model=folder, speculative_config=dict(spec, adaptive_draft_length=False), **ENGINE)
    outputs = _token_ids(llm.generate(_prompts(), PARAMS, use_tqdm=False))
    return outputs, llm.get_metrics()


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_plain_decoding_is_transformers_greedy(kind, targets):
    hf, _, plain = targets[kind]
    for prompt, tokens in zip(_prompts(), plain):
        assert tokens == greedy_tokens(hf, prompt["prompt_token_ids"], PARAMS.max_tokens)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    {"method": "suffix", "num_speculative_tokens": K},
])
def test_lookup_proposers_keep_greedy_output(kind, spec, targets):
    _, folder, plain = targets[kind]
    outputs, metrics = _speculate(folder, spec)
    assert outputs == plain
    assert metrics.num_drafts > 0 and metrics.num_accepted_tokens > 0


@pytest.mark.parametrize("draft_kind", ["qwen3", "mixtral"])  # a dense draft, and an MoE one
def test_a_draft_model_keeps_greedy_output(draft_kind, targets, tmp_path):
    _, folder, plain = targets["qwen3_moe"]
    draft = save_hf_folder(tiny_hf_model(draft_kind, seed=2, num_hidden_layers=1), tmp_path / "draft")
    outputs, metrics = _speculate(folder, {"method": "draft_model", "model": draft, "num_speculative_tokens": K})
    assert outputs == plain
    assert metrics.num_drafts > 0


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_eagle3_with_a_random_head_keeps_greedy_output(kind, targets, tmp_path):
    """The head reads the aux hidden states of all three layers, dense and MoE."""
    hf, folder, plain = targets[kind]
    written = write_eagle3(str(tmp_path / "eagle3"), hf.config, aux_layer_ids=[0, 1, 2])
    outputs, metrics = _speculate(folder, {"method": "eagle3", "model": written.folder, "num_speculative_tokens": K})
    assert outputs == plain
    assert metrics.num_drafts > 0
