"""`specserve train-drafter`: self-distillation, features, training and a model card, in one command.

    specserve train-drafter --method eagle3 --prompts data/distill/prompts.jsonl --out heads/my-eagle3
    specserve train-drafter --method eagle3 --data data/selfchat --out heads/my-eagle3

1. The engine answers every prompt with the target (chat template; greedy unless --temperature), appended
   to WORK/distilled.jsonl as it goes (WORK: --work, default OUT/work). With --data, the conversations of
   a `specserve synthesize-data` folder are used as they are (every assistant turn counts).
2. One target pass per prompt + answer writes the states the method reads to WORK/features (memmap).
3. The head trains on all but every `--held-out-every`-th sequence; checkpoints go to WORK every
   --checkpoint-minutes, `--resume` continues from them (and reuses steps 1-2).
4. OUT holds the head in the public layout (config.json, model.safetensors) and README.md: the command,
   data, steps, time, peak memory, held-back teacher-forced accuracy and the acceptance measured in the
   engine on held-back prompts.
"""
from __future__ import annotations

import json
import os
import resource
import shlex
import shutil
import time
from dataclasses import dataclass, field

import torch

from specserve.train.features import FEATURE_PATHS, STATE_DTYPES

METHODS = ("eagle3", "eagle", "medusa")


@dataclass
class Phases:
    """Seconds and peak resident memory (GiB, the process so far) after each phase."""

    rows: list[tuple[str, float, float]] = field(default_factory=list)
    _start: float = field(default_factory=time.perf_counter)

    def done(self, name: str) -> None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
        self.rows.append((name, time.perf_counter() - self._start, peak))
        self._start = time.perf_counter()


