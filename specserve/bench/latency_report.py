"""`specserve bench latency`'s records and report: one prompt through one method (RequestTiming), the
per-category medians and ratios, the per-method summary over categories, and the printed tables.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from specserve.bench.common import BenchPrompt, format_table, median, prompts_summary, safe_div
from specserve.bench.llamacpp import LLAMACPP_PLAIN, LLAMACPP_PROMPT_LOOKUP, PROMPT_LOOKUP_TOKENS as LLAMACPP_LOOKUP

# num_speculative_tokens per method when --num-speculative-tokens is not given; the adaptive policy drafts
# fewer when they do not pay. On the default model a step over 1 + k tokens costs ~1 + 0.02-0.03k one-token
# steps at ~1k tokens of context, and an int8 self-draft ~0.5 of a step per draft token. ngram's k is 8:
# replaying plain decoding's outputs (benchmarks/spec_replay.py) at 2% per draft, k=8 matches k=5 everywhere
# but extraction, where long copies make it better (3.32 vs 3.01 tokens per unit of cost).
DEFAULT_NUM_SPECULATIVE_TOKENS = {"ngram": 8, "suffix": 5, "draft_model": 4, "eagle": 4, "eagle3": 4, "medusa": 3,
                                  "auto": None}  # auto: each of its proposers' own default
HF_PROMPT_LOOKUP_TOKENS = 10  # transformers' prompt_lookup_num_tokens, as in ANCHORS.md
PLAIN, HF_PLAIN, HF_PROMPT_LOOKUP = "plain", "hf_plain", "hf_prompt_lookup"
LABELS = {PLAIN: "specserve plain", **{m: f"specserve {m}" for m in DEFAULT_NUM_SPECULATIVE_TOKENS},
          **{f"{m}+tree": f"specserve {m} (trees)" for m in DEFAULT_NUM_SPECULATIVE_TOKENS},
          HF_PLAIN: "transformers plain",
          HF_PROMPT_LOOKUP: f"transformers prompt lookup ({HF_PROMPT_LOOKUP_TOKENS})",
          LLAMACPP_PLAIN: "llama.cpp plain", LLAMACPP_PROMPT_LOOKUP: f"llama.cpp prompt lookup ({LLAMACPP_LOOKUP})"}


@dataclass
class RequestTiming:
    """One prompt through one method: the numbers the per-category medians are taken over.

    ttft_s: arrival to first token; decode_s: first token to last token; total_s: the whole request.
    """

    method: str
    category: str
    question_id: Any
    num_prompt_tokens: int
    ttft_s: float
    decode_s: float
    total_s: float
    token_ids: list[int] = field(repr=False)
    acceptance_length: float | None = None  # 1 + accepted / drafts (speculative methods)
    spec_stats: dict = field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_tokens_per_s(self) -> float:
        """Output tokens after the first over the time after the first."""
        return safe_div(self.num_output_tokens - 1, self.decode_s) if self.num_output_tokens > 1 else float("nan")

    @property
    def e2e_tokens_per_s(self) -> float:
        return safe_div(self.num_output_tokens, self.total_s)

    def to_json(self) -> dict:
        return {"method": self.method, "category": self.category, "question_id": self.question_id,
                "num_prompt_tokens": self.num_prompt_tokens, "num_output_tokens": self.num_output_tokens,
                "ttft_s": self.ttft_s, "decode_s": self.decode_s, "total_s": self.total_s,
                "decode_tokens_per_s": self.decode_tokens_per_s, "e2e_tokens_per_s": self.e2e_tokens_per_s,
                "acceptance_length": self.acceptance_length, **self.spec_stats}

def reference_method(method: str) -> str | None:
    """Whose greedy tokens a method must reproduce: the plain decoding of the same engine."""
    if method in (PLAIN, HF_PLAIN, LLAMACPP_PLAIN):
        return None
    if method.startswith("llamacpp_"):
        return LLAMACPP_PLAIN
    return HF_PLAIN if method.startswith("hf_") else PLAIN


def summarize(timings: list[RequestTiming]) -> list[dict]:
    """One row per (category, method): medians over the category's prompts, decode-speed ratios to specserve
    plain and transformers plain (ratios of medians), and greedy equivalence with the reference method."""
    methods = list(dict.fromkeys(t.method for t in timings))
    categories = list(dict.fromkeys(t.category for t in timings))
    tokens = {(t.method, t.question_id): t.token_ids for t in timings}
    plain_of = {t.question_id: t for t in timings if t.method == PLAIN}
    rows = []
    for category in categories:
        decode = {m: median(t.decode_tokens_per_s for t in timings if t.method == m and t.category == category)
                  for m in methods}
        for method in methods:
            group = [t for t in timings if t.method == method and t.category == category]
            row = {"category": category, "method": method, "num_prompts": len(group),
                   "ttft_median_s": median(t.ttft_s for t in group),
                   "decode_tokens_per_s_median": decode[method],
                   "e2e_tokens_per_s_median": median(t.e2e_tokens_per_s for t in group),
                   "acceptance_length_median": _median_or_none(t.acceptance_length for t in group),
                   "decode_vs_specserve_plain": safe_div(decode[method], decode.get(PLAIN, float("nan"))),
                   "decode_vs_transformers_plain": safe_div(decode[method], decode.get(HF_PLAIN, float("nan"))),
                   "decode_vs_llamacpp_plain": safe_div(decode[method], decode.get(LLAMACPP_PLAIN, float("nan"))),
                   "decode_vs_specserve_plain_paired": paired_ratio(group, plain_of)}
            row.update(greedy_check(group, tokens, reference_method(method)))
            rows.append(row)
    return rows


def paired_ratio(group: list[RequestTiming], plain_of: dict) -> float | None:
    """Decode speed over specserve plain's, each prompt against plain's run of the same prompt in the same
    round (seconds apart): the median over rounds per prompt, the geometric mean over prompts. A host whose
    speed drifts between prompts moves both runs of a pair alike. None for a method plain does not pair with."""
    ratios = []
    for t in group:
        plain = plain_of.get(t.question_id)
        if plain is None or (t.method != PLAIN and reference_method(t.method) != PLAIN):
            return None
        mine = t.spec_stats.get("decode_s_rounds") or [t.decode_s]
        theirs = plain.spec_stats.get("decode_s_rounds") or [plain.decode_s]
        ratios.append(median([safe_div(p, m) for p, m in zip(theirs, mine)]))
    return geometric_mean(ratios) if ratios else None


def _median_or_none(values) -> float | None:
    values = [v for v in values if v is not None]
    return median(values) if values else None


def greedy_check(group: list[RequestTiming], tokens: dict, reference: str | None) -> dict:
    """How many of the group's outputs equal the reference's for the same prompt, and where each mismatch
    starts (None where there is no reference or it was not run)."""
    pairs = [(t, tokens.get((reference, t.question_id))) for t in group]
    pairs = [(t, ref) for t, ref in pairs if ref is not None]
    if reference is None or not pairs:
        return {"greedy_reference": None, "greedy_identical": None, "greedy_compared": 0, "greedy_mismatches": []}
    mismatches = [{"question_id": t.question_id, "first_diff": _first_diff(t.token_ids, ref)}
                  for t, ref in pairs if t.token_ids != ref]
    return {"greedy_reference": reference, "greedy_identical": len(pairs) - len(mismatches),
            "greedy_compared": len(pairs), "greedy_mismatches": mismatches}


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def geometric_mean(values) -> float:
    values = [v for v in values if v is not None and v == v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def acceptance_by_position(timings: list[RequestTiming]) -> list[float]:
    """Per draft position i, the share of all drafting rounds whose token i was accepted."""
    rounds = sum(t.spec_stats.get("num_drafts", 0) for t in timings)
    per_position = [t.spec_stats.get("accepted_per_position", []) for t in timings]
    width = max(map(len, per_position), default=0)
    return [sum(p[i] for p in per_position if i < len(p)) / rounds for i in range(width)] if rounds else []


def summarize_methods(rows: list[dict], timings: list[RequestTiming] = ()) -> list[dict]:
    """Per method, over categories: geometric means of the ratios, acceptance, and the greedy check's totals."""
    timings_of: dict[str, list[RequestTiming]] = {}
    for t in timings:
        timings_of.setdefault(t.method, []).append(t)
    summary = []
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        acceptance = [r["acceptance_length_median"] for r in mine if r["acceptance_length_median"] is not None]
        summary.append({
            "method": method, "num_categories": len(mine),
            "decode_vs_specserve_plain_geomean": geometric_mean(r["decode_vs_specserve_plain"] for r in mine),
            "decode_vs_transformers_plain_geomean": geometric_mean(r["decode_vs_transformers_plain"] for r in mine),
            "decode_vs_llamacpp_plain_geomean": geometric_mean(r["decode_vs_llamacpp_plain"] for r in mine),
            "decode_vs_specserve_plain_paired_geomean": geometric_mean(r.get("decode_vs_specserve_plain_paired")
                                                                       for r in mine),
            "decode_vs_specserve_plain_paired_min": min((r["decode_vs_specserve_plain_paired"] for r in mine
                                                         if r.get("decode_vs_specserve_plain_paired")), default=None),
            "ttft_median_s_geomean": geometric_mean(r["ttft_median_s"] for r in mine),
            "acceptance_length_mean": sum(acceptance) / len(acceptance) if acceptance else None,
            "acceptance_by_position": acceptance_by_position(timings_of.get(method, [])),
            "greedy_identical": sum(r["greedy_identical"] or 0 for r in mine),
            "greedy_compared": sum(r["greedy_compared"] for r in mine)})
    return summary


