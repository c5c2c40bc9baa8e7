"""Streaming answers: what each choice has been sent, merging several requests' outputs, server-sent events,
and noticing a client that went away (which aborts its requests).
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from itertools import repeat
from typing import AsyncIterator

import anyio
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse

from specserve.engine.outputs import CompletionOutput, RequestOutput
from specserve.sampling_params import SamplingParams
from specserve.server.async_engine import AsyncLLM, RequestAbortedError, RequestFailedError, RequestStream
from specserve.server.protocol import TokenSource
from specserve.server.serving import APIError, request_failed
from specserve.tokenizer import IncrementalDetokenizer


@dataclass
class ChoiceCursor:
    """How much of one choice the client has been sent.

    With stop strings the engine cuts the text where a stop string begins, which can be up to
    len(stop) - 1 characters before the end of text already produced; holding that many back keeps the
    streamed text equal to the final text.
    """

    holdback: int = 0
    text_sent: int = 0
    tokens_sent: int = 0
    finished: bool = False

    @classmethod
    def for_params(cls, params: SamplingParams) -> "ChoiceCursor":
        hold = 0 if params.include_stop_str_in_output or not params.stop else max(map(len, params.stop)) - 1
        return cls(holdback=hold)

    def advance(self, c: CompletionOutput) -> tuple[str, list[int], list[dict] | None]:
        """The new text, token ids and logprob entries since the last call."""
        end = len(c.text) if c.finish_reason else max(self.text_sent, len(c.text) - self.holdback)
        text = c.text[self.text_sent:end]
        self.text_sent = max(self.text_sent, end)
        new_ids = c.token_ids[self.tokens_sent:]
        logprobs = c.logprobs[self.tokens_sent:] if c.logprobs is not None else None
        self.tokens_sent = len(c.token_ids)
        self.finished = c.finish_reason is not None
        return text, new_ids, logprobs


class TokenSourceCursor:
    """The `token_sources` extension of one choice: each new token's text, from a detokenizer of its own fed
    one token at a time (so the texts add up to the choice's text), with how it was produced."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.tokens_sent = 0

    def advance(self, c: CompletionOutput) -> list[TokenSource]:
        start, self.tokens_sent = self.tokens_sent, len(c.token_ids)
        sources = c.token_sources[start:] if c.token_sources is not None else repeat("target")
        drafters = c.token_drafters[start:] if c.token_drafters is not None else repeat(None)
        return [TokenSource(text=self.detokenizer.add((token_id,)), source=source, drafter=drafter)
                for token_id, source, drafter in zip(c.token_ids[start:], sources, drafters)]


async def merged(engine: AsyncLLM, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams as they come; closing it aborts the unfinished ones."""
    if len(streams) == 1:
        async for out in engine.outputs(streams[0]):
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in engine.outputs(stream):
                queue.put_nowait((i, out))
            queue.put_nowait((i, done))
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(payload: BaseModel | dict) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else _json(payload)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: Exception) -> str:
    """An error after the stream started (status 200 already sent): one error event, as vLLM does."""
    if isinstance(exc, RequestFailedError):
        exc = request_failed(exc)
    if isinstance(exc, APIError):
        info = {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
    else:
        info = {"message": str(exc), "type": "server_error", "param": None,
                "code": "aborted" if isinstance(exc, RequestAbortedError) else "engine_failed"}
    return sse({"error": info})


def _json(value) -> str:
    return json.dumps(value, separators=(",", ":"))


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop (and abort the request) as soon as the client disconnects, even while the
    request is still waiting for its first token."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def unless_disconnected(raw_request: Request, work):
    """Await `work` (a coroutine); if the client disconnects first, cancel it (which aborts its requests)
    and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    return task.result() if not task.cancelled() else None


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return
