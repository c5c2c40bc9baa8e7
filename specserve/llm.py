"""The offline API, with vLLM's names: `LLM(...).generate(prompts, SamplingParams(...))` and `.chat(...)`."""
from __future__ import annotations

import itertools
import time
from typing import Sequence

from specserve.config import EngineConfig
from specserve.engine.engine import EngineMetrics, LLMEngine
from specserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from specserve.multimodal.chat import split_chat_images, template_renders_images
from specserve.sampling_params import SamplingParams


class LLM:
    """Load a model once; generate for many prompts with continuous batching."""

    def __init__(self, model: str | None = None, tokenizer: str | None = None, dtype: str = "auto",
                 quantization: str | None = None, gguf_dequantize: bool = False, gguf_compute: str = "int8",
                 kv_cache_dtype: str = "auto", max_model_len: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 1024,
                 enable_prefix_caching: bool = True, block_size: int = 16,
                 kv_cache_memory_bytes: int = 1 << 30, num_kv_blocks: int | None = None, seed: int = 0,
                 speculative_config: dict | None = None, limit_mm_per_prompt: dict | None = None,
                 mm_processor_kwargs: dict | None = None, skip_tokenizer_init: bool = False,
                 tensor_parallel_size: int = 1, distributed_executor_backend: str | None = None, **kwargs) -> None:
        if kwargs:
            raise ValueError(f"unknown LLM argument(s): {', '.join(sorted(kwargs))}")
        self.config = EngineConfig(
            model=model, tokenizer=tokenizer, dtype=dtype, quantization=quantization,
            gguf_dequantize=gguf_dequantize, gguf_compute=gguf_compute, kv_cache_dtype=kv_cache_dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            enable_prefix_caching=enable_prefix_caching, kv_cache_memory_bytes=kv_cache_memory_bytes,
            num_kv_blocks=num_kv_blocks, seed=seed, speculative_config=speculative_config,
            limit_mm_per_prompt=limit_mm_per_prompt, mm_processor_kwargs=mm_processor_kwargs,
            skip_tokenizer_init=skip_tokenizer_init, tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend=distributed_executor_backend)
        self.llm_engine = LLMEngine(self.config)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_metrics(self) -> EngineMetrics:
        return self.llm_engine.get_metrics()

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a string, token ids, or a list of either; one RequestOutput per prompt, in order.

        A prompt that cannot run (too long, empty) comes back with `error` set and finish_reason
        "error"; the others are generated as usual.
        """
        prompts = _as_list(prompts)
        params = _params_for(prompts, sampling_params)
        request_ids, failed = [], {}
        for prompt, p in zip(prompts, params):
            rid = str(next(self._counter))
            request_ids.append(rid)
            try:
                self.llm_engine.add_request(rid, prompt, p)
            except ValueError as exc:
                if not isinstance(prompt, (str, list, tuple, dict)):
                    raise
                failed[rid] = _error_output(rid, prompt, p, str(exc))
        finished = self._run(len(request_ids) - len(failed), use_tqdm)
        finished.update(failed)
        return [finished[rid] for rid in request_ids]

    def _run(self, num_requests: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = _progress_bar(num_requests) if use_tqdm and num_requests else None
        start, num_out = time.perf_counter(), 0
        engine = self.llm_engine
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    num_out += sum(len(o.token_ids) for o in out.outputs)
                    if bar is not None:
                        bar.set_postfix_str(f"{num_out / (time.perf_counter() - start):.1f} tok/s", refresh=False)
                        bar.update(1)
        if bar is not None:
            bar.close()
        return finished

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None
             ) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of them. Content may be
        a list of OpenAI parts: text, image_url (a base64 data URL) or image_pil (a PIL image)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("LLM.chat needs a tokenizer, but skip_tokenizer_init=True")
        renders_images = template_renders_images(tok.chat_template)
        prompts = []
        for conv in conversations:
            conv, images = split_chat_images(conv, renders_images)
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                           **(chat_template_kwargs or {}))
            prompt = {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return list(prompts)


def _params_for(prompts: list, sampling_params) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams() for _ in prompts]
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * len(prompts)
    params = list(sampling_params)
    if len(params) != len(prompts):
        raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
    return params


def _error_output(rid: str, prompt, params: SamplingParams, message: str) -> RequestOutput:
    text = prompt if isinstance(prompt, str) else (prompt.get("prompt") if isinstance(prompt, dict) else None)
    ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
    outputs = [CompletionOutput(i, "", [], None, None, "error") for i in range(params.n)]
    now = time.time()
    return RequestOutput(rid, text, ids, outputs, True, RequestMetrics(now, finished_time=now), error=message)


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
