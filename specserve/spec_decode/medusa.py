"""Medusa proposer: K heads over the target's final post-norm hidden state of the last accepted token.

No draft pass and no KV: from h_t (the state whose logits gave the token sampled last, x_{t+1}), head k
predicts x_{t+1+k}, so one call gives up to K drafts per request, each from its own head's distribution.
Greedy requests get each head's argmax; sampling requests get one sample per head, with that head's
probabilities for verification (each draft is drawn from a distribution fixed before it is drawn, which
is all lossless verification needs).

With draft trees (Medusa's tree candidates), a request's node at depth d offers head d's TREE_TOP_K likeliest
tokens, whatever its ancestors (the heads do not read the drafts), each node at the product of its path's
head probabilities; TreeChooser keeps the likeliest nodes as far as they pay. Candidates are fixed tokens
(q one-hot), so verification stays lossless for sampling requests too.
"""
from __future__ import annotations

import torch

from specserve.models.drafter_loader import build_drafter_head, load_drafter_checkpoint
from specserve.spec_decode.draw import draft_sampling_metadata, draw
from specserve.spec_decode.proposer import DraftInputs, DrafterNeeds, Drafts, TargetInfo, TargetStates
from specserve.spec_decode.tree import TreeChooser, best_first, static_candidates

TREE_TOP_K = 4  # candidates each head offers at its depth


class MedusaProposer:
    def __init__(self, spec_config, target: TargetInfo) -> None:
        checkpoint = load_drafter_checkpoint(spec_config.model, "medusa", dtype=target.dtype)
        weight_dtype = spec_config.quantization or target.weight_dtype
        self.heads = build_drafter_head(checkpoint, target.model, weight_dtype)
        if spec_config.num_speculative_tokens > self.heads.num_heads:
            raise ValueError(f"speculative_config.num_speculative_tokens {spec_config.num_speculative_tokens} "
                             f"exceeds the {self.heads.num_heads} heads of {spec_config.model!r}: one draft per head")
        self.needs = DrafterNeeds(target_states=TargetStates.ACCEPTED)
        self.trees = TreeChooser()

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs) -> Drafts:
        drafts: list[list[int]] = [[] for _ in inputs.req_ids]
        probs: list[torch.Tensor | None] = [None] * len(inputs.req_ids)
        self.trees.start(inputs)
        rows = [i for i, n in enumerate(inputs.num_drafts) if n > 0]
        if not rows:
            return Drafts(drafts)
        # inputs.target_req_ids is inputs.req_ids here: the last kept row of request i ends at cu[i + 1]
        last = torch.tensor([inputs.cu_num_tokens[i + 1] - 1 for i in rows])
        states = self.heads.head_states(inputs.target_hidden_states[last])  # [K, len(rows), H]
        trees = {}
        if inputs.tree_costs is not None:
            tree_rows = [j for j, i in enumerate(rows) if inputs.wants_tree(i)]
            trees = self._trees(inputs, [rows[j] for j in tree_rows], states[:, tree_rows])
            states = states[:, [j for j, i in enumerate(rows) if i not in trees]]  # the chains' columns
            rows = [i for i in rows if i not in trees]
        head_probs: dict[int, list[torch.Tensor]] = {}
        for k in range(max((inputs.num_drafts[i] for i in rows), default=0)):
            # only requests wanting a k-th draft draw one
            live = [j for j, i in enumerate(rows) if inputs.num_drafts[i] > k]
            state = states[k][torch.tensor(live)]
            meta = draft_sampling_metadata(inputs, [rows[j] for j in live], self.heads.vocab_size)
            tokens, q = draw(meta, lambda: self.heads.head_argmax(k, state), lambda: self.heads.head_logits(k, state),
                             step=k)
            for n, j in enumerate(live):
                drafts[rows[j]].append(tokens[n])
                if q is not None and not inputs.sampling_params[rows[j]].is_greedy:
                    head_probs.setdefault(rows[j], []).append(q[n])
        for i, q in head_probs.items():
            probs[i] = torch.stack(q)
        for i, tree in trees.items():
            drafts[i] = list(tree.tokens)
        return Drafts(drafts, probs, trees=[trees[i] if i in trees and not trees[i].is_chain else None
                                           for i in range(len(inputs.req_ids))] if trees else None)

    def _trees(self, inputs: DraftInputs, rows: list[int], states: torch.Tensor) -> dict:
        """Medusa's tree candidates for requests `rows` (states: [K, len(rows), H] the heads' states)."""
        if not rows:
            return {}
        depth = max(inputs.num_drafts[i] for i in rows)
        shape = inputs.tree_shape
        width = max(TREE_TOP_K, 1 + max(max(node) for node in shape)) if shape else TREE_TOP_K
        top = [self.heads.head_logits(k, states[k]).softmax(-1).topk(width, dim=-1) for k in range(depth)]
        costs = self.trees.costs(inputs)
        trees = {}
        for j, i in enumerate(rows):
            options = [list(zip(top[k].indices[j].tolist(), top[k].values[j].tolist())) for k in range(depth)]

            def expand(d, cap=inputs.num_drafts[i], options=options):
                d = d or 0
                return [(t, p, d + 1) for t, p in options[d] if p > 0] if d < cap else []

            length = len(inputs.token_ids[i])
            if shape is not None:
                trees[i] = self.trees.fixed(inputs.req_ids[i], length,
                                            static_candidates(shape, expand, inputs.num_drafts[i]))
            else:
                trees[i] = self.trees.choose(inputs.req_ids[i], length, best_first(expand, inputs.max_tree_nodes),
                                             costs)
        return trees
