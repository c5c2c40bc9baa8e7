"""Draft trees: several continuations verified in one step (SpecInfer, Miao et al. 2023; Medusa; EAGLE-2).

A tree's nodes are draft tokens in depth-first preorder; node i's parent is an earlier node or -1, the step's
input token (the root: the request's newest token, at depth 0). Siblings carry distinct tokens, so a node is
one candidate continuation. Preorder keeps every prefix of the node list a tree (the scheduler may cut drafts
short) and puts each root-to-leaf path's own nodes next to each other, so each path is verified as a chain
(worker/tree_step.py).

A chain of k drafts is the tree whose node i has parent i - 1.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # per node, the index of its parent node, -1 for the root

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a draft tree needs one parent per token, got {len(self.tokens)} tokens and "
                             f"{len(self.parents)} parents")
        path: list[int] = []  # the ancestors of the previous node, itself included
        seen: set[tuple[int, int]] = set()
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            if parent != -1 and parent not in path:
                raise ValueError(f"draft tree node {i}: parent {parent} is not an ancestor of node {i - 1} or "
                                 "the root (nodes must be in depth-first preorder)")
            if (parent, token) in seen:
                raise ValueError(f"draft tree node {i}: token {token} repeats a sibling's")
            seen.add((parent, token))
            del path[path.index(parent) + 1 if parent != -1 else 0:]
            path.append(i)

    @classmethod
    def chain(cls, tokens) -> DraftTree:
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    @classmethod
    def from_paths(cls, paths) -> DraftTree:
        """The tree of these token paths from the root (shared prefixes merged), paths in the given order:
        node order is the preorder visiting children in the order their first path came."""
        trie: dict = {}
        for path in paths:
            level = trie
            for token in path:
                level = level.setdefault(token, {})
        tokens, parents = [], []

        def visit(level: dict, parent: int) -> None:
            for token, below in level.items():
                tokens.append(token)
                parents.append(parent)
                visit(below, len(tokens) - 1)

        visit(trie, -1)
        return cls(tuple(tokens), tuple(parents))

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Per node, its depth: 1 for a child of the root."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return tuple(depths)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @cached_property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @cached_property
    def children(self) -> dict[int, dict[int, int]]:
        """node (-1: the root) -> {token: child node}, children in node order."""
        out: dict[int, dict[int, int]] = {-1: {}}
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            out.setdefault(parent, {})[token] = i
            out.setdefault(i, {})
        return out

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node` (empty for the root, -1)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    @cached_property
    def leaves(self) -> tuple[int, ...]:
        """Nodes without children, in preorder: one per root-to-leaf path."""
        return tuple(i for i in range(len(self)) if not self.children[i])

    def prefix(self, n: int) -> DraftTree:
        """The first n nodes: a tree again (preorder)."""
        return DraftTree(self.tokens[:n], self.parents[:n])

    def first_path(self) -> list[int]:
        """The nodes of the first root-to-leaf path: 0, 1, ... while each is its predecessor's child."""
        n = 0
        while n < len(self) and self.parents[n] == n - 1:
            n += 1
        return list(range(n))


def best_first(expand, budget: int, min_prob: float = 0.0) -> list[tuple[int, int, float]]:
    """Candidate nodes by path probability (EAGLE-2's expansion, SuffixDecoding's trees): expand(state) ->
    [(token, conditional probability, child state)] of a node's candidate children; the root is state
    None. The most probable open candidate joins next, so the first n nodes hold the n most probable
    continuations the expansion offers. Returns at most `budget` nodes as (parent's index in this list or
    -1, token, path probability), parents first; the probabilities' sum over the first n is the expected
    number of accepted drafts of those n when the probabilities are right. Candidates whose path
    probability falls below min_prob are never taken."""
    heap: list = []
    counter = 0

    def offer(parent_key: int, parent_prob: float, state) -> None:
        nonlocal counter
        for token, prob, child_state in expand(state):
            if parent_prob * prob < min_prob:
                continue
            counter += 1
            heapq.heappush(heap, (-parent_prob * prob, counter, parent_key, token, child_state))

    offer(-1, 1.0, None)
    chosen: list[tuple[int, int, float]] = []
    while heap and len(chosen) < budget:
        neg_prob, _, parent, token, state = heapq.heappop(heap)
        chosen.append((parent, token, -neg_prob))
        offer(len(chosen) - 1, -neg_prob, state)
    return chosen


