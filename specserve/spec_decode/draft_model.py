"""Draft-model proposer: a second, smaller model with the target's vocabulary, keeping its KV in the shared
drafter KV cache (spec_decode/drafter_kv.py).

Each step it catches up on the tokens accepted since its last call (one batched forward with ragged
queries), then runs k - 1 single-token steps. Its KV stays in step with accepted tokens: the cache's
`num_valid` is the history length at its last catch-up, so rejected draft positions are simply
overwritten next time, and a request that skipped drafting for some steps catches up on all of them at once.

A self-draft (the target's own weights, quantized) has no cache of its own: it reads the target's KV of the
history and writes its draft tokens' KV into the target's cache at the slots past the history, which the
target's verification step overwrites with its own before it reads them (the scheduler reserves those
slots as lookahead). No copy, no second pool, and nothing to catch up on but the newest token. Greedy requests get argmax drafts (one-hot q); sampling requests get drafts
sampled from the drafter's own distribution under the request's sampling parameters, and those
probabilities go to the rejection sampler, so verification stays lossless.
"""
from __future__ import annotations

import torch

from specserve.models.gguf_quant import ACTIVATION_DIGITS, QuantizedWeight, int8_activation_weights
from specserve.models.loader import load_model_weights
from specserve.models.registry import build_model
from specserve.ops.attention import paged_metadata
from specserve.ops.kernels import argmax_rows, kernel_usable
from specserve.spec_decode.draw import draft_chains, draft_sampling_metadata, draw
from specserve.spec_decode.proposer import DraftInputs, KVCacheSpec, DrafterNeeds, Drafts, TargetInfo


