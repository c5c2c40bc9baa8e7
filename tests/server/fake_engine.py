"""A stand-in for LLMEngine with its add/abort/step surface: one character per request per step, the first
`max_running` requests running and the rest waiting, and a gate that holds `step()` until opened."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from specserve.engine.engine import EngineMetrics
from specserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from specserve.engine.scheduler import SchedulerStats


class FakeTokenizer:
    """One token per character (ids are code points); a chat template of tagged lines."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        turns = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return turns + ("<assistant>" if add_generation_prompt else "")


class FakeEngine:
    def __init__(self, max_running: int = 8, fail_on_step: int | None = None) -> None:
        self.requests: dict[str, tuple[list[int], object, RequestOutput]] = {}
        self.order: list[str] = []
        self.aborted: list[str] = []
        self.max_running = max_running
        self.fail_on_step = fail_on_step
        self.num_steps = 0
        self.gate = threading.Event()
        self.gate.set()
        self.scheduler = self
        self.metrics = EngineMetrics()
        self.config = SimpleNamespace(kv_cache_dtype="auto")
        self.kv_bytes_per_token = 1024.0  # one block of 16 tokens a request, of 100

    def add_request(self, request_id, prompt, params, arrival_time=None, grammar=None) -> None:
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else [ord(c) for c in prompt]
        if not ids:
            raise ValueError("prompt must not be empty")
        completion = CompletionOutput(0, "", [], None, None)
        out = RequestOutput(request_id, None, list(ids), [completion], False, RequestMetrics(arrival_time or 0.0))
        self.requests[request_id] = (ids, params, out)
        self.order.append(request_id)
        self.metrics.num_prompt_tokens += len(ids)

    def compile_grammar(self, structured):
        return structured

    def abort_request(self, request_id) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.order.remove(request_id)
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.gate.wait()
        self.num_steps += 1
        if self.fail_on_step == self.num_steps:
            raise RuntimeError("simulated engine failure")
        time.sleep(0.001)
        outputs = []
        for rid in list(self.order[: self.max_running]):
            _, params, out = self.requests[rid]
            c = out.outputs[0]
            c.token_ids.append(ord("a"))
            c.text += "a"
            now = time.time()
            out.metrics.first_token_time = out.metrics.first_token_time or now
            out.metrics.last_token_time = now
            self.metrics.num_generation_tokens += 1
            if len(c.token_ids) >= (getattr(params, "max_tokens", None) or 4):
                c.finish_reason, out.finished = "length", True
                out.metrics.finished_time = now
                del self.requests[rid]
                self.order.remove(rid)
            outputs.append(RequestOutput(out.request_id, out.prompt, out.prompt_token_ids,
                                         [CompletionOutput(0, c.text, list(c.token_ids), None, None,
                                                           c.finish_reason)], out.finished, out.metrics))
        return outputs

    # the scheduler's and engine's read-only views
    def get_stats(self) -> SchedulerStats:
        running = min(len(self.order), self.max_running)
        return SchedulerStats(running, len(self.order) - running, kv_cache_usage=len(self.order) / 100,
                              kv_cache_blocks_in_use=len(self.order), kv_cache_blocks=100)

    def get_metrics(self) -> EngineMetrics:
        return self.metrics


def build_fake_engine(config) -> FakeEngine:
    """An engine factory for replica processes: a FakeEngine sized by the replicas' config."""
    engine = FakeEngine(max_running=config.max_num_seqs)
    engine.max_model_len = config.max_model_len or 64
    engine.model = SimpleNamespace(config=SimpleNamespace(vocab_size=0x110000))
    return engine
