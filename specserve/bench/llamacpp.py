"""llama.cpp (llama-cpp-python, the `llamacpp` extra) as a batch-1 baseline for `specserve bench latency`.

It runs the same GGUF file on the same prompt token ids, greedy (top-k 1, no repetition penalty), plain and
with its prompt-lookup drafter, one request at a time with its KV cache cleared before each prompt (every
prompt fully prefilled, as specserve's runs are). The generator yields tokens as they are decided, so time
to first token and decode time come from the same run; EOS does not stop it, so every request makes
exactly max_tokens tokens. llama.cpp quantizes activations for its dot products, so its greedy tokens may
part from specserve's exact ones; the report counts them apart from the greedy check.
"""
from __future__ import annotations

import time

from specserve.bench.common import BenchPrompt, Stopwatch

LLAMACPP_PLAIN, LLAMACPP_PROMPT_LOOKUP = "llamacpp_plain", "llamacpp_prompt_lookup"
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
