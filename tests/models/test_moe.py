"""Mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers: logits through the paged
KV cache, HF folders in the Hub's per-expert names, GGUF files with 3-D expert tensors, and the grouping of a
step's rows by expert."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from specserve.models.gguf_loader import load_gguf, unpermute_rotary_rows
from specserve.models.loader import ModelLoadError, load_model_weights
from specserve.models.moe import MoEConfig
from specserve.models.registry import build_model
from specserve.ops import kernels
from tests.kernel_support import require_c_kernels
from tests.models.test_gguf_loader import llama_cpp_permute
from tests.paged_harness import max_logit_errors
from tests.kernel_support import requires_c_kernels
from tests.tiny_models import hf_config_dict, hf_state_dict, save_hf_folder, tiny_hf_model

Q = gguf.GGMLQuantizationType

# (family, tied embeddings, overrides): with and without a shared expert, dense layers mixed in
CASES = [
    ("qwen3_moe", False, {}),
    ("qwen3_moe", True, dict(num_hidden_layers=3, mlp_only_layers=[1])),
    ("qwen3_moe", False, dict(norm_topk_prob=False)),
    ("qwen2_moe", False, {}),
    ("qwen2_moe", True, dict(num_hidden_layers=3, decoder_sparse_step=2, norm_topk_prob=True)),
    ("mixtral", False, {}),
    ("mixtral", True, dict(num_local_experts=8)),
]


def _reference_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].float()


def greedy_tokens(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, each token the argmax of a full forward (EOS is just a token)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def _prompts(seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 160, (n,), generator=g).tolist() for n in (13, 5, 22)]


def _moe_layers(hf) -> list[bool]:
    """Per transformers layer, whether its MLP is a sparse MoE block."""
    return [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]


def _worst_error(model, hf) -> float:
    # Token budget 7: prompts are prefilled in chunks, decodes ride along with other prefills.
    worst = max_logit_errors(model, _prompts(), 8, 7, lambda tokens: _reference_logits(hf, tokens))
    return max(worst.values())


@pytest.mark.parametrize("ops", ["c", "torch"])  # specserve's C kernels, and the PyTorch fallback
@pytest.mark.parametrize("kind,tie,overrides", CASES)
def test_prefill_and_decode_match_transformers(kind, tie, overrides, ops, monkeypatch):
    if ops == "c":
        require_c_kernels()
    monkeypatch.setenv(kernels.ENV_VAR, ops)
    hf = tiny_hf_model(kind, tie=tie, **overrides)
    model = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)  # fused 3-D experts
    assert [layer.moe is not None for layer in model.layers] == _moe_layers(hf)
    assert not model.fused_forward  # the fused C stack is dense-only
    assert _worst_error(model, hf) < 1e-4


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_routing_is_not_degenerate(kind):
    """The tiny models' routers spread rows over every expert with top-k weights far from uniform, so the
    parity test above sees renormalisation, the weights and the choice of experts."""
    hf = tiny_hf_model(kind)
    model = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)
    h = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    weights, experts = model.layers[0].moe.route(h)
    assert experts.unique().numel() == model.config.moe.num_experts
    assert weights.std() > 0.1


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_a_wrong_shared_gate_or_renormalisation_fails_parity(kind):
    """What the parity tests rely on: the tolerance sees the renormalisation and the shared-expert gate."""
    hf = tiny_hf_model(kind)
    model = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)
    for layer in model.layers:
        if kind == "qwen2_moe":
            layer.moe.shared_gate = -layer.moe.shared_gate  # sigmoid(-x) instead of sigmoid(x)
        else:
            layer.moe.norm_topk_prob = False
    assert _worst_error(model, hf) > 1e-2


def test_rows_are_grouped_by_expert():
    """Each expert a step's rows picked runs once, on exactly the rows that picked it; the others not at all."""
    hf = tiny_hf_model("mixtral", num_local_experts=8)
    model = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)
    moe = model.layers[0].moe
    moe._c_experts = None  # the Python loop, whose calls can be counted (the C call is checked against it below)
    calls: dict[int, list[int]] = {}

    def counting(e, linear):
        def call(x):
            calls.setdefault(e, []).append(x.shape[0])
            return linear(x)
        return call

    moe.experts = [(counting(e, gate_up), down) for e, (gate_up, down) in enumerate(moe.experts)]
    for rows in (1, 3):
        calls.clear()
        h = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        _, experts = moe.route(h)
        moe(h)
        assert calls == {e: [int((experts == e).sum())] for e in experts.unique().tolist()}


