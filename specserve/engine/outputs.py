"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes, plus request metrics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # Per token: "accepted" (a draft the target accepted), "bonus" (the target's token after all drafts
    # were accepted), "correction" (the target's token in place of a rejected draft) or "target" (no drafts)
    token_sources: list[str] | None = None
    token_drafters: list[str | None] | None = None  # per token: the drafter of its step's drafts, or None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts: tokens emitted per verification step (None without speculation)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None  # set when the request failed on its own (e.g. prompt too long)
    error_from_input: bool = False  # the error came from the request's own input (a client error)

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, finished={self.finished}, "
                f"outputs={[(o.text, o.finish_reason) for o in self.outputs]!r})")
