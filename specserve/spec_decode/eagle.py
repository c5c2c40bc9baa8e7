"""EAGLE and EAGLE-3 proposers: one draft decoder layer over [token embedding; target feature], with its
own one-layer paged KV in the shared drafter KV cache.

Slot p of the drafter's KV holds the pair (f_p, x_{p+1}) at the target's position of token p, where f_p is
the target's feature of token p (EAGLE: its final post-norm state; EAGLE-3: fc over three aux states).
Every step the target's true features of every processed token (prompt chunks included, rejected tails
dropped) are written first, so slots a draft step filled from the drafter's own outputs are overwritten
once verified. Then, per drafting request, the last kept row gives draft 1 and k - 1 single-token steps
feed the drafter's output g back as the feature with the token just drafted, at the next positions by
the target's rule. Greedy requests get argmax drafts; sampling requests get drafts sampled from the
head's distribution under the request's sampling parameters, with those probabilities for verification.
"""
from __future__ import annotations

import torch

from specserve.models.drafter_loader import build_drafter_head, load_drafter_checkpoint
from specserve.spec_decode.drafter_kv import DrafterKVCache
from specserve.spec_decode.draw import draft_chains, draft_sampling_metadata, draw
from specserve.spec_decode.proposer import (DraftInputs, KVCacheSpec, DrafterNeeds, Drafts, TargetInfo,
                                            TargetStates)


class EagleProposer:
    def __init__(self, spec_config, target: TargetInfo) -> None:
        checkpoint = load_drafter_checkpoint(spec_config.model, spec_config.method, dtype=target.dtype)
        weight_dtype = "int8" if spec_config.quantization == "int8" else target.weight_dtype
        self.head = build_drafter_head(checkpoint, target.model, weight_dtype)
        cfg = self.head.config
        self.needs = DrafterNeeds(
            target_states=TargetStates.ALL, aux_layers=tuple(self.head.aux_layer_ids),
            kv=KVCacheSpec(1, cfg.num_key_value_heads, cfg.head_dim, self.head.dtype),
            num_lookahead_tokens=spec_config.num_speculative_tokens)

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs) -> Drafts:
        kv = inputs.drafter_kv
        g = self._write_target_features(inputs, kv)  # [T, H]: every kept row, drafting or not
        rows = [i for i, n in enumerate(inputs.num_drafts) if n > 0]
        if not rows or g is None:
            return Drafts([[] for _ in inputs.req_ids])
        last_row = {rid: inputs.cu_num_tokens[j + 1] - 1 for j, rid in enumerate(inputs.target_req_ids)}
        outputs = {}  # row -> the head's output it drafts from next

        def draw_rows(live: list[int], g: torch.Tensor):
            outputs.update(zip(live, g))
            return self._draw(inputs, live, g)

        def advance(live: list[int], last_tokens: list[int], step: int) -> torch.Tensor:
            g = torch.stack([outputs[i] for i in live])
            return self._advance(inputs, kv, live, g, last_tokens, step)

        first = g[torch.tensor([last_row[inputs.req_ids[i]] for i in rows])]  # [len(rows), H]
        return draft_chains(inputs, rows, first, draw_rows, advance)

    def _write_target_features(self, inputs: DraftInputs, kv: DrafterKVCache) -> torch.Tensor | None:
        """One draft pass over every kept target row: slot p gets (f_p, x_{p+1}); returns g [T, H]."""
        if not inputs.target_req_ids:
            return None
        tokens, query_lens, context_lens, tables = [], [], [], []
        for j, rid in enumerate(inputs.target_req_ids):
            lo, hi, start = inputs.cu_num_tokens[j], inputs.cu_num_tokens[j + 1], inputs.target_start[j]
            tokens.extend(inputs.target_token_ids[lo + 1:hi].tolist())
            tokens.append(inputs.target_next_token_ids[j])
            query_lens.append(hi - lo)
            context_lens.append(start + hi - lo)
            tables.append(inputs.block_tables[rid])
            kv.num_valid[rid] = start + hi - lo
        features = self.head.target_features(inputs.target_hidden_states, inputs.aux_hidden_states)
        meta = kv.metadata(query_lens, context_lens, tables)
        return self.head.forward(torch.tensor(tokens), features, inputs.target_positions, meta, kv.caches[0])

    def _advance(self, inputs: DraftInputs, kv: DrafterKVCache, rows: list[int], g: torch.Tensor,
                 last_tokens: list[int], step: int) -> torch.Tensor:
        """One token per request: (g, the draft just made) at token index len(history) - 1 + step."""
        index = [len(inputs.token_ids[i]) - 1 + step for i in rows]
        positions = inputs.next_positions[..., torch.tensor(rows)] + step
        tables = [inputs.block_tables[inputs.req_ids[i]] for i in rows]
        meta = kv.metadata([1] * len(rows), [p + 1 for p in index], tables)
        return self.head.forward(torch.tensor(last_tokens), g, positions, meta, kv.caches[0])

    def _draw(self, inputs: DraftInputs, rows: list[int], g: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
        """g: [len(rows), H] -> one draft per row (target ids), and q where any row samples."""
        meta = draft_sampling_metadata(inputs, rows, self.head.vocab_size)
        return draw(meta, lambda: self.head.greedy_tokens(g), lambda: self.head.logits_in_target_vocab(g))