@requires_c_kernels
@pytest.mark.parametrize("weights", ["fp32", "Q4_0", "Q4_0 x int8", "Q8_0"])
def test_one_c_call_over_the_experts_is_bitwise_the_python_loop(weights):
    """fused.moe_experts runs every used expert's GEMMs in one call: the same bits as the loop of FastLinear
    calls and index_add_, for 1 to 17 rows, on fp32 weights and on GGUF blocks (with fp32 or int8 activations)."""
    from benchmarks.moe_rows import random_weight
    from specserve.models.gguf_quant import QuantizedWeight
    from specserve.models.llama import make_linear
    from specserve.models.moe import MoEConfig, MoEMLP

    cfg = MoEConfig(num_experts=16, top_k=4, intermediate_size=64, norm_topk_prob=True)
    g = torch.Generator().manual_seed(3)
    qtype = weights.split()[0]

    def weight(rows, cols):
        w = random_weight(rows, cols, qtype, g)
        return w.for_int8_activations(2) if weights.endswith("int8") and isinstance(w, QuantizedWeight) else w

    state = {"p.mlp.gate.weight": torch.randn(16, 128, generator=g)}
    for e in range(16):
        for name, shape in (("gate_proj", (64, 128)), ("up_proj", (64, 128)), ("down_proj", (128, 64))):
            state[f"p.mlp.experts.{e}.{name}.weight"] = weight(*shape)
    moe = MoEMLP(cfg, state, "p.", make_linear, c_ops=True)
    assert moe._c_experts is not None
    for rows in (1, 2, 5, 9, 17):
        h = torch.randn(rows, 128, generator=g)
        one_call = moe(h)
        c_experts, moe._c_experts = moe._c_experts, None
        loop = moe(h)
        moe._c_experts = c_experts
        assert torch.equal(one_call, loop), (weights, rows)


def test_hf_folders_in_hub_names_load_and_generate_like_transformers(tmp_path):
    """save_pretrained writes the Hub's per-expert names (Qwen mlp.experts.{e}.*, Mixtral
    block_sparse_moe.experts.{e}.w1/w2/w3); LLM(model=folder) reads them and decodes transformers' greedy
    tokens."""
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    for kind in ("qwen3_moe", "qwen2_moe", "mixtral"):
        hf = tiny_hf_model(kind, num_hidden_layers=3)
        folder = save_hf_folder(hf, tmp_path / kind)
        state_dict = load_model_weights(folder).state_dict
        expert = "block_sparse_moe.experts.1.w3" if kind == "mixtral" else "mlp.experts.1.up_proj"
        assert f"model.layers.2.{expert}.weight" in state_dict
        llm = LLM(model=folder, max_model_len=128, block_size=8, max_num_batched_tokens=16)
        prompts = _prompts()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == greedy_tokens(hf, prompt, 12), kind


