"""The collectives of a tensor-parallel decoder, wrapped around the layers each rank builds from its shard.

`parallelize` swaps them into a LlamaForCausalLM built from a shard (sharding.py): o_proj and down_proj
all-reduce their partial products, the embedding assembles rows from every rank's vocabulary slice, and the
LM head gathers the vocabulary slices' logits (or their (max, argmax) pairs) on the driver.
"""
from __future__ import annotations

import torch

from specserve.distributed.group import TensorParallelGroup
from specserve.distributed.sharding import TensorShard


class RowParallelLinear:
    """A linear layer over this rank's input columns: its partial product is summed over ranks by one
    all-reduce, then the bias (whole, on every rank) is added once."""

    def __init__(self, local, group: TensorParallelGroup, bias: torch.Tensor | None = None) -> None:
        self.local, self.group, self.bias = local, group, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in / size] → [N, out], the same on every rank."""
        y = self.group.all_reduce(self.local(x).contiguous())
        return y if self.bias is None else y.add_(self.bias)


class VocabParallelEmbedding:
    """The token embedding of this rank's vocabulary rows [start, end): other ids give zero rows, and an
    all-reduce assembles every token's row (exact: one non-zero term per element)."""

    def __init__(self, local, shard: TensorShard, group: TensorParallelGroup) -> None:
        self.local, self.group = local, group  # local: [vocab_shard_size, hidden], indexable by ids
        self.start, self.end = shard.vocab

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [N] int64 → [N, hidden]."""
        local = ids - self.start
        inside = (local >= 0) & (local < self.end - self.start)
        rows = self.local[torch.where(inside, local, torch.zeros_like(local))]
        rows = rows.masked_fill(~inside.unsqueeze(-1), 0).contiguous()
        return self.group.all_reduce(rows)


class VocabParallelLMHead:
    """The LM head of this rank's vocabulary rows. Every rank computes its slice of the logits; the driver
    (rank 0) gets the whole vocabulary, the other ranks None."""

    def __init__(self, local, shard: TensorShard, group: TensorParallelGroup) -> None:
        self.local, self.group = local, group  # local: hidden → [M, vocab_shard_size] (padding rows zero)
        self.start, self.end = shard.vocab
        self.vocab_size = shard.config.vocab_size

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [M, hidden] → logits [M, vocab] on the driver."""
        parts = self.group.gather(self.local(hidden).float().contiguous())
        return None if parts is None else torch.cat(parts, dim=-1)[:, : self.vocab_size]

    def argmax(self, hidden: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor | None:
        """hidden: [M, hidden]; allowed: None or [M, vocab] bool → [M] int64 on the driver: exactly
        torch.argmax over the whole vocabulary's logits (the first maximum), from each rank's (max, argmax)."""
        logits = self.local(hidden).float()[:, : self.end - self.start]
        if allowed is not None:
            logits = logits.masked_fill(~allowed[:, self.start:self.end], float("-inf"))
        index = logits.argmax(dim=-1, keepdim=True)
        pair = torch.cat([logits.gather(1, index).double(), (index + self.start).double()], dim=1)  # [M, 2]
        parts = self.group.gather(pair.contiguous())
        return None if parts is None else combine_argmax(torch.stack(parts))


def combine_argmax(pairs: torch.Tensor) -> torch.Tensor:
    """pairs: [ranks, M, 2] per rank (max value, its global index), ranks in vocabulary order → [M] int64:
    the index torch.argmax gives over the concatenated logits. A NaN wins, as in torch.argmax; among equal
    maxima the lowest rank wins, and within a rank its own argmax already took the first."""
    values, index = pairs[..., 0], pairs[..., 1].long()
    nan = values.isnan()
    best = values.masked_fill(nan, float("-inf")).amax(dim=0, keepdim=True)
    # rank score: 2 for a NaN, 1 for the maximum, 0 otherwise; argmax takes the first rank of the top score
    score = torch.where(nan, 2, (values == best).long())
    winner = score.argmax(dim=0, keepdim=True)
    return index.gather(0, winner).squeeze(0)


def parallelize(model, shard: TensorShard, group: TensorParallelGroup, row_biases: dict[int, torch.Tensor]) -> None:
    """Give a LlamaForCausalLM built from `shard` (sharding.shard_state_dict, `shard=shard`) its collectives.

    row_biases: {layer: o_proj bias}, added after the all-reduce. The fused C decoder stack computes whole
    layers in one call with no place for an all-reduce, so the model runs layer by layer.
    """
    for i, layer in enumerate(model.layers):
        layer.o_proj = RowParallelLinear(layer.o_proj, group, row_biases.get(i))
        layer.down = RowParallelLinear(layer.down, group)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, shard, group)
    model.lm_head = VocabParallelLMHead(model.lm_head, shard, group)
    model.exact_argmax = True  # greedy_tokens goes through lm_head.argmax: (max, argmax) pairs, not logits
    model.fused_forward = False
