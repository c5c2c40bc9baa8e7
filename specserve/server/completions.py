"""POST /v1/completions: prompts (text or token ids, one or a batch) to completions, whole or streamed."""
from __future__ import annotations

import time
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from specserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from specserve.sampling_params import SamplingParams
from specserve.server.protocol import (
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse)
from specserve.server.serving import (
    MIN_LOGPROB, APIError, ServingContext, bad_request, final_outputs, make_usage, random_id, single_constraint,
    unsupported)
from specserve.server.streaming import (
    SSE_DONE, ChoiceCursor, EventStreamResponse, TokenSourceCursor, merged, sse, sse_error, unless_disconnected)

# SamplingParams field -> the request field a client would fix (the names agree here).
_RENAMES: dict[str, str] = {}


async def create_completion(ctx: ServingContext, request: CompletionRequest, raw_request: Request) -> Response:
    ctx.check_model(request.model)
    _check_unsupported(request)
    constraint = single_constraint(request.output_constraints())
    prompts = _engine_prompts(ctx, request.prompt)
    jobs, params = [], None
    request_id = random_id("cmpl")
    for i, prompt in enumerate(prompts):
        max_tokens = ctx.max_tokens_for(request.max_tokens, len(prompt["prompt_token_ids"]), "max_tokens")
        params = ctx.sampling_params(request, max_tokens, _RENAMES, constraint)
        jobs.append((request_id if len(prompts) == 1 else f"{request_id}-{i}", prompt, params))
    streams = await ctx.start_all(jobs, "prompt", constraint)
    if request.stream:
        body = _stream(ctx, request, request_id, streams, prompts, params)
        return EventStreamResponse(body)
    outputs = await unless_disconnected(raw_request, final_outputs(ctx.engine, streams))
    if outputs is None:
        return Response(status_code=499)
    echoes = [_prompt_text(ctx, p) if request.echo else "" for p in prompts]
    response = CompletionResponse(id=request_id, model=ctx.model_name, usage=make_usage(outputs),
                                  choices=[_choice(request, i, echoes[i], c)
                                           for i, out in enumerate(outputs) for c in out.outputs])
    return Response(response.model_dump_json(), media_type="application/json")


def _check_unsupported(request: CompletionRequest) -> None:
    unsupported(request.suffix, "suffix", "insertion is not implemented")
    unsupported(request.logit_bias, "logit_bias", "leave it empty")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of must equal n (ranking candidates is not supported)", "best_of")
    if request.echo and request.logprobs is not None:
        raise bad_request("echo with logprobs needs prompt logprobs, which are not supported", "echo")


def _engine_prompts(ctx: ServingContext, prompt) -> list[dict]:
    """The request's prompt(s) as {"prompt", "prompt_token_ids"}, each checked against the context."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            text, ids = p, ctx.tokenize(p, "prompt")
        else:
            text, ids = None, list(p)
        ctx.check_prompt_ids(ids, "prompt")
        out.append({"prompt": text, "prompt_token_ids": ids})
    return out


def _prompt_text(ctx: ServingContext, prompt: dict) -> str:
    text = prompt["prompt"]
    return text if text is not None else ctx.tokenizer.decode(prompt["prompt_token_ids"])


def _choice(request: CompletionRequest, prompt_index: int, echo: str, c: CompletionOutput) -> CompletionChoice:
    text = echo + c.text
    logprobs = completion_logprobs(c.logprobs, request.logprobs, 0) if request.logprobs is not None else None
    return CompletionChoice(index=prompt_index * request.n + c.index, text=text, logprobs=logprobs,
                            finish_reason=c.finish_reason, stop_reason=c.stop_reason)


def completion_logprobs(entries: list[dict[int, Logprob]] | None, num: int, text_offset: int
                        ) -> CompletionLogprobs:
    """OpenAI's legacy format: per token its text, logprob, the top `num` alternatives and its offset."""
    result = CompletionLogprobs()
    for entry in entries or ():
        sampled = next(iter(entry.values()))  # the engine puts the sampled token first
        token = sampled.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(max(sampled.logprob, MIN_LOGPROB))
        top = sorted(entry.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
        result.top_logprobs.append({(lp.decoded_token or ""): max(lp.logprob, MIN_LOGPROB)
                                    for lp in top if lp is sampled or (lp.rank or 0) <= num})
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


async def _stream(ctx: ServingContext, request: CompletionRequest, request_id: str, streams, prompts: list[dict],
                  params: SamplingParams) -> AsyncIterator[str]:
    created = int(time.time())
    cursors: dict[int, ChoiceCursor] = {}
    sources: dict[int, TokenSourceCursor] = {}
    offsets: dict[int, int] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        async for prompt_index, out in merged(ctx.engine, streams):
            for c in out.outputs:
                index = prompt_index * request.n + c.index
                cursor = cursors.setdefault(index, ChoiceCursor.for_params(params))
                if cursor.finished:
                    continue
                first = cursor.tokens_sent == 0 and cursor.text_sent == 0
                text, _, entries = cursor.advance(c)
                if request.echo and first:
                    text = _prompt_text(ctx, prompts[prompt_index]) + text
                if not text and not entries and not cursor.finished:
                    continue
                logprobs = None
                if request.logprobs is not None:
                    logprobs = completion_logprobs(entries, request.logprobs, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs.tokens)
                tokens = None
                if request.include_token_sources_in_stream:
                    if index not in sources:
                        sources[index] = TokenSourceCursor(ctx.tokenizer, out.prompt_token_ids, params)
                    tokens = sources[index].advance(c)
                choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                                          stop_reason=c.stop_reason, token_sources=tokens)
                yield sse(CompletionResponse(id=request_id, created=created, model=ctx.model_name,
                                             choices=[choice]))
            if out.finished:
                finals[prompt_index] = out
        if request.include_usage_in_stream:
            yield sse(CompletionResponse(id=request_id, created=created, model=ctx.model_name, choices=[],
                                         usage=make_usage(list(finals.values()))))
        yield SSE_DONE
    except (APIError, RuntimeError) as exc:
        yield sse_error(exc)
        yield SSE_DONE
