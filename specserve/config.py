"""Engine configuration with vLLM's option names, validated once at construction."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

_DTYPES = ("float32", "bfloat16", "float16", "auto")
GGUF_COMPUTE = ("int8", "q8", "fp32")  # EngineConfig.gguf_compute
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")  # EngineConfig.kv_cache_dtype (specserve/ops/kv_cache.py)


@dataclass
class EngineConfig:
    # HF folder, .gguf file, or a name from the model catalog (`specserve models`), which __post_init__
    # replaces with its verified GGUF file's path; None = the default SmolLM2 GGUF
    model: str | None = None
    tokenizer: str | None = None  # defaults to the model's own; a catalog name as for `model`
    # auto/float32: exact fp32. bfloat16: linear weights stored in bf16 (oneDNN), fp32 activations and KV.
    # float16: the whole model in fp16 (plain F.linear).
    dtype: str = "auto"
    quantization: str | None = None  # "int8": int8 linear weights (per-channel scales), approximate
    # GGUF weights stay in their quantized blocks (exact: the C GEMM dequantizes them in registers to the
    # values a load-time dequantization gives); True dequantizes them to fp32 at load instead.
    gguf_dequantize: bool = False
    # How GGUF 4-bit blocks (Q4_0, Q4_1, Q4_K) are multiplied: "int8" writes each input row per group of 32
    # as two int8 digits (~15 bits) and takes integer dot products (csrc/gemm_q4_i8.c: logits within ~1e-2
    # of the dequantized model's, extra verified tokens cheap); "q8" as one int8 digit (llama.cpp's Q8_0
    # activations: half the dot products of an extra row, logits further from the dequantized model's);
    # "fp32" keeps fp32 activations, bitwise the dequantized model. Either way a row's result does not
    # depend on its batch, so speculation's greedy output equals plain decoding's.
    gguf_compute: str = "int8"
    # How the paged KV cache stores K and V (target and drafter): "auto" in the model's dtype (fp32: exact),
    # "bfloat16" (2x the tokens in the same memory), "int8" with an fp32 scale per 16 numbers of a token's key or
    # value (3.2x at head_dim 64 and above). Greedy speculation stays equal to plain decoding on the same kv_cache_dtype.
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int = 1 << 30
    num_kv_blocks: int | None = None  # overrides the memory budget (tests use it to force preemption)
    seed: int = 0
    speculative_config: dict | None = None
    # Images (Qwen2-VL family): at most this many per prompt ({"image": n}), and the processor's pixel bounds
    # ({"min_pixels", "max_pixels"}) over the model's preprocessor_config.json.
    limit_mm_per_prompt: dict | None = None
    mm_processor_kwargs: dict | None = None
    skip_tokenizer_init: bool = False  # token-id prompts only; outputs carry token ids and no text
    # Tensor parallelism: the decoder split over this many ranks (specserve/distributed), as local worker
    # processes ("mp", the default) or Ray actors ("ray"); kv_cache_memory_bytes is then per rank.
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.gguf_compute not in GGUF_COMPUTE:
            raise ValueError(f"gguf_compute must be one of {', '.join(map(repr, GGUF_COMPUTE))}, "
                             f"got {self.gguf_compute!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be None or 'int8', got {self.quantization!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise ValueError("distributed_executor_backend must be 'mp' or 'ray', "
                             f"got {self.distributed_executor_backend!r}")
        self.model, self.tokenizer = resolve_model_name(self.model), resolve_model_name(self.tokenizer)

    @property
    def torch_dtype(self):
        import torch

        return torch.float16 if self.dtype == "float16" else torch.float32

    @property
    def keep_gguf_blocks(self) -> bool:
        """Whether a GGUF model's weight matrices stay in their blocks: exact fp32 compute on the C kernels."""
        from specserve.ops import kernels

        # tensor parallelism shards plain tensors: a GGUF file is dequantized for it
        return not self.gguf_dequantize and self.dtype in ("auto", "float32") and self.quantization is None \
            and self.tensor_parallel_size == 1 \
            and kernels.kernel_enabled()

    @property
    def linear_weight_dtype(self):
        """How linear weights are stored: None (as torch_dtype), torch.bfloat16 or "int8"."""
        import torch

        if self.quantization == "int8":
            return "int8"
        return torch.bfloat16 if self.dtype == "bfloat16" else None


def resolve_model_name(model: str | None) -> str | None:
    """A catalog model name (specserve/models/catalog.py) becomes its GGUF file's path, assembled and hashed on
    first use; paths and None are returned as they are."""
    if model is None:
        return None
    from specserve.models import catalog

    return catalog.resolve(model)


