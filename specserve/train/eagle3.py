"""Trains an EAGLE-3 draft head on target features (features.py) with training-time test, and saves it in
the official layout (`midlayer.*`, d2t/t2d, no embedding) that models/drafter_loader.py reads.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from specserve.models.rope import rope_parameters
from specserve.train.features import SequenceFeatures, TargetParts, masked_targets
from specserve.train.layers import MLP, DraftAttention, RMSNorm
from specserve.train.loop import Batch, count_hits, save_head, step_labels


# ---------------------------------------------------------------- draft vocabulary


@dataclass
class DraftVocab:
    """token_ids: [Vd] ascending target ids; d2t: [Vd] int64 offsets (target id = draft id + d2t[draft id]);
    t2d: [V] bool membership; coverage: share of the counted training targets inside the vocabulary."""

    token_ids: torch.Tensor
    d2t: torch.Tensor
    t2d: torch.Tensor
    coverage: float

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """target_ids: [...] -> draft ids of the same shape, -1 where the token is outside the vocabulary."""
        index = torch.full((self.t2d.shape[0],), -1, dtype=torch.int64)
        index[self.token_ids] = torch.arange(self.token_ids.shape[0])
        return index[target_ids]


def build_vocab_from_d2t(d2t: torch.Tensor, t2d: torch.Tensor) -> DraftVocab:
    """The DraftVocab of a saved head (coverage unknown: 0)."""
    ids = torch.arange(d2t.shape[0]) + d2t
    return DraftVocab(ids, d2t.long(), t2d.bool(), 0.0)


def build_draft_vocab(targets: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> DraftVocab:
    """targets: [N] the counted training target ids -> the draft_vocab_size most frequent (ties: lower id
    first), sorted ascending."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in [1, {vocab_size}] (the target vocabulary)")
    counts = torch.bincount(targets.long(), minlength=vocab_size)
    order = torch.sort(-counts, stable=True).indices
    ids = order[:draft_vocab_size].sort().values
    total = int(counts.sum())
    coverage = float(counts[ids].sum()) / total if total else 0.0
    t2d = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    return DraftVocab(ids, ids - torch.arange(draft_vocab_size), t2d, coverage)


# ---------------------------------------------------------------- the head


