"""The cache of converted GGUF files: a folder per version of a file (its path, size and mtime), holding the
converted state dict as safetensors (QuantizedWeights as their packed bytes, described in the file's metadata)
and the config, written last to mark the entry complete.

It is written a tensor at a time and read a tensor at a time (CachedTensors), so neither holds the whole model
twice.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Callable

import torch

from specserve.models.gguf_quant import QuantizedWeight
from specserve.models.loader import ModelLoadError
from specserve.ops.paths import cache_root

logger = logging.getLogger(__name__)

# Bump when the conversion changes, so stale caches are not reused.
_CACHE_VERSION = 3


def gguf_cache_dir(path: str) -> Path:
    """The cache folder for one version of one GGUF file (its absolute path, size and mtime)."""
    stat = os.stat(path)
    identity = f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|v{_CACHE_VERSION}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{Path(path).stem}-{digest}"


def atomic_write(target: Path, write: Callable[[str], None]) -> None:
    """Call `write(tmp_path)` and rename the result onto `target`, so readers never see half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# safetensors dtype names of the tensors a cache holds
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8,
                       "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}
_DTYPE_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


class CachedTensors(Mapping):
    """The state dict in a cache file, each tensor read from the file when it is asked for (a QuantizedWeight
    for packed ones) and the same object while it is alive.

    Read, not memory-mapped: a mapped file's pages stay in the process's resident set for as long as the
    mapping lives, beside the repacked and fused copies the model builds from them (for a 1.5B model ~1.5 GB
    more), and a model builder that reads one layer at a time holds one layer's parts at a time."""

    def __init__(self, file: Path) -> None:
        size = file.stat().st_size
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 0 < length <= size - 8:
                raise ValueError(f"header length {length} does not fit a file of {size} bytes")
            header = json.loads(f.read(length))
        metadata = header.pop("__metadata__", None) or {}
        self.file, self.data_start, self.entries = file, 8 + length, header
        self.packed = json.loads(metadata.get("quantized", "{}"))
        end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
        if self.data_start + end > size or any(entry["dtype"] not in _SAFETENSORS_DTYPES for entry in header.values()):
            raise ValueError(f"{size} bytes hold less than the header describes, or an unknown dtype")
        self._alive: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def __getitem__(self, name: str):
        value = self._alive.get(name)
        if value is None:
            value = self._read(name)
            self._alive[name] = value
        return value

    def _read(self, name: str):
        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        raw = torch.empty(end - begin, dtype=torch.uint8)
        with open(self.file, "rb") as f:
            f.seek(self.data_start + begin)
            if f.readinto(raw.numpy()) != end - begin:
                raise ModelLoadError(f"{self.file}: {name!r} runs past the end of the file; delete the cache folder")
        tensor = raw.view(_SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])
        meta = self.packed.get(name)
        if meta is None:
            return tensor
        return QuantizedWeight(tensor, meta["format"], meta["group"], tuple(meta["shape"]), meta["qtype"],
                               meta.get("supers", 0))

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def read_cache(folder: Path) -> tuple[dict, Mapping] | None:
    """(config, state dict read on demand) from a cache folder, or None if it is absent or unreadable."""
    config_file, weights_file = folder / "config.json", folder / "model.safetensors"
    if not (config_file.exists() and weights_file.exists()):
        return None
    try:
        return json.loads(config_file.read_text()), CachedTensors(weights_file)
    except Exception as e:  # a damaged cache is rebuilt, not fatal
        logger.warning("ignoring unreadable cache %s: %s", folder, e)
        return None


def write_safetensors(target: Path, tensors: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> list[str]:
    """Write (name, tensor) pairs as they come into a safetensors file (QuantizedWeights as their packed bytes,
    described in the file's `quantized` metadata), holding one tensor at a time; returns the names.

    The data goes to a file beside it first, as the header that precedes it lists every tensor's offsets."""
    entries: dict[str, dict] = {}
    packed: dict[str, dict] = {}
    offset = 0
    with tempfile.TemporaryFile(dir=target.parent) as data:
        for name, t in tensors:
            if isinstance(t, QuantizedWeight):
                packed[name] = {"format": t.format, "group": t.group, "shape": list(t.shape), "qtype": t.qtype,
                                "supers": t.supers}
                t = t.packed
            t = t.contiguous()
            nbytes = t.numel() * t.element_size()
            data.write(t.reshape(-1).view(torch.uint8).numpy().data if nbytes else b"")
            entries[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                             "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header = json.dumps({"__metadata__": {"quantized": json.dumps(packed)}, **entries}).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
        data.seek(0)

        def write(tmp: str) -> None:
            with open(tmp, "wb") as out:
                out.write(len(header).to_bytes(8, "little") + header)
                shutil.copyfileobj(data, out, 16 << 20)

        atomic_write(target, write)
    return list(entries)