# Methods that run a drafter model, and what speculative_config.model must hold for each.
_MODEL_METHODS = {
    "draft_model": "a HF folder, .gguf file or catalog model name (specserve models) with the target's vocabulary",
    "eagle": "an EAGLE-1/EAGLE-2 head folder (fc over [embedding; feature], one decoder layer)",
    "eagle3": "an EAGLE-3 head folder (fc over three aux features, midlayer, its own norm and lm_head)",
    "medusa": "a Medusa head folder (medusa_lm_head.safetensors/.pt or vLLM's blocks/lm_heads layout)",
}
SPEC_METHODS = ("ngram", "suffix", *_MODEL_METHODS, "auto")
# auto: suffix and ngram (almost free to run) plus one model drafter, chosen per request and step. Its
# num_speculative_tokens, when not given, is each proposer's own default below; given, it caps them all.
AUTO_DEFAULT_NUM_SPECULATIVE_TOKENS = {"suffix": 5, "ngram": 8, "model": 4}
AUTO_DRAFTERS = (*_MODEL_METHODS, "none")
# auto's default int8 self-draft (~1 byte a weight with its scales) pays only against a target that reads
# clearly more per step: fp32 (4) or bf16 (2), not GGUF blocks (Q8_0 1.06, Q4_1 0.6: against those the
# self-draft's step takes ~1.12 of the target's).
SELF_DRAFT_MIN_TARGET_BYTES = 1.5


DRAFT_TREES = ("chain", "auto", "static")


