"""What the completion and chat endpoints share: validating a request into engine prompts and SamplingParams,
starting its engine requests (errors as OpenAI error bodies), and the usage block of the answer.
"""
from __future__ import annotations

import asyncio
import re
import uuid
from dataclasses import dataclass
from typing import Sequence

from specserve.engine.outputs import RequestOutput
from specserve.sampling_params import SamplingParams, StructuredOutputsParams
from specserve.server.async_engine import (
    AsyncLLM, EngineDeadError, QueueFullError, RequestAbortedError, RequestFailedError, RequestStream)
from specserve.server.protocol import OutputConstraint, SamplingFields, SpeculationUsage, UsageInfo

RETRY_AFTER_S = 1
# Logprobs of tokens the model gives zero probability are clamped to this (JSON has no -inf).
MIN_LOGPROB = -9999.0


class APIError(Exception):
    """An error the client sees as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code=code)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class ServingContext:
    """The engine and what the endpoints need to know about its model."""

    engine: AsyncLLM
    tokenizer: object
    served_model_names: list[str]
    max_model_len: int
    vocab_size: int
    model_path: str | None = None

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_model_names:
            raise APIError(400, f"The model `{name}` does not exist; this server serves "
                                f"{', '.join(self.served_model_names)}.", "model", code="model_not_found")

    def tokenize(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # JSON can carry lone surrogates ("\\ud800"); no tokenizer takes them
            raise bad_request(f"{param} must be valid Unicode text: {exc.reason} at index {exc.start}", param) from exc
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_prompt_ids(self, ids: Sequence[int], param: str) -> None:
        if not ids:
            raise bad_request("the prompt is empty", param)
        if len(ids) >= self.max_model_len:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                              f"has {len(ids)} tokens, leaving no room to generate.", param,
                              code="context_length_exceeded")
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of range: the vocabulary has {self.vocab_size} tokens", param)

    def max_tokens_for(self, requested: int | None, prompt_len: int, param: str) -> int:
        """The request's max_tokens, or all the room left in the context when it gave none."""
        room = self.max_model_len - prompt_len
        if requested is None:
            return room
        if requested > room:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                              f"has {prompt_len} tokens and {param} asks for {requested} more.", param,
                              code="context_length_exceeded")
        return requested

    def sampling_params(self, request: SamplingFields, max_tokens: int, renames: dict[str, str],
                        constraint: OutputConstraint | None = None) -> SamplingParams:
        """request.to_sampling_params, with SamplingParams' ValueError ("<field> must be ...") turned into a
        400 naming the request's own field (`renames` maps SamplingParams names to the request's);
        `constraint` (see `single_constraint`) becomes its structured_outputs."""
        for t in request.stop_token_ids or ():
            if t >= self.vocab_size:
                raise bad_request(f"stop_token_ids must be < {self.vocab_size} (the vocabulary size), got {t}",
                                  "stop_token_ids")
        structured = None
        if constraint is not None:
            try:
                structured = StructuredOutputsParams.coerce(constraint.fields)
            except ValueError as exc:
                raise constraint_error(constraint, exc) from exc
        try:
            return request.to_sampling_params(max_tokens, structured)
        except ValueError as exc:
            field_name = str(exc).split(" ", 1)[0]
            raise bad_request(str(exc), renames.get(field_name, field_name)) from exc

    async def start(self, request_id: str, prompt: dict, params: SamplingParams, param: str,
                    constraint: OutputConstraint | None = None) -> RequestStream:
        """Add the request; a ValueError is a 400 naming `param`, or `constraint`'s field when the engine
        refused the structured output spec (its errors start "structured_outputs"); any other failure to admit
        it alone is a 500."""
        try:
            return await self.engine.add_request(request_id, prompt, params)
        except ValueError as exc:
            if constraint is not None and str(exc).startswith("structured_outputs"):
                raise constraint_error(constraint, exc) from exc
            raise bad_request(str(exc), param) from exc
        except RequestFailedError as exc:
            raise request_failed(exc) from exc
        except QueueFullError as exc:
            raise APIError(503, str(exc), type="server_overloaded", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_unavailable") from exc

    async def start_all(self, jobs: list[tuple[str, dict, SamplingParams]], param: str,
                        constraint: OutputConstraint | None = None) -> list[RequestStream]:
        """Start every request or none: if one is refused, the ones already started are aborted."""
        streams: list[RequestStream] = []
        try:
            for request_id, prompt, params in jobs:
                streams.append(await self.start(request_id, prompt, params, param, constraint))
        except BaseException:
            for stream in streams:
                self.engine.abort(stream.request_id)
            raise
        return streams


def unsupported(value, param: str, what: str) -> None:
    if value:
        raise bad_request(f"{param} is not supported ({what})", param)


def single_constraint(constraints: list[OutputConstraint]) -> OutputConstraint | None:
    """The request's one output constraint, or None; two or more are a 400 naming them."""
    if len(constraints) > 1:
        names = [c.param for c in constraints]
        raise bad_request(f"{', '.join(names[:-1])} and {names[-1]} each constrain the output; send only one",
                          names[-1])
    return constraints[0] if constraints else None


def constraint_error(constraint: OutputConstraint, exc: ValueError) -> APIError:
    """A 400 for a refused structured output spec, naming the request field it came from."""
    message = str(exc)
    if constraint.label is not None:
        message = re.sub(r"^structured_outputs(\.\w+)?", lambda _: constraint.label, message)
    return bad_request(message, constraint.param)


# ------------------------------------------------------------------------------------------- results


async def final_output(engine: AsyncLLM, stream: RequestStream) -> RequestOutput:
    last = None
    async for last in engine.outputs(stream):
        pass
    return last


async def final_outputs(engine: AsyncLLM, streams: list[RequestStream]) -> list[RequestOutput]:
    try:
        return list(await asyncio.gather(*(final_output(engine, s) for s in streams)))
    except RequestAbortedError as exc:
        raise APIError(503, str(exc), type="server_error", code="aborted") from exc
    except EngineDeadError as exc:
        raise APIError(500, str(exc), type="server_error", code="engine_failed") from exc
    except RequestFailedError as exc:
        raise request_failed(exc) from exc


def request_failed(exc: RequestFailedError) -> APIError:
    """A request the engine ended with an error: 400 when its own input caused it, else 500."""
    if exc.from_input:
        return APIError(400, str(exc), code="request_failed")
    return APIError(500, str(exc), type="server_error", code="request_failed")


def make_usage(outputs: Sequence[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     speculation=speculation_usage(outputs))


def speculation_usage(outputs: Sequence[RequestOutput]) -> SpeculationUsage | None:
    drafts = sum(o.metrics.num_drafts for o in outputs)
    if not drafts:
        return None
    draft_tokens = sum(o.metrics.num_draft_tokens for o in outputs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    return SpeculationUsage(num_drafts=drafts, num_draft_tokens=draft_tokens, num_accepted_tokens=accepted,
                            acceptance_rate=accepted / draft_tokens if draft_tokens else 0.0,
                            mean_acceptance_length=1.0 + accepted / drafts)
