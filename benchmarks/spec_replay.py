"""Offline replay of prompt-lookup drafting against real greedy outputs, to choose ngram settings.

Greedy speculative decoding emits exactly plain decoding's tokens, so how many drafts a setting gets
accepted can be computed from plain outputs alone, without running the model per setting. This script
generates plain greedy outputs for Spec-Bench prompts once, then replays each (prompt_lookup_min,
prompt_lookup_max, k, adaptive) setting with specserve's own matcher and draft-length policy and prints
tokens per unit of cost per category, where a step verifying d drafts costs 1 + cost * d one-token steps
(measure `cost` with `specserve bench latency`; it was ~0.035 for SmolLM2 here).

    .venv/bin/python benchmarks/spec_replay.py --prompts-per-category 6 --cost 0.035

With --bounds it also prints how far drafting could go with hindsight, at the same cost: drafting exactly
the tokens that will be accepted from the occurrence the matcher chose (a perfect draft length), and from
the best earlier occurrence of the last token (a perfect choice of occurrence too); and how often each
draft position is accepted by the length of the match the draft was copied after, from every position
of the outputs (k=8).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics

import numpy as np

from specserve.spec_decode.ngram import find_ngram_match, ngram_continuation, num_to_draft
from specserve.spec_decode.policy import DraftLengthPolicy

CATEGORIES = ["summarization", "math_reasoning", "coding", "translation", "qa", "rag", "writing", "extraction"]
SETTINGS = [(2, 5, 4), (1, 5, 4), (1, 5, 5), (1, 5, 6), (1, 5, 8), (1, 3, 5), (1, 8, 5)]


def generate(dataset: str, per_category: int, max_tokens: int) -> list[dict]:
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    rows = [json.loads(line) for line in open(dataset)]
    chosen = [r for c in CATEGORIES for r in [r for r in rows if r.get("category") == c][:per_category]]
    llm = LLM(max_num_seqs=16)
    outs = llm.chat([[{"role": "user", "content": r["turns"][0]}] for r in chosen],
                    SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [{"category": r["category"], "prompt": list(o.prompt_token_ids), "output": list(o.outputs[0].token_ids)}
            for r, o in zip(chosen, outs)]


def replay(item: dict, min_n: int, max_n: int, k: int, cost: float, adaptive: bool) -> float:
    """Output tokens per unit of step cost for one request under one setting."""
    tokens = item["prompt"] + item["output"]
    pos, end = len(item["prompt"]), len(tokens)
    policy = DraftLengthPolicy(cost_per_draft=cost, adaptive=adaptive)
    src_end = src_size = -1
    steps = 0.0
    while pos < end:
        history = np.asarray(tokens[:pos], dtype=np.int64)
        num = min(policy.num_drafts("r", k), end - pos - 1)
        draft = []
        if num > 0:
            match = find_ngram_match(history, min_n, max_n, src_end + pos - src_size if src_end >= 0 else -1)
            src_end, src_size = match, pos
            if match >= 0:
                draft = ngram_continuation(history, match, num_to_draft(history, match, num)).tolist()
        accepted = accepted_prefix(tokens, pos, draft)
        if draft:
            policy.record("r", len(draft), accepted)
        steps += 1 + cost * len(draft)
        pos += accepted + 1
    return len(item["output"]) / steps


def accepted_prefix(tokens: list[int], pos: int, draft: list[int]) -> int:
    """How many leading tokens of `draft` equal tokens[pos:]."""
    n = 0
    while n < len(draft) and pos + n < len(tokens) and tokens[pos + n] == draft[n]:
        n += 1
    return n


def match_length(history: np.ndarray, end: int, cap: int = 64) -> int:
    """Length of the common suffix of history[:end + 1] and history (at most cap)."""
    n, size = 0, history.shape[0]
    while n < cap and end - n >= 0 and history[end - n] == history[size - 1 - n]:
        n += 1
    return n


def hindsight(item: dict, k: int, cost: float, best_occurrence: bool) -> float:
    """Output tokens per unit of cost when every step drafts exactly the tokens that will be accepted
    (at most k): from the matcher's occurrence (1..5-token match), or from the best occurrence."""
    tokens = item["prompt"] + item["output"]
    pos, end, steps, src_end, src_size = len(item["prompt"]), len(tokens), 0.0, -1, -1
    while pos < end:
        history = np.asarray(tokens[:pos], dtype=np.int64)
        num = min(k, end - pos - 1)
        if best_occurrence:
            ends = np.flatnonzero(history[:-1] == history[-1]).tolist()
        else:
            match = find_ngram_match(history, 1, 5, src_end + pos - src_size if src_end >= 0 else -1)
            src_end, src_size = match, pos
            ends = [match] if match >= 0 else []
        accepted = max((accepted_prefix(tokens, pos, ngram_continuation(history, e, num).tolist())
                        for e in ends), default=0) if num > 0 else 0
        steps += 1 + cost * accepted
        pos += accepted + 1
    return len(item["output"]) / steps


