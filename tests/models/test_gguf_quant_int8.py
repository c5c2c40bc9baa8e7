"""Whole models whose 8-bit GGUF blocks (Q8_0, Q5_0, Q6_K, and a Q4_K_M-like mix) run on int8 activations
(gguf_compute "int8": two digits, ~15 bits; "q8": one): every projection takes an integer GEMM, and the
engine's greedy tokens are those of the same file with fp32 activations (gguf_compute="fp32").

Tolerance: the teacher-forced logits of the int8 model differ from the fp32 model's by at most 5e-4 times the
largest fp32 logit magnitude with two digits, and 5e-2 with one (measured ~1e-4 and ~2e-2 on these random
one-layer models); the engine's greedy tokens are asserted equal with two digits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.llm import LLM
from specserve.models.gguf_quant import INT8_ACTIVATION_FORMATS, int8_activation_weights
from specserve.models.linear import int8_workloads
from specserve.models.loader import load_model_weights
from specserve.models.registry import build_model
from specserve.sampling_params import SamplingParams
from tests.kernel_support import requires_c_kernels
from tests.models.test_gguf_quant import VOCAB, _teacher_forced_logits, write_model

pytestmark = requires_c_kernels

EIGHT_BIT = {"token_embd": "Q8_0", "output": "Q8_0", "blk.0.attn_q": "Q8_0", "blk.0.attn_k": "Q5_0",
             "blk.0.attn_v": "Q6_K", "blk.0.attn_output": "Q5_0", "blk.0.ffn_gate": "Q6_K", "blk.0.ffn_up": "Q6_K",
             "blk.0.ffn_down": "Q8_0"}
Q4_K_M_LIKE = {"token_embd": "Q4_K", "output": "Q6_K", "blk.0.attn_q": "Q4_K", "blk.0.attn_k": "Q4_K",
               "blk.0.attn_v": "Q6_K", "blk.0.attn_output": "Q4_K", "blk.0.ffn_gate": "Q4_K", "blk.0.ffn_up": "Q4_K",
               "blk.0.ffn_down": "Q6_K"}
MODELS = pytest.mark.parametrize("model_file", [EIGHT_BIT, Q4_K_M_LIKE], indirect=True, ids=["q8-q5-q6", "q4_k_m-like"])
TOLERANCE = {2: 5e-4, 1: 5e-2}  # max |logit difference| / max |fp32 logit|, per activation digits
PROMPTS = [[1, 2, 3], [5, 7, 11, 13, 17], [42] * 6, list(range(100, 120))]


@pytest.fixture
def model_file(tmp_path, monkeypatch, request):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    write_model(tmp_path / "m.gguf", request.param, np.random.default_rng(11))
    return str(tmp_path / "m.gguf")


@MODELS
def test_int8_logits_stay_within_the_tolerance(model_file):
    loaded = load_model_weights(model_file, keep_quantized=True)
    exact = build_model(loaded.config, loaded.state_dict, dtype=torch.float32)
    tokens = torch.tensor(PROMPTS[3])
    want = _teacher_forced_logits(exact, tokens)
    for digits, tolerance in TOLERANCE.items():
        model = build_model(loaded.config, int8_activation_weights(loaded.state_dict, digits), dtype=torch.float32)
        assert all(getattr(model.layers[0], name)._wq.format in INT8_ACTIVATION_FORMATS
                   for name in ("qkv", "o_proj", "gate_up", "down"))
        got = _teacher_forced_logits(model, tokens)
        assert not torch.equal(got, want)  # a different computation ...
        error = ((got - want).abs().max() / want.abs().max()).item()
        assert error < tolerance, (digits, error)  # ... within the activations' rounding


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


@MODELS
def test_engine_greedy_tokens_follow_fp32_activations(model_file):
    """The engine on int8 activations (the default) routes every projection to an int8 kernel and decodes the
    greedy tokens it decodes on fp32 activations."""
    fp32 = LLM(model=model_file, gguf_compute="fp32", max_model_len=128, skip_tokenizer_init=True)
    want = greedy(fp32)
    assert all(0 <= t < VOCAB for tokens in want for t in tokens)
    del fp32
    int8 = LLM(model=model_file, gguf_compute="int8", max_model_len=128, skip_tokenizer_init=True)
    workloads = int8_workloads(int8.llm_engine.runner.model)
    assert len(workloads["gemm"]) + len(workloads["gemm_q8"]) == 4 and workloads["gemm_q8"]
    assert greedy(int8) == want
