"""Medusa heads: K small heads that each predict one more token from the target's last hidden state.

Head k (k = 0..K-1) maps h_t, the target's final post-norm state at the last accepted position t, through
its ResBlocks (y = x + SiLU(W x + b)) and a vocabulary projection, and predicts x_{t+2+k} (the target's
own head predicts x_{t+1}). There is no draft pass and no KV cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.models.drafter_loader import DrafterCheckpoint, cast_weight, expect_tensor, to_target_vocab
from specserve.models.llama import make_linear
from specserve.models.loader import ModelLoadError
from specserve.ops import kernels


class MedusaHeads:
    """The K heads of a Medusa checkpoint (see drafter_loader for the layouts), checked against the target.

    Heads without a projection of their own (Medusa "version 2") use the target's LM head. A checkpoint
    with a truncated vocabulary (vLLM's `token_map`: target id of each of its Vt ids) gives logits over the
    target vocabulary with -inf outside those ids.
    """

    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, checkpoint: DrafterCheckpoint, target, weight_dtype=None) -> None:
        if checkpoint.family != "medusa":
            raise ValueError(f"MedusaHeads needs a 'medusa' checkpoint, got {checkpoint.family!r}")
        self.num_heads = K = checkpoint.num_heads
        self.hidden_size = H = target.config.hidden_size
        self.vocab_size = target.config.vocab_size
        self.dtype = target.dtype
        self.target = target
        self.token_map = self._token_map(checkpoint)
        vocab = self.vocab_size if self.token_map is None else len(self.token_map)
        make = lambda w, b=None: make_linear(cast_weight(w, self.dtype), cast_weight(b, self.dtype), weight_dtype)  # noqa: E731
        blocks = [[self._block(checkpoint, i, j) for j in range(checkpoint.num_layers[i])] for i in range(K)]
        # Every head's first ResBlock reads the same h_t: one [K * H, H] projection for all of them.
        self.first = None
        if all(blocks):
            biases = [b[0][1] for b in blocks]
            bias = None if all(b is None for b in biases) else torch.cat(
                [torch.zeros(H) if b is None else b for b in biases])
            self.first = make(torch.cat([b[0][0] for b in blocks]), bias)
            blocks = [b[1:] for b in blocks]
        self.blocks = [[make(w, b) for w, b in head] for head in blocks]
        self.lm_heads = [self._projection(checkpoint, i, vocab, make) for i in range(K)]
        self.exact_argmax = [getattr(p, "enable_exact_argmax", lambda: False)() if p is not None else False
                             for p in self.lm_heads]

    def _block(self, ckpt: DrafterCheckpoint, head: int, layer: int):
        H, prefix = self.hidden_size, f"blocks.{head}.layers.{layer}."
        why = f"Medusa ResBlock: [H, H] with the target's hidden size H = {H}"
        weight = expect_tensor(ckpt, prefix + "weight", (H, H), why)
        bias = expect_tensor(ckpt, prefix + "bias", (H,), why) if prefix + "bias" in ckpt.state_dict else None
        return weight, bias

    def _projection(self, ckpt: DrafterCheckpoint, head: int, vocab: int, make):
        name = f"lm_heads.{head}.weight"
        if name not in ckpt.state_dict:
            if self.token_map is not None:
                raise ModelLoadError(f"{ckpt.source}: missing tensor {name!r}, expected shape "
                                     f"{[vocab, self.hidden_size]} (a truncated vocabulary needs per-head projections)")
            return None  # the target's LM head
        why = f"vocabulary {vocab} x the target's hidden size {self.hidden_size}"
        weight = expect_tensor(ckpt, name, (vocab, self.hidden_size), why)
        bias_name = f"lm_heads.{head}.bias"
        bias = expect_tensor(ckpt, bias_name, (vocab,), why) if bias_name in ckpt.state_dict else None
        return make(weight, bias)

    def _token_map(self, ckpt: DrafterCheckpoint) -> torch.Tensor | None:
        token_map = ckpt.state_dict.get("token_map")
        if token_map is None:
            return None
        token_map = token_map.to(torch.int64).reshape(-1)
        if len(token_map) and (int(token_map.min()) < 0 or int(token_map.max()) >= self.vocab_size):
            raise ModelLoadError(f"{ckpt.source}: tensor 'token_map' {list(token_map.shape)} holds ids outside the "
                                 f"target's vocabulary of {self.vocab_size} tokens")
        return token_map

    def head_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] (the target's final post-norm states) -> [K, N, H] after each head's ResBlocks."""
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be [N, {self.hidden_size}], got {list(hidden.shape)}")
        n, H = hidden.shape[0], self.hidden_size
        if self.first is None:
            states = hidden.unsqueeze(0).expand(self.num_heads, n, H)
        else:
            z = self.first(hidden).view(n, self.num_heads, H).transpose(0, 1)  # [K, N, H]
            states = hidden.unsqueeze(0) + F.silu(z)
        out = []
        for k, blocks in enumerate(self.blocks):
            x = states[k]
            for block in blocks:
                x = x + F.silu(block(x.contiguous()))
            out.append(x)
        return torch.stack(out)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [K, N, V] float32 over the target vocabulary (head k at index k)."""
        states = self.head_states(hidden)
        return torch.stack([self.head_logits(k, states[k]) for k in range(self.num_heads)])

    compute_logits = forward

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> [N, K] int64 target ids; column k is head k's argmax."""
        states = self.head_states(hidden)
        K, N = states.shape[:2]
        if all(p is None for p in self.lm_heads):  # all heads on the target's head: one call
            return self.target.greedy_tokens(states.reshape(K * N, -1)).view(K, N).t()
        return torch.stack([self.head_argmax(k, states[k]) for k in range(K)], dim=1)

    def head_argmax(self, k: int, state: torch.Tensor) -> torch.Tensor:
        """state: [N, H] head k's hidden state (head_states(...)[k]) -> [N] its argmax, in target ids."""
        projection = self.lm_heads[k]
        if projection is None:
            return self.target.greedy_tokens(state)
        x = state.contiguous()
        ids = projection.argmax(x) if self.exact_argmax[k] else kernels.argmax_rows(projection(x).float())
        return ids if self.token_map is None else self.token_map[ids]

    def head_logits(self, k: int, state: torch.Tensor) -> torch.Tensor:
        """state: [N, H] head k's hidden state -> [N, V] float32 logits over the target vocabulary."""
        projection = self.lm_heads[k]
        if projection is None:
            return self.target.compute_logits(state)
        return to_target_vocab(projection(state.contiguous()).float(), self.token_map, self.vocab_size)
