"""Engine options on the command line (`generate`, `chat`, `serve`, `bench`), and the LLM kwargs they give."""
from __future__ import annotations

import argparse
import json

from specserve.config import SPEC_METHODS


def add_engine_args(p: argparse.ArgumentParser, speculation_flags: bool = True,
                    speculate_by_default: bool = True) -> None:
    """Engine options; speculation_flags=False leaves out the short speculation flags (for commands
    that define their own); speculate_by_default=False makes plain decoding the default (benchmarks whose
    baseline it is)."""
    p.set_defaults(default_speculation=DEFAULT_SPECULATION if speculate_by_default else None)
    p.add_argument("--model", default=None,
                   help="HF folder, .gguf file or a model name that `specserve models` lists, e.g. "
                        "qwen2.5-coder-1.5b-instruct (default: smollm2-135m-instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="bfloat16: bf16 linear weights with fp32 activations (faster, approximate)")
    p.add_argument("--quantization", default=None, choices=["int8"],
                   help="int8: int8 linear weights with per-channel scales (fastest, approximate)")
    p.add_argument("--gguf-dequantize", action="store_true",
                   help="dequantize a GGUF model's weights to fp32 at load (default: the kernels read the "
                        "file's quantized blocks, with the same results)")
    p.add_argument("--gguf-compute", default="int8", choices=["int8", "q8", "fp32"],
                   help="how GGUF 4-bit blocks are multiplied: activations as two int8 digits and integer dot "
                        "products (int8, the default; cheaper verification), as one int8 digit (q8: llama.cpp's "
                        "Q8_0 activations, half the arithmetic of an extra row, logits further from fp32), or "
                        "fp32 activations (bitwise the dequantized model)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "int8"],
                   help="how the KV cache stores keys and values: auto (the model's dtype, fp32: exact), bfloat16 "
                        "(2x the tokens in the same memory) or int8 with a scale per 16 numbers (3.2x)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's own limit, capped to what the KV cache "
                        "holds, with a warning)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30,
                   help="memory for the paged KV cache, target and drafter (default: %(default)s, 1 GiB)")
    p.add_argument("--speculative-config", type=speculative_config_json, default=None,
                   help='JSON, e.g. \'{"method": "suffix"}\' (see the README for every key), or none. Default: '
                        '{"method": "auto"}, which drafts with suffix trees, prompt lookup or a draft model per '
                        "request and step, only where a draft pays")
    p.add_argument("--no-speculation", action="store_true", help="plain decoding (--speculative-config none)")
    p.add_argument("--limit-mm-per-prompt", type=json_object, default=None,
                   help='JSON, most images one prompt may carry, e.g. \'{"image": 2}\' (default: 16 images)')
    p.add_argument("--mm-processor-kwargs", type=json_object, default=None,
                   help='JSON, image resizing bounds, e.g. \'{"min_pixels": 3136, "max_pixels": 1003520}\' '
                        "(default: the model's preprocessor_config.json)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many ranks (default: %(default)s; see docs/distributed.md)")
    p.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                   help="where the tensor-parallel workers run: local processes (mp, the default) or Ray actors")
    if not speculation_flags:
        return
    # Short flags; each overrides the same key of --speculative-config.
    p.add_argument("--speculative-method", choices=SPEC_METHODS, default=None)
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--speculative-model", default=None,
                   help="drafter weights: a draft model (HF folder, .gguf or a name that `specserve models` lists), "
                        "or an EAGLE/EAGLE-3/Medusa head folder")
    p.add_argument("--prompt-lookup-min", type=int, default=None)
    p.add_argument("--prompt-lookup-max", type=int, default=None)


def json_object(text: str) -> dict:
    """argparse type for a JSON object flag."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"image\": 2}}', got {text!r}")
    return value


# What the command line and the server speculate with unless told otherwise. LLM() keeps vLLM's default (no
# speculation unless asked), so a program written for vLLM's LLM runs unchanged; a newcomer who starts the
# server or the chat page sees drafting at once.
DEFAULT_SPECULATION = {"method": "auto"}


def speculative_config_json(text: str) -> dict | str:
    """argparse type of --speculative-config: a JSON object, or "none"."""
    if text.strip().lower() in ("none", "null", "off"):
        return "none"
    return json_object(text)


def speculative_config(args) -> dict | None:
    """--speculative-config JSON with the short flags laid over it; DEFAULT_SPECULATION when nothing is said,
    None for --no-speculation or --speculative-config none."""
    off = getattr(args, "no_speculation", False) or args.speculative_config == "none"
    config = {} if off else dict(args.speculative_config or {})
    flags = {"method": "speculative_method", "num_speculative_tokens": "num_speculative_tokens",
             "model": "speculative_model", "prompt_lookup_min": "prompt_lookup_min",
             "prompt_lookup_max": "prompt_lookup_max"}
    short = {key: getattr(args, flag, None) for key, flag in flags.items()}
    if not hasattr(args, "speculative_method"):
        short = {}  # the command defines its own meaning for these flags
    given = {k: v for k, v in short.items() if v is not None}
    if off:
        if given:
            raise ValueError(f"--no-speculation (or --speculative-config none) cannot go with "
                             f"{', '.join('--' + flags[k].replace('_', '-') for k in given)}")
        return None
    config.update(given)
    if config and "method" not in config:
        config["method"] = "draft_model" if "model" in config else "ngram"
    default = getattr(args, "default_speculation", None)
    return config or (dict(default) if default else None)


def engine_kwargs(args) -> dict:
    return dict(model=args.model, dtype=args.dtype, quantization=getattr(args, "quantization", None),
                gguf_dequantize=getattr(args, "gguf_dequantize", False),
                gguf_compute=getattr(args, "gguf_compute", "int8"),
                kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=not args.no_prefix_caching, speculative_config=speculative_config(args),
                kv_cache_memory_bytes=getattr(args, "kv_cache_memory_bytes", 1 << 30),
                limit_mm_per_prompt=getattr(args, "limit_mm_per_prompt", None),
                mm_processor_kwargs=getattr(args, "mm_processor_kwargs", None),
                tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                distributed_executor_backend=getattr(args, "distributed_executor_backend", None))
