"""Turns scheduler progress into RequestOutputs: incremental detokenization, stop strings, logprobs, n>1."""
from __future__ import annotations

import time
from dataclasses import dataclass

from specserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from specserve.engine.request import Request
from specserve.tokenizer import IncrementalDetokenizer


@dataclass
class ChildState:
    """One sequence of a (possibly n > 1) request, as the user will see it."""

    index: int
    params: object
    detokenizer: IncrementalDetokenizer | None
    completion: CompletionOutput
    num_tokens_seen: int = 0
    # Where in the text a stop string may still begin: past the text of the first min_tokens tokens, and at most
    # len(longest stop) - 1 characters before the text's end at the last search.
    stop_search_from: int = 0


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: dict[str, ChildState]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    num_finished: int = 0
    error: str | None = None
    error_from_input: bool = False

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.children)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(self, parent_id: str, prompt: str | None, prompt_token_ids: list[int],
                    children: list[tuple[str, object]], arrival_time: float) -> None:
        states = {}
        for index, (child_id, params) in enumerate(children):
            detok = None
            if getattr(params, "detokenize", True) and self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                               skip_special_tokens=getattr(params, "skip_special_tokens", True))
            want_lp = getattr(params, "logprobs", None) is not None
            completion = CompletionOutput(index, "", [], 0.0 if want_lp else None, [] if want_lp else None,
                                          token_sources=[], token_drafters=[])
            states[child_id] = ChildState(index, params, detok, completion)
            self.child_to_parent[child_id] = parent_id
        self.parents[parent_id] = ParentState(parent_id, prompt, list(prompt_token_ids), states,
                                              RequestMetrics(arrival_time))

    def has_request(self, parent_id: str) -> bool:
        return parent_id in self.parents

    def child_ids(self, parent_id: str) -> list[str]:
        return list(self.parents[parent_id].children)

    def process(self, request: Request, logprobs: list[dict] | None, now: float | None = None) -> str | None:
        """Absorb a child's new tokens; returns a stop string if one ended it (the caller aborts it)."""
        now = time.time() if now is None else now
        parent = self.parents[self.child_to_parent[request.request_id]]
        child = parent.children[request.request_id]
        seen = child.num_tokens_seen
        new_ids = request.output_token_ids[seen:]
        child.num_tokens_seen = len(request.output_token_ids)
        self._update_metrics(parent.metrics, request, bool(new_ids), now)
        parent.num_cached_tokens = max(parent.num_cached_tokens, request.num_cached_tokens)
        stop_str, num_kept = self._detokenize(child, new_ids) if child.detokenizer else (None, len(new_ids))
        completion = child.completion
        completion.token_ids.extend(new_ids[:num_kept])
        completion.token_sources.extend(request.token_sources[seen:seen + num_kept])
        completion.token_drafters.extend(request.token_drafters[seen:seen + num_kept])
        if logprobs and completion.logprobs is not None:
            self._add_logprobs(completion, logprobs[:num_kept])
        if stop_str is not None:
            completion.finish_reason, completion.stop_reason = "stop", stop_str
        elif request.is_finished:
            completion.finish_reason = request.status.finish_reason
            completion.stop_reason = request.stop_reason
        if completion.finish_reason is not None:
            parent.num_finished += 1
            if parent.finished:
                parent.metrics.finished_time = now
        return stop_str

    def _update_metrics(self, m: RequestMetrics, request: Request, got_tokens: bool, now: float) -> None:
        if m.first_scheduled_time is None:
            m.first_scheduled_time = request.first_scheduled_time
        if got_tokens:
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
        s = request.spec_stats
        m.num_drafts, m.num_draft_tokens = s.num_drafts, s.num_draft_tokens
        m.num_accepted_tokens, m.accepted_per_position = s.num_accepted_tokens, list(s.accepted_per_position)

    def _add_logprobs(self, completion: CompletionOutput, entries: list[dict]) -> None:
        for token_id, entry in zip(completion.token_ids[len(completion.logprobs):], entries):
            completion.logprobs.append({
                tid: Logprob(lp, rank, self.tokenizer.decode([tid], skip_special_tokens=False)
                             if self.tokenizer is not None else None)
                for tid, (lp, rank) in entry.items()})
            completion.cumulative_logprob += entry[token_id][0]

    def _detokenize(self, child: ChildState, new_ids: list[int]) -> tuple[str | None, int]:
        """Append the new tokens' text; on a stop string, truncate the text there. Returns (the stop string or
        None, how many of new_ids the output keeps: all, or up to the one whose text completed the stop string,
        as plain decoding would have stopped there).

        A stop string counts only where it begins after the text of the first min_tokens tokens, so that text
        is never cut (nor what a stream already sent of it), and each search covers only the new text plus the
        len(stop) - 1 characters before it.
        """
        stops = getattr(child.params, "stop", None) or []
        if not stops:
            child.completion.text += child.detokenizer.add(new_ids)
            return None, len(new_ids)
        min_tokens = getattr(child.params, "min_tokens", 0)
        num_before = len(child.completion.token_ids)
        for i, token_id in enumerate(new_ids):
            child.completion.text += child.detokenizer.add([token_id])
            if num_before + i + 1 <= min_tokens:
                child.stop_search_from = len(child.completion.text)
            elif (stop := self._truncate_at_stop(child, stops)) is not None:
                return stop, i + 1
        return None, len(new_ids)

    @staticmethod
    def _truncate_at_stop(child: ChildState, stops: list[str]) -> str | None:
        """Search the text from child.stop_search_from; on the earliest stop string, truncate the text there
        (after it with include_stop_str_in_output) and return it."""
        text = child.completion.text
        found = [(i, s) for s in stops if (i := text.find(s, child.stop_search_from)) >= 0]
        child.stop_search_from = max(child.stop_search_from, len(text) - max(map(len, stops)) + 1)
        if not found:
            return None
        index, stop = min(found)
        keep = index + len(stop) if getattr(child.params, "include_stop_str_in_output", False) else index
        child.completion.text = text[:keep]
        return stop

    def fail(self, parent_id: str, message: str, from_input: bool = False) -> None:
        """End every unfinished sequence of the request with finish_reason "error" and `message`."""
        parent = self.parents[parent_id]
        parent.error, parent.error_from_input = message, from_input
        for child in parent.children.values():
            if child.completion.finish_reason is None:
                child.completion.finish_reason = "error"
                parent.num_finished += 1
        parent.metrics.finished_time = time.time()

    def abort(self, parent_id: str) -> None:
        parent = self.parents.get(parent_id)
        if parent is None:
            return
        for child in parent.children.values():
            if child.completion.finish_reason is None:
                child.completion.finish_reason = "abort"
                parent.num_finished += 1

    def make_output(self, parent_id: str) -> RequestOutput:
        """A snapshot of the request; finished requests are forgotten afterwards."""
        p = self.parents[parent_id]
        outputs = [_copy_completion(c.completion) for c in sorted(p.children.values(), key=lambda c: c.index)]
        out = RequestOutput(p.request_id, p.prompt, p.prompt_token_ids, outputs, p.finished, p.metrics,
                            p.num_cached_tokens, p.error, p.error_from_input)
        if p.finished:
            del self.parents[parent_id]
            for child_id in p.children:
                self.child_to_parent.pop(child_id, None)
        return out

    def parent_of(self, child_id: str) -> str | None:
        return self.child_to_parent.get(child_id)


def _copy_completion(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                            list(c.logprobs) if c.logprobs is not None else None, c.finish_reason, c.stop_reason,
                            _copy(c.token_sources), _copy(c.token_drafters))


def _copy(values: list | None) -> list | None:
    return list(values) if values is not None else None
