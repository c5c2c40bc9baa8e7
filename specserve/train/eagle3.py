"""Trains an EAGLE-3 draft head on target features (features.py) with training-time test, and saves it in
the official layout (`midlayer.*`, d2t/t2d, no embedding) that models/drafter_loader.py reads.
"""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from specserve.train.features import SequenceFeatures


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


def build_draft_vocab(features: Sequence[SequenceFeatures], vocab_size: int, draft_vocab_size: int) -> DraftVocab:
    """The draft_vocab_size most frequent loss-masked target tokens (ties: lower id first), sorted ascending."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in [1, {vocab_size}] (the target vocabulary)")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for f in features:
        counts += torch.bincount(f.target_ids[f.loss_mask], minlength=vocab_size)
    order = torch.sort(-counts, stable=True).indices
    ids = order[:draft_vocab_size].sort().values
    total = int(counts.sum())
    coverage = float(counts[ids].sum()) / total if total else 0.0
    t2d = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    return DraftVocab(ids, ids - torch.arange(draft_vocab_size), t2d, coverage)


# ---------------------------------------------------------------- the head


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Attention(nn.Module):
    def __init__(self, H: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(2 * H, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * H, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * H, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, H, bias=False)

    def forward(self, z: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: list) -> torch.Tensor:
        """z: [B, T, 2H]; cos/sin: [T, D] for this step's positions; cache: the (k, v) [B, heads, T, D] of
        earlier TTT steps, appended to. Row t attends causally to step 0's keys and to its own row's keys of
        steps 1..i (the drafted tokens at row t), as a chain of single-token draft steps would."""
        B, T, _ = z.shape
        rep = self.heads // self.kv_heads
        q = _rope(self.q_proj(z).view(B, T, self.heads, -1).transpose(1, 2), cos, sin)
        k = _rope(self.k_proj(z).view(B, T, self.kv_heads, -1).transpose(1, 2), cos, sin)
        v = self.v_proj(z).view(B, T, self.kv_heads, -1).transpose(1, 2)
        cache.append((k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
        scale = self.head_dim ** -0.5
        k0, v0 = cache[0]
        causal = torch.ones(T, T, dtype=torch.bool, device=z.device).triu(1)
        scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(causal, float("-inf"))]  # [B, h, T, T]
        scores += [((q * kj).sum(-1) * scale)[..., None] for kj, _ in cache[1:]]  # [B, h, T, 1] each
        probs = torch.cat(scores, -1).softmax(-1)
        out = probs[..., :T] @ v0
        for j, (_, vj) in enumerate(cache[1:]):
            out = out + probs[..., T + j, None] * vj
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class _MLP(nn.Module):
    def __init__(self, H: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(H, intermediate, bias=False)
        self.up_proj = nn.Linear(H, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, H: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.self_attn = _Attention(H, heads, kv_heads, head_dim)
        self.mlp = _MLP(H, intermediate)
        self.hidden_norm = RMSNorm(H, eps)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos, sin, cache: list) -> torch.Tensor:
        """embeds, hidden: [B, T, H] -> g [B, T, H] (pre-norm); embedding first in the 2H input."""
        z = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)
        r = hidden + self.self_attn(z, cos, sin, cache)
        return r + self.mlp(self.post_attention_layernorm(r))


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
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, int, int]

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, aux_layer_ids: Sequence[int],
                    intermediate_size: int | None = None) -> "Eagle3HeadConfig":
        """From a transformers Llama-family config (or its dict)."""
        t = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
        if t.get("rope_scaling"):
            raise ValueError(f"target rope_scaling {t['rope_scaling']} is not supported by the trainer yet "
                             f"(plain RoPE only)")
        theta = t.get("rope_theta") or (t.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        heads = t["num_attention_heads"]
        return cls(t["hidden_size"], intermediate_size or t["intermediate_size"], heads,
                   t.get("num_key_value_heads") or heads, t.get("head_dim") or t["hidden_size"] // heads,
                   t["rms_norm_eps"], float(theta), t["max_position_embeddings"], t["vocab_size"],
                   draft_vocab_size, tuple(int(i) for i in aux_layer_ids))

    def to_json(self) -> dict:
        """config.json in the official EAGLE-3 layout (engines must be told the method "eagle3")."""
        return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                    hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                    num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                    head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                    max_position_embeddings=self.max_position_embeddings, vocab_size=self.vocab_size,
                    num_hidden_layers=1, tie_word_embeddings=False, draft_vocab_size=self.draft_vocab_size,
                    eagle_config={"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                                  "use_aux_hidden_state": True})


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
        self.midlayer = _MidLayer(H, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                  c.rms_norm_eps)
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
        """input_ids: [B, T]; aux_hidden: [B, T, 3Ht] -> num_steps logits [B, T, Vd]. Step i at row t reads
        token t + 1 + i (teacher-forced; 0 past the end) and, for i > 0, step i - 1's pre-norm output at row
        t, at RoPE position t + i; it predicts the target's choice after token t + 1 + i."""
        B, T = input_ids.shape
        hidden, cache, logits = self.fc(aux_hidden), [], []
        for i in range(num_steps):
            tokens = F.pad(input_ids[:, 1 + i:], (0, 1 + i))
            cos, sin = _cos_sin(torch.arange(T) + i, self.config.head_dim, self.config.rope_theta)
            hidden = self.midlayer(self.embed_tokens[tokens], hidden, cos, sin, cache)
            logits.append(self.lm_head(self.norm(hidden)))
        return logits

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def _cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = positions.double()[:, None] * inv_freq[None, :]
    angle = torch.cat([angle, angle], -1)
    return angle.cos().float(), angle.sin().float()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, h, T, D], rotate-half layout."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


