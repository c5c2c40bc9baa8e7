"""Trains an EAGLE-1 draft head on the target's final hidden states (features.py, kind "final") and saves it
in the public EAGLE-1 layout (SafeAILab: `fc` with bias, `layers.0.*`, no embedding) that
models/drafter_loader.py reads as "eagle".

EAGLE (Li et al. 2024, https://arxiv.org/abs/2401.15077) drafts at the feature level: from the target's
feature f_t and the next token x_{t+1}, one decoder layer predicts f_{t+1}; the target's own LM head turns
the prediction into a token. Its loss is a regression onto the target's next feature plus a small
cross-entropy of that token (w_cls = 0.1 in the paper).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from specserve.models.llama import DecoderConfig
from specserve.models.rope import rope_parameters
from specserve.train.features import SequenceFeatures, TargetParts, require_final_states
from specserve.train.layers import MLP, DraftAttention, RMSNorm
from specserve.train.loop import Batch, count_hits, save_head, step_labels


def eagle_config(target_config: dict, fc_bias: bool = True) -> dict:
    """config.json of an EAGLE-1 head for a target (its normalized HF config dict): the target's Llama sizes
    with one layer, as SafeAILab's checkpoints carry; "bias" says whether fc has one."""
    t = dict(target_config)
    theta, scaling = rope_parameters(t)
    heads = t["num_attention_heads"]
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", num_hidden_layers=1,
                hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"], num_attention_heads=heads,
                num_key_value_heads=t.get("num_key_value_heads") or heads,
                head_dim=t.get("head_dim") or t["hidden_size"] // heads, rms_norm_eps=t.get("rms_norm_eps", 1e-6),
                rope_theta=theta, rope_scaling=scaling, max_position_embeddings=t.get("max_position_embeddings", 4096),
                vocab_size=t["vocab_size"], tie_word_embeddings=False, bias=fc_bias)


# ---------------------------------------------------------------- the head


class _DecoderLayer(nn.Module):
    """EAGLE-1's layer: no input norm (fc's output goes straight into attention and the residual)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg, cfg.hidden_size)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, u: torch.Tensor, positions: torch.Tensor, cache: list) -> torch.Tensor:
        """u: [B, T, H] fc's output; positions: [T]; cache: see DraftAttention -> [B, T, H]."""
        r = u + self.self_attn(u, positions, cache)
        return r + self.mlp(self.post_attention_layernorm(r))


class EagleDraftModel(nn.Module):
    """The EAGLE-1 head with the checkpoint's parameter names (fc, layers.0.*), so state_dict() is the
    checkpoint. The target's embedding and LM head are frozen, unsaved buffers.

    config: eagle_config(...) (config.json); embed_tokens, lm_head: [V, H] the target's.
    """

    def __init__(self, config: dict, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        cfg = DecoderConfig.from_hf(config)  # read as the engine's EagleHead reads it
        H, V = cfg.hidden_size, cfg.vocab_size
        for name, weight in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if tuple(weight.shape) != (V, H):
                raise ValueError(f"{name} {list(weight.shape)} must be [{V}, {H}] (the target's vocabulary x "
                                 f"hidden size)")
        self.fc = nn.Linear(2 * H, H, bias=config.get("bias", True))
        self.layers = nn.ModuleList([_DecoderLayer(cfg)])
        self.register_buffer("embed_tokens", embed_tokens.detach().float().clone(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().float().clone(), persistent=False)

    def unroll(self, input_ids: torch.Tensor, features: torch.Tensor, num_steps: int) -> list[torch.Tensor]:
        """input_ids: [B, T]; features: [B, T, H] the target's final states -> num_steps predicted features
        g [B, T, H]. Step i at row t reads token t + 1 + i (teacher-forced; 0 past the end) with f_t for
        i = 0, else step i - 1's output at row t, at RoPE position t + i; it predicts f_{t+1+i}."""
        T = input_ids.shape[1]
        cache, outputs = [], []
        for i in range(num_steps):
            tokens = F.pad(input_ids[:, 1 + i:], (0, 1 + i))
            u = self.fc(torch.cat([self.embed_tokens[tokens], features], -1))
            features = self.layers[0](u, torch.arange(T, device=input_ids.device) + i, cache)
            outputs.append(features)
        return outputs

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """g: [..., H] -> [..., V] through the target's LM head (EAGLE-1 has no head or norm of its own)."""
        return g @ self.lm_head.t()


# ---------------------------------------------------------------- training


class EagleObjective:
    """Per unrolled step i (step 0 reads the target's features, step i > 0 the head's own step i - 1):
    loss = sum_i step_weight**i * (smooth_l1(g_i, f_next) + token_weight * CE(lm_head(g_i), target's token)),
    over the counted positions of that step."""

    def __init__(self, model: EagleDraftModel, num_steps: int = 2, token_weight: float = 0.1,
                 step_weight: float = 0.8) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be at least 1, got {num_steps}")
        if token_weight < 0:
            raise ValueError(f"token_weight must be at least 0, got {token_weight}")
        self.model, self.num_steps = model, num_steps
        self.token_weight, self.step_weight = token_weight, step_weight

    def loss(self, batch: Batch) -> torch.Tensor:
        total = torch.zeros(())
        for i, g in enumerate(self.model.unroll(batch.input_ids, batch.hidden, self.num_steps)):
            labels, counted = step_labels(batch, i)
            if not counted.any():
                continue
            wanted = F.pad(batch.hidden[:, 1 + i:], (0, 0, 0, 1 + i))  # [B, T, H] f_{t+1+i}
            g = g[counted]
            step = F.smooth_l1_loss(g, wanted[counted]) \
                + self.token_weight * F.cross_entropy(self.model.logits(g), labels[counted])
            total = total + self.step_weight ** i * step
        return total

    def step_hits(self, batch: Batch) -> tuple[list[int], list[int]]:
        """Per step: counted positions where the target's LM head on g picks the target's choice."""
        steps = self.model.unroll(batch.input_ids, batch.hidden, self.num_steps)
        return count_hits(batch, self.num_steps, lambda i, counted: self.model.logits(steps[i][counted]).argmax(-1))

    def save(self, folder: str) -> None:
        """config.json + model.safetensors (float16) in SafeAILab's layout, without the embedding."""
        save_head(folder, self.model.config, self.model)

    def describe(self) -> list[str]:
        return ["reads the target's final hidden state; predicts its next one and drafts through the target's LM head",
                f"loss: smooth L1 on the next feature + {self.token_weight} x cross-entropy of the target's token, "
                f"over {self.num_steps} unrolled draft step(s) weighted {self.step_weight}**step"]


def build_eagle(target: TargetParts, data: Sequence[SequenceFeatures], num_steps: int = 2,
                seed: int = 0) -> EagleObjective:
    """A fresh head for `target`; data must hold the target's final states (width H)."""
    require_final_states(data, target.config["hidden_size"], "EAGLE")
    torch.manual_seed(seed)
    model = EagleDraftModel(eagle_config(target.config), target.embed_tokens, target.lm_head)
    return EagleObjective(model, num_steps)
