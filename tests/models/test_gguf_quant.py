"""GGUF weights kept in their blocks (models/gguf_quant.py, ops/csrc/gemm_gguf.c): the same values as the gguf
package's dequantizer, and bitwise the same outputs as the fp32 path on those values, from one GEMM to a
whole model (the default SmolLM2 GGUF, and small files of every supported block type); with int8
activations (ops/csrc/gemm_q4_i8.c), close to them."""
from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch

from specserve.bench.common import teacher_forced_logits as _teacher_forced_logits
from specserve.config import EngineConfig
from specserve.models.gguf_loader import load_gguf
from specserve.models.gguf_quant import (BLOCK_TYPES, F16, Q4_I8, Q4_Q8, QuantizedWeight, cat_rows,
                                         int8_activation_weights, quantize_q4)
from specserve.models.linear import FastLinear
from specserve.models.loader import load_model_weights
from specserve.models.registry import build_model
from specserve.ops import kernels
from specserve.tokenizer import load_tokenizer
from tests.kernel_support import requires_c_kernels
from tests.models.test_fused_forward import _run

Q = gguf.GGMLQuantizationType
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16")  # gguf.quants can write these
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # gguf.quants reads these only: their blocks are drawn at random
TYPES = QUANTIZABLE + K_QUANTS


