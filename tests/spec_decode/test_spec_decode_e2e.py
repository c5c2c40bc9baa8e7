"""Greedy equivalence of every proposer on SmolLM2: token for token the output of plain decoding.

24 Spec-Bench prompts from 8 categories (tests/data/specbench_sample.jsonl), 96 tokens each, run in
mixed-length batches with chunked prefill.
"""
import json
import os

import pytest
from safetensors.torch import save_file

from specserve.llm import LLM
from specserve.models.loader import load_model_weights
from specserve.sampling_params import SamplingParams
from specserve.ops.kernels import WEIGHT_Q4, WEIGHT_Q4_Q8, kernel_enabled

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "specbench_sample.jsonl")
MAX_TOKENS = 96
ENGINE = dict(max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=256, kv_cache_memory_bytes=256 << 20)


@pytest.fixture(scope="module")
def prompts():
    plain = LLM(**ENGINE)
    tok = plain.get_tokenizer()
    rows = [json.loads(line) for line in open(DATA)]
    assert len({r["category"] for r in rows}) >= 6 and len(rows) == 24
    texts = [tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}]) for r in rows]
    ids = [{"prompt_token_ids": tok.encode(t, add_special_tokens=False)} for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in plain.generate(ids, params, use_tqdm=False)]
    return ids, reference


@pytest.fixture(scope="module")
def weak_draft(tmp_path_factory):
    """A weaker draft: the target with only its first 10 of 30 layers, saved as a HF folder."""
    loaded = load_model_weights(None)
    cfg = dict(loaded.config, num_hidden_layers=10)
    keep = {k: v.contiguous() for k, v in loaded.state_dict.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < 10}
    folder = tmp_path_factory.mktemp("weak_draft")
    save_file(keep, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def _check_metrics(llm, outs):
    m = llm.get_metrics()
    assert m.num_drafts > 0 and 0 <= m.num_accepted_tokens <= m.num_draft_tokens
    per_pos = m.accepted_per_position
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos
    assert sum(per_pos) == m.num_accepted_tokens
    for out in outs:
        r = out.metrics
        assert r.num_accepted_tokens <= r.num_draft_tokens
        assert all(a >= b for a, b in zip(r.accepted_per_position, r.accepted_per_position[1:]))
    return m


def _run(spec, prompts):
    ids, reference = prompts
    # A fixed draft length: the adaptive policy may stop drafting in a busy batch, and these tests need drafts.
    llm = LLM(speculative_config=dict(spec, adaptive_draft_length=False), **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(ids, params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} diverged"
    return llm, outs


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    {"method": "suffix", "num_speculative_tokens": 6},
])
def test_lookup_proposers_keep_greedy_output(spec, prompts):
    llm, outs = _run(spec, prompts)
    _check_metrics(llm, outs)


def test_self_draft_accepts_everything(prompts, default_gguf_path):
    llm, outs = _run({"method": "draft_model", "model": default_gguf_path, "num_speculative_tokens": 3}, prompts)
    m = _check_metrics(llm, outs)
    assert m.num_accepted_tokens == m.num_draft_tokens
    assert llm.llm_engine.runner.proposer.shares_target_kv  # the target's KV


def test_weaker_draft_keeps_greedy_output(prompts, weak_draft):
    llm, outs = _run({"method": "draft_model", "model": weak_draft, "num_speculative_tokens": 3}, prompts)
    assert not llm.llm_engine.runner.proposer.shares_target_kv  # 10 layers: it computes its own KV
    m = _check_metrics(llm, outs)
    assert m.num_accepted_tokens < m.num_draft_tokens


def test_int8_self_draft_keeps_greedy_output(prompts, default_gguf_path):
    """The target's own weights quantized to int8 for the drafter only: cheaper, approximate drafts."""
    llm, outs = _run({"method": "draft_model", "model": default_gguf_path, "quantization": "int8",
                      "num_speculative_tokens": 3}, prompts)
    m = _check_metrics(llm, outs)
    assert 0.5 * m.num_draft_tokens < m.num_accepted_tokens < m.num_draft_tokens
    expected = "c_int8" if kernel_enabled() else "int8_dynamic"
    assert llm.llm_engine.runner.proposer.model.layers[0].gate_up.backend == expected


@pytest.mark.parametrize("compute,weight_format", [("fp32", WEIGHT_Q4), ("q8", WEIGHT_Q4_Q8)])
def test_other_block_arithmetic_keeps_greedy_output(prompts, compute, weight_format):
    """The default engine multiplies the 4-bit blocks with activations as two int8 digits (above); with fp32
    activations (gguf_compute="fp32", bitwise the dequantized model) or one int8 digit ("q8") speculation is
    as lossless."""
    ids = prompts[0][:8]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = LLM(gguf_compute=compute, **ENGINE)
    reference = [o.outputs[0].token_ids for o in plain.generate(ids, params, use_tqdm=False)]
    assert plain.llm_engine.model.layers[0].gate_up._wq.weight_format == (weight_format, 32)  # not the default's
    llm = LLM(gguf_compute=compute, speculative_config={"method": "suffix", "num_speculative_tokens": 6,
                                                        "adaptive_draft_length": False}, **ENGINE)
    outs = llm.generate(ids, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    _check_metrics(llm, outs)