def add_train_parser(sub) -> None:
    p = sub.add_parser("train-drafter", help="train an EAGLE-3, EAGLE or Medusa head on the target's own answers",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--model", default=None, help="target: HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts",
                        help="JSON lines of {\"prompt\": ...} or {\"messages\": [...]}, or a text file of one prompt "
                             "per line: the target answers them first")
    source.add_argument("--data", help="a `specserve synthesize-data` folder: conversations the target already wrote")
    p.add_argument("--max-conversations", type=int, default=None,
                   help="--data: train on the first N conversations that are not held back")
    p.add_argument("--loop-tails", choices=("keep", "cut"), default="cut",
                   help="--data: an answer that falls into a repetition loop is trained on up to two periods of "
                        "the loop (cut: the same Spec-Bench accuracy as keep for a quarter less training) or whole "
                        "(keep); held-back conversations stay whole either way")
    p.add_argument("--features", default=None,
                   help="folder of the target's states (default: WORK/features); a folder made for the same "
                        "sequences is reused, so runs on one --data folder can share it")
    p.add_argument("--out", required=True, help="output folder (the head, its README, and work/)")
    p.add_argument("--work", default=None,
                   help="folder for answers, features, checkpoints and the log (default: OUT/work)")
    p.add_argument("--resume", action="store_true", help="continue from the work folder (answers, features, checkpoint)")
    p.add_argument("--max-prompts", type=int, default=None, help="use the first N prompts")
    p.add_argument("--max-tokens", type=int, default=256, help="answer length cap for self-distillation")
    p.add_argument("--temperature", type=float, default=0.0, help="self-distillation sampling (0: greedy)")
    p.add_argument("--max-num-seqs", type=int, default=128, help="generation batch for self-distillation")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=4 << 30,
                   help="KV cache of the self-distillation engine (default: %(default)s, 4 GiB)")
    p.add_argument("--feature-dtype", choices=STATE_DTYPES, default="float16",
                   help="stored target states: float16, bfloat16 or q8 (int8 blocks of 32, about half of float16)")
    p.add_argument("--features-from", choices=FEATURE_PATHS, default="engine",
                   help="engine: the target as the engine runs it (a GGUF file's 4-bit blocks), what the drafter reads "
                        "at inference; fp32: weights dequantized to float32")
    p.add_argument("--draft-vocab-size", type=int, default=8192, help="eagle3: draft vocabulary size")
    p.add_argument("--init", default=None,
                   help="eagle3: start from this saved head (its weights and draft vocabulary) instead of a fresh one")
    p.add_argument("--ttt-steps", type=int, default=4, help="eagle3: training-time test steps")
    p.add_argument("--num-heads", type=int, default=4, help="medusa: number of heads")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--held-out-every", type=int, default=32, help="every N-th sequence is held back for evaluation")
    p.add_argument("--checkpoint-minutes", type=float, default=5.0)
    p.add_argument("--eval-prompts", type=int, default=16,
                   help="held-back prompts the finished head drafts in the engine for the model card (0: skip)")
    p.add_argument("--bf16", action="store_true",
                   help="bfloat16 autocast in training (fast on CPUs with AMX or AVX512-BF16)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_train_drafter)


def cmd_train_drafter(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    train_drafter(args, "specserve " + " ".join(shlex.quote(a) for a in args.argv))
    return 0


def train_drafter(args, command: str = "", log=print) -> str:
    from specserve.models.loader import load_model_weights
    from specserve.train import loop
    from specserve.train.features import Subset, TargetParts, default_aux_layers, feature_model, write_feature_store

    work = args.work or os.path.join(args.out, "work")
    if not args.resume and os.path.exists(work):
        shutil.rmtree(work)
    os.makedirs(work, exist_ok=True)
    _check_run(work, args)
    phases = Phases()
    train_ids = None
    if args.data:
        seqs, held_ids, prompts, train_ids = conversation_sequences(args.data, args.max_conversations,
                                                                    args.held_out_every, args.loop_tails)
    else:
        seqs, held_ids, prompts = distilled_sequences(args, work, log)
        phases.done("self-distillation")

    loaded = load_model_weights(args.model)
    L = loaded.config["num_hidden_layers"]
    aux = default_aux_layers(L) if args.method == "eagle3" else ()
    model = feature_model(args.model, aux, args.features_from)
    store = write_feature_store(model, [s[1] for s in seqs], [s[2] for s in seqs],
                                args.features or os.path.join(work, "features"), "aux" if aux else "final",
                                args.feature_dtype, [s[0] for s in seqs], log=log)
    del model
    phases.done("features")

    ids = store.sequence_ids()
    train_set = Subset(store, [i for i, s in enumerate(ids)
                               if s not in held_ids and (train_ids is None or s in train_ids)])
    held_set = Subset(store, [i for i, s in enumerate(ids) if s in held_ids])
    target = TargetParts.from_state_dict(loaded.config, loaded.state_dict)
    objective = build_objective(args, target, train_set, aux)
    config = loop.LoopConfig(epochs=args.epochs, batch_tokens=args.batch_tokens, lr=args.lr, seed=args.seed,
                             checkpoint_every_s=60 * args.checkpoint_minutes, bf16=args.bf16)
    state = loop.train(objective, train_set, held_set, config, work, resume=args.resume, log=log)
    phases.done("training")

    objective.save(args.out)
    acceptance = None
    if args.eval_prompts:
        held_prompts = [p for p in prompts if p["id"] in held_ids][:args.eval_prompts]
        acceptance = measure_acceptance(args, held_prompts, min(4, args.num_heads) if args.method == "medusa" else 4)
        phases.done("acceptance check")
    data = dict(prompts=args.data or args.prompts, num_prompts=len(prompts), num_sequences=len(store),
                num_train=len(train_set), num_held=len(held_set), num_tokens=store.num_tokens,
                num_loss_tokens=store.meta["num_loss_tokens"], max_tokens=args.max_tokens,
                temperature=args.temperature)
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(model_card(args, command, objective, state, data, phases, acceptance))
    log(f"saved {args.method} head to {args.out}")
    return args.out


def distilled_sequences(args, work: str, log) -> tuple[list[tuple], set, list[dict]]:
    """--prompts: the target answers them (resumable) -> ([(id, token ids, prompt length)], held-back ids,
    prompts)."""
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams
    from specserve.train.distill import distill, read_prompts

    prompts = read_prompts(args.prompts)[:args.max_prompts]
    held_ids = {p["id"] for n, p in enumerate(prompts) if n % args.held_out_every == args.held_out_every - 1}
    llm = LLM(model=args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, seed=args.seed)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    seqs = distill(llm, prompts, os.path.join(work, "distilled.jsonl"), params, log=log)
    return [(s.id, s.token_ids, len(s.prompt_token_ids)) for s in seqs], held_ids, prompts


def conversation_sequences(folder: str, limit: int | None, held_out_every: int, loop_tails: str = "cut"
                           ) -> tuple[list[tuple], set, list[dict], set | None]:
    """--data: ([(index, token ids, loss mask)] of every conversation, held-back indices (every N-th of the
    folder, whatever --max-conversations is, so runs of different sizes are measured on the same
    conversations), the held-back check's prompts (each conversation's first user turn with its system
    prompt), and the indices trained on (the first `limit` others; None: all others). loop_tails "cut": the
    conversations trained on lose their answers' repetition loops after two periods
    (Conversation.without_loop_tails)."""
    from specserve.train.shards import read_conversations

    convs = read_conversations(folder)
    held = {i for i in range(len(convs)) if i % held_out_every == held_out_every - 1}
    trained = [c.without_loop_tails() if loop_tails == "cut" and i not in held else c for i, c in enumerate(convs)]
    seqs = [(i, c.token_ids.tolist(), c.loss_mask) for i, c in enumerate(trained)]
    train = None if limit is None else set([i for i in range(len(convs)) if i not in held][:limit])
    prompts = [{"id": i, "messages": ([{"role": "system", "content": c.meta["system"]}] if c.meta["system"] else [])
                + [{"role": "user", "content": c.meta["users"][0]}]} for i, c in enumerate(convs)]
    return seqs, held, prompts, train


def _check_run(work: str, args) -> None:
    """A resumed run must be the same run: same target, prompts and data settings."""
    keys = ("method", "model", "prompts", "data", "max_prompts", "max_conversations", "max_tokens", "temperature",
            "feature_dtype", "features_from", "features", "init", "seed", "loop_tails")
    run = {k: getattr(args, k) for k in keys}
    path = os.path.join(work, "run.json")
    if os.path.exists(path):
        with open(path) as f:
            before = json.load(f)
        changed = [k for k in keys if before.get(k) != run[k]]
        if changed:
            raise ValueError(f"--resume: {', '.join(changed)} differ from the run in {work}; "
                             f"use another --out or drop --resume")
    with open(path, "w") as f:
        json.dump(run, f)


def build_objective(args, target, data, aux_layers):
    if args.method == "eagle3":
        from specserve.train.eagle3 import Eagle3Objective, build_eagle3, load_eagle3
        from specserve.train.features import masked_targets

        if args.init:
            model = load_eagle3(args.init, target)
            if tuple(model.config.aux_layer_ids) != tuple(aux_layers):
                raise ValueError(f"--init {args.init}: its aux layers {list(model.config.aux_layer_ids)} are not the "
                                 f"target's {list(aux_layers)}")
            targets = masked_targets(data)
            model.vocab.coverage = float(model.vocab.t2d[targets].float().mean()) if len(targets) else 0.0
            return Eagle3Objective(model, args.ttt_steps)
        return build_eagle3(target, data, args.draft_vocab_size, aux_layers, args.ttt_steps, args.seed)
    if args.method == "eagle":
        from specserve.train.eagle import build_eagle

        return build_eagle(target, data, seed=args.seed)
    from specserve.train.medusa import build_medusa

    return build_medusa(target, data, num_heads=args.num_heads, seed=args.seed)


def measure_acceptance(args, prompts: list[dict], k: int = 4) -> dict:
    """The finished head drafting k tokens for held-back prompts in the engine (greedy, batch 1)."""
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    llm = LLM(model=args.model, max_num_seqs=1, speculative_config={
        "method": args.method, "model": args.out, "num_speculative_tokens": k})
    llm.chat([p["messages"] for p in prompts], SamplingParams(temperature=0.0, max_tokens=128), use_tqdm=False)
    m = llm.get_metrics()
    rates = [a / m.num_drafts for a in m.accepted_per_position] if m.num_drafts else []
    return dict(num_prompts=len(prompts), k=k, mean_acceptance_length=m.mean_acceptance_length or 1.0,
                acceptance_by_position=rates)


def model_card(args, command, objective, state, data, phases, acceptance) -> str:
    final = sum(state.losses[-20:]) / max(1, len(state.losses[-20:]))
    accuracy = state.evals[-1]["accuracy"] if state.evals else []
    lines = [f"# {args.method.upper()} draft head for {os.path.basename(str(args.model or 'SmolLM2-135M-Instruct'))}",
             "", f"Trained by specserve; load with `speculative_config={{\"method\": \"{args.method}\", "
             f"\"model\": <this folder>}}`.", "", "## How it was made", "", f"```\n{command}\n```", "",
             (f"- data: {data['num_prompts']} conversations from `{data['prompts']}`, written and answered by the "
              f"target itself (`specserve synthesize-data`; its manifest.json and README say how)" if args.data else
              f"- data: {data['num_prompts']} prompts from `{data['prompts']}`, answered by the target itself "
              f"({'greedy' if not data['temperature'] else 'temperature ' + str(data['temperature'])}, at most "
              f"{data['max_tokens']} tokens)")
             + (", answers' repetition loops cut after two periods (held-back conversations whole)"
                if args.data and args.loop_tails == "cut" else "")
             + f"; {data['num_tokens']} tokens in all, {data['num_loss_tokens']} answer positions; "
             f"{data['num_train']} sequences trained on, {data['num_held']} held back",
             f"- features: the target's states {'as the engine computes them' if args.features_from == 'engine' else 'from weights dequantized to float32'}"
             f", stored as {args.feature_dtype}",
             *(f"- {line}" for line in objective.describe()),
             f"- training: {state.step} optimizer steps, {args.epochs} epochs, {state.num_tokens} counted positions, "
             f"AdamW lr {args.lr}, {args.batch_tokens} padded tokens per step"
             f"{', bfloat16 autocast' if args.bf16 else ''}; final loss {final:.4f}",
             "", "| phase | time | peak memory (process) |", "|---|---|---|"]
    lines += [f"| {name} | {seconds / 60:.1f} min | {peak:.1f} GiB |" for name, seconds, peak in phases.rows]
    lines += ["", f"Threads: {torch.get_num_threads()}, on {os.cpu_count()} CPUs.", "", "## Measured", "",
              "Held-back teacher-forced accuracy by draft step: "
              + (", ".join(f"step {k}: {a:.3f}" for k, a in enumerate(accuracy)) or "n/a") + "."]
    if acceptance:
        lines.append(f"Mean acceptance length at k={acceptance['k']} on {acceptance['num_prompts']} held-back "
                     f"prompts (greedy, 128 tokens): {acceptance['mean_acceptance_length']:.2f}; draft position i accepted "
                     f"in " + ", ".join(f"{r:.0%}" for r in acceptance['acceptance_by_position']) + " of rounds.")
    return "\n".join(lines) + "\n"
