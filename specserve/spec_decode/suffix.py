"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975): drafts from suffix tries over
this request's tokens and over earlier requests' outputs, extended while the continuation stays likely.

Terms: a trie holds every substring of length <= depth of its sequences with its occurrence count; the
*match* is the longest suffix of the history found in a trie; a draft follows the most frequent child
from the match while the path probability (product of child count / sibling total) is >= min_token_prob.
"""
from __future__ import annotations

import math
from collections import deque

from specserve.spec_decode.proposer import DraftInputs, DrafterNeeds, Drafts
from specserve.sample.draft_tree import DraftTree
from specserve.spec_decode.tree import TreeChooser, best_first, static_candidates


class _Node:
    """A substring seen at least twice (or once, after evictions); its children are what followed it."""

    __slots__ = ("count", "total", "best", "children")

    def __init__(self, count: int) -> None:
        self.count = count  # occurrences of this substring
        self.total = 0  # sum of the children's counts: occurrences that have a next token
        self.best = -1  # most frequent child's token (latest on ties); -1: recompute when needed
        # token -> _Node, or a leaf (seq_id, start): the single occurrence seqs[seq_id][start:], whose
        # deeper path is implicit, so a trie stores O(repeated substrings) nodes, not O(length * depth).
        self.children: dict = {}


def _count(child) -> int:
    return child.count if type(child) is _Node else 1


class SuffixTrie:
    """Depth-limited trie of all substrings of its sequences, with counts, updated in O(depth) per token."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node(0)
        self.seqs: dict[int, list[int]] = {}
        # Only the latest sequence grows, so a leaf of any other one has its whole continuation stored.
        self.growing: int | None = None
        self._open: list[_Node] = [self.root]  # the growing sequence's suffixes' nodes, index = length

    def extend(self, seq_id: int, tokens) -> None:
        """Append tokens to sequence seq_id, which must be new or the growing one; O(depth) per token."""
        if seq_id != self.growing:
            if seq_id in self.seqs:
                raise ValueError(f"sequence {seq_id} was closed when sequence {self.growing} was started")
            self.growing, self._open = seq_id, [self.root]
        seq = self.seqs.setdefault(seq_id, [])
        open_nodes = self._open
        for tok in tokens:
            seq.append(tok)
            end = len(seq) - 1
            grown = [self.root]
            for length, node in enumerate(open_nodes):  # node = seq[end - length : end]
                child = self._add(node, tok, seq_id, end - length, length + 1)
                if child is not None and length + 1 < self.depth:
                    grown.append(child)
            open_nodes = grown
        self._open = open_nodes

    def open_nodes(self) -> list[_Node]:
        """Nodes of the growing sequence's suffixes, index = length, as long as each occurred before too."""
        return self._open

    def _add(self, node: _Node, tok: int, seq_id: int, start: int, depth: int) -> _Node | None:
        """Count one more occurrence of node's substring + tok; returns the child (None if a new leaf)."""
        children = node.children
        child = children.get(tok)
        if child is None:
            child = children[tok] = (seq_id, start)
            count = 1
        elif type(child) is _Node:
            child.count += 1
            count = child.count
        else:
            child = children[tok] = self._split(child, depth)
            count = 2
        node.total += 1
        best = node.best
        if best == tok or len(children) == 1 or best >= 0 and count >= _count(children[best]):
            node.best = tok
        return child if count > 1 else None

    def _split(self, leaf: tuple[int, int], depth: int) -> _Node:
        """A leaf met a second occurrence: a real node, with the old occurrence's next token as a leaf."""
        seq_id, start = leaf
        node, seq = _Node(2), self.seqs[seq_id]
        if depth < self.depth and start + depth < len(seq):
            node.children[seq[start + depth]] = leaf
            node.total, node.best = 1, seq[start + depth]
        return node

    def remove(self, seq_id: int) -> None:
        """Forget a sequence: undo every count it added, dropping nodes that reach zero."""
        seq = self.seqs.pop(seq_id)
        if seq_id == self.growing:
            self.growing, self._open = None, [self.root]
        for start in range(len(seq)):
            node = self.root
            for tok in seq[start:start + self.depth]:
                child = node.children[tok]
                node.total -= 1
                if node.best == tok:
                    node.best = -1
                if type(child) is not _Node or child.count == 1:  # only this occurrence was left
                    del node.children[tok]
                    break
                child.count -= 1
                node = child

    def match(self, pattern: list[int]):
        """The state (a node or a leaf) reached by pattern from the root, or None if it does not occur."""
        state, depth = self.root, 0
        for tok in pattern:
            if type(state) is _Node:
                state = state.children.get(tok)
                if state is None:
                    return None
            else:
                seq = self.seqs[state[0]]
                pos = state[1] + depth
                if pos >= len(seq) or seq[pos] != tok:
                    return None
            depth += 1
        return state

    def longest_match(self, history: list[int]) -> int:
        """Length of the longest suffix of history (< depth) found here, by bisection.

        Substrings of substrings are substrings, so if the last n tokens occur, so do the last n - 1.
        """
        lo, hi = 0, min(self.depth - 1, len(history))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.match(history[len(history) - mid:]) is not None else (lo, mid - 1)
        return lo

    def draft(self, state, depth: int, limit: int, min_prob: float) -> tuple[list[int], float]:
        """Greedy path from state (at depth) while the path probability is >= min_prob: (tokens, score).

        score = sum of the path probabilities = expected number of accepted tokens.
        """
        tokens, prob, score = [], 1.0, 0.0
        while len(tokens) < limit and depth < self.depth and type(state) is _Node and state.total:
            tok = self._best(state)
            child = state.children[tok]
            prob *= _count(child) / state.total
            if prob < min_prob:
                return tokens, score
            tokens.append(tok)
            score += prob
            state, depth = child, depth + 1
        if type(state) is not _Node:  # a single occurrence: its continuation, each with probability 1
            seq_id, start = state
            seq = self.seqs[seq_id]
            tail = seq[start + depth:min(start + self.depth, len(seq))][:limit - len(tokens)]
            tokens.extend(tail)
            score += prob * len(tail)
        return tokens, score

    def continuations(self, state, depth: int):
        """[(token, conditional probability, (child state, depth + 1))] after `state` at `depth`: a node's
        children by count, or a single occurrence's next token with probability 1."""
        if depth >= self.depth:
            return []
        if type(state) is _Node:
            total = state.total
            return [(tok, _count(child) / total, (child, depth + 1)) for tok, child in state.children.items()] \
                if total else []
        seq = self.seqs[state[0]]
        pos = state[1] + depth
        return [(seq[pos], 1.0, (state, depth + 1))] if pos < len(seq) else []

    @staticmethod
    def _best(node: _Node) -> int:
        if node.best < 0:  # stale after a removal
            node.best = max(node.children, key=lambda t: _count(node.children[t]))
        return node.best