@dataclass
class Eagle3HeadConfig:
    """The draft layer's Llama fields; the draft hidden size is the target's (the embedding is shared)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, int, int]

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, aux_layer_ids: Sequence[int],
                    intermediate_size: int | None = None) -> "Eagle3HeadConfig":
        """From a transformers Llama-family config (or its dict); RoPE as the engine reads the target's."""
        t = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
        theta, scaling = rope_parameters(t)
        heads = t["num_attention_heads"]
        return cls(t["hidden_size"], intermediate_size or t["intermediate_size"], heads,
                   t.get("num_key_value_heads") or heads, t.get("head_dim") or t["hidden_size"] // heads,
                   t["rms_norm_eps"], theta, scaling, t["max_position_embeddings"], t["vocab_size"],
                   draft_vocab_size, tuple(int(i) for i in aux_layer_ids))

    def to_json(self) -> dict:
        """config.json in the official EAGLE-3 layout (engines must be told the method "eagle3")."""
        return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                    hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                    num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                    head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                    rope_scaling=self.rope_scaling, max_position_embeddings=self.max_position_embeddings,
                    vocab_size=self.vocab_size, num_hidden_layers=1, tie_word_embeddings=False,
                    draft_vocab_size=self.draft_vocab_size,
                    eagle_config={"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                                  "use_aux_hidden_state": True})


class _MidLayer(nn.Module):
    """EAGLE-3's layer: attention over [input_layernorm(embedding); hidden_norm(hidden)], hidden as residual."""

    def __init__(self, c: Eagle3HeadConfig) -> None:
        super().__init__()
        H = c.hidden_size
        self.self_attn = DraftAttention(c, 2 * H)
        self.mlp = MLP(H, c.intermediate_size)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: list) -> torch.Tensor:
        """embeds, hidden: [B, T, H]; positions: [T]; cache: see DraftAttention -> g [B, T, H] (pre-norm);
        embedding first in the 2H input."""
        z = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)
        r = hidden + self.self_attn(z, positions, cache)
        return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3DraftModel(nn.Module):
    """The EAGLE-3 head with the official parameter names (fc, midlayer.*, norm, lm_head; buffers d2t, t2d),
    so state_dict() is the checkpoint. The target's embedding is a frozen, unsaved buffer."""

    def __init__(self, config: Eagle3HeadConfig, embed_tokens: torch.Tensor, vocab: DraftVocab,
                 lm_head_init: torch.Tensor | None = None) -> None:
        super().__init__()
        c, H = config, config.hidden_size
        if tuple(embed_tokens.shape) != (c.vocab_size, H):
            raise ValueError(f"embed_tokens {list(embed_tokens.shape)} must be [{c.vocab_size}, {H}]")
        if vocab.token_ids.shape[0] != c.draft_vocab_size:
            raise ValueError(f"draft vocabulary of {vocab.token_ids.shape[0]} tokens, config says {c.draft_vocab_size}")
        self.config = c
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
        if lm_head_init is not None:  # the target's LM head rows of the draft vocabulary: a warm start
            with torch.no_grad():
                self.lm_head.weight.copy_(lm_head_init[vocab.token_ids])
        self.register_buffer("d2t", vocab.d2t.clone())
        self.register_buffer("t2d", vocab.t2d.clone())
        self.register_buffer("embed_tokens", embed_tokens.detach().float().clone(), persistent=False)
        self.vocab = vocab

    def unroll(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, num_steps: int) -> list[torch.Tensor]:
        """input_ids: [B, T]; aux_hidden: [B, T, 3Ht] -> num_steps pre-norm outputs [B, T, H] (logits() maps
        rows to draft logits). Step i at row t reads token t + 1 + i (teacher-forced; 0 past the end) and,
        for i > 0, step i - 1's output at row t, at RoPE position t + i; it predicts the target's choice
        after token t + 1 + i."""
        T = input_ids.shape[1]
        hidden, cache, outputs = self.fc(aux_hidden), [], []
        for i in range(num_steps):
            tokens = F.pad(input_ids[:, 1 + i:], (0, 1 + i))
            hidden = self.midlayer(self.embed_tokens[tokens], hidden, torch.arange(T, device=input_ids.device) + i,
                                   cache)
            outputs.append(hidden)
        return outputs

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] pre-norm outputs -> [..., Vd] draft logits."""
        return self.lm_head(self.norm(hidden))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


# ---------------------------------------------------------------- training


class Eagle3Objective:
    """Training-time test: the head runs num_steps draft steps on its own outputs (teacher-forced tokens);
    loss = sum_i step_weight**i * CE_i over positions whose target token is in the draft vocabulary."""

    def __init__(self, model: Eagle3DraftModel, num_steps: int = 4, step_weight: float = 0.8) -> None:
        if num_steps < 1:
            raise ValueError(f"ttt steps must be at least 1, got {num_steps}")
        self.model, self.num_steps, self.step_weight = model, num_steps, step_weight

    def loss(self, batch: Batch) -> torch.Tensor:
        total = torch.zeros(())
        for i, hidden in enumerate(self.model.unroll(batch.input_ids, batch.hidden, self.num_steps)):
            labels, counted = step_labels(batch, i)
            draft = self.model.vocab.to_draft(labels)
            keep = counted & (draft >= 0)
            if keep.any():  # the LM head over counted rows only
                logits = self.model.logits(hidden[keep]).float()
                total = total + self.step_weight ** i * F.cross_entropy(logits, draft[keep])
        return total

    def step_hits(self, batch: Batch) -> tuple[list[int], list[int]]:
        """Per step: positions where the draft's argmax (mapped through d2t) is the target's choice;
        out-of-vocabulary targets count as misses."""
        steps = self.model.unroll(batch.input_ids, batch.hidden, self.num_steps)
        m = self.model
        return count_hits(batch, self.num_steps,
                          lambda i, counted: m.draft_to_target(m.logits(steps[i][counted]).argmax(-1)))

    def save(self, folder: str) -> None:
        """config.json + model.safetensors in the official layout (no embedding)."""
        save_head(folder, self.model.config.to_json(), self.model)

    def describe(self) -> list[str]:
        m = self.model.config
        return [f"aux layers (input of layer): {list(m.aux_layer_ids)}",
                f"draft vocabulary: {m.draft_vocab_size} of {m.vocab_size} tokens, covering "
                f"{self.model.vocab.coverage:.1%} of the training targets",
                f"training-time test: {self.num_steps} draft steps, loss weight {self.step_weight}**step"]


def build_eagle3(target: TargetParts, data: Sequence[SequenceFeatures], draft_vocab_size: int,
                 aux_layer_ids: Sequence[int], num_steps: int = 4, seed: int = 0) -> Eagle3Objective:
    """A fresh head for `target`: draft vocabulary from data's targets, LM head warm-started from the
    target's rows of it."""
    vocab = build_draft_vocab(masked_targets(data), target.config["vocab_size"], draft_vocab_size)
    config = Eagle3HeadConfig.from_target(target.config, draft_vocab_size, aux_layer_ids)
    torch.manual_seed(seed)
    return Eagle3Objective(Eagle3DraftModel(config, target.embed_tokens, vocab, target.lm_head), num_steps)


def load_eagle3(folder: str, target: TargetParts) -> Eagle3DraftModel:
    """A saved head (config.json + model.safetensors in the official layout, as save() writes) as the training
    model, to evaluate or train further; the embedding is the target's."""
    import json
    import os

    from safetensors.torch import load_file

    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    aux = raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    config = Eagle3HeadConfig.from_target(dict(target.config, **{k: raw[k] for k in (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps") if k in raw}),
        raw["draft_vocab_size"], aux, raw["intermediate_size"])
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    model = Eagle3DraftModel(config, target.embed_tokens, build_vocab_from_d2t(tensors["d2t"], tensors["t2d"]))
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()})
    return model
