"""Tiny random transformers models built in memory, the reference for logits parity tests."""
from __future__ import annotations

import os

import torch

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=160, max_position_embeddings=256, rms_norm_eps=1e-6)
MOE = {  # each family's expert fields, on top of TINY
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


def tiny_hf_model(kind: str, tie: bool = False, seed: int = 1234, **overrides):
    """A random transformers causal LM of the given family ("llama", "qwen2", "qwen3", "mistral", and the
    mixture-of-experts "qwen3_moe", "qwen2_moe", "mixtral": 4 experts, top-2, routers perturbed)."""
    import transformers

    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[kind]
    kwargs = {**TINY, **MOE.get(kind, {}), "tie_word_embeddings": tie, **overrides}
    if kind in ("qwen3", "qwen3_moe"):
        kwargs.setdefault("head_dim", 32)
    if kind == "gemma3":  # windows shorter than the test prompts, a full-attention layer between them
        kwargs.setdefault("head_dim", 32)
        kwargs.setdefault("sliding_window", 6)
        kwargs.setdefault("query_pre_attn_scalar", 24)
        kwargs.setdefault("layer_types", [("full_attention" if i % 3 == 2 else "sliding_attention")
                                          for i in range(kwargs["num_hidden_layers"])])
    torch.manual_seed(seed)
    config = cls_cfg(**kwargs)
    return perturb_experts(perturb_norms_and_biases(cls_model(config).eval().float()))


def perturb_experts(model):
    """Random init gives routers (and Qwen2-MoE's shared-expert gate) small logits, so every expert gets about
    the same probability, and experts' outputs small next to the residual: scale both up, so routing is
    decisive, renormalising the top-k matters and the experts' sum moves the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.copy_(torch.randn_like(p) * 0.25)
            elif ".experts." in name or ".shared_expert." in name:
                p.mul_(3.0)
    return model


def perturb_norms_and_biases(model):
    """Random init leaves norms at exactly 1 and biases at 0: perturb them so every path is exercised."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def hf_config_dict(model) -> dict:
    return model.config.to_dict()


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def save_hf_folder(model, path) -> str:
    """Save a tiny model as a folder LLM(model=...) loads: its weights, config and a word-level tokenizer
    with one token ("t0", "t1", ...) per id of its vocabulary."""
    import tokenizers
    from tokenizers.models import WordLevel

    model.save_pretrained(str(path))
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tokenizers.Tokenizer(WordLevel(vocab, unk_token="t0")).save(os.path.join(path, "tokenizer.json"))
    return str(path)