# ---------------------------------------------------------------- training


@dataclass
class Eagle3TrainConfig:
    ttt_steps: int = 3
    step_weight: float = 0.8  # loss = sum_i step_weight**i * CE_i
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    batch_size: int = 4
    epochs: int = 1
    warmup_ratio: float = 0.03  # then cosine decay to 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.ttt_steps < 1 or self.batch_size < 1 or self.epochs < 1:
            raise ValueError("ttt_steps, batch_size and epochs must be at least 1")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] right-padded with 0
    aux_hidden: torch.Tensor  # [B, T, 3Ht]
    target_ids: torch.Tensor  # [B, T]
    valid: torch.Tensor  # [B, T] bool: a real, loss-masked position


def collate(features: Sequence[SequenceFeatures]) -> Batch:
    T = max(len(f) for f in features)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (0, 0, 0, T - t.shape[0])) if t.dim() == 2 else F.pad(t, (0, T - t.shape[0]))

    return Batch(torch.stack([pad(f.input_ids) for f in features]), torch.stack([pad(f.aux_hidden) for f in features]),
                 torch.stack([pad(f.target_ids) for f in features]), torch.stack([pad(f.loss_mask) for f in features]))


def step_labels(batch: Batch, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step` at row t predicts target_ids[t + 1 + step] -> (target ids [B, T], counted [B, T] bool)."""
    shift = 1 + step
    labels = F.pad(batch.target_ids[:, shift:], (0, shift))
    counted = F.pad(batch.valid[:, shift:], (0, shift), value=False)
    return labels, counted


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # per optimizer step
    num_tokens: int = 0
    seconds: float = 0.0


class Eagle3Trainer:
    """AdamW with warmup + cosine, gradient clipping, TTT loss; `evaluate` gives teacher-forced step-k accuracy."""

    def __init__(self, model: Eagle3DraftModel, config: Eagle3TrainConfig) -> None:
        self.model, self.config = model, config
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr,
                                           betas=config.betas, weight_decay=config.weight_decay)
        self.result = TrainResult()

    def loss(self, batch: Batch) -> torch.Tensor:
        """sum_i step_weight**i * CE_i over positions whose target token is in the draft vocabulary."""
        total = torch.zeros(())
        for i, logits in enumerate(self.model.unroll(batch.input_ids, batch.aux_hidden, self.config.ttt_steps)):
            labels, counted = step_labels(batch, i)
            draft = self.model.vocab.to_draft(labels)
            keep = counted & (draft >= 0)
            if keep.any():
                total = total + self.config.step_weight ** i * F.cross_entropy(logits[keep], draft[keep])
        return total

    def train(self, features: Sequence[SequenceFeatures]) -> TrainResult:
        c, g = self.config, torch.Generator().manual_seed(self.config.seed)
        per_epoch = math.ceil(len(features) / c.batch_size)
        total_steps = per_epoch * c.epochs
        warmup = max(1, int(c.warmup_ratio * total_steps))
        schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(
            (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / total_steps)))))
        start = time.perf_counter()
        self.model.train()
        for _ in range(c.epochs):
            order = torch.randperm(len(features), generator=g).tolist()
            for b in range(0, len(order), c.batch_size):
                batch = collate([features[j] for j in order[b:b + c.batch_size]])
                loss = self.loss(batch)
                self.optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
                self.optimizer.step()
                schedule.step()
                self.result.losses.append(loss.item())
                self.result.num_tokens += int(batch.valid.sum())
        self.result.seconds += time.perf_counter() - start
        return self.result

    @torch.no_grad()
    def evaluate(self, features: Sequence[SequenceFeatures]) -> list[float]:
        """Teacher-forced step-k accuracy, k = 0..ttt_steps-1: the share of counted positions where the draft's
        argmax (mapped through d2t) equals the target's choice; out-of-vocabulary targets count as misses."""
        self.model.eval()
        hits, counts = [0] * self.config.ttt_steps, [0] * self.config.ttt_steps
        for b in range(0, len(features), self.config.batch_size):
            batch = collate(features[b:b + self.config.batch_size])
            for i, logits in enumerate(self.model.unroll(batch.input_ids, batch.aux_hidden, self.config.ttt_steps)):
                labels, counted = step_labels(batch, i)
                predicted = self.model.draft_to_target(logits.argmax(-1))
                hits[i] += int((predicted == labels)[counted].sum())
                counts[i] += int(counted.sum())
        return [h / n if n else 0.0 for h, n in zip(hits, counts)]

    def save(self, folder: str, command: str = "", step_accuracy: Sequence[float] | None = None) -> str:
        """config.json + model.safetensors (official layout, no embedding) + README.md model card."""
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(self.model.config.to_json(), f, indent=2)
        tensors = {k: v.detach().contiguous().clone() for k, v in self.model.state_dict().items()}
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "README.md"), "w") as f:
            f.write(self._model_card(command, step_accuracy))
        return folder

    def _model_card(self, command: str, step_accuracy: Sequence[float] | None) -> str:
        c, r, m = self.config, self.result, self.model.config
        final = sum(r.losses[-10:]) / len(r.losses[-10:]) if r.losses else float("nan")
        acc = ", ".join(f"step {k}: {a:.3f}" for k, a in enumerate(step_accuracy or []))
        return (f"# EAGLE-3 draft head (specserve)\n\nLoad with `speculative_config={{\"method\": \"eagle3\", "
                f"\"model\": <this folder>}}`; the embedding is the target's.\n\n"
                f"- command: `{command or 'n/a'}`\n- aux layers (input of layer): {list(m.aux_layer_ids)}\n"
                f"- draft vocabulary: {m.draft_vocab_size} of {m.vocab_size} tokens, coverage "
                f"{self.model.vocab.coverage:.3f}\n- data: {r.num_tokens} counted tokens seen, "
                f"{len(r.losses)} optimizer steps, {r.seconds:.1f} s\n- TTT steps {c.ttt_steps}, lr {c.lr}, batch "
                f"{c.batch_size}, epochs {c.epochs}\n- final loss (mean of last 10 steps): {final:.4f}\n"
                f"- held-out teacher-forced accuracy: {acc or 'n/a'}\n")


def train_eagle3(target_hf, train: Sequence[SequenceFeatures], held_out: Sequence[SequenceFeatures], folder: str,
                 draft_vocab_size: int, aux_layer_ids: Sequence[int], config: Eagle3TrainConfig | None = None,
                 command: str = "") -> tuple[Eagle3Trainer, list[float]]:
    """The whole recipe over extracted features: draft vocabulary, a head warm-started from the target's LM
    head rows, training, held-out step-k accuracy, save to `folder`. target_hf: the transformers target
    the features came from (its config, embedding and LM head are read)."""
    config = config or Eagle3TrainConfig()
    vocab = build_draft_vocab(train, target_hf.config.vocab_size, draft_vocab_size)
    head_config = Eagle3HeadConfig.from_target(target_hf.config, draft_vocab_size, aux_layer_ids)
    torch.manual_seed(config.seed)
    model = Eagle3DraftModel(head_config, target_hf.get_input_embeddings().weight, vocab,
                             target_hf.get_output_embeddings().weight.detach())
    trainer = Eagle3Trainer(model, config)
    trainer.train(train)
    accuracy = trainer.evaluate(held_out)
    trainer.save(folder, command, accuracy)
    return trainer, accuracy
