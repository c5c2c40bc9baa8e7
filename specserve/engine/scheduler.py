"""Continuous-batching scheduler: token budget, chunked prefill, drafts, preemption by recompute.

Pure Python (no torch). Every running request gets `num_tokens_with_spec - num_computed_tokens` new
tokens, capped by the step's token budget; a prefill therefore chunks itself, and drafts from the
previous step are just more tokens to schedule. FCFS; out of blocks, the newest running request is
preempted and recomputed later. No request is ever dropped or duplicated.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from specserve.engine.kv_cache_manager import KVCacheManager
from specserve.engine.request import ACCEPTED, BONUS, CORRECTION, TARGET, Request, RequestStatus
from specserve.types import CachedRequestData, NewRequestData, SchedulerOutput, max_draft_tokens


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # Extra slots reserved per request for drafters that write their own KV ahead of the target.
    num_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    kv_cache_blocks_in_use: int = 0
    kv_cache_blocks: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # per request of the last scheduled step, its num_computed_tokens before it: the first token whose KV
        # that step writes
        self.step_start_tokens: dict[str, int] = {}
        self.recomputing: set[str] = set()  # sent back to recompute after a step (discard_step_kv)

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.num_prompt_tokens < 1:
            raise ValueError("prompt must contain at least one token")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; max_model_len is "
                f"{self.config.max_model_len}, leaving no room to generate")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        """Finish (abort, or stop on a stop string) requests from outside the step loop."""
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)

    def discard_step_kv(self, failed_ids) -> list[str]:
        """The requests `failed_ids` fail inside the last scheduled step, whose KV for them cannot be trusted (an
        image that did not encode, positions that could not be built): take the blocks that step wrote for them
        out of the prefix cache, and send every request of the step that read one of those blocks through a
        prefix hit back to recompute (preempted: update_from_output then passes over its tokens of the step).
        Call after the step ran, before update_from_output and before the failed requests are freed. Returns the
        ids sent back."""
        failed_ids = set(failed_ids)
        untrusted: set = set()
        readers = []
        for rid, start in self.step_start_tokens.items():  # schedule order: a hit reads blocks scheduled before it
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            if rid in failed_ids or (untrusted and self.kv.holds_any(rid, untrusted)):
                untrusted |= self.kv.uncache_from(request, start)
                if rid not in failed_ids:
                    readers.append(request)
        for request in reversed(readers):  # FCFS kept at the front of the queue
            self._preempt(request)
            request.num_cached_tokens = -1  # the hit it reports is the one it is admitted again with
            self.recomputing.add(request.request_id)
        return [r.request_id for r in readers]

    def _free(self, request: Request) -> None:
        self.kv.free(request)
        self.finished_req_ids.add(request.request_id)
        self.recomputing.discard(request.request_id)  # the runner is told it finished, not that it was preempted
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage, self.num_preemptions,
                              self.kv.num_used_blocks, self.kv.num_blocks)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        new_blocks: dict[str, list[int]] = {}
        resumed: list[Request] = []
        preempted: set[str] = set()

        for request in list(self.running):
            if budget == 0:
                break
            if request.request_id in preempted:
                continue
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                continue
            num_draft = max(0, request.num_computed_tokens + num_new - request.num_tokens)
            block_ids = self._allocate_or_preempt(request, num_new, num_draft, preempted)
            if block_ids is None:
                continue  # the request itself was preempted
            num_scheduled[request.request_id] = num_new
            new_blocks[request.request_id] = block_ids
            if num_draft:
                spec_tokens[request.request_id] = request.spec_token_ids[:num_draft]
            budget -= num_new

        if not preempted:
            budget = self._schedule_waiting(budget, num_scheduled, new_blocks, resumed)
        return self._make_output(num_scheduled, spec_tokens, new_blocks, resumed, preempted)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        num_new = request.num_tokens_with_spec - request.num_computed_tokens
        # Never compute KV for a position >= max_model_len: drop drafts that would.
        num_new = min(num_new, budget, self.config.max_model_len - 1 - request.num_computed_tokens)
        return max(num_new, 0)

    def _allocate_or_preempt(self, request: Request, num_new: int, num_draft: int,
                             preempted: set[str]) -> list[int] | None:
        while True:
            block_ids = self.kv.allocate_slots(
                request, num_new, num_draft_tokens=num_draft,
                num_lookahead_tokens=self.config.num_lookahead_tokens)
            if block_ids is not None:
                return block_ids
            victim = self.running[-1]
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int],
                          new_blocks: dict[str, list[int]], resumed: list[Request]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            computed_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            block_ids = self.kv.allocate_slots(request, num_new, computed_blocks,
                                               num_lookahead_tokens=self.config.num_lookahead_tokens)
            if block_ids is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            resumed.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        return budget

    def _make_output(self, num_scheduled, spec_tokens, new_blocks, resumed, preempted) -> SchedulerOutput:
        preempted, self.recomputing = preempted | self.recomputing, set()
        resumed_ids = {r.request_id for r in resumed}
        new_reqs = [
            NewRequestData(r.request_id, r.prompt_token_ids, list(r.output_token_ids), r.sampling_params,
                           self.kv.get_block_ids(r.request_id), r.num_computed_tokens, r.mm_features, r.grammar)
            for r in resumed
        ]
        cached_reqs = [
            CachedRequestData(rid, new_blocks[rid], self.requests[rid].num_computed_tokens)
            for rid in num_scheduled if rid not in resumed_ids
        ]
        req_ids = list(num_scheduled)
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            req_ids=req_ids,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens=spec_tokens,
            finished_req_ids=self.finished_req_ids | preempted,
            preempted_req_ids=preempted,
        )
        self.finished_req_ids = set()
        self.step_start_tokens = {rid: self.requests[rid].num_computed_tokens for rid in num_scheduled}
        # Advance progress now; update_from_output rolls back rejected drafts.
        for rid, n in num_scheduled.items():
            self.requests[rid].num_computed_tokens += n
        return out

    def update_from_output(self, sched: SchedulerOutput, sampled_token_ids: dict[str, list[int]],
                           draft_token_ids: dict[str, list[int]] | None = None,
                           draft_source_names: dict[str, str] | None = None) -> list[Request]:
        """Append accepted tokens, roll back rejected drafts, check stops; return finished requests.
        `draft_source_names` names the drafter of each request's new drafts (for Request.token_drafters)."""
        finished = []
        for rid in sched.req_ids:
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            generated = sampled_token_ids.get(rid, [])
            drafts = sched.scheduled_spec_decode_tokens.get(rid)
            request.spec_token_ids = []
            if drafts:
                num_rejected = len(drafts) + 1 - len(generated)
                request.num_computed_tokens -= num_rejected
                request.spec_stats.record(len(drafts), len(generated) - 1)
            for token_id, source in zip(generated, _token_sources(len(drafts or ()), len(generated))):
                request.append_output_token(token_id, source, request.spec_drafter if drafts else None)
                if self._check_stop(request, token_id):
                    break
            if request.is_finished:
                self.running.remove(request)
                self._free(request)
                finished.append(request)
            elif draft_token_ids and draft_token_ids.get(rid):
                request.spec_token_ids = self._trim_drafts(request, draft_token_ids[rid])
                request.spec_drafter = draft_source_names.get(rid) if draft_source_names else None
        return finished

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Length first, then stop tokens (vLLM's order). Before min_tokens the sampler masks EOS and stop ids
        unless nothing else is allowed (a grammar that has ended), so one that comes anyway stops the request."""
        num_out = request.num_output_tokens
        if request.num_tokens >= self.config.max_model_len or (
                request.max_tokens is not None and num_out >= request.max_tokens):
            request.status = RequestStatus.FINISHED_LENGTH
        elif token_id in request.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id
        elif not request.ignore_eos and token_id in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
        return request.is_finished

    def _trim_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """Drafts beyond max_tokens or max_model_len could never be emitted."""
        room = max_draft_tokens(request.num_tokens, self.config.max_model_len)
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens - 1)
        return list(drafts[:max(room, 0)])


def _token_sources(num_drafts: int, num_generated: int) -> list[str]:
    """How each of a step's tokens was produced: the accepted drafts, then the target's own token (a bonus
    when every draft was accepted, else the correction of the first rejected one)."""
    if not num_drafts:
        return [TARGET] * num_generated
    last = BONUS if num_generated == num_drafts + 1 else CORRECTION
    return [ACCEPTED] * (num_generated - 1) + [last]
