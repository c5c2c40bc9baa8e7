"""Greedy speculation on a bfloat16 or int8 KV cache is token for token plain decoding on the same cache: a
verification step writes each token's K/V bits as a one-token step would (a scale per token and kv head) and
reads them the same way. Every drafter (ngram, suffix, a draft model with its own int8/bf16 KV, EAGLE-3 with
its own), with prefix caching on, on a full-attention model and a sliding-window one (Gemma 3)."""
from __future__ import annotations

import pytest
import torch

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from tests.models.drafter_checkpoints import write_eagle3
from tests.tiny_models import save_hf_folder, tiny_hf_model

ENGINE = dict(max_model_len=160, max_num_batched_tokens=24, block_size=4, max_num_seqs=4,
              kv_cache_memory_bytes=64 << 20, enable_prefix_caching=True)
PARAMS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
TARGETS = {"llama": dict(kind="llama", num_hidden_layers=3),
           "gemma3": dict(kind="gemma3", sliding_window=7, num_hidden_layers=3)}
KV_DTYPES = ["bfloat16", "int8"]


def _prompts() -> list[dict]:
    """Prompts over a small alphabet, so lookups find repeats."""
    g = torch.Generator().manual_seed(1)
    return [{"prompt_token_ids": torch.randint(3, 20, (n,), generator=g).tolist()} for n in (6, 25, 50)]


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request, tmp_path_factory):
    hf = tiny_hf_model(**TARGETS[request.param])
    folder = tmp_path_factory.mktemp(request.param)
    draft = save_hf_folder(tiny_hf_model("llama", seed=9), folder / "draft")
    eagle3 = write_eagle3(str(folder / "eagle3"), hf.config, aux_layer_ids=[0, 1, 2]).folder
    return request.param, save_hf_folder(hf, folder / "target"), draft, eagle3


def _generate(folder, kv_cache_dtype, spec=None) -> tuple[LLM, list[list[int]]]:
    """The prompts, then the last one extended by its output but for 4 tokens: a prefix-cache hit (in a
    windowed model's window pool too, whose blocks near the sequence's end are still cached)."""
    llm = LLM(model=folder, kv_cache_dtype=kv_cache_dtype, speculative_config=spec, **ENGINE)
    prompts = _prompts()
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    again = {"prompt_token_ids": prompts[-1]["prompt_token_ids"] + outs[-1][:-4]}
    return llm, outs + [llm.generate([again], PARAMS, use_tqdm=False)[0].outputs[0].token_ids]


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_every_drafter_keeps_plain_decodings_tokens(target, kv_cache_dtype):
    name, folder, draft, eagle3 = target
    _, plain = _generate(folder, kv_cache_dtype)
    drafters = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                          "prompt_lookup_max": 3},
                "suffix": {"method": "suffix", "num_speculative_tokens": 4},
                "draft_model": {"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
                "eagle3": {"method": "eagle3", "model": eagle3, "num_speculative_tokens": 3}}
    for method, spec in drafters.items():
        llm, out = _generate(folder, kv_cache_dtype, dict(spec, adaptive_draft_length=False))
        assert out == plain, (name, kv_cache_dtype, method)
        assert llm.get_metrics().num_draft_tokens > 0, (name, kv_cache_dtype, method)
        assert llm.get_metrics().prefix_cache_hits > 0, (name, kv_cache_dtype, method)
        runner = llm.llm_engine.runner
        stored = {runner.kv_dtype, *(k.dtype for k, _ in runner.kv_caches)}
        if runner.drafter_kv is not None:
            stored |= {k.dtype for k, _ in runner.drafter_kv.caches}
        assert stored == {getattr(torch, kv_cache_dtype)}, (method, stored)



@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_draft_trees_keep_plain_decodings_tokens(target, kv_cache_dtype, monkeypatch):
    """A verified tree writes each node's K/V into its path's blocks, and the accepted path's slots are moved
    into place (copy_slots): int8 rows move with their scales."""
    from specserve.worker import model_runner

    name, folder, _, eagle3 = target
    if name != "llama":
        pytest.skip("a model with windowed layers keeping their own blocks drafts chains only")
    trees = []
    layout = model_runner.layout
    monkeypatch.setattr(model_runner, "layout", lambda tree, *args: (trees.append(len(tree)), layout(tree, *args))[1])
    _, plain = _generate(folder, kv_cache_dtype)
    shape = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    _, out = _generate(folder, kv_cache_dtype, dict(method="eagle3", model=eagle3, num_speculative_tokens=3,
                                                    speculative_token_tree=str(shape), adaptive_draft_length=False))
    assert out == plain
    assert trees.count(len(shape)) > 5, trees
