"""The messages between the router and its engine replicas, and the delta encoding that sends each request's
new tokens and text per step instead of its whole cumulative output.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from specserve.server.async_engine import EngineSnapshot


# ---- router -> replica ----------------------------------------------------------------------------


@dataclass
class AddCommand:
    request_id: str
    prompt: object
    params: object
    arrival_time: float


@dataclass
class AbortCommand:
    request_id: str


@dataclass
class StopCommand:
    """Abort everything and exit."""


# ---- replica -> router ----------------------------------------------------------------------------


@dataclass
class ReplicaReady:
    """The first message of a replica whose engine was built."""

    max_model_len: int
    vocab_size: int
    pid: int
    host: str


@dataclass
class ReplicaFailed:
    """The last message of a replica whose engine could not be built or raised in a step."""

    error_type: str  # the exception's class name ("ValueError" for a configuration the engine refuses)
    message: str


@dataclass
class CompletionDelta:
    """What one choice gained in one step."""

    index: int
    text_keep: int  # characters of the text sent so far that stay (fewer only when a stop string cut it)
    text: str  # characters after those
    token_ids: list[int]
    logprobs: list | None  # new entries; None when the request asked for no logprobs
    token_sources: list[str] | None
    token_drafters: list | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class OutputDelta:
    """One request's progress in one step; the prompt rides on the request's first delta only."""

    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int
    error: str | None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    error_from_input: bool = False


@dataclass
class ReplicaUpdate:
    """Everything one iteration of a replica's loop produced (one engine step at most), as one message."""

    accepted: list[str] = field(default_factory=list)  # request ids the engine took
    refused: list[tuple[str, str]] = field(default_factory=list)  # (request id, the engine's ValueError text)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (request id, what else its admission raised)
    outputs: list[OutputDelta] = field(default_factory=list)
    snapshot: EngineSnapshot | None = None  # the replica's load and counters after the iteration


# ---- the delta encoding ---------------------------------------------------------------------------


class OutputEncoder:
    """Replica side: turns each cumulative RequestOutput into the delta since the last one sent.

    Token ids, logprobs and token sources only grow; the text only grows, except that a stop string cuts it
    back when the choice finishes.
    """

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, tuple[int, int]]] = {}  # request -> choice -> (chars, tokens) sent

    def encode(self, out: RequestOutput) -> OutputDelta:
        first = out.request_id not in self._sent
        sent = self._sent.setdefault(out.request_id, {})
        completions = []
        for c in out.outputs:
            chars, tokens = sent.get(c.index, (0, 0))
            keep = min(chars, len(c.text))
            completions.append(CompletionDelta(
                c.index, keep, c.text[keep:], c.token_ids[tokens:], _tail(c.logprobs, tokens),
                _tail(c.token_sources, tokens), _tail(c.token_drafters, tokens), c.cumulative_logprob,
                c.finish_reason, c.stop_reason))
            sent[c.index] = (len(c.text), len(c.token_ids))
        if out.finished:
            del self._sent[out.request_id]
        return OutputDelta(out.request_id, completions, out.finished, out.metrics, out.num_cached_tokens, out.error,
                           out.prompt if first else None, out.prompt_token_ids if first else None,
                           out.error_from_input)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


class OutputAssembler:
    """Router side: one request's cumulative RequestOutput, rebuilt from its deltas. Each `apply` returns a
    fresh copy, as the engine's own outputs are, so a consumer may keep it."""

    def __init__(self) -> None:
        self._output: RequestOutput | None = None

    def apply(self, delta: OutputDelta) -> RequestOutput:
        out = self._output
        if out is None:
            out = self._output = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids or [], [],
                                               False, delta.metrics)
        choices = {c.index: c for c in out.outputs}
        for d in delta.completions:
            c = choices.get(d.index)
            if c is None:
                c = choices[d.index] = CompletionOutput(
                    d.index, "", [], None, [] if d.logprobs is not None else None,
                    token_sources=[] if d.token_sources is not None else None,
                    token_drafters=[] if d.token_drafters is not None else None)
            c.text = c.text[:d.text_keep] + d.text
            c.token_ids.extend(d.token_ids)
            _extend(c.logprobs, d.logprobs)
            _extend(c.token_sources, d.token_sources)
            _extend(c.token_drafters, d.token_drafters)
            c.cumulative_logprob, c.finish_reason, c.stop_reason = d.cumulative_logprob, d.finish_reason, d.stop_reason
        out.outputs = [choices[i] for i in sorted(choices)]
        out.finished, out.metrics = delta.finished, delta.metrics
        out.num_cached_tokens, out.error, out.error_from_input = (delta.num_cached_tokens, delta.error,
                                                                  delta.error_from_input)
        return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, [_copy(c) for c in out.outputs],
                             out.finished, out.metrics, out.num_cached_tokens, out.error, out.error_from_input)


def _tail(values: list | None, start: int) -> list | None:
    return values[start:] if values is not None else None


def _extend(values: list | None, new: list | None) -> None:
    if values is not None and new:
        values.extend(new)


def _copy(c: CompletionOutput) -> CompletionOutput:
    def copy(values):
        return list(values) if values is not None else None

    return CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob, copy(c.logprobs),
                            c.finish_reason, c.stop_reason, copy(c.token_sources), copy(c.token_drafters))
