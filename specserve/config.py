"""Engine configuration with vLLM's option names, validated once at construction."""
from __future__ import annotations

from dataclasses import dataclass, field

_DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass
class EngineConfig:
    model: str | None = None  # HF folder or .gguf file; None = the default SmolLM2 GGUF
    tokenizer: str | None = None  # defaults to the model's own
    dtype: str = "auto"  # auto = float32 on CPU
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int = 1 << 30
    num_kv_blocks: int | None = None  # overrides the memory budget (tests use it to force preemption)
    seed: int = 0
    speculative_config: dict | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")

    @property
    def torch_dtype(self):
        import torch

        return {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}[self.dtype]
