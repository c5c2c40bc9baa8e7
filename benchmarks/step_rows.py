"""What a step of n tokens costs against a one-token step, in the engine, at batch 1, and where it goes.

The engine runs the default model greedily on Spec-Bench prompts with a drafter that proposes exactly
n - 1 tokens, cycling n through --sizes, so every size is measured at the same contexts (drafts are the
last token repeated: mostly rejected, which changes nothing of a step's cost). Per size it prints the
median `execute_model` time, split into the decoder stack (`model.forward`), the LM head's sampling or
verification and the rest (input preparation, Python), each relative to the one-token step, and with
--components the C kernels' own shares inside the stack (projections, attention, norms and the rest),
read from the stack's profile counters.

--bound adds what the machine allows on the 4-bit path (measured in the same run, csrc/probe.c): the time
to read the step's weight bytes once (the decoder's blocks and the LM head's int8 screen) at the measured
memory rate, plus each row's multiply-adds (the int8 digits times the decoder's weights, the screen's two
terms times the head's) at the measured AVX512-VNNI rate (64 per vpdpbusd), and each step's ratio to it.

    .venv/bin/python benchmarks/step_rows.py --sizes 1,2,5,9,17 --components --bound
    .venv/bin/python benchmarks/step_rows.py --model qwen2.5-coder-1.5b-instruct --sizes 1,2,5,9,17,33 --components
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from specserve.bench.common import DEFAULT_DATASET, read_specbench, render_prompts
from specserve.bench.latency import select_per_category
from specserve.config import GGUF_COMPUTE
from specserve.llm import LLM
from specserve.ops import profiling
from specserve.sampling_params import SamplingParams


def instrument(llm: LLM, sizes: list[int], components: bool) -> list[dict]:
    """Each step's timings from now on, as {rows, total, forward, sample, <component>: seconds}."""
    runner, model, records = llm.llm_engine.runner, llm.llm_engine.runner.model, []
    cycle = {"i": 0}
    execute, forward, sample = runner.execute_model, model.forward, runner.sample_or_verify

    def execute_timed(sched):
        rec = {"rows": sched.total_num_scheduled_tokens, "forward": 0.0, "sample": 0.0}
        records.append(rec)
        if components:
            profiling.decoder_profile(reset=True)
        start = time.perf_counter()
        out = execute(sched)
        rec["total"] = time.perf_counter() - start
        rec["rest"] = rec["total"] - rec["forward"] - rec["sample"]
        if components:
            rec.update(profiling.decoder_profile())
        return out

    def timed(fn, key):
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            records[-1][key] += time.perf_counter() - start
            return out
        return call

    def propose(batch, sampled, hidden, aux):
        n = sizes[cycle["i"] % len(sizes)]
        cycle["i"] += 1
        return {rid: toks[-1:] * (n - 1) for rid, toks in sampled.items() if toks}

    runner.execute_model = execute_timed
    model.forward = timed(forward, "forward")
    runner.sample_or_verify = timed(sample, "sample")
    runner.propose_draft_token_ids = propose
    return records


def step_bound(llm: LLM, gguf_compute: str):
    """rows -> seconds: the weight bytes at the measured memory rate plus the rows' int8 multiply-adds at the
    measured VNNI rate (see the module docstring); prints the rates."""
    model = llm.llm_engine.runner.model
    digits = {"int8": 2, "q8": 1}.get(gguf_compute)
    screen = getattr(model.lm_head, "_screen", None)
    if digits is None or screen is None:
        raise SystemExit("--bound is for the 4-bit path with int8 activations and the greedy screen")
    decoder_bytes, decoder_weights = model.linear_weight_bytes()
    screen_bytes = screen[0].numel()
    read_rate, dot_rate = profiling.machine_rates(decoder_bytes + screen_bytes)
    if not dot_rate:
        raise SystemExit("--bound needs AVX512-VNNI")
    macs_per_row = digits * decoder_weights + 2 * screen_bytes
    nbytes = decoder_bytes + screen_bytes
    read_s, row_s = nbytes / read_rate, macs_per_row / 64 / dot_rate
    print(f"bound: {nbytes / 2**20:.0f} MiB at {read_rate / 1e9:.1f} GB/s = {read_s * 1e3:.2f} ms + "
          f"{macs_per_row / 1e6:.0f} M multiply-adds a row at {64 * dot_rate / 1e9:.0f} G/s = {row_s * 1e3:.3f} ms a row")
    return lambda rows: read_s + rows * row_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default=DEFAULT_DATASET)
    p.add_argument("--categories", default="summarization,writing,coding,math_reasoning")
    p.add_argument("--prompts", type=int, default=1, help="prompts per category")
    p.add_argument("--sizes", default="1,2,5,9,17")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--components", action="store_true", help="the decoder stack's kernels' shares")
    p.add_argument("--bound", action="store_true", help="the bytes' time plus the multiply-adds at the VNNI rate")
    p.add_argument("--gguf-dequantize", action="store_true", help="fp32 weights instead of GGUF blocks")
    p.add_argument("--gguf-compute", default="int8", choices=GGUF_COMPUTE)
    p.add_argument("--model", default=None, help="a path or catalog name (default: the default model)")
    args = p.parse_args()

    sizes = [int(s) for s in args.sizes.split(",")]
    rows = select_per_category(read_specbench(args.dataset), args.categories.split(","), args.prompts)
    spec = {"method": "ngram", "num_speculative_tokens": max(sizes) - 1, "adaptive_draft_length": False}
    llm = LLM(model=args.model, max_num_seqs=1, max_model_len=4096, gguf_dequantize=args.gguf_dequantize,
              gguf_compute=args.gguf_compute, speculative_config=spec)
    prompts = render_prompts(llm.get_tokenizer(), rows)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([prompts[0].as_engine_prompt()], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    records = instrument(llm, sizes, args.components)
    for prompt in prompts:
        llm.llm_engine.kv_cache_manager.reset_prefix_cache()
        llm.generate([prompt.as_engine_prompt()], params, use_tqdm=False)

    bound = step_bound(llm, args.gguf_compute) if args.bound else None
    by_size = defaultdict(list)
    for rec in records:
        if rec["rows"] in sizes:
            by_size[rec["rows"]].append(rec)
    keys = ["total", "forward", "sample", "rest"]
    if args.components:
        keys += list(profiling.DECODER_PROFILE_PARTS)

    def med(size, key):
        return statistics.median(r[key] for r in by_size[size]) * 1e3

    print(f"{len(prompts)} prompts, {args.max_tokens} tokens; median ms per step by rows (steps), "
          f"and relative to the one-row step's total")
    header = f"{'rows':>5} {'steps':>6} " + " ".join(f"{k:>12}" for k in keys)
    print(header + ("  bound ms, step/bound" if bound else ""))
    base = med(sizes[0], "total")
    for n in sizes:
        if not by_size[n]:
            continue
        cells = " ".join(f"{med(n, k):6.2f} {med(n, k) / base:5.2f}" for k in keys)
        if bound:
            limit = bound(n) * 1e3
            cells += f"  {limit:6.2f} {med(n, 'total') / limit:5.2f}"
        print(f"{n:>5} {len(by_size[n]):>6} {cells}")


if __name__ == "__main__":
    main()