class DraftModelProposer:
    def __init__(self, spec_config, target: TargetInfo) -> None:
        # a GGUF drafter follows the target's storage: its blocks, multiplied as the target multiplies its own
        # (a self-draft then computes exactly the target's tokens)
        blocks = spec_config.quantization is None and target.gguf_compute is not None
        loaded = load_model_weights(spec_config.model, dtype=target.dtype, keep_quantized=blocks)
        if blocks and target.gguf_compute in ACTIVATION_DIGITS:
            loaded.state_dict = int8_activation_weights(loaded.state_dict, ACTIVATION_DIGITS[target.gguf_compute])
        weight_dtype = spec_config.quantization or target.weight_dtype
        self.model = build_model(loaded.config, loaded.state_dict, dtype=target.dtype, weight_dtype=weight_dtype)
        kv_window = getattr(target.model, "kv_window", 0)
        if kv_window:  # its KV lives in the target's block tables, whose blocks are kept only for that window
            for layer in self.model.layers:
                layer.window = min(layer.window or kv_window, kv_window)
        target_vocab, draft_vocab = target.model.config.vocab_size, self.model.config.vocab_size
        if target_vocab != draft_vocab:
            raise ValueError(f"speculative_config.model {spec_config.model!r} has a vocabulary of {draft_vocab} "
                             f"tokens; the target's has {target_vocab}: a draft model must share the tokenizer")
        self.max_position = min(target.max_model_len, self.model.config.max_position_embeddings)
        # A self-draft (the target's own weights, perhaps quantized) works in the target's KV cache: no prefill
        # of its own, and one token per catch-up.
        # (not when the target's windowed layers keep tables of their own, which the drafter is not given)
        self.shares_target_kv = _is_self_draft(self.model, target.model) and not getattr(target.model, "mixed_windows", ())
        cfg = self.model.config
        own_kv = KVCacheSpec(self.model.num_layers, cfg.num_key_value_heads, cfg.head_dim, target.kv_dtype,
                             self.model.dtype)
        self.needs = DrafterNeeds(kv=None if self.shares_target_kv else own_kv,
                                  num_lookahead_tokens=spec_config.num_speculative_tokens,
                                  reads_target_kv=self.shares_target_kv,
                                  drafting_cost=_weight_bytes_ratio(self.model, target.model))
        self.use_kernel = kernel_usable(self.model.dtype)

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs) -> Drafts:
        kv = _TargetKV(inputs.target_kv_caches, self.use_kernel) if self.shares_target_kv else inputs.drafter_kv
        rows = [i for i, n in enumerate(inputs.num_drafts)
                if n > 0 and len(inputs.token_ids[i]) + n - 1 <= self.max_position]
        if not rows:
            return Drafts([[] for _ in inputs.req_ids])
        logits = self._catch_up(inputs, kv, rows)  # [len(rows), vocab], one row per drafting request
        return draft_chains(inputs, rows, logits, lambda *args: self._draw(inputs, *args),
                            lambda live, last, step: self._advance(inputs, kv, live, last, step))

    # ---- forward passes ------------------------------------------------------------------
    def _forward(self, kv, ids: list[int], positions: torch.Tensor, query_lens: list[int],
                 context_lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        meta = kv.metadata(query_lens, context_lens, tables)
        hidden, _ = self.model.forward(torch.tensor(ids), positions, meta, kv.caches)
        last = torch.tensor(query_lens).cumsum(0) - 1
        return self.model.compute_logits(hidden[last])

    def _catch_up(self, inputs: DraftInputs, kv, rows: list[int]) -> torch.Tensor:
        """Feed each request the history tokens the drafter has not seen; [len(rows), vocab] logits. In the
        target's cache every token but the newest has its KV (the target's own) already."""
        ids, spans, qlens, clens, tables = [], [], [], [], []
        for i in rows:
            rid, history = inputs.req_ids[i], inputs.token_ids[i]
            start = len(history) - 1 if self.shares_target_kv else kv.num_valid[rid]
            ids.extend(history[start:])
            spans.append((i, start, len(history)))
            qlens.append(len(history) - start)
            clens.append(len(history))
            tables.append(inputs.block_tables[rid])
            if not self.shares_target_kv:
                kv.written(rid, len(history), inputs.block_tables[rid])
        return self._forward(kv, ids, self._positions(inputs, spans), qlens, clens, tables)

    def _positions(self, inputs: DraftInputs, spans: list[tuple[int, int, int]]) -> torch.Tensor:
        """Positions of (request row, start, end) token spans, flattened: [n], or [3, n] for an M-RoPE draft
        model (the target's positions, images included)."""
        if not self.model.uses_mrope:
            return torch.tensor([p for _, start, end in spans for p in range(start, end)], dtype=torch.long)
        return torch.cat([inputs.positions(i, start, end, mrope=True) for i, start, end in spans], dim=1)

    def _advance(self, inputs: DraftInputs, kv, rows: list[int], last_tokens: list[int],
                 step: int) -> torch.Tensor:
        """One token per request: the draft just proposed, at index len(history) + step."""
        index = [len(inputs.token_ids[i]) + step for i in rows]
        tables = [inputs.block_tables[inputs.req_ids[i]] for i in rows]
        positions = self._positions(inputs, [(i, p, p + 1) for i, p in zip(rows, index)])
        return self._forward(kv, last_tokens, positions, [1] * len(rows), [p + 1 for p in index], tables)

    def _draw(self, inputs: DraftInputs, rows: list[int], logits: torch.Tensor, allowed: torch.Tensor | None = None,
              step: int = 0) -> tuple[list[int], torch.Tensor | None]:
        """logits: [len(rows), vocab] -> one draft per row (where the grammar allows, given allowed), and q
        where any row samples."""
        meta = draft_sampling_metadata(inputs, rows, self.model.config.vocab_size)
        return draw(meta, lambda: argmax_rows(logits), lambda: logits, allowed, step)


class _TargetKV:
    """The target's KV cache seen through the drafter-cache interface (metadata and caches)."""

    def __init__(self, caches: list[tuple[torch.Tensor, torch.Tensor]], use_kernel: bool) -> None:
        self.caches, self.use_kernel = caches, use_kernel
        self.block_size = caches[0][0].shape[1]

    def metadata(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]]):
        return paged_metadata(query_lens, context_lens, block_tables, self.block_size, self.use_kernel)


def _is_self_draft(draft, target) -> bool:
    """Whether the drafter runs the target's own weights (perhaps quantized): the same layer shapes and
    the same embeddings. Only the draft's quality depends on it; verification keeps the output exact."""
    same_shapes = (draft.num_layers == target.num_layers and draft.kv_cache_shape(1, 16) == target.kv_cache_shape(1, 16)
                   and draft.dtype == target.dtype == torch.float32)
    return same_shapes and torch.equal(_dense(draft.embed_tokens), _dense(target.embed_tokens))


def _dense(weight) -> torch.Tensor:
    """An embedding as an fp32 tensor (a GGUF one kept in its blocks, dequantized)."""
    return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight


def _weight_bytes_ratio(draft, target) -> float:
    """The draft's projection bytes over the target's: a one-token step is bound by the weights it reads, so
    this is a draft token's price in target steps before it is measured (0 where the target cannot say)."""
    target_bytes = getattr(target, "linear_weight_bytes", None)
    if target_bytes is None or not target_bytes()[0]:
        return 0.0
    return draft.linear_weight_bytes()[0] / target_bytes()[0]
