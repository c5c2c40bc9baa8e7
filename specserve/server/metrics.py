"""Prometheus metrics for the server, in one CollectorRegistry per app: request outcomes and latencies observed
per output, engine load and token/speculation counters read from the engine thread's latest snapshot.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

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


class _Latencies:
    """The three latency histograms for one label set (the model, or the model and one replica)."""

    def __init__(self, ttft: Histogram, itl: Histogram, e2e: Histogram, labels: list[str]) -> None:
        self.ttft, self.itl, self.e2e = ttft.labels(*labels), itl.labels(*labels), e2e.labels(*labels)


class ServerMetrics:
    """`record_output` / `record_abort` run on the engine thread (on the event loop with replicas); `render`
    on the event loop.

    With replicas (`num_replicas` given), every metric also has a per-replica twin named `replica_<name>` with
    a `replica` label ("0".."M-1"), and the replicas' health is exported; the metrics under their usual names
    stay the totals over all replicas, so existing queries and dashboards read the same thing.
    """

    def __init__(self, async_engine, model_name: str, num_replicas: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self._progress: dict[str, _Progress] = {}
        self.model_name = model_name
        self.request_success = Counter(
            PREFIX + "request_success", "Finished sequences (each of n choices counts) by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry)
        self.latencies = _Latencies(*self._histograms("", ["model_name"]), [model_name])
        self._replica_latencies: list[_Latencies] = []
        if num_replicas is not None:
            self.replica_request_success = Counter(
                PREFIX + "replica_request_success", "Finished sequences by replica and finish reason.",
                ["model_name", "replica", "finished_reason"], registry=self.registry)
            histograms = self._histograms("replica_", ["model_name", "replica"])
            self._replica_latencies = [_Latencies(*histograms, [model_name, str(i)]) for i in range(num_replicas)]
        self.registry.register(_EngineCollector(async_engine, model_name, per_replica=num_replicas is not None))

    def _histograms(self, prefix: str, labels: list[str]) -> tuple[Histogram, Histogram, Histogram]:
        by = " By replica." if prefix else ""
        ttft = Histogram(PREFIX + prefix + "time_to_first_token_seconds", "Arrival to first output token." + by,
                         labels, buckets=_TTFT_BUCKETS, registry=self.registry)
        # With speculation one step emits several tokens; each gets an equal share of the step's interval,
        # so the histogram's mean is the time per output token.
        itl = Histogram(PREFIX + prefix + "inter_token_latency_seconds", "Time between output tokens (a step's "
                        "interval split evenly over the tokens it emitted)." + by, labels, buckets=_ITL_BUCKETS,
                        registry=self.registry)
        e2e = Histogram(PREFIX + prefix + "e2e_request_latency_seconds", "Arrival to finish, finished requests." + by,
                        labels, buckets=_E2E_BUCKETS, registry=self.registry)
        return ttft, itl, e2e

    def record_output(self, out: RequestOutput, replica: int | None = None) -> None:
        targets = [self.latencies]
        if replica is not None and self._replica_latencies:
            targets.append(self._replica_latencies[replica])
        m = out.metrics
        progress = self._progress.setdefault(out.request_id, _Progress())
        num_tokens = sum(len(o.token_ids) for o in out.outputs)
        new = num_tokens - progress.num_tokens
        if new > 0 and m.last_token_time is not None:
            if progress.last_token_time is None:
                if m.first_token_time is not None:
                    for t in targets:
                        t.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
                new -= 1
                progress.last_token_time = m.first_token_time
            if new > 0 and progress.last_token_time is not None:
                per_token = max(0.0, m.last_token_time - progress.last_token_time) / new
                for t in targets:
                    for _ in range(new):
                        t.itl.observe(per_token)
            progress.num_tokens, progress.last_token_time = num_tokens, m.last_token_time
        if out.finished:
            del self._progress[out.request_id]
            for o in out.outputs:
                self._count_finished(o.finish_reason or "unknown", replica)
            if m.finished_time is not None:
                for t in targets:
                    t.e2e.observe(max(0.0, m.finished_time - m.arrival_time))

    def record_abort(self, request_id: str, replica: int | None = None) -> None:
        self._progress.pop(request_id, None)
        self._count_finished("abort", replica)

    def _count_finished(self, reason: str, replica: int | None) -> None:
        self.request_success.labels(self.model_name, reason).inc()
        if replica is not None and self._replica_latencies:
            self.replica_request_success.labels(self.model_name, str(replica), reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


# (name, help, EngineMetrics field) of the engine-wide counters
_ENGINE_COUNTERS = (
    ("prompt_tokens", "Prompt tokens received.", "num_prompt_tokens"),
    ("generation_tokens", "Tokens generated.", "num_generation_tokens"),
    ("num_preemptions", "Requests preempted for lack of KV blocks.", "num_preemptions"),
    ("prefix_cache_queries", "Prompt blocks looked up in the prefix cache.", "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt blocks found in the prefix cache.", "prefix_cache_hits"),
    ("num_requests_failed_alone", "Requests ended by an error of their own (a grammar, an image) while the "
     "others went on.", "num_requests_failed"),
    ("num_engine_restarts", "Steps that failed in a way no request owns: the requests in flight failed and the "
     "engine reset its state and went on.", "num_engine_restarts"),
    ("spec_decode_num_drafts", "Draft sequences verified.", "num_drafts"),
    ("spec_decode_num_draft_tokens", "Draft tokens verified.", "num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "num_accepted_tokens"),
)


class _EngineCollector:
    """Gauges and engine-wide counters, read at scrape time from the engine's last snapshot (and with
    replicas, from each replica's)."""

    def __init__(self, async_engine, model_name: str, per_replica: bool = False) -> None:
        self.async_engine = async_engine
        self.model_name = model_name
        self.per_replica = per_replica

    def describe(self):
        return []  # collected lazily: the engine's counters are not known at registration

    def collect(self):
        yield from _snapshot_families(self.async_engine.snapshot, "", [], [self.model_name])
        if not self.per_replica:
            return
        replicas = self.async_engine.replicas
        families = [_snapshot_families(r.snapshot if r.alive else _dead(r.snapshot), "replica_", ["replica"],
                                       [self.model_name, str(r.index)]) for r in replicas]
        for parts in zip(*families):  # one family per metric, with every replica's sample
            family = parts[0]
            for other in parts[1:]:
                family.samples.extend(other.samples)
            yield family
        yield from self._health(replicas)

    def _health(self, replicas):
        labels = ["model_name", "replica"]
        alive = GaugeMetricFamily(PREFIX + "replica_alive", "1 while the replica runs, 0 once it has died.",
                                  labels=labels)
        in_flight = GaugeMetricFamily(PREFIX + "replica_num_requests_in_flight",
                                      "Requests the router has sent to the replica and not seen finish.", labels=labels)
        retried = CounterMetricFamily(PREFIX + "replica_requests_retried", "Requests moved to another replica "
                                      "when this one died before they produced output.", labels=labels)
        failed = CounterMetricFamily(PREFIX + "replica_requests_failed", "Requests ended with an error because "
                                     "this replica died while running them.", labels=labels)
        for r in replicas:
            values = [self.model_name, str(r.index)]
            alive.add_metric(values, int(r.alive))
            in_flight.add_metric(values, r.num_in_flight)
            retried.add_metric(values, r.num_retried)
            failed.add_metric(values, r.num_failed)
        yield from (alive, in_flight, retried, failed)
        yield _gauge("replicas_alive", "Replicas running.", sum(r.alive for r in replicas), [self.model_name])


