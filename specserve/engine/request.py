"""A request's state as the scheduler sees it: tokens, progress, drafts, finish status.

Pure Python (no torch) so the scheduler and its tests stay light.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


# How each output token was produced (Request.token_sources, CompletionOutput.token_sources).
ACCEPTED = "accepted"  # a draft token the target accepted
BONUS = "bonus"  # the target's own token after every draft of the step was accepted
CORRECTION = "correction"  # the target's own token in place of the first rejected draft
TARGET = "target"  # the target's own token in a step that verified no drafts


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything past this point is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class SpecDecodeStats:
    """Speculation counters, per request and engine-wide (mean acceptance length = 1 + accepted / drafts)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position.extend([0] * (num_draft - len(self.accepted_per_position)))
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


class Request:
    """One sequence: prompt, outputs so far, drafts awaiting verification, KV progress."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        max_tokens: int | None = None,
        mm_features: list | None = None,
        grammar: Any = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.spec_token_ids: list[int] = []
        self.spec_drafter: str | None = None  # the drafter that proposed spec_token_ids
        # Per output token: how it was produced (ACCEPTED, ...) and the drafter of its step's drafts (or None).
        self.token_sources: list[str] = []
        self.token_drafters: list[str | None] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit, set on first scheduling
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.spec_stats = SpecDecodeStats()
        # Stop conditions the scheduler checks token by token (stop strings are the detokenizer's).
        self.max_tokens = max_tokens if max_tokens is not None else getattr(sampling_params, "max_tokens", None)
        self.min_tokens = getattr(sampling_params, "min_tokens", 0)
        self.ignore_eos = getattr(sampling_params, "ignore_eos", False)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(getattr(sampling_params, "stop_token_ids", None) or ())
        self.num_speculative_tokens = getattr(sampling_params, "num_speculative_tokens", None)
        self.mm_features = list(mm_features or ())  # types.MultiModalFeature per image, in prompt order
        self.grammar = grammar  # the compiled structured-output grammar, or None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int, source: str = TARGET, drafter: str | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.token_sources.append(source)
        self.token_drafters.append(drafter)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, spec={len(self.spec_token_ids)})")
