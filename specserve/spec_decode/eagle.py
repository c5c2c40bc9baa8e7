"""EAGLE and EAGLE-3 proposers: one draft decoder layer over [token embedding; target feature], with its
own one-layer paged KV in the shared drafter KV cache.

Slot p of the drafter's KV holds the pair (f_p, x_{p+1}) at the target's position of token p, where f_p is
the target's feature of token p (EAGLE: its final post-norm state; EAGLE-3: fc over three aux states).
The target's true features of processed tokens (rejected tails dropped) are written before a request
drafts, so slots a draft step filled from the drafter's own outputs are overwritten once verified. Prompt
rows are written as they are prefilled (prefix-cached blocks then carry the head's KV too); a request that
does not draft this step keeps its decode rows aside (a copy of the target's states of those tokens) and
writes them with its next drafting step's rows in the same pass, so skipping steps costs no head forward
and resuming recomputes nothing the target verified. Then, per drafting request, the last kept row gives draft 1 and k - 1 single-token steps
feed the drafter's output g back as the feature with the token just drafted, at the next positions by
the target's rule. Greedy requests get argmax drafts; sampling requests get drafts sampled from the
head's distribution under the request's sampling parameters, with those probabilities for verification.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from specserve.models.drafter_loader import build_drafter_head, load_drafter_checkpoint
from specserve.ops.attention import copy_blocks
from specserve.sample.draft_tree import DraftTree
from specserve.spec_decode.drafter_kv import DrafterKVCache
from specserve.spec_decode.draw import draft_chains, draft_sampling_metadata, draw
from specserve.spec_decode.proposer import (DraftInputs, KVCacheSpec, DrafterNeeds, Drafts, TargetInfo,
                                            TargetStates)
from specserve.spec_decode.tree import TreeChooser


# A request's deferred rows past which they are written anyway: bounds the states kept aside (EAGLE-3 keeps
# three hidden-size rows a token) to ~256 tokens a request.
MAX_DEFERRED_ROWS = 256
# Draft trees (EAGLE-2's dynamic trees): each drafted node offers its TREE_TOP_K likeliest next tokens, and
# per depth the TREE_TOP_K likeliest nodes (by path probability) are expanded.
TREE_TOP_K = 4


@dataclass
class _Rows:
    """Consecutive processed tokens of one request, with what the head needs to write their slots."""

    start: int  # token index of the first row
    tokens: list[int]  # per row p, the token p + 1 (the head's input token at slot p)
    positions: torch.Tensor  # [n] or [3, n]: the positions the target saw
    hidden: torch.Tensor | None  # [n, H] the target's final states
    aux: list[torch.Tensor] | None  # each [n, H]

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def kept(self) -> "_Rows":
        """A copy that does not hold on to the step's tensors."""
        return _Rows(self.start, self.tokens, self.positions.clone(),
                     None if self.hidden is None else self.hidden.clone(),
                     None if self.aux is None else [a.clone() for a in self.aux])