class Calibration:
    """How often drafted nodes are accepted against the path probability their drafter gave them, learned
    online over the engine's recent trees: a drafter's probabilities (a suffix trie's counts) are not
    acceptance rates (Spec-Bench replays: nodes given ~0.5 are accepted ~0.1 of the time), and a tree sized
    by them buys rows that do not pay. Per probability bin (fifths), the ratio of nodes accepted to the
    probability given, starting from 1 (the drafter's word) and forgetting at DECAY a node."""

    BINS = 5
    DECAY = 0.998
    PRIOR = 8.0  # the starting ratio weighs as this much probability per bin

    def __init__(self) -> None:
        self.given = [self.PRIOR] * self.BINS
        self.accepted = [self.PRIOR] * self.BINS

    def _bin(self, prob: float) -> int:
        return min(int(prob * self.BINS), self.BINS - 1)

    def observe(self, probs: list[float], accepted: set[int]) -> None:
        """probs: each node's path probability as drafted; accepted: the nodes verification accepted."""
        for node, prob in enumerate(probs):
            b = self._bin(prob)
            self.given[b] = self.given[b] * self.DECAY + prob
            self.accepted[b] = self.accepted[b] * self.DECAY + (node in accepted)

    def __call__(self, prob: float) -> float:
        """The acceptance rate expected of a node drafted at path probability `prob`."""
        b = self._bin(prob)
        return min(1.0, prob * self.accepted[b] / self.given[b])


def best_size(chosen: list[tuple[int, int, float]], cost, calibration: Calibration | None = None) -> int:
    """How many of best_first's nodes to verify: n with the most expected tokens per unit of cost,
    (1 + the first n nodes' expected acceptance) / cost(n), cost(0) = 1 (a plain step); the smallest on
    ties. A node's expected acceptance is its path probability, through `calibration` where given."""
    best_n, best, expected = 0, 1.0 / cost(0), 1.0
    for n, (_, _, prob) in enumerate(chosen, 1):
        expected += calibration(prob) if calibration is not None else prob
        score = expected / cost(n)
        if score > best:
            best_n, best = n, score
    return best_n


def preorder(chosen: list[tuple[int, int, float]]) -> tuple[DraftTree, list[float]]:
    """best_first's nodes (parents first) as a DraftTree, each node's children in decreasing probability, so
    the first path is the most probable chain; with each tree node's path probability."""
    kids: dict[int, list[int]] = {}
    for i, (parent, _, _) in enumerate(chosen):
        kids.setdefault(parent, []).append(i)
    tokens, parents, probs = [], [], []
    stack = [(i, -1) for i in sorted(kids.get(-1, []), key=lambda i: chosen[i][2])]
    while stack:
        i, new_parent = stack.pop()
        tokens.append(chosen[i][1])
        parents.append(new_parent)
        probs.append(chosen[i][2])
        here = len(tokens) - 1
        stack.extend((j, here) for j in sorted(kids.get(i, []), key=lambda j: chosen[j][2]))
    return DraftTree(tuple(tokens), tuple(parents)), probs


def accepted_nodes(tree: DraftTree, tokens) -> list[int]:
    """The path of `tree` that greedy verification accepts when the sequence goes on with `tokens`."""
    path, node = [], -1
    for token in tokens:
        child = tree.children[node].get(token)
        if child is None:
            break
        path.append(child)
        node = child
    return path


class TreeChooser:
    """What a tree drafter keeps between steps: its Calibration, learned from each request's last candidate
    nodes (all of them, verified or not: greedy acceptance depends only on the tokens that come) once the
    request's next tokens are known."""

    def __init__(self) -> None:
        self.calibration = Calibration()
        self._last: dict[str, tuple[int, DraftTree, list[float]]] = {}  # history length, candidates, probs

    def score(self, req_id: str, history: list[int]) -> None:
        """The request's last candidates against the tokens that came after them."""
        last = self._last.pop(req_id, None)
        if last is not None and len(history) > last[0]:
            length, tree, probs = last
            self.calibration.observe(probs, set(accepted_nodes(tree, history[length:])))

    def choose(self, req_id: str, length: int, chosen: list[tuple[int, int, float]], costs: list[float]
               ) -> DraftTree:
        """The tree of the first n candidates (best_first order) that gives the most expected tokens per unit
        of cost (a chain, or empty, where that pays best); the candidates are kept to score. length: the
        history's."""
        self._last[req_id] = (length, *preorder(chosen))
        return preorder(chosen[:best_size(chosen, costs.__getitem__, self.calibration)])[0]

    def forget(self, req_id: str) -> None:
        self._last.pop(req_id, None)
