"""The step types the scheduler hands the model runner: which requests run this step, with what.

A neutral module both `engine/` and `worker/` import, so neither imports the other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MultiModalFeature:
    """One image of a prompt: the run of placeholder tokens it fills and what the vision encoder reads."""

    offset: int  # index of the first placeholder token in the prompt
    length: int  # placeholder tokens = the encoder's output rows for this image
    grid_thw: tuple[int, int, int]  # (temporal, height, width) in patches
    hash: str  # content hash: part of the prefix-cache key of every block the image touches
    pixel_values: Any  # [t * h * w, patch_dim] float32 (numpy), in the processor's row order

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (its state is rebuilt)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: Any
    block_ids: list[int]
    num_computed_tokens: int
    mm_features: list[MultiModalFeature] = field(default_factory=list)  # the prompt's images, in order
    grammar: Any = None  # the compiled structured-output grammar (structured.grammar.CompiledGrammar) or None


@dataclass
class CachedRequestData:
    """A request the runner already holds: only the blocks added this step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # Requests in the order the runner lays them out in the flattened batch.
    req_ids: list[str]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Drafts (from the previous step) to verify this step; a subset of each request's drafts.
    scheduled_spec_decode_tokens: dict[str, list[int]]
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = field(default_factory=set)


def max_draft_tokens(num_tokens: int, max_model_len: int) -> int:
    """Drafts a request of num_tokens tokens may carry: history + drafts + the bonus token fit in
    max_model_len (the scheduler and the runner both apply it)."""
    return max(0, max_model_len - num_tokens - 1)


@dataclass(frozen=True)
class RequestFailure:
    """Why one request failed inside a step while the others went on: `from_input` when its own input (a
    grammar, an image) caused it, so the client is told it sent something that cannot be served."""

    message: str
    from_input: bool = False


class FatalEngineError(RuntimeError):
    """The engine cannot go on (a tensor-parallel worker died): a step that raises it ends the engine rather
    than resetting it."""
