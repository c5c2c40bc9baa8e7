"""What an EAGLE-3 draft vocabulary of V tokens buys and costs on the default model.

Coverage: the V most frequent assistant tokens of a `specserve synthesize-data` folder (how train-drafter
picks them), as a share of that folder's assistant tokens and of the target's greedy Spec-Bench answers (a
--answers file from benchmarks/drafter_accuracy.py's work folder): a token outside it is never drafted.
Cost: one greedy draw over V rows of a hidden-size-576 LM head, median of 200, q4 (the int8-activation GEMM)
and int8 weights, against the target's one-token step measured in the same run.

    .venv/bin/python benchmarks/draft_vocab.py --data data/selfchat --answers runs/specbench-accuracy/answers.jsonl
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def median_ms(fn, repeats: int = 200) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--answers", default=None, help="JSON lines with output_token_ids (Spec-Bench answers)")
    p.add_argument("--sizes", default="4096,8192,16384,32768")
    args = p.parse_args()

    from specserve.llm import LLM
    from specserve.models.gguf_quant import quantize_q4
    from specserve.ops import kernels
    from specserve.sampling_params import SamplingParams
    from specserve.train.shards import read_conversations

    convs = read_conversations(args.data)
    tokens = np.concatenate([c.token_ids[c.assistant] for c in convs])
    vocab = 49152
    counts = np.bincount(tokens, minlength=vocab)
    order = np.argsort(-counts, kind="stable")
    answers = None
    if args.answers:
        with open(args.answers) as f:
            answers = np.array([t for line in f for t in json.loads(line)["output_token_ids"]])
    llm = LLM(max_num_seqs=1)
    out = llm.generate("Write a short story about a lighthouse keeper.", SamplingParams(temperature=0, max_tokens=64,
                                                                                          ignore_eos=True),
                       use_tqdm=False)[0]
    step_ms = 1e3 * (out.metrics.last_token_time - out.metrics.first_token_time) / (len(out.outputs[0].token_ids) - 1)
    print(f"{len(tokens)} assistant tokens in {args.data}; target one-token step {step_ms:.2f} ms")
    print("| V | coverage (data) | coverage (Spec-Bench answers) | q4 draw | int8 draw |")
    print("|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 576, generator=g)
    for size in (int(s) for s in args.sizes.split(",")):
        keep = np.zeros(vocab, bool)
        keep[order[:size]] = True
        w = torch.randn(size, 576, generator=g) * 0.05
        q = quantize_q4(w).for_int8_activations(2)
        i8, scale = kernels.pack_gemm_weight_int8(w)
        q4_ms = median_ms(lambda: kernels.argmax_rows(kernels.gemm_weight(x, q.packed, q.weight_format, None, size)))
        i8_ms = median_ms(lambda: kernels.argmax_rows(kernels.gemm_packed_int8(x, i8, scale, None)))
        sb = f"{keep[answers].mean():.1%}" if answers is not None else "n/a"
        print(f"| {size} | {counts[keep].sum() / counts.sum():.1%} | {sb} | {q4_ms:.3f} ms ({q4_ms / step_ms:.3f}) "
              f"| {i8_ms:.3f} ms ({i8_ms / step_ms:.3f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
