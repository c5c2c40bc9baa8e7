"""One request's draft tree in a target step: its rows, where their K/V go, and how attention reads them.

A request verifying a tree (spec_decode/tree.py) feeds its uncomputed tokens (the last of them is the tree's
root), then every node, in preorder. Node v sits at position root + depth(v). Each root-to-leaf path is
attended as a chain of its own (a *virtual sequence* of the attention metadata): its block table is the
request's for the blocks before the tree's first draft position, then blocks holding exactly this path's
keys at their positions. So a node's keys are summed at the same absolute positions, in the same order, as
when its path is verified as a chain: its logits are bitwise the chain's, and greedy output stays plain
decoding's.

The first path uses the request's own blocks (its drafts land where a chain's would). Every other path gets
scratch blocks from a small pool outside the scheduler's: before the forward the request's cached keys that
share the first scratch block are copied in (all layers), and every row is written to each path it is on
(AttentionMetadata.slot_rows). Preorder makes each path's own nodes (those not on an earlier path) follow
each other, so they are the virtual sequence's query rows. After verification the accepted nodes' K/V move
to the request's own slots (`accepted_moves`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.sample.draft_tree import DraftTree


@dataclass
class TreeStep:
    """One request's tree in a step, rows counted from the request's first row."""

    tree: DraftTree
    num_real: int  # uncomputed tokens fed before the nodes (the last is the root)
    positions: list[int]  # per row, its token index (root + depth for nodes)
    slots: list[int]  # per row, its home slot (the first path holding it)
    extra_writes: list[tuple[int, int]]  # (row, slot): the row's K/V copied into a later path's blocks
    block_copies: list[tuple[int, int]]  # (request's block, scratch block) to copy in every layer first
    # virtual sequences: (first row, query rows, context length, block table)
    sequences: list[tuple[int, int, int, list[int]]] = field(default_factory=list)

    def node_row(self, node: int) -> int:
        return self.num_real + node


def scratch_blocks_needed(tree: DraftTree, root: int, block_size: int) -> list[int]:
    """Per leaf (preorder), the scratch blocks its path needs: 0 for the first path, else its blocks from the
    one holding position root + 1 to the one holding its leaf."""
    first = (root + 1) // block_size
    return [0 if i == 0 else (root + tree.depths[leaf]) // block_size - first + 1
            for i, leaf in enumerate(tree.leaves)]


def fit_to_scratch(tree: DraftTree, root: int, block_size: int, available: int) -> DraftTree:
    """The longest preorder prefix of `tree` whose paths fit in `available` scratch blocks (the whole tree,
    or at least its first path)."""
    need = scratch_blocks_needed(tree, root, block_size)
    if sum(need) <= available:
        return tree
    used = 0
    for j, blocks in enumerate(need):  # the first path needs none: j > 0 where it stops
        if used + blocks > available:  # cut after the previous leaf, before this path's own nodes
            return tree.prefix(tree.leaves[j - 1] + 1)
        used += blocks
    return tree


def layout(tree: DraftTree, start: int, num_real: int, table: list[int], block_size: int,
           scratch: list[int]) -> TreeStep:
    """The rows of a request whose tokens start..start + num_real - 1 are fed this step, the last one the
    root of `tree`; scratch: free scratch block ids, taken from the front (fit_to_scratch first)."""
    root = start + num_real - 1
    positions = list(range(start, root + 1)) + [root + d for d in tree.depths]
    num_rows = len(positions)

    def real_slot(p: int) -> int:
        return table[p // block_size] * block_size + p % block_size

    slots = [real_slot(p) for p in positions]  # nodes off the first path are re-homed below
    first = (root + 1) // block_size  # the first block whose keys differ between paths
    owner_done: set[int] = set()
    extra, copies = [], []
    first_path = tree.first_path()
    sequences = [(0, num_real + len(first_path), root + 1 + len(first_path), list(table))]
    owner_done.update(first_path)
    for leaf in tree.leaves[1:]:
        path = tree.path_to(leaf)
        depth = len(path)
        count = (root + depth) // block_size - first + 1
        blocks, scratch[:] = scratch[:count], scratch[count:]
        if len(blocks) < count:
            raise RuntimeError("draft tree: out of scratch blocks (fit_to_scratch first)")
        path_table = list(table[:first]) + blocks

        def path_slot(p: int) -> int:
            return path_table[p // block_size] * block_size + p % block_size

        if first * block_size < start:  # cached keys in the first scratch block
            copies.append((table[first], blocks[0]))
        for row in range(num_real):  # this step's real tokens that share the first scratch block
            if positions[row] >= first * block_size:
                extra.append((row, path_slot(positions[row])))
        owned = [v for v in path if v not in owner_done]
        for v in path:
            row = num_real + v
            if v in owner_done:
                extra.append((row, path_slot(positions[row])))
            else:
                slots[row] = path_slot(positions[row])
        owner_done.update(owned)
        sequences.append((num_real + owned[0], len(owned), root + 1 + depth, path_table))
    assert sum(q for _, q, _, _ in sequences) == num_rows
    return TreeStep(tree, num_real, positions, slots, extra, copies, sequences)


def accepted_moves(step: TreeStep, accepted: list[int], table: list[int], block_size: int) -> list[tuple[int, int]]:
    """(from slot, to slot) bringing the accepted nodes' K/V (a path from the root, in order) to the request's
    own slots root + 1, root + 2, ...; empty when they are on the first path, already there."""
    root = step.positions[step.num_real - 1]
    moves = []
    for depth, node in enumerate(accepted, 1):
        p = root + depth
        dst = table[p // block_size] * block_size + p % block_size
        src = step.slots[step.node_row(node)]
        if src != dst:
            moves.append((src, dst))
    return moves
