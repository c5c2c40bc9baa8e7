"""Writes random-weight drafter checkpoints (EAGLE-1/2, EAGLE-3, Medusa) in their public layouts to a folder.

Each writer takes the target's config (a transformers config or its dict; Qwen2-VL configs are flattened to
their text fields) and returns a WrittenDrafter: the folder plus the tensors exactly as written, so a test
can compute a reference from the raw layout. Weights are large enough that drafts vary with the input.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import torch

EAGLE3_LAYOUTS = ("official", "sglang", "speculators")
MEDUSA_LAYOUTS = ("fasterdecoding", "vllm")


@dataclass
class WrittenDrafter:
    folder: str
    family: str  # "eagle", "eagle3" or "medusa"
    config: dict  # config.json as written ({} when none)
    tensors: dict[str, torch.Tensor]  # every tensor as written, under its raw name
    prefix: str = ""  # prepended to every name ("model.", "medusa_head.")
    layer_prefix: str = "layers.0."  # EAGLE: where the decoder layer lives ("midlayer." in official EAGLE-3)
    medusa_layout: str = ""

    def tensor(self, name: str) -> torch.Tensor:
        """An EAGLE top-level tensor by its canonical name (fc.weight, norm.weight, lm_head.weight, d2t)."""
        return self.tensors[self.prefix + name]

    def layer(self, name: str) -> torch.Tensor:
        """An EAGLE decoder-layer tensor, e.g. layer("self_attn.q_proj.weight")."""
        return self.tensors[self.prefix + self.layer_prefix + name]

    def medusa_block(self, head: int, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.medusa_layout == "fasterdecoding":
            name = f"{self.prefix}{head}.{layer}.linear."
        else:
            name = f"{self.prefix}blocks.{head}.layers.{layer}."
        return self.tensors[name + "weight"], self.tensors.get(name + "bias")

    def medusa_lm_head(self, head: int, num_layers: int) -> torch.Tensor | None:
        if self.medusa_layout == "fasterdecoding":
            return self.tensors.get(f"{self.prefix}{head}.{num_layers}.weight")
        return self.tensors.get(f"{self.prefix}lm_heads.{head}.weight")


def target_fields(target) -> dict:
    """The target's flat decoder fields (hidden_size, vocab_size, ...) from a transformers config or dict."""
    cfg = target.to_dict() if hasattr(target, "to_dict") else dict(target)
    if cfg.get("model_type") in ("qwen2_vl", "qwen2_5_vl"):
        from specserve.models.qwen2_vl import text_decoder_config

        cfg = text_decoder_config(cfg)
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if cfg.get("rope_theta") is None:
        cfg["rope_theta"] = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return cfg


