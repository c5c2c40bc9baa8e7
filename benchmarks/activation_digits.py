"""How often one int8 digit per activation (gguf_compute="q8") changes greedy output against two (the default).

Runs the default model greedily (chat template, EOS ignored) over Spec-Bench's first N questions of every
category with both arithmetic paths, and prints, per category and over all, the share of outputs whose
tokens differ and the median position of the first difference among those (the text before it is equal).
Speed is `specserve bench latency --gguf-compute q8` against the default, in one run.

    .venv/bin/python benchmarks/activation_digits.py --prompts-per-category 4 --max-tokens 128
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from specserve.bench.common import DEFAULT_DATASET, read_specbench, render_prompts
from specserve.bench.latency import select_per_category
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ, None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default=DEFAULT_DATASET)
    p.add_argument("--prompts-per-category", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()

    dataset = read_specbench(args.dataset)
    categories = sorted({row["category"] for row in dataset})
    rows = select_per_category(dataset, categories, args.prompts_per_category)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs = {}
    for compute in ("int8", "q8"):
        llm = LLM(max_num_seqs=16, gguf_compute=compute)
        prompts = render_prompts(llm.get_tokenizer(), rows)
        outs = llm.generate([pr.as_engine_prompt() for pr in prompts], params, use_tqdm=False)
        outputs[compute] = [o.outputs[0].token_ids for o in outs]
        del llm

    changed, where = defaultdict(int), defaultdict(list)
    for row, two, one in zip(rows, outputs["int8"], outputs["q8"]):
        at = first_difference(list(two), list(one))
        if at is not None:
            changed[row["category"]] += 1
            where[row["category"]].append(at)
    print(f"{len(rows)} prompts ({args.prompts_per_category} per category), {args.max_tokens} greedy tokens: "
          f"outputs that differ between two int8 digits (int8) and one (q8)")
    for category in categories:
        n = sum(r["category"] == category for r in rows)
        at = f", first difference at token {statistics.median(where[category]):.0f} (median)" if where[category] else ""
        print(f"  {category:24s} {changed[category]}/{n}{at}")
    total = sum(changed.values())
    positions = [i for v in where.values() for i in v]
    at = f", first difference at token {statistics.median(positions):.0f} (median)" if positions else ""
    print(f"  {'all':24s} {total}/{len(rows)} = {total / len(rows):.0%}{at}")


if __name__ == "__main__":
    main()
