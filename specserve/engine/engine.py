"""LLMEngine: owns the scheduler, the model runner and the output processor; one `step()` at a time."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

import torch

from specserve.config import EngineConfig, SpeculativeConfig
from specserve.engine.kv_cache_manager import HybridKVCacheManager, KVCacheManager
from specserve.engine.output_processor import OutputProcessor
from specserve.engine.outputs import RequestOutput
from specserve.engine.request import Request, RequestStatus, SpecDecodeStats
from specserve.engine.scheduler import Scheduler, SchedulerConfig
from specserve.models.gguf_quant import ACTIVATION_DIGITS, int8_activation_weights
from specserve.models.loader import load_model_weights
from specserve.ops.heap import mapped_large_allocations, trim_heap
from specserve.models.registry import build_model
from specserve.multimodal.processor import MultiModalProcessor
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.proposer import TargetStates
from specserve.tokenizer import load_tokenizer
from specserve.types import FatalEngineError, RequestFailure
from specserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class EngineMetrics(SpecDecodeStats):
    """Engine-wide counters since start; the speculation counters come from SpecDecodeStats."""

    num_requests_finished: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_requests_failed: int = 0  # ended by an error of their own while the others went on
    num_engine_restarts: int = 0  # steps that failed in a way no request owns, after which the engine reset


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        with mapped_large_allocations():  # no freed heap between the weights' copies (ops/heap.py)
            loaded = load_model_weights(config.model, dtype=config.torch_dtype, keep_quantized=config.keep_gguf_blocks)
            if config.keep_gguf_blocks and config.gguf_compute in ACTIVATION_DIGITS:
                loaded.state_dict = int8_activation_weights(loaded.state_dict, ACTIVATION_DIGITS[config.gguf_compute])
            self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or config.model)
            if config.tensor_parallel_size > 1:  # rank 0's shard, its workers started (specserve/distributed)
                from specserve.distributed.model import start_tensor_parallel

                self.model = start_tensor_parallel(config, loaded)
            else:
                self.model = build_model(loaded.config, loaded.state_dict, dtype=config.torch_dtype,
                                         weight_dtype=config.linear_weight_dtype)
            self.hf_config = loaded.config
            self.max_model_len = self._max_model_len()
            self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids if self.tokenizer is not None
                                           else _config_eos_ids(loaded.config))
            self._grammar_compiler = None  # built on the first structured-output request
            self._grammar_compiler_lock = threading.Lock()
            self.mm_processor = MultiModalProcessor(
                loaded.config, config.model, getattr(self.model, "vision", None) is not None,
                config.limit_mm_per_prompt, config.mm_processor_kwargs)
            bytes_per_weight = getattr(self.model, "linear_bytes_per_weight", None)
            self.spec_config = (SpeculativeConfig.from_dict(config.speculative_config, config.model,
                                                            bytes_per_weight() if bytes_per_weight else None)
                                if config.speculative_config else None)
            self.runner = ModelRunner(self.model, config.block_size, set(self.eos_token_ids), self.max_model_len,
                                      self.spec_config, config.linear_weight_dtype,
                                      config.gguf_compute if config.keep_gguf_blocks else None, config.kv_cache_dtype)
            del loaded
        trim_heap()  # what building the models freed, before the KV cache is allocated beside them
        num_blocks = self._num_kv_blocks()
        self.runner.initialize_kv_cache(num_blocks, self.num_window_blocks)
        self.runner.calibrate_step_costs(min(num_blocks, self.num_window_blocks or num_blocks), config.max_num_seqs)
        self._build_scheduler(num_blocks)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics()
        # What `recover` needs of the step in progress: the sequences it scheduled, and the final outputs it made
        # (the output processor forgets a request once its final output is made).
        self._step_req_ids: list[str] = []
        self._step_final_outputs: dict[str, RequestOutput] = {}

    def _build_scheduler(self, num_blocks: int) -> None:
        """An empty block pool and prefix cache, and a scheduler with no request."""
        needs = self.runner.drafter_needs
        reads_all_states = needs is not None and needs.target_states is TargetStates.ALL
        drafter_kv = self.runner.drafter_kv
        self.kv_cache_manager = KVCacheManager(
            num_blocks, self.config.block_size, self.config.enable_prefix_caching,
            recompute_last_hit_block=reads_all_states, sliding_window=getattr(self.model, "kv_window", 0),
            block_usable=drafter_kv.has_block if reads_all_states and drafter_kv is not None else None)
        if self.num_window_blocks:  # windowed layers with a pool of their own; drafters follow the full tables
            window = KVCacheManager(self.num_window_blocks, self.config.block_size, self.config.enable_prefix_caching,
                                    sliding_window=max(self.runner.window_group_windows), null_block=True)
            self.kv_cache_manager = HybridKVCacheManager(self.kv_cache_manager, window)
        self.scheduler = Scheduler(SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                                   self.max_model_len, self.runner.num_lookahead_tokens),
                                   self.kv_cache_manager)

    # ---- sizing -------------------------------------------------------------------------
    def _max_model_len(self) -> int:
        limit = self.model.config.max_position_embeddings
        if self.config.max_model_len is None:
            return limit
        if self.config.max_model_len > limit:
            raise ValueError(f"max_model_len {self.config.max_model_len} exceeds the model's "
                             f"max_position_embeddings {limit}")
        return self.config.max_model_len

    def _num_kv_blocks(self) -> int:
        per_block = self.runner.kv_bytes_per_block()  # the target's KV and the drafter's
        self.kv_bytes_per_token = per_block / self.config.block_size
        budget = self._full_kv_budget()
        num_blocks = self.config.num_kv_blocks or budget // per_block
        needed = -(-self.max_model_len // self.config.block_size)
        window = getattr(self.model, "kv_window", 0)
        if window:  # blocks before the window are freed as a sequence grows: it holds the window's and those of
            # its largest step (a prefill chunk, or a verification step's lookahead)
            step = max(self.config.max_num_batched_tokens, self.runner.num_lookahead_tokens + 1)
            needed = min(needed, -(-(window + step) // self.config.block_size) + 1)
        if num_blocks < needed and self.config.max_model_len is None and num_blocks >= 2:
            capped = num_blocks * self.config.block_size  # the model's own limit, not asked for: what fits
            logger.warning("max_model_len is capped to %d tokens, what the KV cache holds, below the model's %d; "
                           "raise kv_cache_memory_bytes (%d, %.1f MiB a block) for the model's full length",
                           capped, self.max_model_len, self.config.kv_cache_memory_bytes, per_block / 2**20)
            self.max_model_len = self.runner.max_model_len = capped
        elif num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks * self.config.block_size} tokens but one sequence of "
                f"max_model_len={self.max_model_len} needs {needed * per_block / 2**20:.1f} MiB "
                f"({needed} blocks); raise kv_cache_memory_bytes or lower max_model_len")
        return num_blocks

    def _full_kv_budget(self) -> int:
        """kv_cache_memory_bytes less the windowed layers' own pool, for a model mixing windowed and
        full-attention layers (sets num_window_blocks; 0 for other models). That pool gets what max_num_seqs
        sequences' windows and one step's blocks need, at most the budget's share its layers would have
        without it, so neither pool holds fewer tokens than one shared pool would."""
        self.num_window_blocks = 0
        window_bytes = self.runner.window_kv_bytes_per_block()
        budget = self.config.kv_cache_memory_bytes
        if not window_bytes:
            return budget
        bs, seqs, window = self.config.block_size, self.config.max_num_seqs, max(self.runner.window_group_windows)
        lookahead = self.runner.num_lookahead_tokens
        need = min(seqs * (-(-(window + lookahead) // bs) + 2) + -(-self.config.max_num_batched_tokens // bs),
                   seqs * -(-self.max_model_len // bs))
        share = window_bytes / (window_bytes + self.runner.kv_bytes_per_block())
        blocks = need if self.config.num_kv_blocks else min(need, int(budget * share) // window_bytes)
        one_sequence = -(-(window + max(self.config.max_num_batched_tokens, lookahead + 1)) // bs) + 1
        if blocks < min(one_sequence, need):
            raise ValueError(f"kv_cache_memory_bytes={budget} leaves the sliding-window layers {blocks} blocks, fewer "
                             f"than one sequence's window and step need ({one_sequence}); raise kv_cache_memory_bytes")
        self.num_window_blocks = blocks + 1  # and the null block
        return budget - self.num_window_blocks * window_bytes

    # ---- requests -----------------------------------------------------------------------
    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """prompt: a string, a list of token ids, or {"prompt": ...} / {"prompt_token_ids": ...}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text needs a tokenizer, but skip_tokenizer_init=True; send "
                                 "prompt_token_ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError("prompt must be a string, a list of token ids, or a dict with 'prompt' or "
                         f"'prompt_token_ids', got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, grammar=None) -> None:
        """Queue a request; raises ValueError (and leaves the engine untouched) if it cannot run. `grammar`:
        params.structured_outputs compiled beforehand by `compile_grammar`, as a server does on another thread
        so that a grammar slow to compile does not hold up the steps of the requests in flight."""
        params = params or SamplingParams()
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        ids, mm_features = self.mm_processor.process(ids, mm_data)
        self._validate_prompt(ids)
        if grammar is None:
            grammar = self.compile_grammar(params.structured_outputs)
        arrival_time = time.time() if arrival_time is None else arrival_time
        children = self._child_params(request_id, params)
        self.output_processor.add_request(request_id, text, ids, children, arrival_time)
        for child_id, child_params in children:
            self.scheduler.add_request(Request(child_id, ids, child_params, self.eos_token_ids, arrival_time,
                                               mm_features=mm_features, grammar=grammar))
        self.metrics.num_prompt_tokens += len(ids)

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens long; max_model_len is {self.max_model_len} "
                             "(the prompt plus at least one generated token must fit)")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids must be in [0, {vocab}), got {bad[0]}")

    def compile_grammar(self, structured):
        """The compiled grammar of a request's structured_outputs (cached by spec), or None; ValueError for
        a spec the grammar engine refuses. Thread-safe."""
        if structured is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer, but skip_tokenizer_init=True")
        with self._grammar_compiler_lock:
            if self._grammar_compiler is None:
                from specserve.structured.grammar import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model.config.vocab_size)
        try:
            return self._grammar_compiler.compile(structured.kind, structured.spec)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.{structured.kind}: {exc}") from exc

    @staticmethod
    def _child_params(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
        """n > 1 fans out into n sequences; seeded ones get seed + index so they differ."""
        if params.n == 1:
            return [(request_id, params)]
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            children.append((f"{request_id}#{i}", replace(params, n=1, seed=seed)))
        return children

    def abort_request(self, request_ids) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if not self.output_processor.has_request(rid):
                continue
            self.scheduler.finish_requests(self.output_processor.child_ids(rid), RequestStatus.FINISHED_ABORTED)
            self.output_processor.abort(rid)
            self.output_processor.make_output(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run, update. A request that fails on its own ends with its error while the step goes on
        for the others; a step that fails in a way no request owns resets the engine (`recover`), unless the
        engine itself is gone (FatalEngineError: a worker process died)."""
        try:
            return self._step()
        except FatalEngineError:
            raise
        except Exception as exc:  # noqa: BLE001 - the engine's state is unknown now: reset it, keep serving
            logger.exception("engine step failed; failing the requests in flight and resetting the engine")
            return self.recover(exc)

    def _step(self) -> list[RequestOutput]:
        self._step_req_ids, self._step_final_outputs = [], {}
        sched = self.scheduler.schedule()
        self._step_req_ids = sched.req_ids
        out = self.runner.execute_model(sched)
        failed = self._fail_children(out.failed)  # before the update, which then passes over them
        running = {rid: r for rid in sched.req_ids
                   if (r := self.scheduler.requests.get(rid)) is not None and r.status == RequestStatus.RUNNING}
        finished = self.scheduler.update_from_output(sched, out.sampled_token_ids, out.spec_token_ids,
                                                     out.draft_source_names)
        self._count(finished, sum(len(out.sampled_token_ids[rid]) for rid in running))
        for rid, drafts in sched.scheduled_spec_decode_tokens.items():
            if rid in running:
                self.metrics.record(len(drafts), len(out.sampled_token_ids.get(rid, ())) - 1)
        return failed + self._make_outputs(running, out.logprobs)

    def _make_outputs(self, running: dict[str, Request], logprobs) -> list[RequestOutput]:
        now = time.time()
        touched: dict[str, None] = {}
        stopped, failed = [], []
        for rid, request in running.items():
            parent = self.output_processor.parent_of(rid)
            if parent is None or (not request.output_token_ids and not request.is_finished):
                continue
            try:
                if self.output_processor.process(request, logprobs.get(rid), now) is not None:
                    stopped.append(rid)
            except Exception as exc:  # noqa: BLE001 - its text (detokenizing, stop strings) fails it alone
                logger.exception("request %s failed alone while its output was processed", rid)
                touched.pop(parent, None)
                failed.append(self._fail_request(parent, RequestFailure(f"processing the output: {exc!r}")))
                continue
            touched[parent] = None
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return failed + [self._make_output(p) for p in touched]

    def _make_output(self, parent_id: str) -> RequestOutput:
        """The request's output now; a final one is also kept for `recover`, should the step fail after it."""
        out = self.output_processor.make_output(parent_id)
        if out.finished:
            self._step_final_outputs[parent_id] = out
        return out

    def _fail_children(self, failures: dict[str, RequestFailure]) -> list[RequestOutput]:
        """End the requests whose sequences failed alone in the runner (one failed sequence fails its n). The KV
        the step wrote for them leaves the prefix cache, and requests that read it recompute."""
        parents = {}
        for child_id, failure in failures.items():
            parent = self.output_processor.parent_of(child_id)
            if parent is not None:
                parents.setdefault(parent, failure)
        if failures:
            children = [c for parent in parents for c in self.output_processor.child_ids(parent)]
            self.scheduler.discard_step_kv([*failures, *children])
        return [self._fail_request(parent, failure) for parent, failure in parents.items()]

    def _fail_request(self, parent_id: str, failure: RequestFailure, alone: bool = True) -> RequestOutput:
        """Finish every sequence of the request with the error; its final output. `alone`: the request failed
        on its own (counted in num_requests_failed), not with the whole step."""
        self.scheduler.finish_requests(self.output_processor.child_ids(parent_id), RequestStatus.FINISHED_ERROR)
        self.output_processor.fail(parent_id, failure.message, failure.from_input)
        self.metrics.num_requests_failed += alone
        return self._make_output(parent_id)

    def recover(self, exc: Exception) -> list[RequestOutput]:
        """After a step failed in a way no single request owns: fail the requests in flight with the error,
        give the block pool, prefix cache, scheduler and runner (drafter included) a new engine's state, and
        keep the requests that had not started. Returns a terminal output for every request in flight: the final
        output the step made before the fault (one that finished or failed alone in it), else its failure."""
        self.metrics.num_engine_restarts += 1
        old_scheduler, old_kv = self.scheduler, self.kv_cache_manager
        parent_of = self.output_processor.parent_of
        not_started = [r for r in old_scheduler.waiting if r.status == RequestStatus.WAITING]
        lost = self._in_flight(old_scheduler, {r.request_id for r in not_started})
        if not lost:  # nothing was in flight: the waiting requests are all the step had
            lost, not_started = dict.fromkeys(parent_of(r.request_id) for r in not_started), []
        self._build_scheduler(old_kv.num_blocks)
        self.scheduler.num_preemptions, self.kv_cache_manager.stats = old_scheduler.num_preemptions, old_kv.stats
        self.runner.reset()
        for request in not_started:
            if parent_of(request.request_id) not in lost:  # a sibling in flight fails its whole request
                self.scheduler.add_request(request)
        failure = RequestFailure(f"the engine step failed ({type(exc).__name__}: {exc}); the engine was reset")
        return [self._lost_output(parent, failure) for parent in lost if parent is not None]

    def _in_flight(self, scheduler: Scheduler, not_started: set[str]) -> dict[str, None]:
        """The requests (parent ids) in flight when a step failed: those the scheduler holds past waiting, those
        the step scheduled (one it freed before the fault is gone from the scheduler, not from the output
        processor), and those the step made a final output for (gone from both)."""
        held = [rid for rid in scheduler.requests if rid not in not_started]
        lost = dict.fromkeys(map(self.output_processor.parent_of, held + list(self._step_req_ids)))
        lost.pop(None, None)
        lost.update(dict.fromkeys(self._step_final_outputs))
        return lost

    def _lost_output(self, parent_id: str, failure: RequestFailure) -> RequestOutput:
        """A request's terminal output after its step failed: the final output the step made for it before the
        fault, else its failure."""
        if self.output_processor.has_request(parent_id):
            return self._fail_request(parent_id, failure, alone=False)
        return self._step_final_outputs[parent_id]

    def _count(self, finished: list[Request], num_generated: int) -> None:
        m = self.metrics
        m.num_generation_tokens += num_generated
        m.num_requests_finished += len(finished)
        m.num_preemptions = self.scheduler.num_preemptions
        m.prefix_cache_queries = self.kv_cache_manager.stats.queries
        m.prefix_cache_hits = self.kv_cache_manager.stats.hits

    def get_metrics(self) -> EngineMetrics:
        return self.metrics


def _config_eos_ids(hf_config: dict) -> set[int]:
    """End-of-sequence ids named by the model config (eos_token_id: int or list), without a tokenizer."""
    eos = hf_config.get("eos_token_id", (hf_config.get("text_config") or {}).get("eos_token_id"))
    return set() if eos is None else set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
