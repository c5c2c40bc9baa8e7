"""Medusa proposer: K heads over the target's final post-norm hidden state of the last accepted token.

No draft pass and no KV: from h_t (the state whose logits gave the token sampled last, x_{t+1}), head k
predicts x_{t+1+k}, so one call gives up to K drafts per request, each from its own head's distribution.
Greedy requests get each head's argmax; sampling requests get one sample per head, with that head's
probabilities for verification (each draft is drawn from a distribution fixed before it is drawn, which
is all lossless verification needs).
"""
from __future__ import annotations

import torch

from specserve.models.drafter_loader import build_drafter_head, load_drafter_checkpoint
from specserve.spec_decode.draw import draft_sampling_metadata, draw
from specserve.spec_decode.proposer import DraftInputs, DrafterNeeds, Drafts, TargetInfo, TargetStates


class MedusaProposer:
    def __init__(self, spec_config, target: TargetInfo) -> None:
        checkpoint = load_drafter_checkpoint(spec_config.model, "medusa", dtype=target.dtype)
        weight_dtype = "int8" if spec_config.quantization == "int8" else target.weight_dtype
        self.heads = build_drafter_head(checkpoint, target.model, weight_dtype)
        if spec_config.num_speculative_tokens > self.heads.num_heads:
            raise ValueError(f"speculative_config.num_speculative_tokens {spec_config.num_speculative_tokens} "
                             f"exceeds the {self.heads.num_heads} heads of {spec_config.model!r}: one draft per head")
        self.needs = DrafterNeeds(target_states=TargetStates.ACCEPTED)

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs) -> Drafts:
        drafts: list[list[int]] = [[] for _ in inputs.req_ids]
        probs: list[torch.Tensor | None] = [None] * len(inputs.req_ids)
        rows = [i for i, n in enumerate(inputs.num_drafts) if n > 0]
        if not rows:
            return Drafts(drafts)
        # inputs.target_req_ids is inputs.req_ids here: the last kept row of request i ends at cu[i + 1]
        last = torch.tensor([inputs.cu_num_tokens[i + 1] - 1 for i in rows])
        states = self.heads.head_states(inputs.target_hidden_states[last])  # [K, len(rows), H]
        head_probs: dict[int, list[torch.Tensor]] = {}
        for k in range(max(inputs.num_drafts[i] for i in rows)):
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
        return Drafts(drafts, probs)
