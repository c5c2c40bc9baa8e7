"""The model runner: one `execute_model` per engine step over a flattened batch with a paged KV cache.

execute_model prepares inputs, runs the target, samples (or verifies drafts) and hands all drafting to
`propose_draft_token_ids` (worker/drafting.py), which builds one DraftInputs and calls one Proposer.
"""
from __future__ import annotations

import logging
import time

import torch

from specserve.models.linear import int8_workloads
from specserve.ops import int8_routes
from specserve.ops.attention import copy_blocks, copy_slots, kv_caches, slot_ids
from specserve.ops.kernels import kernel_usable
from specserve.ops.kv_cache import kv_storage_dtype
from specserve.sample.metadata import SamplingMetadata
from specserve.sample.draft_tree import DraftTree
from specserve.sample.rejection_sampler import RejectionSampler, verify_argmax_targets
from specserve.sample.sampler import Sampler
from specserve.sample.spec_metadata import build_spec_decode_metadata, logits_indices
from specserve.sample.tree_verify import trees_of, verify_tree_argmax, verify_tree_random
from specserve.spec_decode.drafter_kv import DrafterKVCache
from specserve.spec_decode.policy import DraftOption, DraftPolicy
from specserve.spec_decode.proposer import DrafterNeeds, KVCacheSpec, Proposer, TargetInfo, make_proposer
from specserve.spec_decode.tree import ShapeChooser
from specserve.types import RequestFailure, SchedulerOutput
from specserve.worker.calibration import StepCalibrator
from specserve.worker.drafting import DraftingMixin
from specserve.worker.input_batch import (CachedRequestState, InputBatch, ModelRunnerOutput, StepRows,
                                          with_image_positions)
from specserve.worker.structured import GrammarRequests
from specserve.worker.threads import ThreadPolicy
from specserve.worker.tree_step import TreeStep, accepted_moves, fit_to_scratch, layout

# Scratch blocks for draft trees' paths other than the first (worker/tree_step.py), outside the scheduler's
# pool: a tree of 16 nodes and 8 leaves needs at most 14.
TREE_SCRATCH_BLOCKS = 32

logger = logging.getLogger(__name__)


