"""llama.cpp as a baseline: llama-cpp-python (the `llamacpp` extra) at batch 1 for `specserve bench latency`, and
llama.cpp's own `llama-server` under load for `specserve bench serve --llama-server` (launch_llama_server).

At batch 1 it runs the same GGUF file on the same prompt token ids, greedy (top-k 1, no repetition penalty), plain and
with its prompt-lookup drafter, one request at a time with its KV cache cleared before each prompt (every
prompt fully prefilled, as specserve's runs are). The generator yields tokens as they are decided, so time
to first token and decode time come from the same run; EOS does not stop it, so every request makes
exactly max_tokens tokens. llama.cpp quantizes activations for its dot products, so its greedy tokens may
part from specserve's exact ones; the report counts them apart from the greedy check.
"""
from __future__ import annotations

import time

from specserve.bench.common import BenchPrompt, ServerProcess, Stopwatch

LLAMACPP_PLAIN, LLAMACPP_PROMPT_LOOKUP = "llamacpp_plain", "llamacpp_prompt_lookup"
LLAMA_SERVER = "llama-server"
# EngineConfig.kv_cache_dtype -> llama.cpp's KV cache type of as many bits (its default is f16)
LLAMA_KV_TYPES = {"auto": "f32", "bfloat16": "bf16", "int8": "q8_0"}
PROMPT_LOOKUP_TOKENS = 10  # as the transformers baseline and ANCHORS.md


def require_llamacpp() -> None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        raise ValueError("--llamacpp needs llama-cpp-python: pip install 'specserve[llamacpp]' (built from its "
                         "sdist: a C++ compiler and cmake, ~15 min on 2 cores)") from exc


def run_llamacpp(model_path: str, prompts: list[BenchPrompt], warmup: BenchPrompt, max_tokens: int,
                 threads: int, warmup_tokens: int, log) -> list:
    """Plain then prompt lookup over every prompt; RequestTiming per (method, prompt)."""
    if not str(model_path).endswith(".gguf"):
        raise ValueError(f"--llamacpp runs GGUF files only, got --model {model_path}")
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as exc:
        raise ValueError(f"--llamacpp needs llama-cpp-python: pip install 'specserve[llamacpp]' ({exc})") from None
    n_ctx = max(len(p.token_ids) for p in [*prompts, warmup]) + max_tokens + PROMPT_LOOKUP_TOKENS + 16
    timings = []
    for method, draft in ((LLAMACPP_PLAIN, None),
                          (LLAMACPP_PROMPT_LOOKUP, LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS))):
        with Stopwatch() as sw:
            llm = Llama(model_path=str(model_path), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                        n_threads_batch=threads, draft_model=draft, logits_all=draft is not None, verbose=False)
        log(f"llama.cpp ({method}): loaded in {sw.seconds:.1f} s")
        generate_timed(llm, warmup, warmup_tokens, method)
        timings += [generate_timed(llm, prompt, max_tokens, method) for prompt in prompts]
        log(f"llama.cpp ({method}): {len(prompts)} prompts in {sum(t.total_s for t in timings if t.method == method):.1f} s")
        llm.close()
    return timings


def generate_timed(llm, prompt: BenchPrompt, max_tokens: int, method: str):
    from specserve.bench.latency_report import RequestTiming

    llm.reset()  # no prefix reuse: the whole prompt is prefilled
    token_ids, start = [], time.perf_counter()
    first = None
    for token in llm.generate(prompt.token_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        if first is None:
            first = time.perf_counter()
        token_ids.append(int(token))
        if len(token_ids) == max_tokens:
            break
    end = time.perf_counter()
    return RequestTiming(method, prompt.category, prompt.question_id, len(prompt.token_ids), ttft_s=first - start,
                         decode_s=end - first, total_s=end - start, token_ids=token_ids)


def llama_server_command(binary: str, model_file: str, slots: int, threads: int, slot_tokens: int,
                         kv_cache_dtype: str, extra: list[str] = ()) -> list[str]:
    """llama-server on `model_file` with `slots` sequences decoded together (continuous batching), each with
    room for `slot_tokens`, on `threads` threads, the KV cache in LLAMA_KV_TYPES[kv_cache_dtype] (a quantized
    V cache needs its flash attention, which is then on for every type), then the `extra` flags."""
    if kv_cache_dtype not in LLAMA_KV_TYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(LLAMA_KV_TYPES)} for llama-server, "
                         f"got {kv_cache_dtype!r}")
    kv = LLAMA_KV_TYPES[kv_cache_dtype]
    return [binary, "--model", str(model_file), "--parallel", str(slots), "--cont-batching",
            "--ctx-size", str(slots * slot_tokens), "--threads", str(threads), "--threads-batch", str(threads),
            "--cache-type-k", kv, "--cache-type-v", kv, "--flash-attn", "on", "--host", "127.0.0.1", *extra]


def launch_llama_server(binary: str, model_file: str, slots: int, threads: int, slot_tokens: int,
                        kv_cache_dtype: str, extra: list[str], log) -> ServerProcess:
    cmd = llama_server_command(binary, model_file, slots, threads, slot_tokens, kv_cache_dtype, extra)
    log(f"starting {' '.join(cmd)}")
    return ServerProcess(cmd, "--port", "llama-server-")
