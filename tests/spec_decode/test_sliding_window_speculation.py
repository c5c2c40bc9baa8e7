"""Sliding-window models end to end: plain decoding is transformers' greedy decoding, every drafter keeps it
(ngram, suffix, a draft model, EAGLE-3 with a random head) through chunked prefill, prefix-cache hits and
preemption, and a model whose every layer has a window frees the blocks that fall out of it."""
from __future__ import annotations

import pytest
import torch

from specserve.engine.kv_cache_manager import KVCacheManager
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from tests.models.drafter_checkpoints import write_eagle3
from tests.tiny_models import save_hf_folder, tiny_hf_model

WINDOW = 11
ENGINE = dict(max_model_len=128, max_num_batched_tokens=24, block_size=4, max_num_seqs=4,
              kv_cache_memory_bytes=64 << 20)
TIGHT = dict(ENGINE, num_kv_blocks=40)  # too few for four requests of ~90 tokens with full attention
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
TARGETS = {
    # every layer windowed: blocks before the window are freed
    "mistral": dict(kind="mistral", sliding_window=WINDOW, num_hidden_layers=3),
    # local layers and a global one (blocks kept for the global layer)
    "gemma3": dict(kind="gemma3", sliding_window=WINDOW, num_hidden_layers=3),
}


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of the transformers model, each from a full forward pass over the sequence so far (eos
    is a token like any other, as with ignore_eos)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _prompts() -> list[dict]:
    """Prompts of 5-60 tokens over a small alphabet, so lookups find repeats; the last repeats the first's
    start, a prefix-cache hit."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 24, (n,), generator=g).tolist() for n in (5, 30, 17, 60)]
    ids.append(ids[3][:48] + [7, 8, 9])
    return [{"prompt_token_ids": p} for p in ids]


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request, tmp_path_factory):
    hf = tiny_hf_model(**TARGETS[request.param])
    folder = save_hf_folder(hf, tmp_path_factory.mktemp(request.param))
    prompts = _prompts()
    reference = [hf_greedy(hf, p["prompt_token_ids"], 40) for p in prompts]
    return request.param, hf, folder, prompts, reference


def _generate(folder, prompts, engine=ENGINE, **kwargs) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=folder, **engine, **kwargs)
    return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def test_plain_decoding_is_transformers(target):
    name, _, folder, prompts, reference = target
    llm, out = _generate(folder, prompts, TIGHT)
    assert out == reference
    assert llm.llm_engine.kv_cache_manager.sliding_window == (WINDOW if name == "mistral" else 0)


def _drafters(tmp_path, hf) -> dict[str, dict]:
    draft = save_hf_folder(tiny_hf_model("llama", seed=9), tmp_path / "draft")
    eagle3 = write_eagle3(str(tmp_path / "eagle3"), hf.config, aux_layer_ids=[0, 1, 2]).folder
    return {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                      "prompt_lookup_max": 3},
            "suffix": {"method": "suffix", "num_speculative_tokens": 4},
            "draft_model": {"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
            "eagle3": {"method": "eagle3", "model": eagle3, "num_speculative_tokens": 3}}


@pytest.mark.parametrize("engine", ["roomy", "tight"])
def test_every_drafter_keeps_greedy_output(target, tmp_path, engine):
    name, hf, folder, prompts, reference = target
    for method, spec in _drafters(tmp_path, hf).items():
        llm, out = _generate(folder, prompts, TIGHT if engine == "tight" else ENGINE,
                             speculative_config=dict(spec, adaptive_draft_length=False))
        assert out == reference, (name, method)
        metrics = llm.get_metrics()
        assert metrics.num_draft_tokens > 0, (name, method)
        if engine == "tight":  # the global layer's blocks do not fit: preemption; freed windows fit
            assert (llm.llm_engine.scheduler.num_preemptions > 0) == (name == "gemma3"), (name, method)


def test_windowed_blocks_are_freed_as_a_request_grows(tmp_path, monkeypatch):
    """A 30-token prompt decoding 200 tokens holds at most window / block_size + 3 blocks (the window, the block
    being filled, the lookahead's) once decoding, whatever its length, in a pool of what the engine asks for; its
    output is transformers' although every freed block is filled with NaN as it is freed."""
    hf = tiny_hf_model(**TARGETS["mistral"])
    folder = save_hf_folder(hf, tmp_path / "m")
    held, caches = [], []
    allocate, drop = KVCacheManager.allocate_slots, KVCacheManager._drop_blocks_before_window

    def recording(self, request, *args, **kwargs):
        out = allocate(self, request, *args, **kwargs)
        held.append((request.num_computed_tokens, self.num_request_blocks(request.request_id)))
        return out

    def poisoning(self, rid, first_query):
        before = self.num_dropped_blocks.get(rid, 0)
        drop(self, rid, first_query)
        freed = torch.tensor(self.get_block_ids(rid)[before:self.num_dropped_blocks.get(rid, 0)], dtype=torch.long)
        for k_cache, v_cache in caches[0]:
            k_cache[freed] = float("nan")
            v_cache[freed] = float("nan")

    monkeypatch.setattr(KVCacheManager, "allocate_slots", recording)
    monkeypatch.setattr(KVCacheManager, "_drop_blocks_before_window", poisoning)
    prompt = torch.randint(3, 24, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    # the engine's minimum: the window's blocks and a 24-token prefill chunk's
    llm = LLM(model=folder, **dict(ENGINE, max_model_len=256, num_kv_blocks=-(-(WINDOW + 24) // 4) + 1),
              speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    caches.append(llm.llm_engine.runner.kv_caches)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == hf_greedy(hf, prompt, 200)
    assert held[-1][0] > 200
    assert max(blocks for computed, blocks in held if computed > 30) <= -(-WINDOW // 4) + 3 + 2, held
    kv = llm.llm_engine.kv_cache_manager
    assert kv.pool.num_free_blocks == kv.num_blocks  # everything back once the request finished


@pytest.mark.parametrize("poison", ["on_free", "on_allocate"])
def test_gemma3_window_layers_keep_only_their_window(tmp_path, monkeypatch, poison):
    """Gemma 3 (local layers and a global one): the local layers' own pool holds a request's window and one
    step's blocks whatever its length, while the global layer keeps every block. Blocks that pool frees are
    filled with NaN as they are freed (without prefix caching, which would keep them), or as they are handed
    out again (with it); the output is still transformers'. With prefix caching, a second request extending the
    first's sequence near its end hits in both pools (the window pool's last blocks stay cached until reused) and gives
    transformers' tokens too."""
    from specserve.engine.kv_cache_manager import HybridKVCacheManager

    hf = tiny_hf_model(**TARGETS["gemma3"])
    folder = save_hf_folder(hf, tmp_path / "g")
    llm = LLM(model=folder, **dict(ENGINE, max_model_len=256, enable_prefix_caching=poison == "on_allocate"),
              speculative_config={"method": "suffix"})
    runner, kv = llm.llm_engine.runner, llm.llm_engine.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager)
    windowed = [pair for pair, layer in zip(runner.kv_caches, runner.model.layers) if layer.window]
    assert windowed and all(k.shape[0] == kv.window.num_blocks < kv.full.num_blocks for k, _ in windowed)
    held = []

    def fill_nan(blocks):
        ids = torch.tensor([b.block_id for b in blocks], dtype=torch.long)
        for k_cache, v_cache in windowed:
            k_cache[ids] = float("nan")
            v_cache[ids] = float("nan")
        held.extend(kv.window.num_request_blocks(rid) for rid in kv.window.req_blocks)

    pool = kv.window.pool
    if poison == "on_free":
        free = pool.free
        monkeypatch.setattr(pool, "free", lambda blocks: (free(blocks), fill_nan(
            [b for b in blocks if b.ref_cnt == 0 and b is not pool.null_block])))
    else:
        allocate = pool.allocate
        monkeypatch.setattr(pool, "allocate", lambda n: (lambda blocks: (fill_nan(blocks), blocks)[1])(allocate(n)))
    prompt = torch.randint(3, 24, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    want = hf_greedy(hf, prompt, 150)
    assert llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids == want
    assert -(-(30 + 150) // 4) > kv.window.num_blocks - 1  # more logical blocks than the pool: reused ones
    step = ENGINE["max_num_batched_tokens"]
    assert max(held) <= -(-(WINDOW + step) // 4) + 1, held
    assert max(held[-20:]) <= -(-WINDOW // 4) + 3, held  # once decoding, about a window's worth
    if poison == "on_allocate":
        again = llm.generate([{"prompt_token_ids": prompt + want[:140]}], SamplingParams(
            temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
        assert again.outputs[0].token_ids == want[140:150]
        assert again.num_cached_tokens >= 160
