"""Prometheus metrics for the server, in one CollectorRegistry per app: request outcomes and latencies observed
per output, engine load and token/speculation counters read from the engine thread's latest snapshot.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specserve.engine.outputs import RequestOutput

PREFIX = "specserve:"
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


@dataclass
class _Progress:
    num_tokens: int = 0
    last_token_time: float | None = None


class ServerMetrics:
    """`record_output` / `record_abort` run on the engine thread; `render` on the event loop."""

    def __init__(self, async_engine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._progress: dict[str, _Progress] = {}
        self.request_success = Counter(
            PREFIX + "request_success", "Finished sequences (each of n choices counts) by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Arrival to first output token.", ["model_name"],
            buckets=_TTFT_BUCKETS, registry=self.registry).labels(**labels)
        # With speculation one step emits several tokens; each gets an equal share of the step's interval,
        # so the histogram's mean is the time per output token.
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between output tokens (a step's interval split "
            "evenly over the tokens it emitted).", ["model_name"], buckets=_ITL_BUCKETS,
            registry=self.registry).labels(**labels)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival to finish, finished requests.", ["model_name"],
            buckets=_E2E_BUCKETS, registry=self.registry).labels(**labels)
        self.model_name = model_name
        self.registry.register(_EngineCollector(async_engine, model_name))

    def record_output(self, out: RequestOutput) -> None:
        m = out.metrics
        progress = self._progress.setdefault(out.request_id, _Progress())
        num_tokens = sum(len(o.token_ids) for o in out.outputs)
        new = num_tokens - progress.num_tokens
        if new > 0 and m.last_token_time is not None:
            if progress.last_token_time is None:
                if m.first_token_time is not None:
                    self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
                new -= 1
                progress.last_token_time = m.first_token_time
            if new > 0 and progress.last_token_time is not None:
                per_token = max(0.0, m.last_token_time - progress.last_token_time) / new
                for _ in range(new):
                    self.itl.observe(per_token)
            progress.num_tokens, progress.last_token_time = num_tokens, m.last_token_time
        if out.finished:
            del self._progress[out.request_id]
            for o in out.outputs:
                self.request_success.labels(self.model_name, o.finish_reason or "unknown").inc()
            if m.finished_time is not None:
                self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))

    def record_abort(self, request_id: str) -> None:
        self._progress.pop(request_id, None)
        self.request_success.labels(self.model_name, "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and engine-wide counters, read at scrape time from the engine thread's last snapshot."""

    def __init__(self, async_engine, model_name: str) -> None:
        self.async_engine = async_engine
        self.model_name = model_name

    def describe(self):
        return []  # collected lazily: the engine's counters are not known at registration

    def collect(self):
        snap = self.async_engine.snapshot
        labels = [self.model_name]
        yield _gauge("num_requests_running", "Requests in the running batch.", snap.num_running, labels)
        yield _gauge("num_requests_waiting", "Requests waiting to be scheduled.", snap.num_waiting, labels)
        yield _gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
                     snap.kv_cache_usage, labels)
        m = snap.metrics
        if m is None:
            return
        for name, doc, value in (
                ("prompt_tokens", "Prompt tokens received.", m.num_prompt_tokens),
                ("generation_tokens", "Tokens generated.", m.num_generation_tokens),
                ("num_preemptions", "Requests preempted for lack of KV blocks.", m.num_preemptions),
                ("prefix_cache_queries", "Prompt blocks looked up in the prefix cache.", m.prefix_cache_queries),
                ("prefix_cache_hits", "Prompt blocks found in the prefix cache.", m.prefix_cache_hits),
                ("spec_decode_num_drafts", "Draft sequences verified.", m.num_drafts),
                ("spec_decode_num_draft_tokens", "Draft tokens verified.", m.num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", m.num_accepted_tokens)):
            yield _counter(name, doc, value, labels)
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=["model_name", "position"])
        for position, value in enumerate(m.accepted_per_position):
            per_pos.add_metric([self.model_name, str(position)], value)
        yield per_pos


def _gauge(name: str, doc: str, value: float, labels: list[str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


def _counter(name: str, doc: str, value: float, labels: list[str]) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family