def draft_vocabulary(vocab_size: int, draft_vocab_size: int, seed: int = 0) -> torch.Tensor:
    """[Vd] distinct target ids, ascending (as EAGLE-3 trainers order the most frequent tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab_size, generator=g)[:draft_vocab_size].sort().values


def write_eagle(folder: str, target, *, fc_bias: bool = True, weights_format: str = "safetensors",
                embed_tokens: torch.Tensor | None = None, qkv_bias: bool = False, prefix: str = "",
                seed: int = 0) -> WrittenDrafter:
    """EAGLE-1/2 (SafeAILab/EAGLE): a copy of the target's config with one layer, `fc` [H, 2H] (+ bias unless
    fc_bias=False, then config "bias": false), `layers.0.*` without input_layernorm, optional embed_tokens."""
    t = target_fields(target)
    H, g = t["hidden_size"], torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": _randn(g, H, 2 * H, std=0.8 / H ** 0.5)}
    if fc_bias:
        tensors["fc.bias"] = _randn(g, H, std=0.1)
    tensors.update(_layer_tensors(g, t, H, in_features=H, qkv_bias=qkv_bias, eagle3=False))
    if embed_tokens is not None:
        tensors["embed_tokens.weight"] = embed_tokens.detach().clone().float()
    config = {k: v for k, v in t.items() if k not in ("text_config", "vision_config", "architectures")}
    config.update(architectures=["LlamaForCausalLM"], num_hidden_layers=1, bias=fc_bias)
    tensors = {prefix + k: v for k, v in tensors.items()}
    _save(folder, config, tensors, "pytorch_model.bin" if weights_format == "bin" else "model.safetensors")
    return WrittenDrafter(folder, "eagle", config, tensors, prefix=prefix)


def write_eagle3(folder: str, target, *, layout: str = "official", draft_vocab_size: int | None = None,
                 hidden_size: int | None = None, norm_before_residual: bool | None = None,
                 aux_layer_ids: list[int] | None = None, embed_tokens: torch.Tensor | None = None,
                 with_lm_head: bool = True, prefix: str = "", seed: int = 0) -> WrittenDrafter:
    """EAGLE-3 in one of EAGLE3_LAYOUTS:
    "official" (yuhuili/EAGLE3-*): architectures LlamaForCausalLM, `midlayer.*`, aux ids under eagle_config;
    "sglang" (SpecForge): architectures LlamaForCausalLMEagle3, `midlayer.*`;
    "speculators": speculators_model_type "eagle3" with the Llama fields in transformer_layer_config,
        `layers.0.*`, norm_before_residual written out.
    d2t/t2d are written for a draft vocabulary smaller than the target's (default V // 2)."""
    if layout not in EAGLE3_LAYOUTS:
        raise ValueError(f"layout must be one of {EAGLE3_LAYOUTS}")
    t = target_fields(target)
    Ht, V = t["hidden_size"], t["vocab_size"]
    H = hidden_size or Ht
    Vd = V // 2 if draft_vocab_size is None else draft_vocab_size
    g = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": _randn(g, H, 3 * Ht, std=0.8 / (3 * Ht) ** 0.5)}
    layer_prefix = "layers.0." if layout == "speculators" else "midlayer."
    tensors.update({k.replace("layers.0.", layer_prefix): v
                    for k, v in _layer_tensors(g, t, H, in_features=2 * H, qkv_bias=False, eagle3=True).items()})
    tensors["norm.weight"] = 1 + _randn(g, H, std=0.1)
    if with_lm_head:
        tensors["lm_head.weight"] = _randn(g, Vd, H, std=1.5 / H ** 0.5)
    if Vd != V:
        ids = draft_vocabulary(V, Vd, seed)
        tensors["d2t"] = ids - torch.arange(Vd)
        tensors["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)
    if embed_tokens is not None:
        tensors["embed_tokens.weight"] = embed_tokens.detach().clone().float()
    layer = {k: t[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                               "rope_theta", "max_position_embeddings", "vocab_size", "hidden_act") if k in t}
    layer.update(model_type="llama", hidden_size=H, intermediate_size=t["intermediate_size"], num_hidden_layers=1,
                 tie_word_embeddings=False)
    extra = {"draft_vocab_size": Vd}
    if H != Ht:
        extra["target_hidden_size"] = Ht
    if layout == "speculators":
        config = dict(extra, architectures=["Eagle3Speculator"], speculators_model_type="eagle3",
                      transformer_layer_config=layer,
                      norm_before_residual=True if norm_before_residual is None else norm_before_residual)
        if aux_layer_ids is not None:
            config["eagle_aux_hidden_state_layer_ids"] = aux_layer_ids
    else:
        arch = "LlamaForCausalLM" if layout == "official" else "LlamaForCausalLMEagle3"
        config = dict(layer, **extra, architectures=[arch])
        if aux_layer_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids, "use_aux_hidden_state": True}
        if norm_before_residual is not None:
            config["norm_before_residual"] = norm_before_residual
    tensors = {prefix + k: v for k, v in tensors.items()}
    _save(folder, config, tensors, "model.safetensors")
    return WrittenDrafter(folder, "eagle3", config, tensors, prefix=prefix, layer_prefix=layer_prefix)


