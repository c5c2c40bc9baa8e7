"""How drafters grow draft trees (sample/draft_tree.py) and how many nodes they keep: candidates best-first by
path probability, a static shape (vLLM's speculative_token_tree), and the size that gives the most expected
tokens per unit of step cost, with the drafter's probabilities calibrated by the acceptance seen.
"""
from __future__ import annotations

import ast
import heapq

from specserve.sample.draft_tree import DraftTree, accepted_nodes

TREE_METHODS = ("ngram", "suffix", "eagle", "eagle3", "medusa", "auto")  # the drafters that can propose trees


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
    """best_first's nodes (parents first) as a DraftTree, each node's children in decreasing probability (ties:
    in chosen order), so the first path is the most probable chain; with each tree node's path probability."""
    kids: dict[int, list[int]] = {}
    for i, (parent, _, _) in enumerate(chosen):
        kids.setdefault(parent, []).append(i)
    tokens, parents, probs = [], [], []
    # a stack: children pushed least likely first (on ties the later chosen first), so the likeliest pops first
    stack = [(i, -1) for i in sorted(kids.get(-1, []), key=lambda i: (chosen[i][2], -i))]
    while stack:
        i, new_parent = stack.pop()
        tokens.append(chosen[i][1])
        parents.append(new_parent)
        probs.append(chosen[i][2])
        here = len(tokens) - 1
        stack.extend((j, here) for j in sorted(kids.get(i, []), key=lambda j: (chosen[j][2], -j)))
    return DraftTree(tuple(tokens), tuple(parents)), probs


class TreeChooser:
    """What a tree drafter keeps between steps: its Calibration, learned from each request's last candidate
    nodes (all of them, verified or not: greedy acceptance depends only on the tokens that come) once the
    request's next tokens are known."""

    def __init__(self) -> None:
        self.calibration = Calibration()
        self._last: dict[str, tuple[int, DraftTree, list[float]]] = {}  # history length, candidates, probs
        self.option = 0  # the drafter's index among the draft policy's options (auto sets it): whose prices

    def start(self, inputs) -> None:
        """A drafting call begins: finished requests are forgotten, the others' last candidates scored."""
        for req_id in inputs.finished_req_ids:
            self.forget(req_id)
        for req_id, history in zip(inputs.req_ids, inputs.token_ids):
            self.score(req_id, history)

    def costs(self, inputs) -> list[float]:
        """cost(n) of n drafts of this drafter, n = 0..max_tree_nodes, in plain steps."""
        return inputs.tree_costs(self.option, inputs.max_tree_nodes)

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

    def fixed(self, req_id: str, length: int, chosen: list[tuple[int, int, float]]) -> DraftTree:
        """The tree of all these candidates (a static shape's), kept to score like choose's."""
        tree, probs = preorder(chosen)
        self._last[req_id] = (length, tree, probs)
        return tree

    def forget(self, req_id: str) -> None:
        self._last.pop(req_id, None)


def parse_token_tree(spec) -> tuple[tuple[int, ...], ...]:
    """vLLM's speculative_token_tree: a list of nodes, each the path of child ranks from the root ((0,) the
    likeliest first draft, (0, 1) the second likeliest after it, ...), given as a list or its string;
    returned sorted by depth. Every node's parent must be listed too."""
    if isinstance(spec, str):
        try:
            spec = ast.literal_eval(spec)
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"speculative_token_tree must be a list of tuples of ranks, e.g. "
                             f"\"[(0,), (1,), (0, 0)]\": {exc}") from None
    if not isinstance(spec, (list, tuple)) or not spec:
        raise ValueError(f"speculative_token_tree must be a non-empty list of tuples of ranks, got {spec!r}")
    nodes = []
    for node in spec:
        if (not isinstance(node, (list, tuple)) or not node
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in node)):
            raise ValueError(f"speculative_token_tree: each node must be a non-empty tuple of ranks >= 0, got {node!r}")
        nodes.append(tuple(node))
    if len(set(nodes)) != len(nodes):
        raise ValueError("speculative_token_tree lists a node twice")
    missing = [n for n in nodes if len(n) > 1 and n[:-1] not in set(nodes)]
    if missing:
        raise ValueError(f"speculative_token_tree: node {missing[0]} is listed without its parent {missing[0][:-1]}")
    if len(nodes) > 64:
        raise ValueError(f"speculative_token_tree has {len(nodes)} nodes; at most 64")
    return tuple(sorted(nodes, key=lambda n: (len(n), n)))


