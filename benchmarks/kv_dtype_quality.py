"""How far a bfloat16 or int8 KV cache (kv_cache_dtype) moves a model's output from the fp32 cache's.

Greedy generation (chat template, EOS ignored) of Spec-Bench prompts spread over its categories, once per KV
dtype: the share of outputs equal to the fp32 cache's token for token, and the median first difference. Then
teacher-forced on the fp32 outputs (prompt + output in one pass, every position reading the cache's stored
K/V, as decoding does): the share of output positions whose next-token argmax agrees with fp32's, and the
mean and max KL(p_fp32 || p_kv) there.

    .venv/bin/python benchmarks/kv_dtype_quality.py --prompts 26 --max-tokens 128 [--model NAME] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from specserve.bench.common import DEFAULT_DATASET, read_specbench, render_prompts, select_spread
from specserve.llm import LLM
from specserve.ops.attention import kv_caches, paged_metadata
from specserve.ops.kernels import kernel_usable
from specserve.ops.kv_cache import kv_storage_dtype
from specserve.sampling_params import SamplingParams

KV_DTYPES = ("auto", "bfloat16", "int8")
BLOCK_SIZE = 16


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def teacher_forced_logits(model, tokens: list[int], num_prompt: int, kv_dtype: torch.dtype) -> torch.Tensor:
    """[len(tokens) - num_prompt, vocab] fp32 logits predicting each output token, from one pass over the
    sequence with a fresh paged cache stored as kv_dtype."""
    blocks = -(-len(tokens) // BLOCK_SIZE)
    caches = kv_caches(model.kv_cache_shape(blocks, BLOCK_SIZE), kv_dtype, model.num_layers)
    meta = paged_metadata([len(tokens)], [len(tokens)], [list(range(blocks))], BLOCK_SIZE, kernel_usable(model.dtype))
    hidden, _ = model.forward(torch.tensor(tokens), torch.arange(len(tokens)), meta, caches)
    return model.compute_logits(hidden[num_prompt - 1:len(tokens) - 1]).float()


def teacher_forced(model, prompts: list[list[int]], outputs: list[list[int]], kv_dtype: torch.dtype
                   ) -> tuple[float, torch.Tensor]:
    """Over every output position: the share whose argmax under a kv_dtype cache is the fp32 cache's, and
    KL(p_fp32 || p_kv) at each ([positions])."""
    agree = total = 0
    kls = []
    for ids, out in zip(prompts, outputs):
        exact = teacher_forced_logits(model, ids + out, len(ids), torch.float32)
        other = teacher_forced_logits(model, ids + out, len(ids), kv_dtype)
        agree += int((exact.argmax(-1) == other.argmax(-1)).sum())
        total += exact.shape[0]
        kls.append(torch.nn.functional.kl_div(other.log_softmax(-1), exact.log_softmax(-1), log_target=True,
                                              reduction="none").sum(-1))
    return agree / total, torch.cat(kls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a catalog name or a path (default: the default model)")
    p.add_argument("--dataset", default=DEFAULT_DATASET)
    p.add_argument("--prompts", type=int, default=26)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()

    rows = select_spread(read_specbench(args.dataset), args.prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs, prompts, model = {}, None, None
    for kv in KV_DTYPES:
        llm = LLM(model=args.model, max_num_seqs=16, kv_cache_dtype=kv)
        prompts = [pr.as_engine_prompt()["prompt_token_ids"] for pr in render_prompts(llm.get_tokenizer(), rows)]
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        outputs[kv] = [list(o.outputs[0].token_ids) for o in outs]
        model = llm.llm_engine.model
        del llm
        print(f"generated with kv_cache_dtype={kv}", flush=True)

    results = {"model": args.model or "default", "prompts": len(rows), "max_tokens": args.max_tokens, "kv_cache_dtypes": {}}
    print(f"{len(rows)} Spec-Bench prompts, {args.max_tokens} greedy tokens each; against the fp32 KV cache:")
    print(f"  {'kv_cache_dtype':15s} {'same output':>12s} {'1st diff (median)':>18s} {'next-token agree':>17s}"
          f" {'mean KL':>9s} {'max KL':>9s}")
    for kv in KV_DTYPES[1:]:
        diffs = [first_difference(a, b) for a, b in zip(outputs["auto"], outputs[kv])]
        same = sum(d is None for d in diffs)
        at = [d for d in diffs if d is not None]
        median = statistics.median(at) if at else None
        agree, kl = teacher_forced(model, prompts, outputs["auto"], kv_storage_dtype(kv, model.dtype))
        print(f"  {kv:15s} {same:>5d}/{len(rows):<3d}{same / len(rows):>4.0%} {median if at else '-':>18} "
              f"{agree:>17.2%} {kl.mean().item():>9.2e} {kl.max().item():>9.2e}", flush=True)
        results["kv_cache_dtypes"][kv] = {"same_outputs": same, "first_difference_median": median,
                                          "next_token_agreement": agree, "mean_kl": kl.mean().item(),
                                          "max_kl": kl.max().item()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