def write_medusa(folder: str, target, *, layout: str = "fasterdecoding", weights_format: str = "safetensors",
                 num_heads: int = 3, num_layers: int = 1, own_lm_heads: bool = True, fc_bias: bool = True,
                 medusa_head_prefix: bool = False, truncated_vocab_size: int | None = None,
                 seed: int = 0) -> WrittenDrafter:
    """Medusa in one of MEDUSA_LAYOUTS:
    "fasterdecoding": medusa_lm_head.safetensors (or .pt with weights_format="pt"), keys `{i}.{j}.linear.*`
        (one ResBlock repeated per head, so its layers hold equal weights, as the reference code builds them)
        and `{i}.{num_layers}.weight` unless own_lm_heads=False ("version 2"); config medusa_num_heads
        understated by one, as the published Vicuna configs are. medusa_head_prefix: the keys of a full
        Medusa-2 repo (`medusa_head.` + a stray backbone tensor).
    "vllm": model.safetensors with `blocks.{i}.layers.{j}.weight[/bias]` and `lm_heads.{i}.weight`; with
        truncated_vocab_size Vt < V the heads project to Vt ids and `token_map` [Vt] holds their target ids."""
    if layout not in MEDUSA_LAYOUTS:
        raise ValueError(f"layout must be one of {MEDUSA_LAYOUTS}")
    t = target_fields(target)
    H, V = t["hidden_size"], t["vocab_size"]
    if truncated_vocab_size is not None and layout != "vllm":
        raise ValueError("a truncated vocabulary (token_map) exists in the vllm layout only")
    Vt = V if truncated_vocab_size is None else truncated_vocab_size
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    if Vt != V:
        tensors["token_map"] = draft_vocabulary(V, Vt, seed)
    for i in range(num_heads):
        shared = (_randn(g, H, H, std=2.0 / H ** 0.5), _randn(g, H, std=0.3))
        for j in range(num_layers):
            fresh = (_randn(g, H, H, std=2.0 / H ** 0.5), _randn(g, H, std=0.3))
            w, b = shared if layout == "fasterdecoding" else fresh
            name = f"{i}.{j}.linear." if layout == "fasterdecoding" else f"blocks.{i}.layers.{j}."
            tensors[name + "weight"] = w.clone()
            if fc_bias:
                tensors[name + "bias"] = b.clone()
        if own_lm_heads:
            head = f"{i}.{num_layers}.weight" if layout == "fasterdecoding" else f"lm_heads.{i}.weight"
            tensors[head] = _randn(g, Vt, H, std=1.5 / H ** 0.5)
    prefix = "medusa_head." if medusa_head_prefix else ""
    tensors = {prefix + k: v for k, v in tensors.items()}
    if medusa_head_prefix:
        tensors["model.norm.weight"] = torch.ones(H)  # the backbone next to the heads, to be ignored
    if layout == "fasterdecoding":
        config = {"medusa_num_heads": max(num_heads - 1, 1), "medusa_num_layers": num_layers,
                  "base_model_name_or_path": "tiny-target"}
        file = "medusa_lm_head.pt" if weights_format == "pt" else "medusa_lm_head.safetensors"
    else:
        config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": H, "vocab_size": V,
                  "num_heads": num_heads, "num_hidden_layers": num_layers, "truncated_vocab_size": Vt,
                  "original_lm_head": not own_lm_heads, "medusa_fc_bias": fc_bias}
        file = "model.safetensors"
    _save(folder, config, tensors, file)
    return WrittenDrafter(folder, "medusa", config, tensors, prefix=prefix, medusa_layout=layout)


# ---------------------------------------------------------------- pieces


def _randn(g: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * std


def _layer_tensors(g: torch.Generator, t: dict, H: int, in_features: int, qkv_bias: bool, eagle3: bool) -> dict:
    """One Llama decoder layer's tensors under `layers.0.`; q/k/v read `in_features` (2H for EAGLE-3)."""
    heads, kv_heads, D, I = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"], t["intermediate_size"]
    p = "layers.0."
    out = {
        p + "self_attn.q_proj.weight": _randn(g, heads * D, in_features, std=1.0 / in_features ** 0.5),
        p + "self_attn.k_proj.weight": _randn(g, kv_heads * D, in_features, std=1.0 / in_features ** 0.5),
        p + "self_attn.v_proj.weight": _randn(g, kv_heads * D, in_features, std=1.0 / in_features ** 0.5),
        p + "self_attn.o_proj.weight": _randn(g, H, heads * D, std=1.0 / (heads * D) ** 0.5),
        p + "mlp.gate_proj.weight": _randn(g, I, H, std=1.0 / H ** 0.5),
        p + "mlp.up_proj.weight": _randn(g, I, H, std=1.0 / H ** 0.5),
        p + "mlp.down_proj.weight": _randn(g, H, I, std=1.0 / I ** 0.5),
        p + "post_attention_layernorm.weight": 1 + _randn(g, H, std=0.1),
    }
    if qkv_bias:
        for name, size in (("q", heads * D), ("k", kv_heads * D), ("v", kv_heads * D)):
            out[p + f"self_attn.{name}_proj.bias"] = _randn(g, size, std=0.1)
    if eagle3:
        out[p + "input_layernorm.weight"] = 1 + _randn(g, H, std=0.1)
        out[p + "hidden_norm.weight"] = 1 + _randn(g, H, std=0.1)
    return out


def _save(folder: str, config: dict, tensors: dict[str, torch.Tensor], file: str) -> None:
    os.makedirs(folder, exist_ok=True)
    if config:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    path = os.path.join(folder, file)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if file.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(tensors, path)
    else:
        torch.save(tensors, path)


def rewrite_tensors(written: WrittenDrafter, updates: dict[str, torch.Tensor | None]) -> WrittenDrafter:
    """Hand-set a written drafter's tensors: `updates` maps raw names (as written, prefix included) to new
    tensors, or to None to drop them; the folder's weights file is saved again with the result."""
    files = [name for name in os.listdir(written.folder) if name.endswith((".safetensors", ".bin", ".pt"))]
    if len(files) != 1:
        raise ValueError(f"{written.folder}: expected the one weights file a writer saves, found {files}")
    tensors = dict(written.tensors)
    for name, tensor in updates.items():
        if tensor is None:
            tensors.pop(name, None)
        else:
            tensors[name] = tensor
    _save(written.folder, written.config, tensors, files[0])
    return replace(written, tensors=tensors)
