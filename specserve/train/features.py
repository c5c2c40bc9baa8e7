"""What a drafter trains on: per self-distilled sequence, the target states the drafter reads, the target's
own next-token choice at every position, and which positions count.

One teacher-forced pass of specserve's own target model over prompt + answer records, per token, either
the aux hidden states (EAGLE-3: the residual stream entering each aux layer, concatenated) or the final
hidden state (EAGLE, Medusa: the normed output the LM head reads), exactly what the runner hands the
drafter at inference. They go to a folder of memory-mapped arrays (`FeatureStore`): states in float16,
bfloat16 or q8 (int8 in blocks of 32 with a float16 scale each: 1.1 bytes a value, outlier dimensions cost
only their own block's precision), tokens and labels as int32, so a data set larger than memory trains
from disk.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

STATE_KINDS = ("aux", "final")
STATE_DTYPES = ("float16", "bfloat16", "q8")
Q8_BLOCK = 32


def encode_states(h: torch.Tensor, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """[T, S] float32 -> (values as stored, q8 scales [T, S / 32] float16 or None)."""
    if dtype == "float16":
        return h.half().numpy(), None
    if dtype == "bfloat16":
        return h.bfloat16().view(torch.uint16).numpy(), None
    blocks = h.reshape(h.shape[0], -1, Q8_BLOCK)
    scale = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    q = torch.where(scale > 0, blocks / scale.clamp_min(1e-30), torch.zeros(())).round().clamp(-127, 127)
    return q.to(torch.int8).reshape(h.shape).numpy(), scale.squeeze(-1).half().numpy()


def decode_states(values: np.ndarray, scales: np.ndarray | None, dtype: str) -> torch.Tensor:
    """The inverse of encode_states, as float32."""
    v = torch.from_numpy(np.array(values))
    if dtype == "float16":
        return v.float()
    if dtype == "bfloat16":
        return v.view(torch.bfloat16).float()
    s = torch.from_numpy(np.array(scales)).float()
    return (v.reshape(v.shape[0], -1, Q8_BLOCK).float() * s[..., None]).reshape(v.shape)


def _storage(dtype: str, width: int) -> tuple[type, int]:
    """(numpy dtype of states.bin, its width) for a feature dtype."""
    if dtype == "q8" and width % Q8_BLOCK:
        raise ValueError(f"q8 features need a width divisible by {Q8_BLOCK}, got {width}; use float16")
    return {"float16": np.float16, "bfloat16": np.uint16, "q8": np.int8}[dtype], width


@dataclass
class SequenceFeatures:
    """One training sequence of T tokens.

    input_ids: [T] int64, the tokens.
    hidden: [T, S] float32, the target states the drafter reads at each position (aux: S = 3 * H, the
        states entering the aux layers concatenated in order; final: S = H).
    target_ids: [T] int64, the target's argmax at each position (its choice for token t + 1); for greedily
        self-distilled text it equals input_ids[t + 1] in the generated part, so hard labels are exact.
    loss_mask: [T] bool, positions whose prediction counts (the answer, from the prompt's last token on).
    """

    input_ids: torch.Tensor
    hidden: torch.Tensor
    target_ids: torch.Tensor
    loss_mask: torch.Tensor

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default aux layers for an L-layer target, "input of layer" convention: (2, L // 2, L - 3)."""
    if num_layers < 6:
        raise ValueError(f"EAGLE-3 needs three distinct aux layers (2, L // 2, L - 3); a target of {num_layers} "
                         f"layers has too few (need at least 6)")
    return 2, num_layers // 2, num_layers - 3


def answer_mask(num_tokens: int, num_prompt_tokens: int) -> torch.Tensor:
    """Rows that predict an answer token: from the prompt's last token to the end."""
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    mask[max(0, num_prompt_tokens - 1):] = True
    return mask


FEATURE_PATHS = ("engine", "fp32")


def feature_model(model_path: str | None, aux_layers: Sequence[int] = (), path: str = "engine"):
    """The target that computes training features. "engine": built as the engine builds it (a GGUF file's
    4-bit blocks with int8 activations: exactly the states the runner hands a drafter at inference);
    "fp32": its weights dequantized to float32. A Hugging Face folder is the same either way."""
    from specserve.config import EngineConfig
    from specserve.models.gguf_quant import ACTIVATION_DIGITS, int8_activation_weights
    from specserve.models.loader import load_model_weights
    from specserve.models.registry import build_model

    if path not in FEATURE_PATHS:
        raise ValueError(f"feature path {path!r}: expected one of {', '.join(FEATURE_PATHS)}")
    if path == "fp32":
        loaded = load_model_weights(model_path)
        return build_model(loaded.config, loaded.state_dict, dtype=torch.float32, aux_hidden_layers=tuple(aux_layers))
    config = EngineConfig(model=model_path)
    loaded = load_model_weights(config.model, dtype=config.torch_dtype, keep_quantized=config.keep_gguf_blocks)
    if config.keep_gguf_blocks and config.gguf_compute in ACTIVATION_DIGITS:
        loaded.state_dict = int8_activation_weights(loaded.state_dict, ACTIVATION_DIGITS[config.gguf_compute])
    return build_model(loaded.config, loaded.state_dict, dtype=config.torch_dtype,
                       weight_dtype=config.linear_weight_dtype, aux_hidden_layers=tuple(aux_layers))


@torch.inference_mode()
def target_states(model, token_ids: Sequence[int], kind: str, block_size: int = 16
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One prefill of specserve's target over token_ids -> (states [T, S] float32, target argmax [T] int64).
    model: a models.registry model; for kind "aux" its aux layers must be set."""
    from specserve.ops import kernels
    from specserve.ops.attention import build_attention_metadata, kv_caches

    if kind not in STATE_KINDS:
        raise ValueError(f"state kind {kind!r}: expected one of {', '.join(STATE_KINDS)}")
    if kind == "aux" and not model.aux_hidden_layers:
        raise ValueError("target_states(kind='aux'): the model has no aux hidden layers set")
    n = len(token_ids)
    blocks = -(-n // block_size)
    caches = kv_caches(model.kv_cache_shape(blocks, block_size), model.dtype, model.num_layers)
    meta = build_attention_metadata([n], [n], [list(range(blocks))], block_size, torch.arange(n),
                                    kernels.kernel_usable(model.dtype))
    ids = torch.tensor(list(token_ids), dtype=torch.int64)
    positions = torch.arange(n)
    if getattr(model, "uses_mrope", False):
        positions = positions.expand(3, n)
    hidden, aux = model.forward(ids, positions, meta, caches)
    states = torch.cat(aux, -1) if kind == "aux" else hidden
    return states.float(), model.greedy_tokens(hidden)


class FeatureStore:
    """A folder of memory-mapped arrays: meta.json, offsets.npy [S + 1], tokens.npy / targets.npy [N] int32,
    mask.npy [N] bool, states.bin [N, width] (float16, bfloat16 bits or q8 values; q8 adds scales.bin
    [N, width / 32] float16). store[i] -> SequenceFeatures (float32)."""

    def __init__(self, folder: str, num_sequences: int | None = None) -> None:
        """num_sequences: read only the store's first sequences (a store written for more)."""
        path = os.path.join(folder, "meta.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{folder}: no feature store here (meta.json missing)")
        with open(path) as f:
            self.meta = json.load(f)
        self.folder = folder
        self.offsets = np.load(os.path.join(folder, "offsets.npy"))[:None if num_sequences is None else num_sequences + 1]
        self.tokens = np.load(os.path.join(folder, "tokens.npy"), mmap_mode="r")
        self.targets = np.load(os.path.join(folder, "targets.npy"), mmap_mode="r")
        self.mask = np.load(os.path.join(folder, "mask.npy"), mmap_mode="r")
        np_dtype, width = _storage(self.meta["dtype"], self.meta["width"])
        n = int(self.offsets[-1])
        self.states = np.memmap(os.path.join(folder, "states.bin"), dtype=np_dtype, mode="r", shape=(n, width))
        self.scales = np.memmap(os.path.join(folder, "scales.bin"), dtype=np.float16, mode="r",
                                shape=(n, width // Q8_BLOCK)) if self.meta["dtype"] == "q8" else None

    @property
    def kind(self) -> str:
        return self.meta["kind"]

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> list[int]:
        return np.diff(self.offsets).tolist()

    def __getitem__(self, i: int) -> SequenceFeatures:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        states = decode_states(self.states[a:b], None if self.scales is None else self.scales[a:b], self.meta["dtype"])
        return SequenceFeatures(torch.from_numpy(self.tokens[a:b].astype(np.int64)), states,
                                torch.from_numpy(self.targets[a:b].astype(np.int64)),
                                torch.from_numpy(np.array(self.mask[a:b])))

    def sequence_ids(self) -> list[int]:
        return list(self.meta.get("sequence_ids", range(len(self))))[:len(self)]


def _progress(folder: str) -> tuple[dict | None, int]:
    """(meta.json of the store in folder or None, how many of its sequences are written)."""
    path = os.path.join(folder, "meta.json")
    if not os.path.exists(path):
        return None, 0
    with open(path) as f:
        meta = json.load(f)
    return meta, int(meta.get("num_done", meta["num_sequences"] if meta.get("complete") else 0))


def _reusable(folder: str, layout: dict, ids: list[int], offsets: np.ndarray, sequences) -> tuple[dict | None, int]:
    """(meta.json of the store in folder or None, how many of the sequences asked for (with these ids, offsets
    and layout: kind, dtype, width) it already holds: its written sequences, or all asked for when it holds
    more, if they are the first ones asked for, token for token; else 0)."""
    old, done = _progress(folder)
    if old is None or not done:
        return old, 0
    k = min(done, len(ids))
    old_offsets = np.load(os.path.join(folder, "offsets.npy"))
    same = all(old[key] == v for key, v in layout.items()) and old["sequence_ids"][:k] == ids[:k] \
        and old_offsets[:k + 1].tolist() == offsets[:k + 1].tolist()
    if same:
        stored = np.load(os.path.join(folder, "tokens.npy"), mmap_mode="r")[:offsets[k]]
        same = np.array_equal(stored, np.concatenate([np.asarray(s, np.int64) for s in sequences[:k]]))
    return old, k if same else 0


def _token_array(folder: str, name: str, dtype, n: int, kept: int) -> np.ndarray:
    """A store's per-token array of n entries, its first kept entries read back from folder."""
    array = np.zeros(n, dtype)
    if kept:
        array[:kept] = np.load(os.path.join(folder, f"{name}.npy"))[:kept]
    return array


def _open_rows(path: str, dtype, rows: int, width: int) -> np.memmap:
    """[rows, width] of dtype memory-mapped from path, the file grown (or created) to that size, rows already
    there kept."""
    size = rows * width * np.dtype(dtype).itemsize
    with open(path, "ab") as f:
        if f.tell() != size:
            f.truncate(size)
    return np.memmap(path, dtype=dtype, mode="r+", shape=(rows, width))


def write_feature_store(model, sequences: Sequence[Sequence[int]], masks: Sequence, folder: str,
                        kind: str, dtype: str = "float16", sequence_ids: Sequence[int] | None = None,
                        log=None, checkpoint_every_s: float = 120.0) -> FeatureStore:
    """Runs target_states over every sequence and writes the store. masks: per sequence, its prompt length
    (the answer counts from the prompt's last token: answer_mask) or a bool array of the positions that count.

    Resumable: progress is saved every checkpoint_every_s seconds, and a folder whose written sequences are
    the first ones asked for (same ids, lengths, kind and dtype) goes on from there, so an interrupted run
    and a data folder that has grown since (new shards) compute only what is missing."""
    if dtype not in STATE_DTYPES:
        raise ValueError(f"feature dtype {dtype!r}: expected one of {', '.join(STATE_DTYPES)}")
    if len(sequences) != len(masks) or not sequences:
        raise ValueError("write_feature_store: need one mask or prompt length per sequence, and at least one sequence")
    lengths = [len(s) for s in sequences]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = list(sequence_ids) if sequence_ids is not None else list(range(len(sequences)))
    width = (len(model.aux_hidden_layers) if kind == "aux" else 1) * model.config.hidden_size
    n = int(offsets[-1])
    old, done = _reusable(folder, dict(kind=kind, dtype=dtype, width=width), ids, offsets, sequences)
    if done == len(ids):  # all written already, maybe as the first sequences of a larger store: kept whole
        return FeatureStore(folder, len(ids))
    os.makedirs(folder, exist_ok=True)
    np_dtype, _ = _storage(dtype, width)
    arrays = {name: _token_array(folder, name, array_dtype, n, int(offsets[done]))
              for name, array_dtype in (("tokens", np.int32), ("targets", np.int32), ("mask", bool))}
    states = _open_rows(os.path.join(folder, "states.bin"), np_dtype, n, width)
    scales = _open_rows(os.path.join(folder, "scales.bin"), np.float16, n, width // Q8_BLOCK) if dtype == "q8" else None
    base = dict(kind=kind, dtype=dtype, width=width, hidden_size=model.config.hidden_size,
                aux_layers=list(model.aux_hidden_layers) if kind == "aux" else [], num_sequences=len(sequences),
                num_tokens=n, sequence_ids=ids)
    seconds = old.get("seconds", 0.0) if done and old else 0.0

    def save(num_done: int, elapsed: float) -> None:
        for array in (states, scales):
            if array is not None:
                array.flush()
        for name, array in (("offsets", offsets), *arrays.items()):
            np.save(os.path.join(folder, f"{name}.tmp.npy"), array)
            os.replace(os.path.join(folder, f"{name}.tmp.npy"), os.path.join(folder, f"{name}.npy"))
        meta = dict(base, num_done=num_done, complete=num_done == len(sequences),
                    num_loss_tokens=int(arrays["mask"].sum()), seconds=round(seconds + elapsed, 1))
        with open(os.path.join(folder, "meta.tmp.json"), "w") as f:
            json.dump(meta, f)
        os.replace(os.path.join(folder, "meta.tmp.json"), os.path.join(folder, "meta.json"))

    if log and done:
        log(f"features: resuming after {done}/{len(sequences)} sequences")
    start = last = time.perf_counter()
    for i in range(done, len(sequences)):
        a, b, m = int(offsets[i]), int(offsets[i + 1]), masks[i]
        h, t = target_states(model, sequences[i], kind)
        states[a:b], q8_scales = encode_states(h, dtype)
        if scales is not None:
            scales[a:b] = q8_scales
        arrays["tokens"][a:b], arrays["targets"][a:b] = np.asarray(sequences[i], np.int32), t.numpy().astype(np.int32)
        arrays["mask"][a:b] = answer_mask(b - a, int(m)).numpy() if np.ndim(m) == 0 else np.asarray(m, bool)
        if time.perf_counter() - last > checkpoint_every_s:
            save(i + 1, time.perf_counter() - start)
            last = time.perf_counter()
        if log and (i + 1) % 100 == 0:
            rate = (b - offsets[done]) / (time.perf_counter() - start)
            log(f"features: {i + 1}/{len(sequences)} sequences, {rate:.0f} tok/s, ETA {(n - b) / rate / 60:.1f} min")
    save(len(sequences), time.perf_counter() - start)
    del states, scales
    return FeatureStore(folder)


@dataclass
class TargetParts:
    """What a drafter's trainer reads from its target: the normalized HF config dict, the input embedding
    [V, H] and the LM head [V, H] (the embedding when tied)."""

    config: dict
    embed_tokens: torch.Tensor
    lm_head: torch.Tensor

    @classmethod
    def from_state_dict(cls, config: dict, state_dict: dict[str, torch.Tensor]) -> "TargetParts":
        embed = state_dict["model.embed_tokens.weight"].float()
        return cls(config, embed, state_dict.get("lm_head.weight", embed).float())


class Subset(Sequence):
    """data[indices] without copying: the training or held-back part of a store. masks: per index, a [T]
    bool array of the positions that may count (AND-ed into each sequence's loss mask)."""

    def __init__(self, data: Sequence[SequenceFeatures], indices: Sequence[int],
                 masks: Sequence[np.ndarray] | None = None) -> None:
        self.data, self.indices, self.masks = data, list(indices), masks

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> SequenceFeatures:
        f = self.data[self.indices[i]]
        if self.masks is None:
            return f
        return replace(f, loss_mask=f.loss_mask & torch.from_numpy(np.asarray(self.masks[i], bool)))


def masked_targets(data: Sequence[SequenceFeatures]) -> torch.Tensor:
    """[N] the target ids at counted positions of data, read from the token arrays only for a store."""
    if isinstance(data, Subset) and isinstance(data.data, FeatureStore):
        store = data.data
        parts = [np.asarray(store.targets[store.offsets[i]:store.offsets[i + 1]])[
                 np.asarray(store.mask[store.offsets[i]:store.offsets[i + 1]])] for i in data.indices]
        return torch.from_numpy(np.concatenate(parts).astype(np.int64))
    if isinstance(data, FeatureStore):
        return torch.from_numpy(np.asarray(data.targets)[np.asarray(data.mask)].astype(np.int64))
    return torch.cat([f.target_ids[f.loss_mask] for f in data])


def require_final_states(data: Sequence[SequenceFeatures], hidden_size: int, method: str) -> None:
    """EAGLE and Medusa read the target's final hidden states (width H); refuse aux-state features."""
    if len(data) and data[0].hidden.shape[-1] != hidden_size:
        raise ValueError(f"{method} trains on the target's final hidden states (width {hidden_size}); the features "
                         f"have width {data[0].hidden.shape[-1]} (aux states are for EAGLE-3: use kind 'final')")
