"""An EAGLE-3 head's teacher-forced accuracy by draft step on prompts it was not trained on: Spec-Bench's
first turns answered by the target (greedy), per category and overall.

At draft step k the head predicts the target's choice k + 1 tokens ahead from its own k previous outputs
(training-time test), so step-k accuracy bounds how often the k-th draft of a chain survives. The answers and
the target's states are made once per --work folder (the engine's default 4-bit path, as the runner hands
them to the head) and reused for every head evaluated there.

    .venv/bin/python benchmarks/drafter_accuracy.py --head specserve/heads/smollm2-135m-instruct-eagle3 \\
        --work runs/specbench-accuracy --prompts-per-category 8

`--held-back DATA --features DIR` measures instead on the conversations `train-drafter --data DATA` holds back
(every `--held-out-every`-th), with the feature store a training run on DATA wrote, so heads trained on different sizes are
compared on the same conversations.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from specserve.bench.common import DEFAULT_DATASET, read_specbench
from specserve.bench.latency import select_per_category


def loop_positions(num_tokens: int, num_prompt_tokens: int, answer: list[int]) -> np.ndarray:
    """[T] bool: the positions that predict a token of the answer's repetition loop past its second period."""
    from specserve.train.shards import loop_cut

    mask = np.zeros(num_tokens, bool)
    kept = loop_cut(answer)
    if kept is not None:
        mask[num_prompt_tokens + kept - 1:] = True
    return mask


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", action="append", required=True, help="an EAGLE-3 head folder (repeat to compare)")
    p.add_argument("--work", required=True, help="folder for the answers and features (reused)")
    p.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dataset", default=DEFAULT_DATASET)
    p.add_argument("--prompts-per-category", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--split-loops", action="store_true",
                   help="also report the positions inside answers' repetition loops (past two periods, as "
                        "train-drafter --loop-tails cut drops them) apart from the rest")
    p.add_argument("--held-back", metavar="DATA", default=None,
                   help="measure on this data folder's held-back conversations instead of Spec-Bench")
    p.add_argument("--features", default=None, help="--held-back: the feature store of a training run on DATA")
    p.add_argument("--feature-dtype", default="q8", help="--held-back: that store's dtype")
    p.add_argument("--held-out-every", type=int, default=32, help="--held-back: as the training run had it")
    args = p.parse_args()
    if args.held_back:
        return held_back_accuracy(args)

    from specserve.llm import LLM
    from specserve.models.loader import load_model_weights
    from specserve.sampling_params import SamplingParams
    from specserve.train.distill import distill
    from specserve.train.eagle3 import Eagle3Objective, load_eagle3
    from specserve.train.features import (Subset, TargetParts, default_aux_layers, feature_model,
                                          write_feature_store)
    from specserve.train.loop import evaluate

    rows = select_per_category(read_specbench(args.dataset), None, args.prompts_per_category)
    prompts = [{"id": i, "messages": [{"role": "user", "content": r["turns"][0]}]} for i, r in enumerate(rows)]
    os.makedirs(args.work, exist_ok=True)
    answers = os.path.join(args.work, "answers.jsonl")
    llm = LLM(model=args.model, max_num_seqs=64, max_num_batched_tokens=2048)
    seqs = distill(llm, prompts, answers, SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
                   log=lambda *_: None)
    del llm
    loaded = load_model_weights(args.model)
    aux = default_aux_layers(loaded.config["num_hidden_layers"])
    store = write_feature_store(feature_model(args.model, aux), [s.token_ids for s in seqs],
                                [len(s.prompt_token_ids) for s in seqs], os.path.join(args.work, "features"), "aux",
                                sequence_ids=[s.id for s in seqs])
    target = TargetParts.from_state_dict(loaded.config, loaded.state_dict)
    category = {i: r["category"] for i, r in enumerate(rows)}
    ids = store.sequence_ids()
    groups = {"all": list(range(len(store)))}
    for j, sid in enumerate(ids):
        groups.setdefault(category[sid], []).append(j)
    groups = {name: Subset(store, idx) for name, idx in groups.items()}
    if args.split_loops:
        in_loop = [loop_positions(len(s.token_ids), len(s.prompt_token_ids), s.token_ids[len(s.prompt_token_ids):])
                   for s in seqs]
        groups["loop tails"] = Subset(store, range(len(store)), in_loop)
        groups["outside loops"] = Subset(store, range(len(store)), [~m for m in in_loop])
    results = {}
    for head in args.head:
        objective = Eagle3Objective(load_eagle3(head, target), args.steps)
        results[head] = {name: evaluate(objective, group) for name, group in groups.items()}
        print(f"{head}: teacher-forced accuracy by draft step on {len(store)} Spec-Bench answers "
              f"({store.meta['num_loss_tokens']} positions)")
        for name, acc in results[head].items():
            print(f"  {name:>22}: " + "  ".join(f"{a:.3f}" for a in acc))
    with open(os.path.join(args.work, "accuracy.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


def held_back_accuracy(args) -> int:
    from specserve.models.loader import load_model_weights
    from specserve.train.eagle3 import Eagle3Objective, load_eagle3
    from specserve.train.features import Subset, TargetParts, default_aux_layers, feature_model, write_feature_store
    from specserve.train.loop import evaluate
    from specserve.train.pipeline import conversation_sequences

    if not args.features:
        raise SystemExit("--held-back needs --features (the store a training run on that folder wrote)")
    seqs, held, _, _ = conversation_sequences(args.held_back, None, args.held_out_every)
    loaded = load_model_weights(args.model)
    aux = default_aux_layers(loaded.config["num_hidden_layers"])
    store = write_feature_store(feature_model(args.model, aux), [s[1] for s in seqs], [s[2] for s in seqs],
                                args.features, "aux", args.feature_dtype, [s[0] for s in seqs])
    held_set = Subset(store, [j for j, sid in enumerate(store.sequence_ids()) if sid in held])
    target = TargetParts.from_state_dict(loaded.config, loaded.state_dict)
    for head in args.head:
        acc = evaluate(Eagle3Objective(load_eagle3(head, target), args.steps), held_set)
        print(f"{head}: held-back accuracy by draft step on {len(held_set)} conversations of {args.held_back}: "
              + "  ".join(f"{a:.3f}" for a in acc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
