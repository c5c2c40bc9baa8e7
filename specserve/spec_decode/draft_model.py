"""Draft-model proposer: a second, smaller model with the target's vocabulary and its own paged KV cache.

Each step it catches up on the tokens accepted since its last call (one batched forward with ragged
queries), then runs k - 1 single-token steps. Its KV stays in step with accepted tokens: the drafter's
`num_computed` is the history length at its last catch-up, so rejected draft positions are simply
overwritten next time. Greedy requests get argmax drafts (one-hot q); sampling requests get drafts
sampled from the drafter's own distribution under the request's sampling parameters, and those
probabilities go to the rejection sampler, so verification stays lossless.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.models.loader import load_model_weights
from specserve.models.registry import build_model
from specserve.sample.metadata import SamplingMetadata
from specserve.sample.sampler import compute_probs, random_sample
from specserve.spec_decode.proposer import DraftInputs, Drafts
from specserve.ops.attention import build_attention_metadata, kv_caches
from specserve.ops.kernels import argmax_rows, copy_kv_rows, kernel_usable, pointer_array


@dataclass
class _DraftRequest:
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # history tokens whose KV the drafter holds
    num_copied: int = 0  # self-draft: history tokens whose KV is the target's (the rest the drafter's own)


class DraftModelProposer:
    def __init__(self, spec_config, target_model, ctx: dict) -> None:
        loaded = load_model_weights(spec_config.model, dtype=ctx["dtype"])
        weight_dtype = "int8" if spec_config.quantization == "int8" else ctx.get("weight_dtype")
        self.model = build_model(loaded.config, loaded.state_dict, dtype=ctx["dtype"], weight_dtype=weight_dtype)
        target_vocab, draft_vocab = target_model.config.vocab_size, self.model.config.vocab_size
        if target_vocab != draft_vocab:
            raise ValueError(f"speculative_config.model {spec_config.model!r} has a vocabulary of {draft_vocab} "
                             f"tokens; the target's has {target_vocab}: a draft model must share the tokenizer")
        self.max_position = min(ctx["max_model_len"], self.model.config.max_position_embeddings)
        self.block_size = ctx["block_size"]
        num_blocks = -(-self.max_position // self.block_size) * 2 + ctx["num_blocks"]
        shape = self.model.kv_cache_shape(num_blocks, self.block_size)
        self.kv_caches = kv_caches(shape, self.model.dtype, self.model.num_layers)
        self.attention_kernel = kernel_usable(self.model.dtype)
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.requests: dict[str, _DraftRequest] = {}
        # A self-draft (the target's own weights, perhaps quantized) takes the target's verified KV for the
        # history instead of recomputing it: no prefill of its own, and one token per catch-up.
        self.copies_target_kv = _is_self_draft(self.model, target_model) and kernel_usable(self.model.dtype)
        self._copy_pointers: tuple | None = None  # (the target's cache tensors, dst, src pointer arrays)

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs) -> Drafts:
        for rid in inputs.finished_req_ids:
            self._free(rid)
        rows = [i for i, n in enumerate(inputs.num_drafts) if n > 0 and self._reserve(inputs, i)]
        drafts: list[list[int]] = [[] for _ in inputs.req_ids]
        probs: list[torch.Tensor | None] = [None] * len(inputs.req_ids)
        if not rows:
            return Drafts(drafts)
        logits = self._catch_up(inputs, rows)  # [len(live), vocab], one row per live request
        step_probs: dict[int, list[torch.Tensor]] = {i: [] for i in rows}
        live, step = rows, 0
        while live:
            # Only rows still drafting draw, so a seeded request's draws never depend on its batch-mates.
            tokens, p = self._draw(logits, self._sampling_metadata(inputs, live))
            for j, i in enumerate(live):
                drafts[i].append(tokens[j])
                if p is not None:
                    step_probs[i].append(p[j])
            keep = [j for j, i in enumerate(live) if len(drafts[i]) < inputs.num_drafts[i]]
            live = [live[j] for j in keep]
            if live:
                logits = self._advance(inputs, live, [drafts[i][-1] for i in live], step)
            step += 1
        for i in rows:
            if step_probs[i] and not inputs.sampling_params[i].is_greedy:
                probs[i] = torch.stack(step_probs[i])
        return Drafts(drafts, probs)

    # ---- KV bookkeeping ------------------------------------------------------------------
    def _free(self, rid: str) -> None:
        state = self.requests.pop(rid, None)
        if state is not None:
            self.free_blocks.extend(reversed(state.block_ids))

    def _reserve(self, inputs: DraftInputs, i: int) -> bool:
        """Blocks for the history plus k - 1 drafted positions; False (no drafts) when out of room."""
        state = self.requests.setdefault(inputs.req_ids[i], _DraftRequest())
        needed_tokens = len(inputs.token_ids[i]) + inputs.num_drafts[i] - 1
        if needed_tokens > self.max_position:
            return False
        needed = -(-needed_tokens // self.block_size) - len(state.block_ids)
        if needed > len(self.free_blocks):
            return False
        state.block_ids.extend(self.free_blocks.pop() for _ in range(max(needed, 0)))
        return True

    # ---- forward passes ------------------------------------------------------------------
    def _forward(self, ids: list[int], positions: list[int], query_lens: list[int], context_lens: list[int],
                 tables: list[list[int]]) -> torch.Tensor:
        bs = self.block_size
        slots = []
        for qlen, clen, table in zip(query_lens, context_lens, tables):
            slots.extend(table[p // bs] * bs + p % bs for p in range(clen - qlen, clen))
        slot_mapping = torch.tensor(slots, dtype=torch.long)
        meta = build_attention_metadata(query_lens, context_lens, tables, bs, slot_mapping, self.attention_kernel)
        hidden, _ = self.model.forward(torch.tensor(ids), torch.tensor(positions), meta, self.kv_caches)
        last = torch.tensor(query_lens).cumsum(0) - 1
        return self.model.compute_logits(hidden[last])

    def _catch_up(self, inputs: DraftInputs, rows: list[int]) -> torch.Tensor:
        """Feed each request the history tokens the drafter has not seen; [len(rows), vocab] logits.

        A self-draft first copies the target's KV of those tokens but the last, then feeds just that one."""
        if self.copies_target_kv and inputs.target_kv_caches is not None:
            self._copy_target_kv(inputs, rows)
        ids, positions, qlens, clens, tables = [], [], [], [], []
        for i in rows:
            state = self.requests[inputs.req_ids[i]]
            history = inputs.token_ids[i]
            new = history[state.num_computed:]
            ids.extend(new)
            positions.extend(range(state.num_computed, len(history)))
            qlens.append(len(new))
            clens.append(len(history))
            tables.append(state.block_ids)
            state.num_computed = len(history)
        return self._forward(ids, positions, qlens, clens, tables)

    def _copy_target_kv(self, inputs: DraftInputs, rows: list[int]) -> None:
        """KV of positions [num_copied, len(history) - 1) from the target's cache into the drafter's."""
        bs, src, dst = self.block_size, [], []
        for i in rows:
            state = self.requests[inputs.req_ids[i]]
            target_table, table = inputs.block_ids[i], state.block_ids
            verified = len(inputs.token_ids[i]) - 1  # the newest token has no KV in the target yet
            positions = range(state.num_copied, verified)
            src.extend(target_table[p // bs] * bs + p % bs for p in positions)
            dst.extend(table[p // bs] * bs + p % bs for p in positions)
            state.num_copied = verified  # also replaces what the drafter computed itself for these
            state.num_computed = max(state.num_computed, verified)
        if not src:
            return
        source = tuple(t for pair in inputs.target_kv_caches for t in pair)
        cached = self._copy_pointers
        if cached is None or len(cached[0]) != len(source) or any(a is not b for a, b in zip(cached[0], source)):
            # holding the target's tensors keeps their memory from being freed and reused under the pointers
            mine = [t for pair in self.kv_caches for t in pair]
            self._copy_pointers = (source, pointer_array(mine), pointer_array(list(source)))
        row_floats = self.kv_caches[0][0].shape[2] * self.kv_caches[0][0].shape[3]
        copy_kv_rows(self._copy_pointers[1], self._copy_pointers[2], torch.tensor(dst), torch.tensor(src), row_floats,
                     bs)

    def _advance(self, inputs: DraftInputs, rows: list[int], last_tokens: list[int], step: int) -> torch.Tensor:
        """One token per request: the draft just proposed, at position len(history) + step."""
        positions = [len(inputs.token_ids[i]) + step for i in rows]
        tables = [self.requests[inputs.req_ids[i]].block_ids for i in rows]
        return self._forward(last_tokens, positions, [1] * len(rows), [p + 1 for p in positions], tables)

    # ---- drawing -------------------------------------------------------------------------
    def _sampling_metadata(self, inputs: DraftInputs, rows: list[int]) -> SamplingMetadata:
        return SamplingMetadata.build(
            params=[inputs.sampling_params[i] for i in rows],
            output_token_ids=[inputs.token_ids[i][inputs.num_prompt_tokens[i]:] for i in rows],
            prompt_token_ids=[inputs.token_ids[i][: inputs.num_prompt_tokens[i]] for i in rows],
            generators=[inputs.generators[i] for i in rows],
            eos_token_ids=set(),
            vocab_size=self.model.config.vocab_size,
        )

    @staticmethod
    def _draw(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[list[int], torch.Tensor | None]:
        """Greedy rows: argmax; sampling rows: a sample from the drafter's shaped distribution q."""
        if meta.all_greedy:
            return argmax_rows(logits).tolist(), None
        probs = compute_probs(logits, meta)  # [rows, vocab]; greedy rows are one-hot
        return random_sample(probs, meta.generators).tolist(), probs


def _is_self_draft(draft, target) -> bool:
    """Whether the drafter runs the target's own weights (perhaps quantized): the same layer shapes and
    the same embeddings. Only the draft's quality depends on it; verification keeps the output exact."""
    same_shapes = (draft.num_layers == target.num_layers and draft.kv_cache_shape(1, 16) == target.kv_cache_shape(1, 16)
                   and draft.dtype == target.dtype == torch.float32)
    return same_shapes and torch.equal(draft.embed_tokens, target.embed_tokens)
