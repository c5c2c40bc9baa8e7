"""Prompt-lookup drafting: copy what followed the longest earlier occurrence of the history's suffix.

`find_ngram_draft` is the pure search; `NgramProposer` keeps a growing numpy copy of each history.
"""
# Which occurrence, when the longest suffix occurs several times (vLLM takes the first). Offline replay
# of SmolLM2-tokenized text, k=8, n in 2..5, tokens per step (drafts checked against the real next tokens):
#   first / most recent / source-following:  code 1.64 / 1.69 / 1.69,  docs 1.20 / 1.21 / 1.21,
#   an edited copy of the prompt 6.44 / 6.09 / 6.83.
# Recency wins when text repeats itself locally; copying a document favours the occurrence we were
# already following, so we prefer that one and otherwise the most recent.
from __future__ import annotations

import numpy as np

from specserve.spec_decode.proposer import DraftInputs, DrafterNeeds, Drafts
from specserve.spec_decode.tree import TreeChooser, best_first, static_candidates
from specserve.ops import kernels

_EMPTY = np.zeros(0, dtype=np.int64)
# A match of the last token alone predicts little. Replaying SmolLM2's greedy Spec-Bench outputs (k=8), a
# draft copied after a one-token match had its 1st token accepted 24% of the time and its 4th 5% (after a
# two-token match: 43% and 14%), so past a few tokens such drafts cost more verification than they return.
# Capping them at 3 tokens gives more tokens per unit of cost than drafting k (a draft token costing 3.3% of
# a step, with the adaptive policy): summarization 1.558 against 1.539, the geomean over 8 categories 1.466
# against 1.458 (extraction, whose long copies start from longer matches, 3.021 against 3.030; the other
# categories gain).
ONE_TOKEN_MATCH_MAX_DRAFTS = 3
# Draft trees: the continuations of at most this many occurrences of the matched n-gram (the latest ones).
TREE_OCCURRENCES = 8


def find_ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int, prefer_end: int = -1) -> np.ndarray:
    """Up to k tokens that followed the chosen earlier occurrence of the longest suffix n-gram.

    tokens: [L] history; n ranges over [min_n, max_n]. Returns [<= k], empty when no n-gram matches.
    """
    end = find_ngram_match(tokens, min_n, max_n, prefer_end) if k > 0 else -1
    return ngram_continuation(tokens, end, k) if end >= 0 else _EMPTY


def find_ngram_match(tokens: np.ndarray, min_n: int, max_n: int, prefer_end: int = -1) -> int:
    """End index j < L-1 of the chosen occurrence of the longest suffix match in [min_n, max_n]; -1: none.

    Among occurrences of that length: `prefer_end` if it is one (the source we were copying from),
    else the most recent. Candidates start as the positions holding the last token; step n keeps those
    whose n-th token back also matches, so after the first O(L) comparison the work is O(survivors).
    """
    size = tokens.shape[0]  # tokens: [L]
    ends = find_ngram_matches(tokens, min_n, max_n)
    if not ends.size:
        return -1
    if 0 <= prefer_end < size - 1 and ends[np.searchsorted(ends, prefer_end) % ends.size] == prefer_end:
        return prefer_end
    return int(ends[-1])


def find_ngram_matches(tokens: np.ndarray, min_n: int, max_n: int) -> np.ndarray:
    """End indices (ascending, each < L-1) of every earlier occurrence of the longest suffix n-gram with n in
    [min_n, max_n]; empty when none matches."""
    size = tokens.shape[0]  # tokens: [L]
    if size < min_n + 1:
        return _EMPTY
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # [C] ascending
    matched = 1 if ends.size else 0
    for n in range(2, max_n + 1):
        keep = ends[ends >= n - 1]
        keep = keep[tokens[keep - (n - 1)] == tokens[size - n]]
        if keep.size == 0:
            break
        ends, matched = keep, n
    return ends if matched >= min_n else _EMPTY


def ngram_continuation(tokens: np.ndarray, end: int, k: int) -> np.ndarray:
    """The k tokens predicted after a match ending at `end`: [k].

    The history is taken to repeat with period p = L-1-end, so a continuation that runs into the
    present keeps copying its own prediction; for p >= k this is just tokens[end+1 : end+1+k].
    """
    period = tokens.shape[0] - 1 - end
    tail = tokens[end + 1:]  # [p]
    if period >= k:
        return tail[:k].copy()
    return np.resize(tail, k)  # tiles the period


def num_to_draft(tokens: np.ndarray, end: int, k: int) -> int:
    """How many tokens to copy after the match ending at `end` (tokens: [L]): k, or at most
    ONE_TOKEN_MATCH_MAX_DRAFTS when only the last token matched there."""
    one_token = end < 1 or tokens[end - 1] != tokens[-2]
    return min(k, ONE_TOKEN_MATCH_MAX_DRAFTS) if one_token else k


