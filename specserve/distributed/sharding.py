"""Which part of a decoder each tensor-parallel rank holds, and that part cut out of a full state dict.

Megatron-style: q/k/v and gate/up are split by output rows (column-parallel), o_proj and down_proj by input
columns (row-parallel, summed by an all-reduce), the embedding and LM head by vocabulary rows. Attention is
split in whole key/value groups (a KV head with the query heads that read it), as evenly as the group
count allows: SmolLM2-135M's 3 KV heads (9 query heads) go 2 + 1 over two ranks.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from specserve.models.llama import DecoderConfig

# Decoder-layer projections by how they are split; anything else (norms, q/k norms) is replicated.
_COLUMN_PARALLEL = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_ROW_PARALLEL = {"o_proj": "q", "down_proj": "mlp"}
_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.(weight|bias)$")
_VOCAB_KEYS = ("embed_tokens.weight", "lm_head.weight")
_VISION_PREFIXES = ("visual.", "model.visual.")


def _split(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when `total` items go to `parts` parts, the first ones one larger."""
    size, extra = divmod(total, parts)
    start = index * size + min(index, extra)
    return start, start + size + (index < extra)


@dataclass(frozen=True)
class TensorShard:
    """Rank `rank` of `size`: the heads, intermediate columns and vocabulary rows it holds.

    The vocabulary is padded to `size` equal shards of ceil(vocab / size) rows (zero rows past the end), so
    every rank's logits have one shape; padded columns are dropped on the driver.
    """

    rank: int
    size: int
    config: DecoderConfig  # the whole model's

    @classmethod
    def create(cls, config: DecoderConfig, rank: int, size: int) -> "TensorShard":
        check_divisible(config, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside tensor_parallel_size {size}")
        return cls(rank, size, config)

    @property
    def kv_heads(self) -> tuple[int, int]:
        return _split(self.config.num_key_value_heads, self.size, self.rank)

    @property
    def q_heads(self) -> tuple[int, int]:
        group = self.config.num_attention_heads // self.config.num_key_value_heads
        start, end = self.kv_heads
        return start * group, end * group

    @property
    def intermediate(self) -> tuple[int, int]:
        width = self.config.intermediate_size // self.size
        return self.rank * width, (self.rank + 1) * width

    @property
    def vocab_shard_size(self) -> int:
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab(self) -> tuple[int, int]:
        """[start, end) of the real vocabulary rows this rank holds (end - start may be < vocab_shard_size)."""
        start = self.rank * self.vocab_shard_size
        return min(start, self.config.vocab_size), min(start + self.vocab_shard_size, self.config.vocab_size)

    def rows(self, kind: str) -> tuple[int, int]:
        """[start, end) of this rank's rows of a projection's output ("q", "kv") or of the MLP's ("mlp")."""
        head_dim = self.config.head_dim
        if kind == "mlp":
            return self.intermediate
        start, end = self.q_heads if kind == "q" else self.kv_heads
        return start * head_dim, end * head_dim

    def layer_config(self, config: DecoderConfig) -> DecoderConfig:
        """The decoder layers' view of this rank: its heads and intermediate columns (what the model
        constructor asks its `shard` for)."""
        (q0, q1), (k0, k1), (i0, i1) = self.q_heads, self.kv_heads, self.intermediate
        return replace(config, num_attention_heads=q1 - q0, num_key_value_heads=k1 - k0, intermediate_size=i1 - i0)


def check_divisible(config: DecoderConfig, size: int) -> None:
    """ValueError naming the sizes when the model cannot be split over `size` ranks."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    if config.moe is not None and size > 1:
        raise ValueError(f"tensor_parallel_size={size}: mixture-of-experts models (model_type "
                         f"{config.model_type!r}) are not split over ranks; use tensor_parallel_size=1")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if kv_heads < size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the attention: each rank holds whole key/value heads "
            f"(with the query heads that read them), and the model has num_key_value_heads={kv_heads} "
            f"(num_attention_heads={heads}); use tensor_parallel_size <= {kv_heads}")
    if config.intermediate_size % size:
        raise ValueError(f"intermediate_size={config.intermediate_size} is not divisible by "
                         f"tensor_parallel_size={size}")


def shard_state_dict(weights: dict[str, torch.Tensor], shard: TensorShard, keep_vision: bool
                     ) -> tuple[dict[str, torch.Tensor], dict[int, torch.Tensor]]:
    """(this rank's state dict, {layer: o_proj bias}) from the full one, in transformers' names.

    Row-parallel biases leave the state dict: they are added once, after the all-reduce (see
    layers.RowParallelLinear). keep_vision: keep a vision tower's weights (the driver encodes images).
    """
    out, row_biases = {}, {}
    for name, tensor in weights.items():
        if name.startswith(_VISION_PREFIXES):
            if keep_vision:
                out[name] = tensor
            continue
        match = _LAYER_KEY.search(name)
        if match is not None and match.group(2) in _COLUMN_PARALLEL:
            start, end = shard.rows(_COLUMN_PARALLEL[match.group(2)])
            out[name] = tensor[start:end].contiguous()
        elif match is not None and match.group(2) in _ROW_PARALLEL and match.group(3) == "weight":
            start, end = shard.rows(_ROW_PARALLEL[match.group(2)])
            out[name] = tensor[:, start:end].contiguous()
        elif match is not None and match.group(2) in _ROW_PARALLEL:
            if match.group(2) == "o_proj":  # the decoder has no down_proj bias
                row_biases[int(match.group(1))] = tensor
        elif name.endswith(_VOCAB_KEYS):
            out[name] = _vocab_rows(tensor, shard)
        else:
            out[name] = tensor
    return out, row_biases


def _vocab_rows(weight: torch.Tensor, shard: TensorShard) -> torch.Tensor:
    """[vocab_shard_size, hidden]: this rank's rows, zero-padded past the vocabulary's end."""
    start, end = shard.vocab
    rows = weight[start:end]
    pad = shard.vocab_shard_size - rows.shape[0]
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, weight.shape[1])])
    return rows.contiguous()