def build_report(args: argparse.Namespace, env: dict, configs: dict[str, dict], prompts: list[BenchPrompt],
                 timings: list[RequestTiming]) -> dict:
    rows = summarize(timings)
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    mismatches = [{"category": r["category"], "method": r["method"], **m}
                  for r in rows for m in r["greedy_mismatches"]]
    return {"benchmark": "latency", "settings": settings, "environment": env,
            "speculative_configs": configs, "hf_prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS,
            "timing_notes": "specserve: from RequestMetrics (ttft = first_token - arrival, decode = last_token - "
                            "first_token); transformers: ttft = a separate 1-token generate of the same prompt, "
                            "decode = full generate - that",
            "prompts": prompts_summary(prompts), "per_category": rows, "summary": summarize_methods(rows, timings),
            "greedy_mismatches": mismatches, "per_request": [t.to_json() for t in timings]}


def format_report(report: dict) -> str:
    """The per-category table, the per-method summary, and every greedy mismatch."""
    with_llamacpp = any(r["method"] == LLAMACPP_PLAIN for r in report["per_category"])
    headers = ["category", "method", "TTFT ms", "decode tok/s", "e2e tok/s", "accept len", "vs plain",
               "vs HF plain", *(["vs llama.cpp"] if with_llamacpp else []), "greedy = ref"]
    rows = [[r["category"], LABELS.get(r["method"], r["method"]), r["ttft_median_s"] * 1000,
             r["decode_tokens_per_s_median"], r["e2e_tokens_per_s_median"], r["acceptance_length_median"],
             _ratio(r["decode_vs_specserve_plain"]), _ratio(r["decode_vs_transformers_plain"]),
             *([_ratio(r.get("decode_vs_llamacpp_plain"))] if with_llamacpp else []), _greedy_cell(r)]
            for r in report["per_category"]]
    summary_headers = ["method", "decode vs plain (geomean)", "paired (geomean, lowest category)",
                       "decode vs HF plain (geomean)",
                       *(["decode vs llama.cpp plain (geomean)"] if with_llamacpp else []), "TTFT ms (geomean)",
                       "accept len (mean)", "greedy = ref"]
    summary = [[LABELS.get(s["method"], s["method"]), _ratio(s["decode_vs_specserve_plain_geomean"]),
                _paired_cell(s), _ratio(s["decode_vs_transformers_plain_geomean"]),
                *([_ratio(s.get("decode_vs_llamacpp_plain_geomean"))] if with_llamacpp else []),
                s["ttft_median_s_geomean"] * 1000, s["acceptance_length_mean"],
                f"{s['greedy_identical']}/{s['greedy_compared']}" if s["greedy_compared"] else None]
               for s in report["summary"]]
    lines = ["Medians over each category's prompts; ratios are of decode tok/s; 'greedy = ref' counts outputs "
             "identical to the same engine's plain decoding; 'paired': each prompt against plain's run of it in "
             "the same round.", format_table(headers, rows), "",
             "Summary over categories:", format_table(summary_headers, summary)]
    for s in report["summary"]:
        if s.get("acceptance_by_position"):
            lines.append(f"{LABELS.get(s['method'], s['method'])}: draft position accepted in "
                         + ", ".join(f"{r:.0%}" for r in s["acceptance_by_position"]) + " of rounds")
    for m in report["greedy_mismatches"]:
        lines.append(f"GREEDY MISMATCH: {LABELS.get(m['method'], m['method'])}, {m['category']} question "
                     f"{m['question_id']}: first differs from {LABELS[reference_method(m['method'])]} at output "
                     f"token {m['first_diff']}")
    return "\n".join(lines)


def speculative_mismatches(report: dict) -> list[str]:
    """One line per specserve speculative output that differs from specserve's plain decoding of the same
    prompt. transformers' prompt lookup is checked in the table too, but its mismatches are not ours to fail on."""
    return [f"{LABELS.get(m['method'], m['method'])} on {m['category']} question {m['question_id']}: output differs "
            f"from {LABELS[PLAIN]} at token {m['first_diff']}"
            for m in report["greedy_mismatches"] if reference_method(m["method"]) == PLAIN]


def _ratio(value: float | None) -> str | None:
    return None if value is None or value != value else f"{value:.2f}x"


def _paired_cell(summary: dict) -> str | None:
    paired = summary.get("decode_vs_specserve_plain_paired_geomean")
    lowest = summary.get("decode_vs_specserve_plain_paired_min")
    return None if paired is None or paired != paired else f"{paired:.2f}x, {lowest:.2f}x"


def _greedy_cell(row: dict) -> str | None:
    if not row["greedy_compared"]:
        return None
    cell = f"{row['greedy_identical']}/{row['greedy_compared']}"
    return cell if row["greedy_identical"] == row["greedy_compared"] else cell + " MISMATCH"