LENGTH_BUCKETS = (1, 2, 3, 5, 8, 16, 64)


def acceptance_by_match_length(items: list[dict], k: int = 8) -> dict[int, np.ndarray]:
    """{bucket: [drafts seen, then per draft position i the fraction whose first i tokens were accepted]}
    over every output position, drafting k tokens after the matcher's occurrence."""
    counts = {b: np.zeros(k + 1) for b in LENGTH_BUCKETS}
    for item in items:
        tokens, start, prev = item["prompt"] + item["output"], len(item["prompt"]), -1
        for pos in range(start, len(tokens) - k):
            history = np.asarray(tokens[:pos], dtype=np.int64)
            match = find_ngram_match(history, 1, 5, prev + 1 if prev >= 0 else -1)
            prev = match
            if match >= 0:
                bucket = next(b for b in LENGTH_BUCKETS if match_length(history, match) <= b)
                counts[bucket][accepted_prefix(tokens, pos, ngram_continuation(history, match, k).tolist())] += 1
    out = {}
    for bucket, c in counts.items():
        if c.sum():
            out[bucket] = np.concatenate([[c.sum()], [c[i:].sum() / c.sum() for i in range(1, k + 1)]])
    return out


def print_bounds(items: list[dict], categories: list[str], cost: float) -> None:
    print(f"\nwith hindsight (k=8, cost {cost}): tokens per unit of cost, median over prompts")
    for label, best in (("perfect draft length", False), ("and best occurrence", True)):
        row = [statistics.median(hindsight(i, 8, cost, best) for i in items if i["category"] == c)
               for c in categories]
        geo = math.exp(sum(map(math.log, row)) / len(row))
        print(f"{label:>20}  " + " ".join(f"{x:10.2f}" for x in row) + f"  {geo:.3f}")
    print("\ndraft positions accepted, by the length of the match copied after (all categories, k=8)")
    print("match <=  drafts  " + " ".join(f"{i:>5}" for i in range(1, 9)))
    for bucket, row in acceptance_by_match_length(items).items():
        print(f"{bucket:>8}  {int(row[0]):6d}  " + " ".join(f"{x:5.2f}" for x in row[1:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="../shared/data/specbench.jsonl")
    p.add_argument("--prompts-per-category", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--cost", type=float, default=0.035, help="cost of one verified draft token, in steps")
    p.add_argument("--outputs", default="bench_results/spec_replay_outputs.json",
                   help="plain outputs, generated once and reused")
    p.add_argument("--bounds", action="store_true", help="also print the hindsight bounds and acceptance by match length")
    args = p.parse_args()
    try:
        items = json.load(open(args.outputs))
    except FileNotFoundError:
        items = generate(args.dataset, args.prompts_per_category, args.max_tokens)
        json.dump(items, open(args.outputs, "w"))
    categories = list(dict.fromkeys(i["category"] for i in items))
    print(f"tokens per unit of cost (median over prompts), cost per draft token {args.cost}")
    print("min,max,k  adaptive  " + " ".join(f"{c[:10]:>10}" for c in categories) + "  geomean")
    for min_n, max_n, k in SETTINGS:
        for adaptive in (True, False):
            row = [statistics.median(replay(i, min_n, max_n, k, args.cost, adaptive)
                                     for i in items if i["category"] == c) for c in categories]
            geo = math.exp(sum(map(math.log, row)) / len(row))
            print(f"{min_n},{max_n},{k:<3}  {'yes' if adaptive else 'no ':>8}  "
                  + " ".join(f"{x:10.2f}" for x in row) + f"  {geo:.3f}")
    if args.bounds:
        print_bounds(items, categories, args.cost)


if __name__ == "__main__":
    main()
