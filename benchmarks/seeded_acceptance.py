"""How often drafts are accepted under the two lossless verification rules for sampling, on the default model.

Unseeded requests are verified by rejection sampling (accept d with probability min(1, p(d) / q(d))); seeded
ones by coupling (accept d exactly when it equals the target's own draw at that position, keyed by the seed and
the position, the drafter drawing its drafts with the same uniforms). Both keep the target distribution; this
prints, per method, the mean acceptance length (tokens per verification step) and the share of draft tokens
accepted under each rule, on the same prompts and sampling parameters. Fixed drafts (ngram, suffix) are
accepted with probability p(d) under both; a model drafter's q meets p best under rejection sampling (its
acceptance, 1 - TV(p, q), is the most any rule can give), which is why unseeded requests keep it.

    .venv/bin/python benchmarks/seeded_acceptance.py --num-prompts 26 --max-tokens 96
"""
from __future__ import annotations

import argparse
import json

from specserve.bench.common import DEFAULT_DATASET, read_specbench, render_prompts
from specserve.bench.latency import select_per_category
from specserve.llm import LLM
from specserve.models.loader import default_model_path
from specserve.sampling_params import SamplingParams

METHODS = {
    "suffix": {"method": "suffix"},
    "draft_model": {"method": "draft_model", "model": None, "quantization": "int8"},  # the target, int8
    "eagle3": {"method": "eagle3"},
}


def acceptance(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> dict:
    before = llm.get_metrics()
    drafts, tokens, accepted = before.num_drafts, before.num_draft_tokens, before.num_accepted_tokens
    llm.generate(prompts, params, use_tqdm=False)
    m = llm.get_metrics()
    drafts, tokens, accepted = m.num_drafts - drafts, m.num_draft_tokens - tokens, m.num_accepted_tokens - accepted
    return {"mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "accepted_share": accepted / tokens if tokens else None, "draft_tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default=DEFAULT_DATASET)
    ap.add_argument("--num-prompts", type=int, default=26, help="taken round-robin over the categories")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    rows = read_specbench(args.dataset)
    categories = sorted({r["category"] for r in rows})
    per_category = -(-args.num_prompts // len(categories))
    rows = select_per_category(rows, categories, per_category)[:args.num_prompts]
    results = {}
    print(f"{'method':<12} {'rule':<18} {'mean acc. length':>16} {'accepted share':>15} {'draft tokens':>13}")
    for name in args.methods.split(","):
        spec = dict(METHODS[name], num_speculative_tokens=args.k, adaptive_draft_length=False)
        if "model" in spec:
            spec["model"] = default_model_path()
        llm = LLM(speculative_config=spec, max_model_len=2048, max_num_seqs=8)
        prompts = [{"prompt_token_ids": p.token_ids} for p in render_prompts(llm.get_tokenizer(), rows)]
        base = dict(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, ignore_eos=True)
        for rule, seeds in (("rejection sampling", [None] * len(prompts)), ("coupling (seeded)", range(len(prompts)))):
            result = acceptance(llm, prompts, [SamplingParams(**base, seed=s) for s in seeds])
            results[f"{name}/{rule}"] = result
            print(f"{name:<12} {rule:<18} {result['mean_acceptance_length']:>16.3f} "
                  f"{result['accepted_share']:>15.3f} {result['draft_tokens']:>13}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