def static_candidates(shape: tuple[tuple[int, ...], ...], expand, max_depth: int) -> list[tuple[int, int, float]]:
    """A static tree's nodes (parse_token_tree) realized from a drafter's candidates: node (r_1, ..., r_d) is
    the r_d-th likeliest child of node (r_1, ..., r_d-1) under expand(state) -> [(token, conditional
    probability, child state)] (state None for the root); nodes the drafter offers no such child for are left
    out with their subtrees, and so are nodes deeper than max_depth. As best_first's: (parent index, token,
    path probability), parents first."""
    placed: dict[tuple[int, ...], tuple[int, float, object]] = {(): (-1, 1.0, None)}
    offered: dict[tuple[int, ...], list] = {}
    out: list[tuple[int, int, float]] = []
    for node in shape:
        parent = placed.get(node[:-1])
        if parent is None or len(node) > max_depth:
            continue
        if node[:-1] not in offered:
            offered[node[:-1]] = sorted(expand(parent[2]), key=lambda c: -c[1])
        children = offered[node[:-1]]
        if node[-1] >= len(children):
            continue
        token, prob, state = children[node[-1]]
        out.append((parent[0], token, parent[1] * prob))
        placed[node] = (len(out) - 1, parent[1] * prob, state)
    return out


class ShapeChooser:
    """Whether trees or chains are drafted (draft_tree "auto"), by the throughput each gives on this engine:
    the step time a tree saves or costs depends on the drafter's own work (EAGLE-2 expands several nodes a
    depth), the extra verification rows and the acceptance they buy, which no price table holds together.
    Steps run in epochs of EPOCH decode steps with one shape; an epoch scores tokens emitted per second of
    its steps (all of execute_model: the forward, verification and drafting). Both shapes are tried until
    each has TRIALS epochs, then the better one (by a decaying mean) runs, and the other every EXPLORE-th
    epoch, so a change of workload or host is followed."""

    EPOCH, TRIALS, EXPLORE, KEEP = 8, 2, 6, 0.7

    def __init__(self) -> None:
        self.rate = [0.0, 0.0]  # chains, trees: decaying mean of an epoch's tokens per second
        self.epochs = [0, 0]
        self.shape = 1  # this epoch's (trees first)
        self.steps, self.tokens, self.seconds = 0, 0, 0.0
        self.count = 0  # epochs so far

    @property
    def trees(self) -> bool:
        return self.shape == 1

    def observe(self, tokens: int, seconds: float) -> None:
        """One decode step: the tokens it emitted and its time, drafting included."""
        self.steps += 1
        if self.steps == 1:  # verifies the other shape's drafts: not counted
            return
        self.tokens += tokens
        self.seconds += seconds
        if self.steps < self.EPOCH:
            return
        rate, shape = self.tokens / self.seconds if self.seconds > 0 else 0.0, self.shape
        self.rate[shape] = rate if not self.epochs[shape] else self.KEEP * self.rate[shape] + (1 - self.KEEP) * rate
        self.epochs[shape] += 1
        self.count += 1
        self.steps, self.tokens, self.seconds = 0, 0, 0.0
        if min(self.epochs) < self.TRIALS:
            self.shape = 1 - shape
        else:
            best = int(self.rate[1] > self.rate[0])
            self.shape = 1 - best if self.count % self.EXPLORE == 0 else best