class EagleProposer:
    def __init__(self, spec_config, target: TargetInfo) -> None:
        checkpoint = load_drafter_checkpoint(spec_config.model, spec_config.method, dtype=target.dtype)
        weight_dtype = spec_config.quantization or target.weight_dtype
        self.head = build_drafter_head(checkpoint, target.model, weight_dtype)
        # its KV lives in the target's block tables: it sees the window the target's blocks are kept for
        self.head.layer.window = getattr(target.model, "kv_window", 0)
        cfg = self.head.config
        self.needs = DrafterNeeds(
            target_states=TargetStates.ALL, aux_layers=tuple(self.head.aux_layer_ids),
            kv=KVCacheSpec(1, cfg.num_key_value_heads, cfg.head_dim, target.kv_dtype, self.head.dtype),
            num_lookahead_tokens=spec_config.num_speculative_tokens)
        self.deferred: dict[str, list[_Rows]] = {}  # per request, rows not written yet (no drafting since)
        self.trees = TreeChooser()

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs) -> Drafts:
        kv = inputs.drafter_kv
        for rid in inputs.finished_req_ids:
            self.deferred.pop(rid, None)
        self.trees.start(inputs)
        rows = [i for i, n in enumerate(inputs.num_drafts) if n > 0]
        g, last_row = self._write_target_features(inputs, kv, {inputs.req_ids[i] for i in rows})
        if not rows:
            return Drafts([[] for _ in inputs.req_ids])
        first = g[torch.tensor([last_row[inputs.req_ids[i]] for i in rows])]  # [len(rows), H]
        tree_rows = self._tree_rows(inputs, kv, rows)
        if tree_rows:  # EAGLE-2 trees for these; chains (below) for the others
            trees = self._draft_trees(inputs, kv, tree_rows, first[torch.tensor([rows.index(i) for i in tree_rows])])
            keep = [j for j, i in enumerate(rows) if i not in trees]
            chains = self._draft_chains(inputs, kv, [rows[j] for j in keep], first[torch.tensor(keep, dtype=torch.long)])
            for i, tree in trees.items():
                chains.token_ids[i] = list(tree.tokens)
            chains.trees = [trees[i] if i in trees and not trees[i].is_chain else None
                            for i in range(len(inputs.req_ids))]
            return chains
        return self._draft_chains(inputs, kv, rows, first)

    def _draft_chains(self, inputs: DraftInputs, kv: DrafterKVCache, rows: list[int], first: torch.Tensor) -> Drafts:
        """Chains for requests `rows`, drafted from the head's outputs first [len(rows), H]: in one C call where
        every row is greedy without a grammar (the same drafts), else a step at a time."""
        kernel = getattr(self.head, "chains_kernel", lambda _: None)(kv.caches[0]) if rows else None
        if kernel is not None and inputs.allowed_next is None and inputs.next_positions.dim() == 1 \
                and all(inputs.sampling_params[i].is_greedy for i in rows):
            chains = self.head.draft_chains(
                kernel, first, [inputs.num_drafts[i] for i in rows], inputs.next_positions[rows].tolist(),
                [len(inputs.token_ids[i]) for i in rows], [inputs.block_tables[inputs.req_ids[i]] for i in rows],
                kv.block_size)
            drafts: list[list[int]] = [[] for _ in inputs.req_ids]
            for i, chain in zip(rows, chains):
                drafts[i] = chain
            return Drafts(drafts, [None] * len(inputs.req_ids))
        outputs = {}  # row -> the head's output it drafts from next

        def draw_rows(live: list[int], g: torch.Tensor, allowed: torch.Tensor | None, step: int):
            outputs.update(zip(live, g))
            return self._draw(inputs, live, g, allowed, step)

        def advance(live: list[int], last_tokens: list[int], step: int) -> torch.Tensor:
            g = torch.stack([outputs[i] for i in live])
            return self._advance(inputs, kv, live, g, last_tokens, step)

        return draft_chains(inputs, rows, first, draw_rows, advance)

    def _tree_rows(self, inputs: DraftInputs, kv: DrafterKVCache, rows: list[int]) -> list[int]:
        """The requests of `rows` that draft trees: trees asked for, no grammar, as many as the scratch
        blocks hold (each expanded node's path takes up to two)."""
        if inputs.tree_costs is None or not kv.tree_scratch:
            return []
        width = TREE_TOP_K
        if inputs.tree_shape:  # a static shape expands its nodes that have children
            width = max(width, max(Counter(len(n) for n in _expandable(inputs.tree_shape)).values(), default=0))
        fit = len(kv.tree_scratch) // (4 * width)  # this depth's paths and the next's
        return [i for i in rows if inputs.wants_tree(i)][:fit]

    def _draft_trees(self, inputs: DraftInputs, kv: DrafterKVCache, rows: list[int], g: torch.Tensor
                     ) -> dict[int, DraftTree]:
        """EAGLE-2's dynamic trees for requests `rows` from the head's outputs g [len(rows), H]: candidates
        grow a depth at a time (each expanded node's TREE_TOP_K likeliest tokens under the head, the
        TREE_TOP_K likeliest nodes of the depth expanded next, all requests' in one head pass), up to each
        request's num_drafts deep and max_tree_nodes candidates; then TreeChooser keeps the likeliest
        candidates as far as they pay. An expanded node attends to the context and its ancestors only: its
        path is a sequence of its own in the head's KV, its ancestors in scratch blocks (tree_step's scheme),
        copied from its parent's. Drafts are top-k tokens (q one-hot), so verification stays lossless for
        sampling requests too. With a static shape (inputs.tree_shape), exactly its nodes are grown (node
        (r_1, ..., r_d): the r_d-th likeliest child of its parent) and verified, up to num_drafts deep."""
        bs, shape = kv.block_size, inputs.tree_shape
        width = max(TREE_TOP_K, 1 + max(max(n) for n in shape)) if shape else TREE_TOP_K
        # per request: candidates (parent candidate or -1, token, path probability) with their rank paths,
        # and the frontier: (request, candidate, its depth, the head output it is drawn from, its path's tail
        # blocks)
        cands: dict[int, list[tuple[int, int, float]]] = {i: [] for i in rows}
        ranks: dict[int, list[tuple[int, ...]]] = {i: [] for i in rows}
        frontier = [(i, -1, 0, g[j], []) for j, i in enumerate(rows)]  # the root: draws depth 1
        free = list(kv.tree_scratch)
        while frontier:
            outputs = torch.stack([f[3] for f in frontier])
            probs = self.head.compute_logits(outputs).softmax(-1)
            top_p, top_ids = probs.topk(min(width, probs.shape[-1]), dim=-1)
            top_ids = self.head.draft_to_target(top_ids)
            grown: dict[int, list[int]] = {}
            for (i, node, depth, _, _), ps, ids in zip(frontier, top_p.tolist(), top_ids.tolist()):
                base, path = (cands[i][node][2], ranks[i][node]) if node >= 0 else (1.0, ())
                for rank, (p, t) in enumerate(zip(ps, ids)):
                    if shape is not None and path + (rank,) not in shape:
                        continue
                    cands[i].append((node, t, base * p))
                    ranks[i].append(path + (rank,))
                    grown.setdefault(i, []).append(len(cands[i]) - 1)
            if shape is not None:  # the nodes with children in the shape
                expandable = _expandable(shape)
                grown = {i: [c for c in new if ranks[i][c] in expandable] for i, new in grown.items()}
            frontier = self._expand(inputs, kv, frontier, cands, grown, free, bs)
        if shape is not None:
            return {i: self.trees.fixed(inputs.req_ids[i], len(inputs.token_ids[i]), cands[i]) for i in rows}
        trees = {}
        costs = None
        for i in rows:
            order = sorted(range(len(cands[i])), key=lambda c: -cands[i][c][2])[:inputs.max_tree_nodes]
            order = _parents_first(order, cands[i])
            index = {c: n for n, c in enumerate(order)}
            chosen = [(index[cands[i][c][0]] if cands[i][c][0] >= 0 else -1, cands[i][c][1], cands[i][c][2])
                      for c in order]
            costs = costs or self.trees.costs(inputs)
            trees[i] = self.trees.choose(inputs.req_ids[i], len(inputs.token_ids[i]), chosen, costs)
        return trees

    def _expand(self, inputs: DraftInputs, kv: DrafterKVCache, frontier, cands, grown, free: list[int], bs: int):
        """The next frontier: per request the TREE_TOP_K likeliest candidates just grown (a static shape: all
        of `grown`) while within its draft length, fed through the head in one pass, each on its own path's
        blocks."""
        nxt = []
        for i, new in grown.items():
            depth = next(f[2] for f in frontier if f[0] == i) + 1
            if depth >= inputs.num_drafts[i]:
                continue
            parents = {f[1]: f for f in frontier if f[0] == i}
            keep = len(new) if inputs.tree_shape is not None else TREE_TOP_K
            for c in sorted(new, key=lambda c: -cands[i][c][2])[:keep]:
                nxt.append((i, c, depth, parents[cands[i][c][0]]))
        if not nxt:
            for f in frontier:
                free.extend(f[4])
            return []
        copies, tables, tails = [], [], []
        for i, c, depth, parent in nxt:
            root = len(inputs.token_ids[i]) - 1  # the newest token; the node is fed at index root + depth - 1
            first = root // bs
            table = inputs.block_tables[inputs.req_ids[i]]
            count = (root + depth - 1) // bs - first + 1
            tail, free[:] = free[:count], free[count:]
            sources = parent[4] or [table[first]]  # the parent's path, or the request's own block
            copies.extend(zip(sources, tail))
            path_table = list(table[:first]) + tail
            tables.append(path_table)
            tails.append(tail)
        copy_blocks(kv.caches, copies)
        for f in frontier:
            free.extend(f[4])
        meta = kv.metadata([1] * len(nxt), [len(inputs.token_ids[i]) + d - 1 for i, _, d, _ in nxt], tables)
        tokens = torch.tensor([cands[i][c][1] for i, c, _, _ in nxt])
        hidden = torch.stack([parent[3] for _, _, _, parent in nxt])
        positions = torch.cat([inputs.next_positions[..., i:i + 1] + d - 1 for i, _, d, _ in nxt], dim=-1)
        out = self.head.forward(tokens, hidden, positions, meta, kv.caches[0])
        return [(i, c, depth, out[n], tail) for n, ((i, c, depth, _), tail) in enumerate(zip(nxt, tails))]

    def _write_target_features(self, inputs: DraftInputs, kv: DrafterKVCache, drafting: set[str]
                               ) -> tuple[torch.Tensor | None, dict[str, int]]:
        """One head pass over the rows to write now: every drafting request's (deferred ones first), and
        prompt rows; other requests' rows are deferred. Slot p gets (f_p, x_{p+1}). Returns g [T, H] of the
        written rows and each written request's last row in it."""
        num_prompt = dict(zip(inputs.req_ids, inputs.num_prompt_tokens))
        writes = []
        for j, rid in enumerate(inputs.target_req_ids):
            pending = self.deferred.pop(rid, [])
            current = self._rows(inputs, j)
            if pending and pending[-1].end != current.start:  # rescheduled after preemption: the KV is gone
                pending = []
            pending.append(current)
            size = sum(len(r.tokens) for r in pending)
            prompt_rows = current.start < num_prompt.get(rid, current.end + 1)
            if rid in drafting or prompt_rows or size > MAX_DEFERRED_ROWS:
                writes.append((rid, pending))
            else:
                self.deferred[rid] = pending[:-1] + [current.kept()]  # the earlier rows are kept copies already
        if not writes:
            return None, {}
        chunks = [r for _, pending in writes for r in pending]
        query_lens = [sum(len(r.tokens) for r in pending) for _, pending in writes]
        context_lens = [pending[0].start + n for (_, pending), n in zip(writes, query_lens)]
        for (rid, _), end in zip(writes, context_lens):
            kv.written(rid, end, inputs.block_tables[rid])
        hidden = None if chunks[0].hidden is None else torch.cat([r.hidden for r in chunks])
        aux = None if chunks[0].aux is None else [torch.cat(parts) for parts in zip(*(r.aux for r in chunks))]
        features = self.head.target_features(hidden, aux)
        meta = kv.metadata(query_lens, context_lens, [inputs.block_tables[rid] for rid, _ in writes])
        tokens = torch.tensor([t for r in chunks for t in r.tokens])
        positions = torch.cat([r.positions for r in chunks], dim=-1)
        g = self.head.forward(tokens, features, positions, meta, kv.caches[0])
        ends = torch.tensor(query_lens).cumsum(0) - 1
        return g, {rid: int(e) for (rid, _), e in zip(writes, ends)}

    @staticmethod
    def _rows(inputs: DraftInputs, j: int) -> _Rows:
        """Target request j's rows of this step."""
        lo, hi = inputs.cu_num_tokens[j], inputs.cu_num_tokens[j + 1]
        tokens = inputs.target_token_ids[lo + 1:hi].tolist() + [inputs.target_next_token_ids[j]]
        hidden = None if inputs.target_hidden_states is None else inputs.target_hidden_states[lo:hi]
        aux = None if inputs.aux_hidden_states is None else [a[lo:hi] for a in inputs.aux_hidden_states]
        return _Rows(inputs.target_start[j], tokens, inputs.target_positions[..., lo:hi], hidden, aux)

    def _advance(self, inputs: DraftInputs, kv: DrafterKVCache, rows: list[int], g: torch.Tensor,
                 last_tokens: list[int], step: int) -> torch.Tensor:
        """One token per request: (g, the draft just made) at token index len(history) - 1 + step."""
        index = [len(inputs.token_ids[i]) - 1 + step for i in rows]
        positions = inputs.next_positions[..., torch.tensor(rows)] + step
        tables = [inputs.block_tables[inputs.req_ids[i]] for i in rows]
        meta = kv.metadata([1] * len(rows), [p + 1 for p in index], tables)
        return self.head.forward(torch.tensor(last_tokens), g, positions, meta, kv.caches[0])

    def _draw(self, inputs: DraftInputs, rows: list[int], g: torch.Tensor, allowed: torch.Tensor | None = None,
              step: int = 0) -> tuple[list[int], torch.Tensor | None]:
        """g: [len(rows), H] -> one draft per row (target ids; where the grammar allows, given allowed), and q
        where any row samples."""
        meta = draft_sampling_metadata(inputs, rows, self.head.vocab_size)
        return draw(meta, lambda: self.head.greedy_tokens(g), lambda: self.head.logits_in_target_vocab(g), allowed,
                    step)


def _expandable(shape: tuple[tuple[int, ...], ...]) -> set[tuple[int, ...]]:
    """The nodes of a static shape that have children in it."""
    return {node[:-1] for node in shape if len(node) > 1}


def _parents_first(order: list[int], cands: list[tuple[int, int, float]]) -> list[int]:
    """Candidates `order` (likeliest first) with each one's missing ancestors pulled in before it and the
    list cut back to its length: a parent is never less likely than its child, but ties may order them
    either way."""
    out, seen = [], set()
    for c in order:
        chain = []
        while c >= 0 and c not in seen:
            chain.append(c)
            c = cands[c][0]
        for a in reversed(chain):
            seen.add(a)
            out.append(a)
    return out[:len(order)]