def _snapshot_families(snap, prefix: str, extra_labels: list[str], values: list[str]):
    """The gauges and counters of one EngineSnapshot, each metric named PREFIX + prefix + name; with
    extra_labels (one replica) the same families every time, empty before the replica's first report."""
    labels = ["model_name", *extra_labels]
    yield _gauge(prefix + "num_requests_running", "Requests in the running batch.", snap.num_running, values, labels)
    yield _gauge(prefix + "num_requests_waiting", "Requests waiting to be scheduled.", snap.num_waiting, values,
                 labels)
    yield _gauge(prefix + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
                 snap.kv_cache_usage, values, labels)
    yield _gauge(prefix + "kv_cache_blocks_in_use", "KV-cache blocks referenced by requests.",
                 snap.kv_cache_blocks_in_use, values, labels)
    yield _gauge(prefix + "kv_cache_blocks", "KV-cache blocks in the pool.", snap.kv_cache_blocks, values, labels)
    yield _gauge(prefix + "kv_cache_bytes_per_token", "Bytes of KV cache one token takes (the target's and its "
                 "drafter's, in kv_cache_dtype).", snap.kv_cache_bytes_per_token, values, labels)
    if not extra_labels and snap.kv_cache_dtype:
        yield _gauge("cache_config_info", "The KV cache's configuration, as labels.", 1,
                     [*values, snap.kv_cache_dtype], ["model_name", "kv_cache_dtype"])
    m = snap.metrics
    if m is None and not extra_labels:
        return  # the engine has not published its counters yet
    for name, doc, attr in _ENGINE_COUNTERS:
        family = CounterMetricFamily(PREFIX + prefix + name, doc, labels=labels)
        if m is not None:
            family.add_metric(values, getattr(m, attr))
        yield family
    per_pos = CounterMetricFamily(PREFIX + prefix + "spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by position in the draft.", labels=[*labels, "position"])
    for position, value in enumerate(m.accepted_per_position if m is not None else ()):
        per_pos.add_metric([*values, str(position)], value)
    yield per_pos


def _dead(snap):
    """A dead replica's snapshot as exported: no load and no blocks, its counters as they last were."""
    return replace(snap, num_running=0, num_waiting=0, kv_cache_usage=0.0, kv_cache_blocks_in_use=0,
                   kv_cache_blocks=0)


def _gauge(name: str, doc: str, value: float, values: list[str], labels: list[str] | None = None
           ) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, doc, labels=labels or ["model_name"])
    family.add_metric(values, value)
    return family