class ModelRunner(DraftingMixin):
    """Owns the target's KV cache and the proposer. Built in two steps, as the engine sizes the KV pool
    from `kv_bytes_per_block` (target plus drafter) before `initialize_kv_cache`."""

    def __init__(self, model, block_size: int, eos_token_ids: set[int], max_model_len: int,
                 spec_config=None, weight_dtype=None, gguf_compute: str | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        """kv_cache_dtype: EngineConfig.kv_cache_dtype, how the target's KV cache (and a drafter's) stores K/V."""
        self.model = model
        self.block_size = block_size
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = model.config.vocab_size
        self.max_model_len = max_model_len
        self.uses_mrope = model.uses_mrope
        self.spec_config = spec_config
        self.kv_dtype = kv_storage_dtype(kv_cache_dtype, model.dtype)  # the caches' torch dtype
        self.target_info = TargetInfo(model, model.dtype, weight_dtype, max_model_len, gguf_compute, self.kv_dtype)
        self.proposer: Proposer | None = None
        self.num_speculative_tokens = 0
        self.draft_policy = DraftPolicy()
        if spec_config is not None:
            self._build_proposer()
            self.num_speculative_tokens = spec_config.num_speculative_tokens
            model.set_aux_hidden_layers(self.proposer.needs.aux_layers)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.drafter_kv: DrafterKVCache | None = None
        self.attention_kernel = kernel_usable(model.dtype)
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.thread_policy = ThreadPolicy()
        self.rejection_sampler = RejectionSampler()
        # per request, the drafts awaiting verification with their q [n, vocab], and the option that drafted
        # them: both live one step (verified next step, or dropped by the scheduler)
        self.draft_probs: dict[str, tuple[list[int], torch.Tensor]] = {}
        self.draft_sources: dict[str, int] = {}  # the policy option that made the drafts awaiting verification
        self.finished_since_draft: set[str] = set()
        self.grammars = GrammarRequests()
        self.forced_drafts: set[str] = set()  # requests whose drafts awaiting verification the grammar forced
        self.undrafted: set[str] = set()  # requests the drafter failed on: plain decoding to their end
        self.failed: dict[str, RequestFailure] = {}  # this step's requests that failed alone
        # draft trees: per request the tree of its drafts awaiting verification (chains are not kept), the
        # scratch blocks their other paths use, and this step's layouts and accepted nodes
        self.draft_trees: dict[str, DraftTree] = {}
        self.tree_scratch: list[int] = []
        self.tree_steps: dict[str, TreeStep] = {}
        self.tree_accepted: dict[str, list[int]] = {}
        self.shapes = ShapeChooser()  # draft_tree "auto": trees or chains, by the throughput each gives

    def _build_proposer(self) -> None:
        """The proposer and its draft policy as a new engine has them."""
        spec_config = self.spec_config
        self.proposer = make_proposer(spec_config, self.target_info)
        options = self.proposer.needs.options or (
            DraftOption(spec_config.method, spec_config.num_speculative_tokens, self.proposer.needs.drafting_cost),)
        self.draft_policy = DraftPolicy(options, adaptive=spec_config.adaptive_draft_length)

    def reset(self) -> None:
        """Forget every request and the drafter's state, as a new runner has them, after a step failed in a way
        no single request owns. The KV tensors stay: no block table refers to their contents any more. The
        draft policy keeps this machine's measured step prices (a new engine calibrates them before its
        first request), nothing else."""
        for state in (self.requests, self.draft_probs, self.draft_sources, self.forced_drafts,
                      self.finished_since_draft, self.undrafted, self.failed, self.draft_trees):
            state.clear()
        self.grammars = GrammarRequests()
        if self.proposer is not None:
            prices = self.draft_policy
            self._build_proposer()
            self.draft_policy.keep_step_prices(prices)
        if self.drafter_kv is not None:
            self.drafter_kv.reset()

    def calibrate_step_costs(self, num_blocks: int, max_num_seqs: int) -> None:
        """Routes the int8 kernels' calls by row count to the fastest path for this model here (measured on
        first use, int8_routes), then times the target's steps on a dummy context before the first request
        (StepCalibrator), so the draft policy prices drafts from this machine's step costs from the first step."""
        int8_routes.ensure_routes(int8_workloads(self.model))
        if self.proposer is not None and self.draft_policy.adaptive:
            StepCalibrator(self).run(num_blocks, max_num_seqs)

    @property
    def drafter_needs(self) -> DrafterNeeds | None:
        return self.proposer.needs if self.proposer is not None else None

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots the scheduler reserves past each request's scheduled tokens, for the drafter."""
        return self.proposer.needs.num_lookahead_tokens if self.proposer is not None else 0

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block of the target's KV plus the drafter's (which follows the same tables); under
        tensor parallelism the target's part counts this rank's KV heads. Windowed layers with their own pool
        (window_kv_bytes_per_block) are not counted."""
        target = self._target_kv_bytes(self.model.config.num_hidden_layers - self._num_window_pool_layers())
        drafter = self.proposer.needs.kv if self.proposer is not None else None
        return target + (drafter.bytes_per_block(self.block_size) if drafter is not None else 0)

    def window_kv_bytes_per_block(self) -> int:
        """Bytes of one block of the windowed layers' KV (their own pool), 0 when they have none."""
        return self._target_kv_bytes(self._num_window_pool_layers())

    @property
    def window_group_windows(self) -> tuple[int, ...]:
        """The target's mixed_windows: the windows of its layers that keep block tables of their own."""
        return getattr(self.model, "mixed_windows", ())

    def _num_window_pool_layers(self) -> int:
        return sum(1 for layer in self.model.layers if layer.window) if self.window_group_windows else 0

    def _target_kv_bytes(self, num_layers: int) -> int:
        _, _, num_kv_heads, head_dim = self.model.kv_cache_shape(1, self.block_size)
        return KVCacheSpec(num_layers, num_kv_heads, head_dim, self.kv_dtype).bytes_per_block(self.block_size)

    @property
    def drafts_trees(self) -> bool:
        """Whether drafts may come as trees: asked for (speculative_config.draft_tree), and every layer reads
        one block table (a hybrid model's windowed pool has no tree scratch)."""
        return (self.spec_config is not None and self.spec_config.draft_tree != "chain"
                and not self.window_group_windows)

    def initialize_kv_cache(self, num_blocks: int, num_window_blocks: int = 0) -> None:
        """num_window_blocks: the windowed layers' own pool, when window_group_windows (the scheduler then gives
        (full, window) block id pairs); 0: every layer in one pool, read through one table. With draft trees
        the pool holds TREE_SCRATCH_BLOCKS more, ids num_blocks and up, which the scheduler never hands out."""
        if self.drafts_trees:
            self.tree_scratch = list(range(num_blocks, num_blocks + TREE_SCRATCH_BLOCKS))
            num_blocks += TREE_SCRATCH_BLOCKS
        if self.window_group_windows and num_window_blocks:
            shape = self.model.kv_cache_shape(num_blocks, self.block_size)
            window_shape = self.model.kv_cache_shape(num_window_blocks, self.block_size)
            self.kv_caches = [kv_caches(window_shape if layer.window else shape, self.kv_dtype, 1)[0]
                              for layer in self.model.layers]
        else:
            self.kv_caches = kv_caches(self.model.kv_cache_shape(num_blocks, self.block_size), self.kv_dtype,
                                       self.model.num_layers)
        if self.proposer is not None and self.proposer.needs.kv is not None:
            self.drafter_kv = DrafterKVCache(self.proposer.needs.kv, num_blocks, self.block_size,
                                             getattr(self.model, "kv_window", 0))
            self.drafter_kv.tree_scratch = list(self.tree_scratch)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.failed = {}
        self._update_states(sched)
        if not sched.req_ids:
            return ModelRunnerOutput([], {}, None, failed=self.failed)
        batch = self.prepare_inputs(sched)
        start = time.perf_counter()
        with self.thread_policy.run(len(batch.input_ids)):
            hidden, aux = self.model.forward(batch.input_ids, batch.positions, batch.attn, self.kv_caches,
                                             batch.mm_embeds)
            sampled, logprobs = self.sample_or_verify(hidden[batch.logits_indices], batch)
            decoding = self.proposer is not None and self._is_decode_step(batch)
            if decoding:  # the measured cost of drafting
                self.draft_policy.observe_step(len(batch.req_ids), len(batch.input_ids), time.perf_counter() - start)
            drafts = self.propose_draft_token_ids(batch, sampled, hidden, aux)
        if decoding and self.tree_scratch:  # with drafting: what this step's shape gives
            self.shapes.observe(sum(map(len, sampled.values())), time.perf_counter() - start)
        options = self.draft_policy.options
        return ModelRunnerOutput(batch.req_ids, sampled, drafts, logprobs, {  # who drafted each request's drafts
            rid: "grammar" if rid in self.forced_drafts else options[self.draft_sources.get(rid, 0)].name
            for rid in drafts or ()}, self.failed)

    def _fail(self, req_id: str, exc: Exception, what: str, from_input: bool = True) -> None:
        """End one request with `exc` while the step goes on for the others (ModelRunnerOutput.failed)."""
        logger.warning("request %s failed alone (%s): %s", req_id, what, exc)
        self.failed.setdefault(req_id, RequestFailure(f"{what}: {exc}", from_input))
        self.grammars.forget(req_id)

    def _grammar_failed(self, req_id: str, exc: Exception) -> None:
        self._fail(req_id, exc, "structured output")

    @staticmethod
    def _is_decode_step(batch: InputBatch) -> bool:
        """Every request decodes (1 token) or verifies its drafts (1 + n): no prefill in the step."""
        return len(batch.sample_req_ids) == len(batch.req_ids) and len(batch.input_ids) == len(batch.req_ids) + sum(
            map(len, batch.draft_token_ids))

    # ---- state --------------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_req_ids:  # finished, or preempted (then rescheduled later as new)
            self.requests.pop(rid, None)
            self.draft_probs.pop(rid, None)
            self.draft_sources.pop(rid, None)
            self.draft_trees.pop(rid, None)
            self.grammars.forget(rid)
            self.forced_drafts.discard(rid)
            if self.drafter_kv is not None:
                self.drafter_kv.forget(rid)  # its blocks are gone with the request's
            if rid not in sched.preempted_req_ids:
                if rid not in self.undrafted:  # the drafter was told when it failed
                    self.finished_since_draft.add(rid)
                self.undrafted.discard(rid)
                self.draft_policy.forget(rid)
        for new in sched.scheduled_new_reqs:
            block_ids, window_block_ids = split_block_groups(new.block_ids)
            state = self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.prompt_token_ids), list(new.output_token_ids), new.sampling_params,
                block_ids, new.num_computed_tokens, getattr(new.sampling_params, "seed", None),
                mm_features=list(new.mm_features), window_block_ids=window_block_ids)
            if state.mm_features:
                try:
                    state.mrope = self.model.prompt_positions(len(state.prompt_token_ids), state.mm_features)
                except Exception as exc:  # noqa: BLE001 - its images' fault: this request fails alone
                    self._fail(new.req_id, exc, "image positions")
            if new.grammar is not None:
                self.grammars.start(new.req_id, new.grammar, state.output_token_ids, self._grammar_failed)
            if self.drafter_kv is not None:
                self.drafter_kv.start(new.req_id, block_ids, new.num_computed_tokens)
        for cached in sched.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            new_ids, new_window_ids = split_block_groups(cached.new_block_ids)
            state.block_ids.extend(new_ids)
            if state.window_block_ids is not None and new_window_ids:
                state.window_block_ids.extend(new_window_ids)
            if self.drafter_kv is not None:
                self.drafter_kv.allocated(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # ---- inputs -------------------------------------------------------------------------
    def prepare_inputs(self, sched: SchedulerOutput) -> InputBatch:
        rows = StepRows()
        sample_ids, sample_drafts, sample_trees, sample_ends = [], [], [], []
        scratch = list(self.tree_scratch)
        self.tree_steps, self.tree_accepted = {}, {}
        for rid in sched.req_ids:
            state = self.requests[rid]
            n = sched.num_scheduled_tokens[rid]
            drafts = sched.scheduled_spec_decode_tokens.get(rid, [])
            start = state.num_computed_tokens
            tokens = state.token_ids[start:start + n]
            tree = self._tree_of(state, drafts, start + len(tokens) - 1, len(scratch)) if drafts else None
            if tree is not None:  # verified as a tree: its nodes after the request's tokens
                drafts, n = list(tree.tokens), len(tokens) + len(tree)
                self.tree_steps[rid] = self._add_tree_rows(rows, state, tokens, tree, scratch)
            else:
                self._add_rows(rows, state, tokens + drafts[: n - len(tokens)])
            if start + n >= len(state.token_ids):
                sample_ids.append(rid)
                sample_drafts.append(drafts)
                sample_trees.append(tree)
                sample_ends.append(rows.starts[-1] + n)
            rows.starts.append(rows.starts[-1] + n)
        attn = rows.attention(self.block_size, self.attention_kernel, self.window_group_windows)
        copy_blocks(self.kv_caches, rows.block_copies)
        spec = build_spec_decode_metadata(sample_drafts, sample_ends) if any(sample_drafts) else None
        return InputBatch(
            req_ids=list(sched.req_ids),
            input_ids=torch.tensor(rows.ids, dtype=torch.long),
            positions=with_image_positions(self.layout_positions(torch.tensor(rows.positions, dtype=torch.long)),
                                            rows.image_positions),
            mm_embeds=((torch.tensor(rows.image_rows, dtype=torch.long), torch.cat(rows.image_embeds))
                       if rows.image_rows else None),
            attn=attn,
            query_start_loc=rows.starts,
            logits_indices=(spec.logits_indices if spec is not None
                            else logits_indices([len(d) for d in sample_drafts], sample_ends)),
            sample_req_ids=sample_ids,
            draft_token_ids=sample_drafts,
            spec_decode_metadata=spec,
            draft_trees=sample_trees if any(t is not None for t in sample_trees) else None,
        )

    def _add_rows(self, rows: StepRows, state: CachedRequestState, ids: list[int]) -> None:
        """A request's tokens from num_computed_tokens on (drafts included) as consecutive rows."""
        start, n, first = state.num_computed_tokens, len(ids), rows.starts[-1]
        rows.ids.extend(ids)
        rows.positions.extend(range(start, start + n))
        if state.mrope is not None:
            rows.image_positions.append((first, state.mrope.range(start, start + n)))
        if state.mm_features and start < state.mm_features[-1].end:
            for image_rows, embeds in self._image_embeds_or_blank(state, start, start + n, first):
                rows.image_rows.extend(image_rows)
                rows.image_embeds.append(embeds)
        rows.slots.extend(slot_ids(state.block_ids, start, start + n, self.block_size))
        if state.window_block_ids is not None:
            rows.window_slots.extend(slot_ids(state.window_block_ids, start, start + n, self.block_size))
            rows.window_tables.append(state.window_block_ids)
        rows.add_sequence(n, start + n, state.block_ids)

    def _add_tree_rows(self, rows: StepRows, state: CachedRequestState, tokens: list[int], tree: DraftTree,
                       scratch: list[int]) -> TreeStep:
        """A request's tokens, then its tree's nodes (worker/tree_step.py), taking scratch blocks."""
        start, first = state.num_computed_tokens, rows.starts[-1]
        step = layout(tree, start, len(tokens), state.block_ids, self.block_size, scratch)
        rows.ids.extend(tokens + list(tree.tokens))
        rows.positions.extend(step.positions)
        if state.mrope is not None:
            columns = torch.tensor(step.positions) - start
            rows.image_positions.append((first, state.mrope.range(start, max(step.positions) + 1)[:, columns]))
        rows.slots.extend(step.slots)
        rows.extra_writes.extend((first + row, slot) for row, slot in step.extra_writes)
        rows.block_copies.extend(step.block_copies)
        for _, q_len, c_len, table in step.sequences:
            rows.add_sequence(q_len, c_len, table)
        return step

    def _tree_of(self, state: CachedRequestState, drafts: list[int], root: int, scratch: int) -> DraftTree | None:
        """The tree of `drafts` (a prefix of the tree they were drafted as), cut to what `scratch` blocks hold;
        None to verify them as a chain."""
        tree = self.draft_trees.get(state.req_id)
        if tree is None or tuple(drafts) != tree.tokens[:len(drafts)] or (
                state.mm_features and root < state.mm_features[-1].end):
            return None
        tree = fit_to_scratch(tree.prefix(len(drafts)), root, self.block_size, scratch)
        return None if tree.is_chain and len(tree) == len(drafts) else tree

    def layout_positions(self, index: torch.Tensor) -> torch.Tensor:
        """[N] absolute indices → the model's layout: [N], or [3, N] under M-RoPE (text: equal rows)."""
        return index.expand(3, -1) if self.uses_mrope else index

    def _image_embeds_or_blank(self, state: CachedRequestState, start: int, end: int, first_row: int):
        """_image_embeds, or zeros in the same rows for a request whose image fails to encode (it fails alone:
        the step's other requests need the rows filled)."""
        try:
            return self._image_embeds(state, start, end, first_row)
        except Exception as exc:  # noqa: BLE001 - its image's fault: this request fails alone
            self._fail(state.req_id, exc, "image")
            out = []
            for f in state.mm_features:
                lo, hi = max(start, f.offset), min(end, f.end)
                if lo < hi:
                    out.append((range(first_row + lo - start, first_row + hi - start),
                                torch.zeros(hi - lo, self.model.config.hidden_size, dtype=self.model.dtype)))
            state.encoder_outputs.clear()
            return out

    def _image_embeds(self, state: CachedRequestState, start: int, end: int, first_row: int):
        """[(batch rows, embeddings [len(rows), hidden])] of the image placeholders among tokens start..end-1,
        whose first token sits at batch row first_row; an image is encoded once and kept until fully fed."""
        out = []
        for i, f in enumerate(state.mm_features):
            lo, hi = max(start, f.offset), min(end, f.end)
            if lo >= hi:
                continue
            if i not in state.encoder_outputs:
                state.encoder_outputs[i] = self.model.encode_image(f.pixel_values, f.grid_thw)
            out.append((range(first_row + lo - start, first_row + hi - start),
                        state.encoder_outputs[i][lo - f.offset:hi - f.offset]))
            if hi == f.end:
                del state.encoder_outputs[i]
        return out

    # ---- sampling -----------------------------------------------------------------------
    def _sampling_metadata(self, req_ids: list[str]) -> SamplingMetadata:
        states = [self.requests[rid] for rid in req_ids]
        return SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            prompt_token_ids=[s.prompt_token_ids for s in states],
            seeds=[s.seed for s in states],
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size,
        )

    def sample_or_verify(self, hidden: torch.Tensor, batch: InputBatch):
        """hidden: [M, hidden] final states at the logits indices; returns ({req_id: new tokens},
        {req_id: one logprob entry per new token})."""
        sampled: dict[str, list[int]] = {rid: [] for rid in batch.req_ids}
        if not batch.sample_req_ids:
            return sampled, {}
        meta = self._sampling_metadata(batch.sample_req_ids)
        spec, lp = batch.spec_decode_metadata, None
        awaiting = {rid: (self.draft_probs.pop(rid, None), self.draft_sources.pop(rid, 0))
                    for rid in batch.sample_req_ids}
        for rid in batch.sample_req_ids:  # its tree was laid out (tree_steps); the next drafts bring their own
            self.draft_trees.pop(rid, None)
        # structured outputs: the grammar's allowed tokens at every sampled or verified row
        masks = (self.grammars.logits_masks(batch.sample_req_ids, batch.draft_token_ids, self._grammar_failed)
                 if self.grammars else [])
        errors = {}  # request index -> why nothing could be sampled for it (InvalidLogitsError)
        if batch.draft_trees is not None:
            tokens, lp, errors = self._verify_trees(hidden, batch, meta, masks, awaiting)
        elif meta.argmax_only:  # greedy without penalties or logprobs: the argmax alone, not the logits
            targets = self.model.greedy_tokens(hidden, self.grammars.allowed_rows(masks, hidden.shape[0],
                                                                                    self.vocab_size) if masks else None)
            tokens = ([[t] for t in targets.tolist()] if spec is None
                      else verify_argmax_targets(spec, targets).token_ids)
        elif spec is None:
            out = self.sampler(self.grammars.apply(self.model.compute_logits(hidden), masks), meta)
            tokens, lp, errors = [[t] for t in out.sampled_token_ids.tolist()], out.logprobs, out.errors
        else:
            probs = [_q_of(awaiting[rid][0], d) for rid, d in zip(batch.sample_req_ids, batch.draft_token_ids)]
            out = self.rejection_sampler(spec, self.grammars.apply(self.model.compute_logits(hidden), masks), meta,
                                         probs if any(p is not None for p in probs) else None)
            tokens, lp, errors = out.token_ids, out.logprobs, out.errors
        for i, exc in errors.items():  # its logits allow no draw (NaN/inf after penalties): it fails alone
            self._fail(batch.sample_req_ids[i], exc, "sampling")
        if spec is not None:
            for rid, drafts, toks in zip(batch.sample_req_ids, batch.draft_token_ids, tokens):
                if drafts and rid not in self.forced_drafts:  # forced drafts teach the policy nothing
                    tree = self.tree_steps[rid].tree if rid in self.tree_steps else None
                    self.draft_policy.record(rid, tree.depth if tree else len(drafts), len(toks) - 1,
                                             awaiting[rid][1])
        self.forced_drafts.difference_update(batch.sample_req_ids)
        for rid, toks in zip(batch.sample_req_ids, tokens):
            sampled[rid] = toks
            self.requests[rid].append(toks)
            if rid in self.grammars:
                self.grammars.accept(rid, toks, self._grammar_failed)
        logprobs = self._logprob_entries(batch.sample_req_ids, tokens, lp) if lp else {}
        return sampled, logprobs

    def _verify_trees(self, hidden: torch.Tensor, batch: InputBatch, meta: SamplingMetadata, masks, awaiting):
        """(tokens, logprobs, errors) of a step where some request verifies a draft tree (the others' chains are
        one-path trees); the accepted nodes' K/V move to their requests' own slots."""
        trees = trees_of(batch.draft_token_ids, batch.draft_trees)
        if meta.argmax_only:
            out = verify_tree_argmax(trees, self.model.greedy_tokens(
                hidden, self.grammars.allowed_rows(masks, hidden.shape[0], self.vocab_size) if masks else None))
        else:
            probs = [_q_of(awaiting[rid][0], d) for rid, d in zip(batch.sample_req_ids, batch.draft_token_ids)]
            out = verify_tree_random(trees, self.grammars.apply(self.model.compute_logits(hidden), masks), meta,
                                     probs if any(p is not None for p in probs) else None)
        for rid, accepted in zip(batch.sample_req_ids, out.accepted):
            step = self.tree_steps.get(rid)
            if step is not None:
                self.tree_accepted[rid] = accepted
                copy_slots(self.kv_caches, accepted_moves(step, accepted, self.requests[rid].block_ids,
                                                          self.block_size), self.block_size)
        return out.token_ids, out.logprobs, out.errors

    def _logprob_entries(self, req_ids: list[str], tokens: list[list[int]], lp) -> dict[str, list[dict]]:
        """Per request, per new token, {token_id: (logprob, rank)}: the sampled token plus the top-n."""
        ids, vals, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
        out, row = {}, 0
        for rid, toks in zip(req_ids, tokens):
            n = getattr(self.requests[rid].sampling_params, "logprobs", None)
            entries = []
            for _ in toks:
                entry = {ids[row][0]: (vals[row][0], ranks[row])}
                for j in range(1, (n or 0) + 1):
                    entry.setdefault(ids[row][j], (vals[row][j], j))
                entries.append(entry)
                row += 1
            if n is not None:
                out[rid] = entries
        return out


def split_block_groups(ids) -> tuple[list[int], list[int] | None]:
    """A request's block ids from the scheduler as (the table of every layer, or of the full-attention ones;
    the windowed layers' own table or None): HybridKVCacheManager gives (full, window) pairs."""
    if ids and isinstance(ids[0], tuple):
        return [full for full, _ in ids], [window for _, window in ids]
    return list(ids), None


def _q_of(awaiting: tuple[list[int], torch.Tensor] | None, drafts: list[int]) -> torch.Tensor | None:
    """[len(drafts), vocab] q of the drafts being verified, when they are (a prefix of) the drafts it came
    with; None (q one-hot) for drafts that came without one."""
    if awaiting is None or not drafts:
        return None
    ids, q = awaiting
    return q[:len(drafts)] if ids[:len(drafts)] == drafts else None
