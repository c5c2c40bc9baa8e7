"""The model runner's drafting half: `propose_draft_token_ids` builds one DraftInputs of what the proposer
declared it needs (the sampled tokens, the target's states and K/V, the draft plans) and calls the one
Proposer; what comes back is cut where a grammar refuses it and kept for the next step's verification."""
from __future__ import annotations

import logging
import time

import torch

from specserve.spec_decode.proposer import DraftInputs, TargetStates
from specserve.types import max_draft_tokens
from specserve.worker.input_batch import CachedRequestState, InputBatch, positions_at, with_image_positions

logger = logging.getLogger(__name__)


class DraftingMixin:
    """ModelRunner's drafting methods; the state they read (proposer, draft_policy, requests, grammars, the
    draft bookkeeping) is ModelRunner's."""

    def propose_draft_token_ids(self, batch: InputBatch, sampled: dict[str, list[int]],
                                hidden: torch.Tensor, aux) -> dict[str, list[int]] | None:
        """Drafts for the next step, per request (None when speculation is off)."""
        if self.proposer is None:
            return None
        calibrating = not self.draft_policy.drafts_this_step(len(batch.req_ids))
        states = [self.requests[rid] for rid in batch.sample_req_ids if self._may_draft(rid)]
        forced = self._forced_drafts(states) if self.grammars else {}
        plans = [[] if calibrating or s.req_id in forced else self._draft_plan(s)
                 for s in states]
        if not any(plans) and self.proposer.needs.target_states is not TargetStates.ALL:
            return forced  # nothing pays: no drafting work (a drafter that keeps state catches up when it next drafts)
        inputs = self._build_draft_inputs(batch, sampled, hidden, aux, states, plans)
        try:
            drafts = self._propose(batch, inputs)
        except Exception:  # noqa: BLE001 - drafts are an optimisation: a failing drafter never fails a request
            logger.exception("the drafter failed; its %d requests of this step go on without drafts",
                             len(inputs.req_ids))
            self.finished_since_draft |= inputs.finished_req_ids  # not delivered: told again next call
            self._stop_drafting(inputs.req_ids)
            drafts = {}
        refused = self._undraft_grammar_failures()
        return {rid: d for rid, d in {**drafts, **forced}.items() if rid not in refused}

    def _undraft_grammar_failures(self) -> set[str]:
        """The requests whose grammar failed while the drafter asked it for masks: they decode without drafts
        from now on, their matcher restarted over their accepted tokens (one that fails again there fails its
        request alone). The other requests of the call keep their drafts."""
        errors = self.grammars.take_drafting_errors()
        for rid, exc in errors.items():
            logger.warning("request %s: its grammar failed while drafting (%s); it goes on without drafts", rid, exc)
            self.grammars.restart(rid, self.requests[rid].output_token_ids, self._grammar_failed)
        self._stop_drafting(list(errors))
        return set(errors)

    def _may_draft(self, req_id: str) -> bool:
        """Not a request that failed this step, nor one the drafter failed on."""
        return req_id not in self.failed and req_id not in self.undrafted

    def _stop_drafting(self, req_ids: list[str]) -> None:
        """Plain decoding for these requests to their end; the drafter drops its state of them on its next
        call, as if they had finished."""
        for rid in req_ids:
            self.undrafted.add(rid)
            self.finished_since_draft.add(rid)
            self.draft_probs.pop(rid, None)
            self.draft_sources.pop(rid, None)
            self.draft_trees.pop(rid, None)
            self.draft_policy.forget(rid)
            if self.drafter_kv is not None:
                self.drafter_kv.forget(rid)

    def _propose(self, batch: InputBatch, inputs: DraftInputs) -> dict[str, list[int]]:
        """The proposer's drafts for `inputs`, cut where a grammar refuses them, with what the policy learns
        from the call (timings, shadow drafts)."""
        start = time.perf_counter()
        drafts = self.proposer.propose(inputs)
        for rid, option, num_drafts, num_accepted in drafts.shadow_records or ():
            self.draft_policy.record(rid, num_drafts, num_accepted, option)
        if self._is_decode_step(batch):  # after a prefill a draft model also catches up on the whole prompt
            for option, num_tokens, seconds in drafts.timings or [
                    (0, sum(map(len, drafts.token_ids)), time.perf_counter() - start)]:
                self.draft_policy.observe_drafting(num_tokens, seconds, option)
        for i, rid in enumerate(inputs.req_ids):
            if rid in self.grammars.drafting_errors:  # its matcher failed in this call: no drafts
                drafts.token_ids[i] = []
                continue
            tree = drafts.trees[i] if drafts.trees is not None else None
            if tree is not None and (rid in self.grammars or not self.tree_scratch):  # chains only: its first path
                drafts.token_ids[i] = [tree.tokens[v] for v in tree.first_path()]
                tree = None
            if tree is not None and not tree.is_chain:
                self.draft_trees[rid] = tree
            else:
                self.draft_trees.pop(rid, None)
            if rid in self.grammars:  # no verification spent on a token the grammar refuses
                drafts.token_ids[i] = drafts.token_ids[i][:self.grammars.allowed_prefix(rid, drafts.token_ids[i])]
            if drafts.probs is not None and drafts.probs[i] is not None and drafts.token_ids[i]:
                self.draft_probs[rid] = (drafts.token_ids[i], drafts.probs[i])
            if drafts.sources is not None and drafts.sources[i] is not None:
                self.draft_sources[rid] = drafts.sources[i]
        return {rid: d for rid, d in zip(inputs.req_ids, drafts.token_ids) if d}

    def _forced_drafts(self, states: list[CachedRequestState]) -> dict[str, list[int]]:
        """Drafts no drafter is needed for: the tokens a request's grammar forces next (the tokenizer's
        spelling of the forced text, which verification nearly always accepts), up to its draft length."""
        forced = {}
        for state in states:
            tokens = self.grammars.forced_tokens(state.req_id, self._max_drafts(state), self._grammar_failed)
            if tokens:
                forced[state.req_id] = tokens
                self.forced_drafts.add(state.req_id)
                self.draft_trees.pop(state.req_id, None)
        return forced

    def _draft_plan(self, state: CachedRequestState) -> list[tuple[int, int]]:
        """The policy's [(option, number of drafts)] within the request's draft length, from its recent
        acceptance and the measured costs."""
        return self.draft_policy.plan(state.req_id, self._max_drafts(state))

    def _max_drafts(self, state: CachedRequestState) -> int:
        """The engine's k, lowered (or turned off with 0) per request by SamplingParams, within max_model_len."""
        k = getattr(state.sampling_params, "num_speculative_tokens", None)
        k = self.num_speculative_tokens if k is None else min(k, self.num_speculative_tokens)
        return max(0, min(k, max_draft_tokens(len(state.token_ids), self.max_model_len)))

    def _target_rows(self, batch: InputBatch, sampled: dict[str, list[int]]) -> tuple[list[str], list[int], list[int]]:
        """(requests, row index, cu offsets) of the target states the proposer declared it reads: the
        processed rows of each request, rejected draft tails dropped."""
        states = self.proposer.needs.target_states
        row_of = {rid: i for i, rid in enumerate(batch.req_ids)}
        num_drafts = dict(zip(batch.sample_req_ids, map(len, batch.draft_token_ids)))
        req_ids = [rid for rid in (batch.req_ids if states is TargetStates.ALL else batch.sample_req_ids)
                   if self._may_draft(rid)]
        index, cu = [], [0]
        for rid in req_ids:
            start, end = batch.query_start_loc[row_of[rid]], batch.query_start_loc[row_of[rid] + 1]
            if rid in self.tree_accepted:  # its tokens' rows, then the accepted nodes'
                step = self.tree_steps[rid]
                index.extend(range(start, start + step.num_real))
                index.extend(start + step.node_row(v) for v in self.tree_accepted[rid])
            else:
                num_rejected = num_drafts[rid] + 1 - len(sampled[rid]) if rid in num_drafts else 0
                index.extend(range(start, end - num_rejected))
            cu.append(len(index))
        return list(req_ids), index, cu

    def _build_draft_inputs(self, batch: InputBatch, sampled: dict[str, list[int]], hidden: torch.Tensor,
                            aux, states: list[CachedRequestState], plans: list[list[tuple[int, int]]]) -> DraftInputs:
        """What the proposer declared it needs, for `states`: the requests that got tokens this step and may
        draft."""
        req_ids = [s.req_id for s in states]
        finished, self.finished_since_draft = self.finished_since_draft, set()
        inputs = DraftInputs(
            req_ids=list(req_ids),
            sampled_token_ids=[sampled[rid] for rid in req_ids],
            next_token_ids=[sampled[rid][-1] for rid in req_ids],
            token_ids=[s.token_ids for s in states],
            num_prompt_tokens=[len(s.prompt_token_ids) for s in states],
            num_drafts=[plan[0][1] if plan else 0 for plan in plans],
            draft_plans=plans,
            sampling_params=[s.sampling_params for s in states],
            seeds=[s.seed for s in states],
            max_model_len=self.max_model_len,
            finished_req_ids=finished,
            drafter_kv=self.drafter_kv,
            mrope_positions=[s.mrope for s in states] if any(s.mrope is not None for s in states) else [],
            allowed_next=self.grammars.allowed_next(list(req_ids)) if self.grammars else None,
        )
        needs = self.proposer.needs
        if self.drafts_trees and self.tree_scratch and (self.shapes.trees or self.spec_config.token_tree_shape):
            inputs.tree_costs = self.draft_policy.draft_costs
            inputs.tree_shape = self.spec_config.token_tree_shape
            inputs.max_tree_nodes = (len(inputs.tree_shape) if inputs.tree_shape
                                     else self.spec_config.draft_tree_max_nodes)
        if needs.kv is not None or needs.reads_target_kv:  # its slots follow the target's block tables
            inputs.block_tables = {rid: self.requests[rid].block_ids for rid in batch.req_ids}
        if needs.target_states is not TargetStates.NONE:
            target_ids, index, inputs.cu_num_tokens = self._target_rows(batch, sampled)
            take = torch.tensor(index, dtype=torch.long)
            inputs.target_req_ids = target_ids
            inputs.target_start = [self.requests[rid].num_computed_tokens for rid in target_ids]
            inputs.target_next_token_ids = [  # the token after the kept rows
                self.requests[rid].token_ids[first + hi - lo] for rid, first, lo, hi in zip(
                    target_ids, inputs.target_start, inputs.cu_num_tokens, inputs.cu_num_tokens[1:])]
            inputs.target_token_ids = batch.input_ids[take]
            inputs.target_positions = positions_at(batch.positions, take)
            inputs.target_hidden_states = hidden[take]
            inputs.aux_hidden_states = [a[take] for a in aux] if aux is not None else None
            inputs.next_positions = with_image_positions(
                self.layout_positions(torch.tensor([len(s.token_ids) - 1 for s in states], dtype=torch.long)),
                [(i, s.mrope.range(len(s.token_ids) - 1, len(s.token_ids))) for i, s in enumerate(states)
                 if s.mrope is not None])
        if needs.reads_target_kv:
            inputs.target_kv_caches = self.kv_caches
        return inputs
