"""Plumbing of `specserve bench serve` (statistics, report); the benchmark itself is run by hand."""
from __future__ import annotations

import math
from dataclasses import asdict

from specserve.bench.serve import RequestRecord, agreement, format_report, percentiles, summarize


def test_percentiles_pick_ranked_values_and_skip_nan():
    values = [float(v) for v in range(1, 101)] + [float("nan")]
    p = percentiles(values)
    assert (p["p50"], p["p90"], p["p99"]) == (51.0, 90.0, 99.0) and p["mean"] == 50.5
    assert math.isnan(percentiles([])["p50"])


def test_summary_and_report():
    ok = RequestRecord(0, ttft_s=0.1, e2e_s=1.1, chunk_gaps_s=[0.1] * 5, num_output_tokens=11, text="x",
                       speculation={"num_drafts": 4, "num_draft_tokens": 8, "num_accepted_tokens": 6})
    failed = RequestRecord(1, error="HTTP 503: full")
    s = summarize([ok, failed], wall_s=2.0, concurrency=2)
    assert s["num_failed"] == 1 and s["output_tokens_per_s"] == 5.5
    assert s["tpot_s"]["p50"] == 0.1 and s["mean_acceptance_length"] == 2.5 and s["acceptance_rate"] == 0.75
    scenarios = {name: {**s, "requests": [asdict(ok), asdict(failed)]} for name in ("no_speculation", "speculation")}
    assert agreement(scenarios) == {"identical": 1, "total": 2}
    report = {"env": {"cpu_count": 2}, "args": {"num_prompts": 2, "max_tokens": 11},
              "greedy_agreement": agreement(scenarios), "scenarios": scenarios}
    text = format_report(report)
    assert "speculation" in text and "2.50" in text and "HTTP 503" in text