def random_blocks(rng: np.random.Generator, qtype: str, n: int, k: int) -> np.ndarray:
    """Raw blocks of a k-quant tensor [n, k]: random bytes, with fp16 super-block scales kept in a sane range."""
    *_, per_block, nbytes = BLOCK_TYPES[qtype]
    raw = rng.integers(0, 256, size=(n * k // per_block, nbytes), dtype=np.uint8)
    for at in ((208,) if qtype == "Q6_K" else (0, 2)):
        scales = rng.uniform(1e-4, 2e-3, raw.shape[0]) * rng.choice([-1, 1], raw.shape[0])
        raw[:, at:at + 2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)  # one row of blocks per output row, as a GGUF file lays them out


def gguf_tensor(rng: np.random.Generator, qtype: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(the tensor's data as a GGUF file holds it, gguf.quants' dequantization [n, k])."""
    if qtype in K_QUANTS:
        raw = random_blocks(rng, qtype, n, k)
    else:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        raw = w.astype(np.float16) if qtype == "F16" else gguf.quants.quantize(w, Q[qtype])
    return raw, gguf.quants.dequantize(raw, Q[qtype]).reshape(n, k).astype(np.float32)


def shapes_for(qtype: str) -> list[tuple[int, int]]:
    """Odd output sizes (not whole 32-column blocks) and a few input sizes of whole GGUF blocks."""
    k = 256 if qtype in K_QUANTS else 32
    return [(1, k), (7, 3 * k), (45, 2 * k), (100, k)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("qtype", TYPES)
def test_blocks_hold_the_gguf_package_values(qtype):
    rng = np.random.default_rng(0)
    for n, k in shapes_for(qtype):
        raw, reference = gguf_tensor(rng, qtype, n, k)
        weight = QuantizedWeight.from_gguf(raw, qtype, (n, k))
        np.testing.assert_array_equal(weight.dequantize().numpy(), reference)
        if weight.format != F16:
            q, a, b = weight.unpack()  # numpy's own dequantization of the packed form: the same values
            values = q.astype(np.float32).reshape(n, -1, weight.group) * a[..., None] + b[..., None]
            np.testing.assert_array_equal(values.reshape(n, k), reference)
        ids = torch.tensor([n - 1, 0, n // 2, n - 1])
        np.testing.assert_array_equal(weight[ids].numpy(), reference[ids.numpy()])
        assert weight[ids.view(2, 2)].shape == (2, 2, k)


@requires_c_kernels
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_on_blocks_is_bitwise_the_fp32_gemm(qtype, threads):
    rng = np.random.default_rng(1)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in shapes_for(qtype) + [(300, 512 if qtype in K_QUANTS else 576)]:
            raw, reference = gguf_tensor(rng, qtype, n, k)
            blocks = FastLinear(QuantizedWeight.from_gguf(raw, qtype, (n, k)))
            dense = FastLinear(torch.from_numpy(reference))
            assert blocks.path_for_rows(1) == "c_gguf" and dense.path_for_rows(1) == "c"
            for rows in list(range(1, 13)) + [13, 30]:
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                assert torch.equal(bits(blocks(x)), bits(dense(x))), (n, k, rows)
    finally:
        torch.set_num_threads(previous)


@requires_c_kernels
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q6_K", "F16"])
def test_exact_argmax_on_blocks(qtype):
    """The greedy head screens through its int8 copy, then recomputes the candidates from the blocks."""
    rng = np.random.default_rng(2)
    n, k = 3000, 256
    raw, reference = gguf_tensor(rng, qtype, n, k)
    head = FastLinear(QuantizedWeight.from_gguf(raw, qtype, (n, k)))
    assert head.enable_exact_argmax()
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(3)) * 4
    x[:, 5] = 40.0  # an outlier dimension, as hidden states have
    logits = FastLinear(torch.from_numpy(reference))(x)
    assert torch.equal(head.argmax(x), logits.argmax(-1))
    allowed = torch.rand(9, n, generator=torch.Generator().manual_seed(4)) < 0.3
    assert torch.equal(head.argmax(x, allowed), logits.masked_fill(~allowed, float("-inf")).argmax(-1))


@requires_c_kernels
def test_fused_rows_of_mixed_types():
    """q/k/v or gate/up in different block types: fused into a common form, the same outputs."""
    rng = np.random.default_rng(5)
    parts = [gguf_tensor(rng, qtype, n, 256) for qtype, n in (("Q4_1", 40), ("Q6_K", 32), ("Q8_0", 9), ("Q4_K", 64))]
    weights = [QuantizedWeight.from_gguf(raw, qtype, ref.shape)
               for (raw, ref), qtype in zip(parts, ("Q4_1", "Q6_K", "Q8_0", "Q4_K"))]
    fused = cat_rows(weights)
    assert isinstance(fused, QuantizedWeight) and fused.group == 16
    reference = np.concatenate([ref for _, ref in parts])
    np.testing.assert_array_equal(fused.dequantize().numpy(), reference)
    x = torch.randn(5, 256)
    assert torch.equal(bits(FastLinear(fused)(x)), bits(FastLinear(torch.from_numpy(reference))(x)))
    whole = cat_rows([weights[0], QuantizedWeight.from_gguf(*gguf_tensor(rng, "Q4_1", 64, 256)[:1], "Q4_1", (64, 256))])
    assert whole.qtype == "Q4_1" and whole.shape == (104, 256)  # same form: the packed records joined
    with_f32 = cat_rows([weights[0], torch.ones(3, 256)])
    assert isinstance(with_f32, torch.Tensor) and with_f32.shape == (43, 256)


def test_without_the_c_kernels_blocks_are_dequantized_once(monkeypatch):
    rng = np.random.default_rng(6)
    raw, reference = gguf_tensor(rng, "Q4_1", 40, 64)
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    layer = FastLinear(QuantizedWeight.from_gguf(raw, "Q4_1", (40, 64)))
    assert layer.path_for_rows(1) != "c_gguf"
    np.testing.assert_array_equal(layer.dense_weight().numpy(), reference)
    weight = QuantizedWeight.from_gguf(raw, "Q4_1", (40, 64))
    np.testing.assert_array_equal(weight[torch.tensor([3, 1])].numpy(), reference[[3, 1]])


# ---------------------------------------------------------------- whole models

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 300


def write_model(path, types: dict[str, str], rng: np.random.Generator) -> None:
    """A one-layer llama GGUF with each weight matrix in the block type `types` names (default Q4_1)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 256), ("embedding_length", HIDDEN), ("feed_forward_length", FFN),
                       ("block_count", 1), ("head_count", HEADS), ("head_count_kv", KV_HEADS)):
        getattr(writer, f"add_{key}")(value)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    head = HIDDEN // HEADS
    matrices = {"token_embd": (VOCAB, HIDDEN), "output": (VOCAB, HIDDEN), "blk.0.attn_q": (HEADS * head, HIDDEN),
                "blk.0.attn_k": (KV_HEADS * head, HIDDEN), "blk.0.attn_v": (KV_HEADS * head, HIDDEN),
                "blk.0.attn_output": (HIDDEN, HEADS * head), "blk.0.ffn_gate": (FFN, HIDDEN),
                "blk.0.ffn_up": (FFN, HIDDEN), "blk.0.ffn_down": (HIDDEN, FFN)}
    for name, (n, k) in matrices.items():
        qtype = types.get(name, "Q4_1")
        if qtype == "F32":
            writer.add_tensor(f"{name}.weight", (rng.standard_normal((n, k)) * 0.05).astype(np.float32))
        else:
            raw, _ = gguf_tensor(rng, qtype, n, k)
            writer.add_tensor(f"{name}.weight", raw, raw_dtype=Q[qtype])
    for name in ("output_norm", "blk.0.attn_norm", "blk.0.ffn_norm"):
        writer.add_tensor(f"{name}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_same_model_outputs(path, fused: bool = True) -> None:
    """Hidden states, logits and greedy tokens of the model on blocks == on its dequantized weights."""
    models = {}
    for keep in (True, False):
        loaded = load_model_weights(str(path), keep_quantized=keep)
        models[keep] = build_model(loaded.config, loaded.state_dict, dtype=torch.float32)
    assert models[True].layers[0].o_proj.path_for_rows(1) == "c_gguf"
    assert models[False].layers[0].o_proj.path_for_rows(1) == "c"
    results = {}
    for keep, model in models.items():
        hidden, _ = _run(model, fused, False)
        with torch.inference_mode():
            results[keep] = [(h, model.compute_logits(h), model.greedy_tokens(h)) for h in hidden]
    for (h1, l1, t1), (h2, l2, t2) in zip(results[True], results[False]):
        assert torch.equal(bits(h1), bits(h2)) and torch.equal(bits(l1), bits(l2)) and torch.equal(t1, t2)


@requires_c_kernels
@pytest.mark.parametrize("types", [
    {},  # Q4_1 throughout
    {"token_embd": "Q8_0", "output": "Q6_K", "blk.0.attn_q": "Q4_0", "blk.0.attn_k": "Q4_K",
     "blk.0.attn_v": "Q5_K", "blk.0.ffn_gate": "F16", "blk.0.ffn_up": "F16", "blk.0.ffn_down": "Q6_K"},
    {"blk.0.attn_v": "F32", "blk.0.ffn_up": "Q8_0", "output": "F16"},  # a fused pair of fp32 and blocks
], ids=["q4_1", "mixed", "with-f32"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-stack", "layer-by-layer"])
def test_small_models_on_blocks_are_bitwise_the_dequantized_models(tmp_path, monkeypatch, types, fused):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    write_model(tmp_path / "m.gguf", types, np.random.default_rng(7))
    assert_same_model_outputs(tmp_path / "m.gguf", fused)


@requires_c_kernels
def test_default_model_on_blocks_is_bitwise_the_dequantized_model(default_gguf_path):
    assert_same_model_outputs(default_gguf_path)


@requires_c_kernels
def test_default_model_keeps_a_fifth_of_the_weight_bytes(default_gguf_path):
    def weight_bytes(model) -> int:
        linears = [model.lm_head] + [getattr(layer, name) for layer in model.layers
                                     for name in ("qkv", "o_proj", "gate_up", "down")]
        embed = model.embed_tokens
        shared = isinstance(embed, QuantizedWeight) and model.lm_head._wq is embed
        own = 0 if shared else (embed.nbytes if isinstance(embed, QuantizedWeight) else embed.numel() * 4)
        return sum(linear.weight_nbytes for linear in linears) + own

    sizes, per_weight = {}, {}
    for keep in (True, False):
        loaded = load_model_weights(default_gguf_path, keep_quantized=keep)
        model = build_model(loaded.config, loaded.state_dict, dtype=torch.float32)
        sizes[keep], per_weight[keep] = weight_bytes(model), model.linear_bytes_per_weight()
    assert sizes[True] <= sizes[False] / 4, sizes
    # Q4_1 blocks: half a byte a weight plus each 32-weight block's fp32 scale and offset; fp32: 4
    assert 0.5 < per_weight[True] < 1.0 and per_weight[False] >= 4.0, per_weight


def test_cache_holds_the_packed_blocks(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_model(path, {"blk.0.ffn_down": "BF16"}, np.random.default_rng(8))  # a type the kernels do not read
    with caplog.at_level(logging.INFO, logger="specserve.models.gguf_loader"):
        _, first = load_gguf(str(path), keep_quantized=True)
    assert "blk.0.ffn_down.weight is BF16" in caplog.text
    assert isinstance(first["model.layers.0.mlp.down_proj.weight"], torch.Tensor)
    assert isinstance(first["model.layers.0.mlp.up_proj.weight"], QuantizedWeight)
    (cache_file,) = (tmp_path / "cache").rglob("model.safetensors")
    fp32_bytes = sum(4 * t.shape[0] * t.shape[1] for t in first.values() if len(t.shape) == 2)
    assert cache_file.stat().st_size < fp32_bytes / 2
    _, again = load_gguf(str(path), keep_quantized=True)  # from the cache
    for name, t in first.items():
        if isinstance(t, QuantizedWeight):
            assert isinstance(again[name], QuantizedWeight) and again[name].weight_format == t.weight_format
            assert torch.equal(again[name].packed, t.packed) and again[name].shape == t.shape
        else:
            assert torch.equal(again[name], t)
    _, dense = load_gguf(str(path))  # the dequantized view of the same cache
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in dense.values())


# ---------------------------------------------------------------- int8 activations (EngineConfig.gguf_compute)

@requires_c_kernels
def test_default_model_with_int8_activations_follows_the_exact_model(default_gguf_path):
    """Activations as two int8 digits (~15 bits) change the logits within their rounding: the next token of
    real text is the exact model's, and the distributions agree to ~1e-6 nats."""
    loaded = load_model_weights(default_gguf_path, keep_quantized=True)
    exact = build_model(loaded.config, loaded.state_dict, dtype=torch.float32)
    int8 = build_model(loaded.config, int8_activation_weights(loaded.state_dict), dtype=torch.float32)
    assert int8.layers[0].gate_up._wq.weight_format == (Q4_I8, 32)
    assert exact.layers[0].gate_up._wq.weight_format[0] == kernels.WEIGHT_Q4
    tokenizer = load_tokenizer(default_gguf_path)
    text = ("The C kernels are compiled on first use with the machine's C compiler into one library, keyed by "
            "the sources, the flags and the CPU, so later starts load it in milliseconds. Calls go through "
            "ctypes, and their OpenMP regions run on the thread pool that PyTorch has already started.")
    tokens = torch.tensor(tokenizer.encode(text))
    want, got = _teacher_forced_logits(exact, tokens), _teacher_forced_logits(int8, tokens)
    agree = (want.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agree >= 0.98, agree
    p, q = want.log_softmax(-1), got.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)  # nats; measured <= 1e-6 at any position of Spec-Bench prompts
    assert kl.max() < 1e-4, kl.max()


@requires_c_kernels
def test_one_digit_activations_are_further_from_the_exact_model(default_gguf_path):
    """gguf_compute="q8": one int8 digit per activation (llama.cpp's Q8_0 activations). Real text's next
    tokens still mostly agree with the exact model's, but the distributions move ~100x further than with two."""
    loaded = load_model_weights(default_gguf_path, keep_quantized=True)
    exact = build_model(loaded.config, loaded.state_dict, dtype=torch.float32)
    one = build_model(loaded.config, int8_activation_weights(loaded.state_dict, digits=1), dtype=torch.float32)
    two = build_model(loaded.config, int8_activation_weights(loaded.state_dict), dtype=torch.float32)
    assert one.layers[0].gate_up._wq.weight_format == (Q4_Q8, 32)
    tokens = torch.tensor(load_tokenizer(default_gguf_path).encode(
        "Speculative decoding drafts several tokens cheaply and verifies them in one step of the target model, "
        "so that greedy output stays exactly what plain decoding gives while each step emits more tokens."))
    want = _teacher_forced_logits(exact, tokens).log_softmax(-1)
    kl = {name: (want.exp() * (want - _teacher_forced_logits(m, tokens).log_softmax(-1))).sum(-1).max().item()
          for name, m in (("one", one), ("two", two))}
    assert kl["two"] * 30 < kl["one"] < 0.05, kl


def test_gguf_compute_is_validated():
    with pytest.raises(ValueError, match="gguf_compute must be one of 'int8', 'q8', 'fp32'"):
        EngineConfig(gguf_compute="int4")


@requires_c_kernels
def test_quantize_q4_rounds_each_value_to_its_group_grid():
    """quantize_q4: every value within half a step of its group's 16-level grid (min to max), each group's
    min and max exact, and the int8-activation form multiplying as the fp32 GEMM on the dequantized values
    up to the activations' rounding."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 96, generator=g) * torch.rand(70, 1, generator=g)
    w[3, :32] = 0.5  # a constant group
    q = quantize_q4(w)
    back = q.dequantize()
    groups = w.reshape(70, 3, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    assert ((back - w).abs().reshape(70, 3, 32) <= step[..., None] / 2 + 1e-6).all()
    assert torch.equal(back.reshape(70, 3, 32).amin(-1), groups.amin(-1))
    assert torch.equal(back[3, :32], w[3, :32])
    x = torch.randn(5, 96, generator=g)
    i8 = q.for_int8_activations(2)
    y = kernels.gemm_weight(x, i8.packed, i8.weight_format, None, 70)
    assert (y - x @ back.t()).abs().max() < 1e-3 * (x.abs() @ back.abs().t()).max()
