"""POST /v1/chat/completions: a conversation rendered with the model's chat template, answered whole or
streamed as chat.completion.chunk events."""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from specserve.engine.outputs import CompletionOutput, Logprob
from specserve.multimodal.chat import split_chat_images, template_renders_images
from specserve.sampling_params import SamplingParams
from specserve.server.protocol import (
    AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatLogprobs, ChatStreamChoice, DeltaMessage, TokenLogprob, TokenSource, TopLogprob)
from specserve.server.serving import (
    MIN_LOGPROB, APIError, ServingContext, bad_request, final_outputs, make_usage, random_id, single_constraint,
    unsupported)
from specserve.server.streaming import (
    SSE_DONE, ChoiceCursor, EventStreamResponse, TokenSourceCursor, sse, sse_error, unless_disconnected)
from specserve.server.tools import (
    AutoCallReader, ToolCallReader, auto_call_reader, tool_call_reader, tool_constraint)


async def create_chat_completion(ctx: ServingContext, request: ChatCompletionRequest, raw_request: Request
                                 ) -> Response:
    ctx.check_model(request.model)
    _check_unsupported(request)
    tools = tool_constraint(request, getattr(ctx.tokenizer, "chat_template", None))
    constraint = single_constraint(request.output_constraints() + ([tools] if tools else []))
    prompt = await render_prompt(ctx, request)
    max_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = ctx.max_tokens_for(request.requested_max_tokens, len(prompt["prompt_token_ids"]), max_param)
    params = ctx.sampling_params(request, max_tokens, {"max_tokens": max_param, "logprobs": "top_logprobs"},
                                 constraint)
    request_id = random_id("chatcmpl")
    stream = await ctx.start(request_id, prompt, params, "messages", constraint)
    if request.stream:
        return EventStreamResponse(_stream(ctx, request, request_id, stream, params))
    outputs = await unless_disconnected(raw_request, final_outputs(ctx.engine, [stream]))
    if outputs is None:
        return Response(status_code=499)
    choices = [_choice(request, c) for c in outputs[0].outputs]
    response = ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=make_usage(outputs))
    return Response(response.model_dump_json(), media_type="application/json")


def _choice(request: ChatCompletionRequest, c: CompletionOutput) -> ChatChoice:
    """One whole answer: its text as content, or as tool_calls when tool_choice asked for them, or split
    between the two for tool_choice 'auto'."""
    message, finish_reason = AssistantMessage(content=c.text), c.finish_reason
    reader = tool_call_reader(request)
    calls = reader.tool_calls(c.text) if reader is not None else None
    if calls is not None:
        message, finish_reason = AssistantMessage(content=None, tool_calls=calls), reader.finish_reason(finish_reason)
    auto = auto_call_reader(request)
    if auto is not None:
        content, calls = auto.parse(c.text)
        message, finish_reason = AssistantMessage(content=content, tool_calls=calls), auto.finish_reason(finish_reason)
    logprobs = chat_logprobs(c.logprobs, request.top_logprobs or 0) if request.logprobs else None
    return ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=finish_reason,
                      stop_reason=c.stop_reason)


def _check_unsupported(request: ChatCompletionRequest) -> None:
    unsupported(request.logit_bias, "logit_bias", "leave it empty")
    if request.top_logprobs and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")


async def render_prompt(ctx: ServingContext, request: ChatCompletionRequest) -> dict:
    """The conversation through the chat template, tokenized as `LLM.chat` does; image parts become the
    template's placeholders and the prompt's multi_modal_data (the engine expands the placeholders)."""
    messages = [m.as_template_dict() for m in request.messages]
    images = []
    if any(m.has_images for m in request.messages):
        renders_images = template_renders_images(getattr(ctx.tokenizer, "chat_template", None))
        try:  # decoding images is CPU work: keep it off the event loop
            messages, images = await asyncio.to_thread(split_chat_images, messages, renders_images)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from exc
    tools = {"tools": [tool.model_dump(exclude_none=True) for tool in request.tools]} if request.tools else {}
    try:
        text = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=request.add_generation_prompt,
                                                 **tools)
    except Exception as exc:  # noqa: BLE001 - a template rejects a conversation by raising anything
        raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from exc
    ids = ctx.tokenize(text, "messages", add_special_tokens=False)
    ctx.check_prompt_ids(ids, "messages")
    prompt = {"prompt": text, "prompt_token_ids": ids}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    return prompt


