"""How close the default path (the file's blocks times int8-quantized activations) stays to the exact one (the
same blocks times fp32 activations): teacher-forced next-token agreement and KL divergence per position.

Both models are built from the same loaded file. Each prompt (the code-editing set's, then Spec-Bench's coding
and math ones, chat template, cut to --tokens tokens) is one prefill through each; per prompt the share of
positions whose argmax agrees, the largest KL(exact || default) over its positions, and over all prompts the
mean agreement, the largest KL and the 99th percentile of the per-position KLs.

    .venv/bin/python benchmarks/default_path_fidelity.py --model qwen2.5-coder-1.5b-instruct --prompts 20
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from specserve.bench.common import DEFAULT_DATASET, read_specbench, render_prompts, teacher_forced_logits
from specserve.models.gguf_quant import ACTIVATION_DIGITS, int8_activation_weights
from specserve.models.loader import load_model_weights
from specserve.models.registry import build_model
from specserve.tokenizer import load_tokenizer

CODE_EDIT = str(Path(DEFAULT_DATASET).with_name("code_edit.jsonl"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--tokens", type=int, default=256, help="each prompt cut to this many tokens")
    p.add_argument("--gguf-compute", default="int8", choices=sorted(ACTIVATION_DIGITS))
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    loaded = load_model_weights(args.model, keep_quantized=True)
    exact = build_model(loaded.config, loaded.state_dict, dtype=torch.float32)
    default = build_model(loaded.config, int8_activation_weights(loaded.state_dict,
                                                                 ACTIVATION_DIGITS[args.gguf_compute]),
                          dtype=torch.float32)
    rows = read_specbench(CODE_EDIT) + [r for r in read_specbench(DEFAULT_DATASET)
                                        if r["category"] in ("coding", "math_reasoning")]
    prompts = render_prompts(load_tokenizer(args.model), rows[:args.prompts])
    per_prompt, kls = [], []
    for prompt in prompts:
        tokens = torch.tensor(prompt.token_ids[:args.tokens])
        want, got = teacher_forced_logits(exact, tokens), teacher_forced_logits(default, tokens)
        logp, logq = want.log_softmax(-1), got.log_softmax(-1)
        kl = (logp.exp() * (logp - logq)).sum(-1)
        kls.extend(kl.tolist())
        per_prompt.append({"category": prompt.category, "tokens": len(tokens),
                           "agreement": (want.argmax(-1) == got.argmax(-1)).float().mean().item(),
                           "kl_max": kl.max().item()})
        print(json.dumps(per_prompt[-1]), flush=True)
    kls.sort()
    summary = {"model": args.model, "gguf_compute": args.gguf_compute, "prompts": len(per_prompt),
               "positions": len(kls), "agreement_mean": statistics.mean(r["agreement"] for r in per_prompt),
               "agreement_min": min(r["agreement"] for r in per_prompt), "kl_max": kls[-1],
               "kl_p99": kls[int(0.99 * (len(kls) - 1))], "kl_median": statistics.median(kls)}
    print(json.dumps(summary))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"summary": summary, "prompts": per_prompt}, indent=1))


if __name__ == "__main__":
    main()