def test_a_missing_expert_and_a_bad_top_k_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_hf_folder(tiny_hf_model("qwen3_moe"), tmp_path / "m")
    weights = load_file(f"{folder}/model.safetensors")
    del weights["model.layers.1.mlp.experts.3.down_proj.weight"]
    save_file(weights, f"{folder}/model.safetensors")
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.experts.3.down_proj.weight"):
        load_model_weights(folder)
    with pytest.raises(ValueError, match="num_experts_per_tok must be in \\[1, num_experts=4\\], got 5"):
        MoEConfig.from_hf(dict(hf_config_dict(tiny_hf_model("mixtral")), num_experts_per_tok=5))
    with pytest.raises(ValueError, match="'moe_intermediate_size' is required"):
        MoEConfig.from_hf({"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2})


def test_tensor_parallel_refuses_moe():
    from specserve.distributed.sharding import check_divisible
    from specserve.models.llama import DecoderConfig

    config = DecoderConfig.from_hf(hf_config_dict(tiny_hf_model("mixtral")))
    check_divisible(config, 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2: mixture-of-experts"):
        check_divisible(config, 2)


def test_weight_bytes_count_the_experts_a_token_reads():
    """linear_weight_bytes: attention, the router, the shared expert and top_k of num_experts of the experts."""
    hf = tiny_hf_model("qwen2_moe", num_hidden_layers=3, decoder_sparse_step=2)  # layer 1 MoE, 0 and 2 dense
    model = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)
    c = hf.config
    attention = c.hidden_size * 16 * (c.num_attention_heads + c.num_key_value_heads) * 2
    dense = 3 * c.hidden_size * c.intermediate_size
    moe = (c.num_experts * c.hidden_size + 3 * c.hidden_size * c.shared_expert_intermediate_size
           + c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size)
    assert model.linear_weight_bytes() == (4 * (3 * attention + 2 * dense + moe), 3 * attention + 2 * dense + moe)


# ---------------------------------------------------------------- GGUF


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def _gguf_tensors(hf, arch: str) -> dict[str, tuple[str, int | None, np.ndarray]]:
    """A transformers MoE model's tensors as llama.cpp writes them: GGUF name -> (transformers name, which half
    of a fused gate_up_proj or None, the array stored). Experts are 3-D [experts, rows, cols]; Mixtral's
    (arch llama) q/k rows are permuted; the shared-expert gate is 1-D."""
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    c = hf.config
    out = {"token_embd.weight": ("model.embed_tokens.weight", None, sd["model.embed_tokens.weight"]),
           "output_norm.weight": ("model.norm.weight", None, sd["model.norm.weight"])}
    if not c.tie_word_embeddings:
        out["output.weight"] = ("lm_head.weight", None, sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf_name, name in _GGUF_LAYER_NAMES.items():
            for suffix in ("weight", "bias"):
                if f"{p}{hf_name}.{suffix}" in sd:
                    out[f"blk.{i}.{name}.{suffix}"] = (f"{p}{hf_name}.{suffix}", None, sd[f"{p}{hf_name}.{suffix}"])
        if p + "mlp.experts.gate_up_proj" in sd:
            gate, up = np.split(sd[p + "mlp.experts.gate_up_proj"], 2, axis=1)
            out[f"blk.{i}.ffn_gate_exps.weight"] = (p + "mlp.experts.gate_up_proj", 0, gate)
            out[f"blk.{i}.ffn_up_exps.weight"] = (p + "mlp.experts.gate_up_proj", 1, up)
            out[f"blk.{i}.ffn_down_exps.weight"] = (p + "mlp.experts.down_proj", None, sd[p + "mlp.experts.down_proj"])
    for name, (hf_name, half, w) in out.items():
        if name.endswith("ffn_gate_inp_shexp.weight"):
            out[name] = (hf_name, half, w.reshape(-1))
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            out[name] = (hf_name, half, llama_cpp_permute(w, _heads(c, name)))
    return out


def _heads(c, gguf_name: str) -> int:
    return c.num_attention_heads if "attn_q" in gguf_name else c.num_key_value_heads


def write_moe_gguf(hf, path, arch: str, qtype) -> dict[str, np.ndarray]:
    """Write a transformers MoE model as llama.cpp would (weight matrices and experts in `qtype`; norms, biases
    and routers in F32); returns every written tensor as the file gives it back (gguf's dequantize)."""
    c = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_expert_count(c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    if arch != "llama":
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    written = {}
    for name, (_, _, w) in _gguf_tensors(hf, arch).items():
        kind = qtype if w.ndim >= 2 and "ffn_gate_inp" not in name else Q.F32
        data = w.astype(np.float16) if kind == Q.F16 else gguf.quants.quantize(np.ascontiguousarray(w), kind)
        writer.add_tensor(name, data, raw_dtype=kind)
        written[name] = gguf.quants.dequantize(data, kind).reshape(w.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def _with_written_values(hf, written: dict[str, np.ndarray], arch: str):
    """The transformers model with the GGUF's values in place of its own: the reference for quantized files."""
    state = hf_state_dict(hf)
    for name, (hf_name, half, _) in _gguf_tensors(hf, arch).items():
        w = written[name]
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = unpermute_rotary_rows(w, _heads(hf.config, name))
        w = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
        if half is None:
            state[hf_name] = w.reshape(state[hf_name].shape)
        else:
            rows = state[hf_name].shape[1] // 2
            state[hf_name][:, half * rows:(half + 1) * rows] = w
    hf.load_state_dict(state)
    return hf


@pytest.mark.parametrize("kind,arch,qtype", [
    ("qwen3_moe", "qwen3moe", Q.F32),
    ("qwen3_moe", "qwen3moe", Q.Q8_0),
    ("qwen2_moe", "qwen2moe", Q.Q4_0),
    ("mixtral", "llama", Q.Q8_0),
    ("mixtral", "llama", Q.F16),
])
def test_gguf_round_trip_matches_transformers(kind, arch, qtype, tmp_path):
    """A tiny MoE written as a llama.cpp GGUF (3-D expert tensors; Mixtral as arch llama, q/k permuted) loads,
    experts kept in their blocks, to logits within 1e-4 of transformers run on the same values."""
    hf = tiny_hf_model(kind, num_hidden_layers=3, **({"mlp_only_layers": [1]} if kind == "qwen3_moe" else {}))
    path = tmp_path / "moe.gguf"
    written = write_moe_gguf(hf, path, arch, qtype)
    config, state_dict = load_gguf(str(path), use_cache=False, keep_quantized=True)
    assert config["model_type"] == kind
    if qtype != Q.F32:
        assert type(state_dict["model.layers.0.mlp.experts.1.up_proj.weight"]).__name__ == "QuantizedWeight"
    expert = state_dict["model.layers.2.mlp.experts.3.down_proj.weight"]
    expert = expert.dequantize() if hasattr(expert, "dequantize") else expert
    np.testing.assert_array_equal(expert.numpy(), written["blk.2.ffn_down_exps.weight"][3])
    reference = _with_written_values(hf, written, arch)
    model = build_model(config, state_dict, dtype=torch.float32)
    assert [layer.moe is not None for layer in model.layers] == _moe_layers(hf)
    assert _worst_error(model, reference) < 1e-4


def test_llm_serves_a_gguf_moe_through_the_cache(tmp_path, monkeypatch):
    """LLM(model=file.gguf) decodes transformers' greedy tokens, from the converted file and from its cache
    (each expert's QuantizedWeight stored on its own)."""
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = tiny_hf_model("qwen2_moe", num_hidden_layers=2)
    path = str(tmp_path / "moe.gguf")
    reference = _with_written_values(hf, write_moe_gguf(hf, path, "qwen2moe", Q.Q8_0), "qwen2moe")
    prompt = _prompts()[0]
    for _ in range(2):  # converted, then cached
        llm = LLM(model=path, max_model_len=128, skip_tokenizer_init=True)
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=10,
                                                                          ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == greedy_tokens(reference, prompt, 10)
    assert len(list((tmp_path / "cache").rglob("model.safetensors"))) == 1