class SuffixProposer:
    """vLLM's `suffix` method: per-request tries plus a global trie of finished requests' outputs."""

    needs = DrafterNeeds()  # token ids only

    def __init__(self, spec_config) -> None:
        self.k = spec_config.num_speculative_tokens
        self.depth = spec_config.suffix_decoding_max_tree_depth
        self.max_cached = spec_config.suffix_decoding_max_cached_requests
        self.spec_factor = spec_config.suffix_decoding_max_spec_factor
        self.min_prob = spec_config.suffix_decoding_min_token_prob
        # req_id -> (trie of its tokens, built when it drafts; prompt length; its live history list)
        self._local: dict[str, tuple[SuffixTrie | None, int, list[int]]] = {}
        self.global_trie = SuffixTrie(self.depth)
        self._cached: deque[int] = deque()  # seq ids of the outputs in global_trie, oldest first
        self._next_seq_id = 0
        self.trees = TreeChooser()  # trees: how often nodes are accepted at the tries' probabilities

    def propose(self, inputs: DraftInputs) -> Drafts:
        for req_id in inputs.finished_req_ids:
            self._retire(req_id)
        self.trees.start(inputs)
        drafts, trees = [], []
        costs = None
        for i, (req_id, history, num_prompt, num_drafts) in enumerate(zip(
                inputs.req_ids, inputs.token_ids, inputs.num_prompt_tokens, inputs.num_drafts)):
            cap = min(num_drafts, self.k)
            tree = None
            if cap > 0:
                tokens, source = self._draft(self._sync(req_id, history, num_prompt), history, cap)
                if source is not None and inputs.wants_tree(i):
                    if costs is None:
                        costs = self.trees.costs(inputs)
                    tree = self._tree(req_id, len(history), source, cap, inputs, costs)
                    if tree is not None:
                        tokens = list(tree.tokens)
                drafts.append(tokens)
            else:  # no trie work; the history is kept for the global cache when the request finishes
                trie = self._local.get(req_id, (None,))[0]
                self._local[req_id] = (trie, num_prompt, history)
                drafts.append([])
            trees.append(tree)
        return Drafts(token_ids=drafts, trees=trees if any(t is not None for t in trees) else None)

    def _tree(self, req_id: str, length: int, source, depth_limit: int, inputs: DraftInputs,
              costs: list[float]) -> DraftTree | None:
        """The continuations of the best match as a tree (most probable nodes first, within depth_limit of the
        match and suffix_decoding_min_token_prob), sized by expected tokens per unit of cost, each node's
        probability calibrated by the acceptance seen; None when a chain is as good (the tree's first path is
        the best chain)."""
        trie, state, length = source

        def expand(node):
            at, depth = (state, length) if node is None else node
            if depth - length >= depth_limit:
                return []
            return trie.continuations(at, depth)

        if inputs.tree_shape is not None:  # the static shape, the trie's children ranked by count
            tree = self.trees.fixed(req_id, length, static_candidates(inputs.tree_shape, expand, depth_limit))
        else:
            tree = self.trees.choose(req_id, length, best_first(expand, inputs.max_tree_nodes, self.min_prob),
                                     costs)
        return None if tree.is_chain else tree

    def _sync(self, req_id: str, history: list[int], num_prompt: int) -> SuffixTrie:
        """The request's trie, extended with the tokens appended since the last call."""
        trie = self._local.get(req_id, (None,))[0]
        seen = trie.seqs.get(0, []) if trie else []
        if trie is None or len(history) < len(seen) or (seen and history[len(seen) - 1] != seen[-1]):
            trie, seen = SuffixTrie(self.depth), []  # new, or not an extension of what we hold
        self._local[req_id] = (trie, num_prompt, history)
        trie.extend(0, history[len(seen):])
        return trie

    def _draft(self, trie: SuffixTrie, history: list[int], cap: int) -> tuple[list[int], tuple | None]:
        """Best-scoring draft over match lengths (longest first) in the request's trie and the global one,
        with where it came from: (trie, state, match length), None for no draft.

        Both tries compete on the same score (expected accepted tokens); ties keep the longer match and
        the request's own trie. Stops once no shorter match could score higher than the best so far.
        """
        open_nodes = trie.open_nodes()  # open_nodes[n]: this request's node for its last n tokens
        longest_global = self.global_trie.longest_match(history) if self._cached else 0
        best, best_score, best_source = [], 0.0, None
        for length in range(max(len(open_nodes) - 1, longest_global), 0, -1):
            limit = min(cap, math.ceil(length * self.spec_factor))  # the draft may grow with the match
            if best_score >= limit:
                break
            candidates = [(trie, open_nodes[length])] if length < len(open_nodes) else []
            if length <= longest_global:
                candidates.append((self.global_trie, self.global_trie.match(history[-length:])))
            for source, state in candidates:
                tokens, score = source.draft(state, length, limit, self.min_prob)
                if score > best_score:
                    best, best_score, best_source = tokens, score, (source, state, length)
        return best, best_source

    def _retire(self, req_id: str) -> None:
        """A finished request's output joins the global trie; the oldest beyond the cap leave.

        Preempted requests never come here: they keep their trie, which `_sync` extends when they resume.
        """
        _, num_prompt, history = self._local.pop(req_id, (None, 0, []))
        if self.max_cached == 0:
            return
        output = history[num_prompt:]
        if output:
            self.global_trie.extend(self._next_seq_id, output)
            self._cached.append(self._next_seq_id)
            self._next_seq_id += 1
        while len(self._cached) > self.max_cached:
            self.global_trie.remove(self._cached.popleft())