def chat_logprobs(entries: list[dict[int, Logprob]] | None, num: int) -> ChatLogprobs:
    """The chat format: per token its text, logprob and UTF-8 bytes, with the `num` most likely tokens."""
    content = []
    for entry in entries or ():
        sampled = next(iter(entry.values()))  # the engine puts the sampled token first
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= num),
                        key=lambda lp: lp.rank)[:num]
        content.append(TokenLogprob(**_top(sampled), top_logprobs=[TopLogprob(**_top(lp)) for lp in ranked]))
    return ChatLogprobs(content=content)


def _top(lp: Logprob) -> dict:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": max(lp.logprob, MIN_LOGPROB), "bytes": list(token.encode("utf-8"))}


async def _stream(ctx: ServingContext, request: ChatCompletionRequest, request_id: str, stream,
                  params: SamplingParams) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatStreamChoice], usage=None) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name, choices=choices,
                                       usage=usage))

    cursors = [ChoiceCursor.for_params(params) for _ in range(request.n)]
    readers = [tool_call_reader(request) for _ in range(request.n)]
    autos = [auto_call_reader(request) for _ in range(request.n)]
    sources: list[TokenSourceCursor] = []
    try:
        for i in range(request.n):
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        last = None
        async for last in ctx.engine.outputs(stream):
            if request.include_token_sources_in_stream and not sources:
                sources = [TokenSourceCursor(ctx.tokenizer, last.prompt_token_ids, params) for _ in range(request.n)]
            for c in last.outputs:
                cursor = cursors[c.index]
                if cursor.finished:
                    continue
                text, _, entries = cursor.advance(c)
                if not text and not entries and not cursor.finished:
                    continue
                logprobs = chat_logprobs(entries, request.top_logprobs or 0) if request.logprobs else None
                tokens = sources[c.index].advance(c) if sources else None
                for choice in _step_choices(c, text, logprobs, readers[c.index], tokens, autos[c.index]):
                    yield chunk([choice])
        if request.include_usage_in_stream and last is not None:
            yield chunk([], usage=make_usage([last]))
        yield SSE_DONE
    except (APIError, RuntimeError) as exc:
        yield sse_error(exc)
        yield SSE_DONE


def _step_choices(c: CompletionOutput, text: str, logprobs: ChatLogprobs | None, reader: ToolCallReader | None,
                  token_sources: list[TokenSource] | None = None, auto: AutoCallReader | None = None
                  ) -> list[ChatStreamChoice]:
    """One step's new `text` of choice `c` as stream choices: its content, or one tool-call delta per chunk,
    or for tool_choice 'auto' both, as `auto` splits them; the step's logprobs, token sources and finish_reason
    ride on the last."""
    finish_reason = c.finish_reason
    if reader is not None:
        deltas = [DeltaMessage(tool_calls=[d]) for d in reader.deltas(text)]
        finish_reason = reader.finish_reason(finish_reason) if finish_reason else None
    elif auto is not None:
        deltas = auto.deltas(text, final=finish_reason is not None)
        finish_reason = auto.finish_reason(finish_reason) if finish_reason else None
    else:
        deltas = [DeltaMessage(content=text)]
    if not deltas and (logprobs is not None or token_sources or finish_reason):
        deltas = [DeltaMessage()]
    choices = [ChatStreamChoice(index=c.index, delta=delta) for delta in deltas]
    if choices:
        choices[-1] = ChatStreamChoice(index=c.index, delta=deltas[-1], logprobs=logprobs,
                                       finish_reason=finish_reason, stop_reason=c.stop_reason,
                                       token_sources=token_sources)
    return choices