class _History:
    """A request's history as a growing int64 buffer, plus where its last draft was copied from."""

    __slots__ = ("buf", "address", "size", "src_end", "src_size")

    def __init__(self, token_ids: list[int]) -> None:
        self._hold(np.asarray(token_ids, dtype=np.int64))  # [capacity]
        self.size = len(token_ids)
        self.src_end = self.src_size = -1  # last match end and the history length then

    def _hold(self, buf: np.ndarray) -> None:
        self.buf, self.address = buf, buf.ctypes.data  # the C search reads the buffer at its address

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """Catch up with the live history list, copying only the new tokens; returns [L]."""
        n, size = len(token_ids), self.size
        if n < size or (size and token_ids[size - 1] != self.buf[size - 1]):
            self.__init__(token_ids)  # not an extension of what we hold (reused id, rewound history)
        elif n > size:
            if n > self.buf.shape[0]:
                grown = np.empty(max(2 * self.buf.shape[0], n), dtype=np.int64)
                grown[:size] = self.buf[:size]
                self._hold(grown)
            self.buf[size:n] = token_ids[size:]
            self.size = n
        return self.buf[:self.size]

    def source_hint(self) -> int:
        """Where last step's source would match now if the output kept copying it (-1: no source)."""
        return self.src_end + self.size - self.src_size if self.src_end >= 0 else -1


class NgramProposer:
    """Prompt lookup (vLLM's `ngram` method): no model, drafts copied from the request's own history."""

    needs = DrafterNeeds()  # token ids only

    def __init__(self, spec_config) -> None:
        self.min_n = spec_config.prompt_lookup_min
        self.max_n = spec_config.prompt_lookup_max
        self.k = spec_config.num_speculative_tokens
        self._histories: dict[str, _History] = {}
        # The C search where specserve's kernels build (a few microseconds against ~0.1 ms of numpy calls
        # for a 1k-token history, per request and step), called at the history buffer's address (None
        # here); else the numpy search. The same result either way.
        self._find_match = None if kernels.kernel_enabled() else find_ngram_match
        self.trees = TreeChooser()

    def propose(self, inputs: DraftInputs) -> Drafts:
        for req_id in inputs.finished_req_ids:
            self._histories.pop(req_id, None)
        self.trees.start(inputs)
        drafts, trees = [], []
        for i, (req_id, tokens, n) in enumerate(zip(inputs.req_ids, inputs.token_ids, inputs.num_drafts)):
            drafts.append(self._propose_one(req_id, tokens, n))
            tree = self._tree(inputs, i) if drafts[-1] and inputs.wants_tree(i) else None
            if tree is not None:
                drafts[-1] = list(tree.tokens)
            trees.append(tree)
        return Drafts(token_ids=drafts, trees=trees if any(t is not None for t in trees) else None)

    def _tree(self, inputs: DraftInputs, i: int):
        """The continuations of the latest TREE_OCCURRENCES occurrences of the matched n-gram as a tree, a
        node's probability the share of those occurrences that go through it (ties: the latest first); None
        when a chain is as good."""
        history = self._histories[inputs.req_ids[i]]
        tokens = history.buf[:history.size]
        ends = find_ngram_matches(tokens, self.min_n, self.max_n)[::-1][:TREE_OCCURRENCES]  # latest first
        if ends.size < 2:
            return None
        k = min(inputs.num_drafts[i], self.k)
        paths = [ngram_continuation(tokens, int(end), num_to_draft(tokens, int(end), k)).tolist() for end in ends]

        def expand(state):
            depth, group = state or (0, paths)
            counts: dict[int, list[list[int]]] = {}
            for path in group:
                if depth < len(path):
                    counts.setdefault(path[depth], []).append(path)
            return [(t, len(g) / len(group), (depth + 1, g)) for t, g in counts.items()]

        length = len(inputs.token_ids[i])
        if inputs.tree_shape is not None:
            tree = self.trees.fixed(inputs.req_ids[i], length, static_candidates(inputs.tree_shape, expand, k))
        else:
            tree = self.trees.choose(inputs.req_ids[i], length, best_first(expand, inputs.max_tree_nodes),
                                     self.trees.costs(inputs))
        return None if tree.is_chain else tree

    def _propose_one(self, req_id: str, token_ids: list[int], num_drafts: int) -> list[int]:
        k = min(num_drafts, self.k)
        if k <= 0:
            return []
        history = self._histories.get(req_id)
        if history is None:
            history = self._histories[req_id] = _History(token_ids)
        tokens = history.sync(token_ids)  # [L]
        if self._find_match is None:
            end = kernels.ngram_match_at(history.address, history.size, self.min_n, self.max_n, history.source_hint())
        else:
            end = self._find_match(tokens, self.min_n, self.max_n, history.source_hint())
        history.src_end, history.src_size = end, history.size
        return ngram_continuation(tokens, end, num_to_draft(tokens, end, k)).tolist() if end >= 0 else []
