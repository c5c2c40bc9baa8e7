"""Trains Medusa heads on the target's final hidden states (features.py, kind "final") and saves them in
vLLM's Medusa layout (`blocks.{k}.layers.{j}.*`, `lm_heads.{k}.weight`), which models/drafter_loader.py
reads as "medusa".

Medusa-1 (Cai et al. 2024, https://arxiv.org/abs/2401.10774): head k maps the target's final state h_t
through ResBlocks y = x + SiLU(W x + b) and its own vocabulary projection, warm-started from the target's
LM head, to x_{t+2+k}; the loss is the heads' cross-entropies weighted 0.8**k.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from specserve.train.features import SequenceFeatures, TargetParts, require_final_states
from specserve.train.loop import Batch, count_hits, save_head, step_labels


class _ResidualBlock(nn.Module):
    """num_layers of y = x + SiLU(W x + b), W zero-initialized so a fresh head starts as the identity
    (as FasterDecoding's reference code initializes it)."""

    def __init__(self, H: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(H, H) for _ in range(num_layers))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaDraftModel(nn.Module):
    """K heads with vLLM's parameter names (blocks.{k}.layers.{j}.weight/bias, lm_heads.{k}.weight), so
    state_dict() is the checkpoint.

    lm_head: [V, H] the target's LM head, copied into every head's projection as its starting point.
    """

    def __init__(self, num_heads: int, num_layers: int, lm_head: torch.Tensor) -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise ValueError(f"num_heads ({num_heads}) and num_layers ({num_layers}) must be at least 1")
        V, H = lm_head.shape
        self.num_heads, self.num_layers = num_heads, num_layers
        self.blocks = nn.ModuleList(_ResidualBlock(H, num_layers) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(H, V, bias=False) for _ in range(num_heads))
        with torch.no_grad():
            for head in self.lm_heads:
                head.weight.copy_(lm_head)
        self.config = dict(architectures=["MedusaModel"], model_type="medusa", hidden_size=H, vocab_size=V,
                           num_heads=num_heads, num_hidden_layers=num_layers, truncated_vocab_size=V,
                           original_lm_head=False, medusa_fc_bias=True)  # vLLM's MedusaConfig fields

    def head_logits(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., H] the target's final states -> head k's logits [..., V]: its guess at the token
        two + k places after the state's own."""
        return self.lm_heads[k](self.blocks[k](hidden))


class MedusaObjective:
    """loss = sum_k head_weight**k * CE(head k at row t, the target's choice at t + 1 + k), over the
    counted positions; draft step k is head k."""

    def __init__(self, model: MedusaDraftModel, head_weight: float = 0.8) -> None:
        if not 0 < head_weight <= 1:
            raise ValueError(f"head_weight must be in (0, 1], got {head_weight}")
        self.model, self.num_steps, self.head_weight = model, model.num_heads, head_weight

    def loss(self, batch: Batch) -> torch.Tensor:
        total = torch.zeros(())
        for k in range(self.num_steps):
            labels, counted = step_labels(batch, k)
            if counted.any():
                logits = self.model.head_logits(k, batch.hidden[counted])
                total = total + self.head_weight ** k * F.cross_entropy(logits, labels[counted])
        return total

    def step_hits(self, batch: Batch) -> tuple[list[int], list[int]]:
        """Per head: counted positions where its argmax is the target's choice."""
        return count_hits(batch, self.num_steps,
                          lambda k, counted: self.model.head_logits(k, batch.hidden[counted]).argmax(-1))

    def save(self, folder: str) -> None:
        """config.json + model.safetensors (float16) in vLLM's layout."""
        save_head(folder, self.model.config, self.model)

    def describe(self) -> list[str]:
        m = self.model
        return [f"{m.num_heads} heads of {m.num_layers} ResBlock(s) over the target's final hidden state; head k "
                f"predicts the token k + 2 places ahead, through its own LM head warm-started from the target's",
                f"loss: cross-entropy per head weighted {self.head_weight}**k"]


def build_medusa(target: TargetParts, data: Sequence[SequenceFeatures], num_heads: int = 4, num_layers: int = 1,
                 seed: int = 0) -> MedusaObjective:
    """Fresh heads for `target`; data must hold the target's final states (width H)."""
    require_final_states(data, target.config["hidden_size"], "Medusa")
    torch.manual_seed(seed)
    return MedusaObjective(MedusaDraftModel(num_heads, num_layers, target.lm_head))