@dataclass
class SpeculativeConfig:
    """vLLM's speculative_config keys; unknown keys are refused so typos do not pass silently."""

    method: str
    num_speculative_tokens: int | None = None  # None: 4 (auto: each proposer's own default)
    # specserve's own: pick each request's draft length (<= num_speculative_tokens) from its recent
    # acceptance and the measured cost of verification; False drafts num_speculative_tokens always.
    adaptive_draft_length: bool = True
    # ngram
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # draft_model, eagle, eagle3, medusa: the drafter's weights
    model: str | None = None
    # vLLM's name: how the drafter's linear weights are stored; None follows the target's storage, "int8"
    # (per-channel scales) or "q4" (4-bit groups of 32, int8 activations) quantizes the drafter alone (a
    # cheaper, approximate draft; verification keeps output exact).
    quantization: str | None = None
    # auto: the method of its model drafter (`model`); without `model`, the target's own weights in int8
    # (draft_model); "none" for suffix and ngram only.
    drafter: str | None = None
    # suffix (SuffixDecoding): vLLM's names
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # specserve's own: "chain" drafts one continuation; "auto" lets drafters that can (TREE_METHODS) propose a
    # tree of continuations, sized per request and step by expected tokens per unit of measured step cost, up
    # to draft_tree_max_nodes nodes (spec_decode/tree.py); "static": the shape of speculative_token_tree
    draft_tree: str = "chain"
    draft_tree_max_nodes: int = 16
    # vLLM's: a static tree, each node the path of child ranks from the root, e.g. "[(0,), (1,), (0, 0)]";
    # given, draft_tree is "static"
    speculative_token_tree: str | list | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPEC_METHODS)}, "
                             f"got {self.method!r}")
        self.num_speculative_tokens_given = self.num_speculative_tokens is not None
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = max(AUTO_DEFAULT_NUM_SPECULATIVE_TOKENS.values()) if self.method == "auto" else 4
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer >= 1, "
                             f"got {self.num_speculative_tokens!r}")
        if self.num_speculative_tokens > 32:
            raise ValueError(f"speculative_config.num_speculative_tokens must be <= 32, "
                             f"got {self.num_speculative_tokens}")
        self._check_lookup()
        self._check_drafter()
        self.model = resolve_model_name(self.model)
        if self.method in _MODEL_METHODS and not self.model:
            from specserve.heads import BUNDLED

            raise ValueError(f"speculative_config.model is required for method {self.method!r} "
                             f"({_MODEL_METHODS[self.method]}); specserve ships a head for the default model only "
                             f"for method(s) {', '.join(BUNDLED)}")
        if self.quantization not in (None, "int8", "q4"):
            raise ValueError(f"speculative_config.quantization must be None, 'int8' or 'q4', got {self.quantization!r}")
        if self.quantization is not None and self.method not in _MODEL_METHODS and self.method != "auto":
            raise ValueError(f"speculative_config.quantization applies to methods {', '.join(_MODEL_METHODS)} "
                             f"only, not {self.method!r}")
        self._check_tree()
        if not isinstance(self.draft_tree_max_nodes, int) or not 1 <= self.draft_tree_max_nodes <= 64:
            raise ValueError("speculative_config.draft_tree_max_nodes must be an integer in [1, 64], "
                             f"got {self.draft_tree_max_nodes!r}")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_tree_depth must be >= 1 and "
                             "suffix_decoding_max_cached_requests >= 0")

    def _check_tree(self) -> None:
        from specserve.spec_decode.tree import TREE_METHODS, parse_token_tree

        if self.draft_tree not in DRAFT_TREES:
            raise ValueError(f"speculative_config.draft_tree must be one of {', '.join(DRAFT_TREES)}, "
                             f"got {self.draft_tree!r}")
        self.token_tree_shape = None
        if self.speculative_token_tree is not None:
            if self.draft_tree == "auto":
                raise ValueError("speculative_config: draft_tree 'auto' sizes trees itself; a static "
                                 "speculative_token_tree goes with draft_tree 'static' (or none)")
            self.draft_tree = "static"
            self.token_tree_shape = parse_token_tree(self.speculative_token_tree)
        elif self.draft_tree == "static":
            raise ValueError("speculative_config.draft_tree 'static' needs speculative_token_tree")
        if self.draft_tree != "chain" and self.method not in TREE_METHODS:
            raise ValueError(f"speculative_config.draft_tree applies to methods {', '.join(TREE_METHODS)}, "
                             f"not {self.method!r} (it drafts chains)")

    def _check_drafter(self) -> None:
        if self.method != "auto":
            if self.drafter is not None:
                raise ValueError(f"speculative_config.drafter applies to method 'auto' only, not {self.method!r}")
            return
        if self.drafter is not None and self.drafter not in AUTO_DRAFTERS:
            raise ValueError(f"speculative_config.drafter must be one of {', '.join(AUTO_DRAFTERS)}, "
                             f"got {self.drafter!r}")
        if self.model and self.drafter in (None, "none"):
            raise ValueError("speculative_config.drafter must name the method of speculative_config.model under "
                             f"'auto' (one of {', '.join(_MODEL_METHODS)})")
        if self.drafter in _MODEL_METHODS and not self.model:
            raise ValueError(f"speculative_config.model is required for auto's drafter {self.drafter!r} "
                             f"({_MODEL_METHODS[self.drafter]})")

    def num_tokens_for(self, proposer: str) -> int:
        """auto: the draft length cap of one of its proposers ("suffix", "ngram" or "model")."""
        default = AUTO_DEFAULT_NUM_SPECULATIVE_TOKENS[proposer]
        return self.num_speculative_tokens if self.num_speculative_tokens_given else default

    def _check_lookup(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        # vLLM: one given value is copied to the other; defaults 5/5. We default to 1..5: with verifying a
        # draft token costing ~3.5% of a step (DEFAULT_COST_PER_DRAFT), a one-token match drafts often enough
        # to pay. Replaying SmolLM2's greedy Spec-Bench outputs (benchmarks/spec_replay.py), 1..5 gives 1.43
        # tokens per unit of cost against 1.36 for 5..5 (geomean of 8 categories), summarization 1.51 against
        # 1.39, and no category lower.
        if lo is None and hi is None:
            lo, hi = 1, 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo < 1 or hi < 1:
            raise ValueError(f"prompt_lookup_min and prompt_lookup_max must be >= 1, got {lo} and {hi}")
        if lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    @classmethod
    def from_dict(cls, d: dict, target_model: str | None = None,
                  target_bytes_per_weight: float | None = None) -> "SpeculativeConfig":
        """target_model: the engine's model (None: the default; a catalog name is resolved); a method without
        `model` gets the head specserve ships for that target, where there is one (specserve/heads).

        target_bytes_per_weight: what the target's projections read per weight; auto's default int8
        self-draft is left out where that is not more than SELF_DRAFT_MIN_TARGET_BYTES (a target kept in
        4- or 8-bit GGUF blocks: an int8 copy of it would cost as much a step as the target itself), and the
        shipped head's weights default to "q4" there (half the cost of a draft token)."""
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown speculative_config key(s): {', '.join(sorted(unknown))} "
                             f"(allowed: {', '.join(sorted(known))})")
        if "method" not in d:
            raise ValueError("speculative_config.method is required (one of " + ", ".join(SPEC_METHODS) + ")")
        target_model = resolve_model_name(target_model)
        packed = target_bytes_per_weight is not None and target_bytes_per_weight <= SELF_DRAFT_MIN_TARGET_BYTES
        if not d.get("model") and (d["method"] in _MODEL_METHODS or (
                d["method"] == "auto" and d.get("drafter") in _MODEL_METHODS and d["drafter"] != "draft_model")):
            from specserve.heads import bundled_head

            d = {**d, "model": bundled_head(d["drafter"] if d["method"] == "auto" else d["method"], target_model)}
            if d["model"] and packed:  # beside 4- or 8-bit blocks the shipped head drafts from 4-bit weights too
                d = {"quantization": "q4", **d}
        if d["method"] == "auto" and not d.get("model") and d.get("drafter") is None and packed:
            logger.info("speculative_config: auto without a model drafter (suffix and ngram): the target reads "
                        "%.2f bytes a weight, no more than an int8 self-draft would", target_bytes_per_weight)
            d = {**d, "drafter": "none"}
        if d["method"] == "auto" and not d.get("model") and d.get("drafter") in (None, "draft_model"):
            from specserve.models.loader import default_model_path

            # the target itself, its linear weights in int8: a quarter of the bytes a step, the same tokenizer
            d = {"quantization": "int8", **d, "drafter": "draft_model", "model": target_model or default_model_path()}
        return cls(**d)
