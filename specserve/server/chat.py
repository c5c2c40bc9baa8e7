"""POST /v1/chat/completions: a conversation rendered with the model's chat template, answered whole or
streamed as chat.completion.chunk events."""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from specserve.engine.outputs import Logprob
from specserve.multimodal.chat import split_chat_images, template_renders_images
from specserve.sampling_params import SamplingParams
from specserve.server.protocol import (
    AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatLogprobs, ChatStreamChoice, DeltaMessage, TokenLogprob, TopLogprob)
from specserve.server.serving import (
    MIN_LOGPROB, APIError, ServingContext, bad_request, final_outputs, make_usage, random_id, unsupported)
from specserve.server.streaming import (
    SSE_DONE, ChoiceCursor, EventStreamResponse, sse, sse_error, unless_disconnected)


async def create_chat_completion(ctx: ServingContext, request: ChatCompletionRequest, raw_request: Request
                                 ) -> Response:
    ctx.check_model(request.model)
    _check_unsupported(request)
    prompt = await render_prompt(ctx, request)
    max_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = ctx.max_tokens_for(request.requested_max_tokens, len(prompt["prompt_token_ids"]), max_param)
    params = ctx.sampling_params(request, max_tokens, {"max_tokens": max_param, "logprobs": "top_logprobs"})
    request_id = random_id("chatcmpl")
    stream = await ctx.start(request_id, prompt, params, "messages")
    if request.stream:
        return EventStreamResponse(_stream(ctx, request, request_id, stream, params))
    outputs = await unless_disconnected(raw_request, final_outputs(ctx.engine, [stream]))
    if outputs is None:
        return Response(status_code=499)
    out = outputs[0]
    choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                          logprobs=chat_logprobs(c.logprobs, request.top_logprobs or 0) if request.logprobs else None,
                          finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in out.outputs]
    response = ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=make_usage(outputs))
    return Response(response.model_dump_json(), media_type="application/json")


def _check_unsupported(request: ChatCompletionRequest) -> None:
    unsupported(request.logit_bias, "logit_bias", "leave it empty")
    unsupported(request.tools, "tools", "tool calling is not implemented")
    if request.response_format is not None and request.response_format.type != "text":
        raise bad_request("response_format must be {'type': 'text'} (structured output is not implemented)",
                          "response_format")
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
    try:
        text = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=request.add_generation_prompt)
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
    try:
        for i in range(request.n):
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        last = None
        async for last in ctx.engine.outputs(stream):
            for c in last.outputs:
                cursor = cursors[c.index]
                if cursor.finished:
                    continue
                text, _, entries = cursor.advance(c)
                if not text and not entries and not cursor.finished:
                    continue
                logprobs = chat_logprobs(entries, request.top_logprobs or 0) if request.logprobs else None
                yield chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(content=text), logprobs=logprobs,
                                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)])
        if request.include_usage_in_stream and last is not None:
            yield chunk([], usage=make_usage([last]))
        yield SSE_DONE
    except (APIError, RuntimeError) as exc:
        yield sse_error(exc)
        yield SSE_DONE
