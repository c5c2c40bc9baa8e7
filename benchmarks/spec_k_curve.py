"""Decode speed against k: plain decoding and each method at each k on the same prompts, one request at a time,
greedy, EOS ignored (every run makes the same number of tokens), in one process; every speculative output is
checked against plain decoding's tokens. Prints per method and k the median over prompts of decode tok/s and
its ratio to plain on the same prompt, and the mean acceptance length; writes the rows as JSON.

    .venv/bin/python benchmarks/spec_k_curve.py --model qwen2.5-coder-1.5b-instruct \\
        --dataset specserve/bench/data/code_edit.jsonl --methods suffix,ngram --ks 4,8,16,32
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics

from specserve.bench.common import read_specbench, render_prompts, select_spread
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.tokenizer import load_tokenizer


def decode_rate(out) -> float:
    m, n = out.metrics, len(out.outputs[0].token_ids)
    return (n - 1) / (m.last_token_time - m.first_token_time)


def run(model: str, spec: dict | None, prompts, max_tokens: int, max_model_len: int):
    """Per prompt: (token ids, decode tok/s, mean acceptance length or None)."""
    llm = LLM(model=model, speculative_config=spec, max_model_len=max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm up
    rows = []
    for prompt in prompts:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        rows.append((out.outputs[0].token_ids, decode_rate(out), out.metrics.mean_acceptance_length))
    del llm
    gc.collect()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dataset", required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--methods", default="suffix,ngram")
    p.add_argument("--ks", default="4,8,16,32")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--output-json", default="bench_results/spec_k_curve.json")
    args = p.parse_args()
    rows = select_spread(read_specbench(args.dataset), args.prompts)
    prompts = [b.as_engine_prompt() for b in render_prompts(load_tokenizer(args.model), rows)]
    plain = run(args.model, None, prompts, args.max_tokens, args.max_model_len)
    results = [{"method": "plain", "k": 0, "tok_s": statistics.median(r[1] for r in plain), "ratio": 1.0,
                "acceptance_length": None, "identical": True}]
    for method in args.methods.split(","):
        for k in map(int, args.ks.split(",")):
            spec = {"method": method, "num_speculative_tokens": k}
            got = run(args.model, spec, prompts, args.max_tokens, args.max_model_len)
            results.append({
                "method": method, "k": k, "tok_s": statistics.median(r[1] for r in got),
                "ratio": statistics.median(g[1] / b[1] for g, b in zip(got, plain)),
                "acceptance_length": statistics.mean(r[2] or 1.0 for r in got),
                "identical": all(g[0] == b[0] for g, b in zip(got, plain))})
            print(json.dumps(results[-1]), flush=True)
    print(f"{'method':<10} {'k':>3} {'decode tok/s':>13} {'x plain':>8} {'accepted/step':>14} identical")
    for r in results:
        al = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        print(f"{r['method']:<10} {r['k']:>3} {r['tok_s']:>13.1f} {r['ratio']:>8.2f} {al:>14} {r['identical']}")
    with open(args.output_json, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
