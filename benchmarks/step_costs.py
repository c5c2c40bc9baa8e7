"""Where a speculative method's decode time goes at batch 1: step time by step size, in the engine.

Loads specserve's plain decoding and one speculative method, runs the same Spec-Bench prompts through
both in turn (greedy, 128 tokens, every prompt fully prefilled), and prints for each engine the median
`execute_model` time of its decode and verification steps by number of tokens in the step, the tokens
emitted per step, and the decode-time ratio. A step over 1 + k tokens costs more than a one-token step
by what the k extra rows cost (attention over the context, the GEMMs' arithmetic, the LM head's
screen); the ratio of the two medians is the price of verification that the drafts must repay.

    .venv/bin/python benchmarks/step_costs.py --category summarization --method ngram --rounds 2
    .venv/bin/python benchmarks/step_costs.py --category writing --method eagle3 --k 4   # the shipped head
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from specserve.bench.common import DEFAULT_DATASET, read_specbench, render_prompts
from specserve.bench.latency import select_per_category
from specserve.config import SPEC_METHODS
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams


def timed_drafting(llm: LLM) -> list[float]:
    """Seconds of propose_draft_token_ids (the drafter's whole share of a step) for every step from now on."""
    runner, times = llm.llm_engine.runner, []
    propose = runner.propose_draft_token_ids

    def propose_timed(*args, **kwargs):
        start = time.perf_counter()
        out = propose(*args, **kwargs)
        times.append(time.perf_counter() - start)
        return out

    runner.propose_draft_token_ids = propose_timed
    return times


def timed_steps(llm: LLM) -> list[tuple[int, float]]:
    """(tokens in the step, seconds of execute_model) for every step the engine runs from now on."""
    runner, steps = llm.llm_engine.runner, []
    execute = runner.execute_model

    def execute_timed(sched):
        start = time.perf_counter()
        out = execute(sched)
        steps.append((sched.total_num_scheduled_tokens, time.perf_counter() - start))
        return out

    runner.execute_model = execute_timed
    return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default=DEFAULT_DATASET)
    p.add_argument("--category", default="summarization")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--method", default="ngram", choices=SPEC_METHODS)
    p.add_argument("--spec-model", default=None, help="speculative_config.model (default: the method's own default)")
    p.add_argument("--spec-quantization", default=None, choices=["int8", "q4"],
                   help="speculative_config.quantization (the int8 self-draft: --spec-model MODEL --spec-quantization int8)")
    p.add_argument("--gguf-dequantize", action="store_true", help="both engines on fp32 weights instead of GGUF blocks")
    p.add_argument("--adaptive", action="store_true", help="adaptive_draft_length on (default: always draft k)")
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()

    rows = select_per_category(read_specbench(args.dataset), [args.category], args.prompts)
    spec = {"method": args.method, "num_speculative_tokens": args.k, "adaptive_draft_length": args.adaptive}
    if args.spec_model:
        spec["model"] = args.spec_model
    if args.spec_quantization:
        spec["quantization"] = args.spec_quantization
    common = dict(max_num_seqs=1, max_model_len=4096, gguf_dequantize=args.gguf_dequantize)
    engines = {"plain": LLM(**common), args.method: LLM(**common, speculative_config=spec)}
    prompts = render_prompts(engines["plain"].get_tokenizer(), rows)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in engines.values():  # warm-up: kernels built, thread policy's first measurements
        llm.generate([prompts[0].as_engine_prompt()], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    steps = {name: timed_steps(llm) for name, llm in engines.items()}
    drafting = timed_drafting(engines[args.method])
    decode_s, emitted = defaultdict(float), defaultdict(int)
    for _ in range(args.rounds):
        for prompt in prompts:
            for name, llm in engines.items():
                llm.llm_engine.kv_cache_manager.reset_prefix_cache()
                out = llm.generate([prompt.as_engine_prompt()], params, use_tqdm=False)[0]
                decode_s[name] += out.metrics.last_token_time - out.metrics.first_token_time
                emitted[name] += len(out.outputs[0].token_ids) - 1

    print(f"{args.category}: {len(prompts)} prompts x {args.rounds} rounds, {args.max_tokens} tokens, "
          f"{args.method} k={args.k}")
    base = None
    for name, timings in steps.items():
        by_size = defaultdict(list)
        for size, seconds in timings:
            if size <= args.k + 1:  # decode and verification steps (a prefill chunk is far longer)
                by_size[size].append(seconds * 1e3)
        num_steps = sum(map(len, by_size.values()))
        sizes = "  ".join(f"{n}: {statistics.median(v):.2f} ms ({len(v)})" for n, v in sorted(by_size.items()))
        base = base if base is not None else statistics.median(by_size[1])
        rel = "  ".join(f"{n}: {statistics.median(v) / base:.2f}" for n, v in sorted(by_size.items()))
        in_steps = sum(map(sum, by_size.values())) / 1e3
        print(f"{name}: {emitted[name] / max(num_steps, 1):.2f} tokens per step, decode {decode_s[name]:.2f} s, "
              f"{decode_s['plain'] / decode_s[name]:.2f}x plain; execute_model {in_steps:.2f} s of it, "
              f"{1e3 * (decode_s[name] - in_steps) / max(num_steps, 1):.2f} ms per step outside")
        print(f"  median step by tokens (count): {sizes}")
        print(f"  relative to plain's one-token step: {rel}")
    draft_ms = statistics.median(drafting) * 1e3
    print(f"drafting ({args.method}): median {draft_ms:.2f} ms a step = {draft_ms / base:.2f} of plain's one-token "
          f"step, {draft_ms / args.k / base:.3f} per draft token at k={args.k}")


if __name__ == "__main__":
    main()
