"""The model runner: one `execute_model` per engine step over a flattened batch with a paged KV cache.

execute_model prepares inputs, runs the target, samples (or verifies drafts) and hands all drafting to
`propose_draft_token_ids`, which builds one DraftInputs and calls one Proposer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.engine.scheduler import SchedulerOutput
from specserve.sample.metadata import SamplingMetadata
from specserve.sample.sampler import Sampler
from specserve.worker.attention import AttentionMetadata, build_attention_metadata


@dataclass
class CachedRequestState:
    """What the runner remembers of a request between steps (tokens exclude drafts)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: object
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids = self.prompt_token_ids + self.output_token_ids

    def append(self, tokens: list[int]) -> None:
        self.output_token_ids.extend(tokens)
        self.token_ids.extend(tokens)


@dataclass
class InputBatch:
    """One step's flattened inputs. Requests appear in `req_ids` order; `sample_req_ids` subset samples."""

    req_ids: list[str]
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N] (or [3, N] under M-RoPE)
    attn: AttentionMetadata
    query_start_loc: list[int]  # [B + 1]
    logits_indices: torch.Tensor  # [M] rows of hidden states the LM head sees
    sample_req_ids: list[str]  # requests that get tokens this step (prompt complete)
    spec_decode_metadata: object | None  # SpecDecodeMetadata when any request verifies drafts


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    sampled_token_ids: dict[str, list[int]]  # empty list for a partial prefill
    spec_token_ids: dict[str, list[int]] | None
    logprobs: dict[str, list[dict]] = field(default_factory=dict)  # per output token: {id: (logprob, rank)}


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, eos_token_ids: set[int], vocab_size: int,
                 proposer=None) -> None:
        self.model = model
        self.block_size = block_size
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = vocab_size
        self.proposer = proposer
        shape = model.kv_cache_shape(num_blocks, block_size)
        self.kv_caches = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
                          for _ in range(model.num_layers)]
        self.requests: dict[str, CachedRequestState] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        if not sched.req_ids:
            return ModelRunnerOutput([], {}, None)
        batch = self.prepare_inputs(sched)
        hidden, aux = self.model.forward(batch.input_ids, batch.positions, batch.attn, self.kv_caches)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        sampled, logprobs = self.sample_or_verify(logits, batch)
        drafts = self.propose_draft_token_ids(batch, sampled, hidden, aux)
        return ModelRunnerOutput(batch.req_ids, sampled, drafts, logprobs)

    # ---- state --------------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_req_ids:
            self.requests.pop(rid, None)
            if rid not in sched.preempted_req_ids:
                self.generators.pop(rid, None)
        for new in sched.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.prompt_token_ids), list(new.output_token_ids), new.sampling_params,
                list(new.block_ids), new.num_computed_tokens, self._generator(new.req_id, new.sampling_params))
        for cached in sched.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _generator(self, req_id: str, params) -> torch.Generator | None:
        """Seeded requests draw from their own generator, kept across preemption."""
        seed = getattr(params, "seed", None)
        if seed is None:
            return None
        if req_id not in self.generators:
            self.generators[req_id] = torch.Generator().manual_seed(seed)
        return self.generators[req_id]

    # ---- inputs -------------------------------------------------------------------------
    def prepare_inputs(self, sched: SchedulerOutput) -> InputBatch:
        bs = self.block_size
        ids, positions, slots, logits_idx = [], [], [], []
        query_lens, context_lens, tables, sample_ids = [], [], [], []
        starts = [0]
        for rid in sched.req_ids:
            state = self.requests[rid]
            n = sched.num_scheduled_tokens[rid]
            drafts = sched.scheduled_spec_decode_tokens.get(rid, [])
            start = state.num_computed_tokens
            tokens = state.token_ids[start:start + n]
            tokens = tokens + drafts[: n - len(tokens)]
            ids.extend(tokens)
            pos = range(start, start + n)
            positions.extend(pos)
            table = state.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if start + n >= len(state.token_ids):
                sample_ids.append(rid)
                end = starts[-1] + n
                logits_idx.extend(range(end - 1 - len(drafts), end))
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(table)
            starts.append(starts[-1] + n)
        slot_mapping = torch.tensor(slots, dtype=torch.long)
        attn = build_attention_metadata(query_lens, context_lens, tables, bs, slot_mapping)
        return InputBatch(
            req_ids=list(sched.req_ids),
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            attn=attn,
            query_start_loc=starts,
            logits_indices=torch.tensor(logits_idx, dtype=torch.long),
            sample_req_ids=sample_ids,
            spec_decode_metadata=None,
        )

    # ---- sampling -----------------------------------------------------------------------
    def _sampling_metadata(self, req_ids: list[str]) -> SamplingMetadata:
        states = [self.requests[rid] for rid in req_ids]
        return SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            prompt_token_ids=[s.prompt_token_ids for s in states],
            generators=[s.generator for s in states],
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size,
        )

    def sample_or_verify(self, logits: torch.Tensor, batch: InputBatch):
        """logits: [M, vocab]; returns ({req_id: new tokens}, {req_id: logprob entries})."""
        sampled: dict[str, list[int]] = {rid: [] for rid in batch.req_ids}
        logprobs: dict[str, list[dict]] = {}
        if not batch.sample_req_ids:
            return sampled, logprobs
        meta = self._sampling_metadata(batch.sample_req_ids)
        out = self.sampler(logits, meta)
        tokens = out.sampled_token_ids.tolist()
        for i, rid in enumerate(batch.sample_req_ids):
            sampled[rid] = [tokens[i]]
            self.requests[rid].append([tokens[i]])
        if out.logprobs is not None:
            logprobs = self._logprob_entries(batch.sample_req_ids, out.logprobs)
        return sampled, logprobs

    def _logprob_entries(self, req_ids: list[str], lp) -> dict[str, list[dict]]:
        """Per request, one {token_id: (logprob, rank)} dict: the sampled token plus its top-n."""
        ids, vals, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
        out = {}
        for i, rid in enumerate(req_ids):
            n = getattr(self.requests[rid].sampling_params, "logprobs", None)
            if n is None:
                continue
            entry = {ids[i][0]: (vals[i][0], ranks[i])}
            for j in range(1, n + 1):
                entry.setdefault(ids[i][j], (vals[i][j], j))
            out[rid] = [entry]
        return out

    # ---- drafting -----------------------------------------------------------------------
    def propose_draft_token_ids(self, batch: InputBatch, sampled: dict[str, list[int]],
                                hidden: torch.Tensor, aux) -> dict[str, list[int]] | None:
        if self.proposer is None:
            return None
        raise NotImplementedError("speculative decoding lands with the speculative-decoding issue")
