"""Draft trees: several continuations verified in one step (SpecInfer, Miao et al. 2023; Medusa; EAGLE-2).

A tree's nodes are draft tokens in depth-first preorder; node i's parent is an earlier node or -1, the step's
input token (the root: the request's newest token, at depth 0). Siblings carry distinct tokens, so a node is
one candidate continuation. Preorder keeps every prefix of the node list a tree (the scheduler may cut drafts
short) and puts each root-to-leaf path's own nodes next to each other, so each path is verified as a chain
(worker/tree_step.py). A chain of k drafts is the tree whose node i has parent i - 1. How drafters grow and
size trees: spec_decode/tree.py.
"""
from __future__ import annotations

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
