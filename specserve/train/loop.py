"""The training loop every drafter method shares: length-bucketed batches, AdamW with warmup and cosine
decay, gradient clipping, a progress bar with ETA, a JSON-lines log of loss and held-back step-k accuracy,
and checkpoints every few minutes that `resume=True` continues from, batch for batch.

A method supplies an `Objective`: its trainable `model`, `loss(batch)`, and `step_hits(batch)` (per draft
step k, how many counted positions the drafter's argmax gets right, teacher-forced).
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from specserve.train.features import SequenceFeatures

CHECKPOINT = "checkpoint.pt"
LOG = "train_log.jsonl"


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] right-padded with 0
    hidden: torch.Tensor  # [B, T, S] the target states
    target_ids: torch.Tensor  # [B, T]
    valid: torch.Tensor  # [B, T] bool: a real, loss-masked position


def collate(features: Sequence[SequenceFeatures]) -> Batch:
    T = max(len(f) for f in features)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (0, 0, 0, T - t.shape[0])) if t.dim() == 2 else F.pad(t, (0, T - t.shape[0]))

    return Batch(torch.stack([pad(f.input_ids) for f in features]), torch.stack([pad(f.hidden) for f in features]),
                 torch.stack([pad(f.target_ids) for f in features]), torch.stack([pad(f.loss_mask) for f in features]))


def step_labels(batch: Batch, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft step `step` at row t predicts target_ids[t + 1 + step] -> (labels [B, T], counted [B, T] bool)."""
    shift = 1 + step
    labels = F.pad(batch.target_ids[:, shift:], (0, shift))
    counted = F.pad(batch.valid[:, shift:], (0, shift), value=False)
    return labels, counted


def count_hits(batch: Batch, num_steps: int, predict: Callable[[int, torch.Tensor], torch.Tensor]
               ) -> tuple[list[int], list[int]]:
    """Per draft step k: (counted positions where predict(k, counted) [n] target ids equal the target's
    choice, counted positions); counted [B, T] bool selects the rows predict must return, in order."""
    hits, counts = [], []
    for k in range(num_steps):
        labels, counted = step_labels(batch, k)
        hits.append(int((predict(k, counted) == labels[counted]).sum()))
        counts.append(int(counted.sum()))
    return hits, counts


class Objective(Protocol):
    model: torch.nn.Module
    num_steps: int  # draft steps whose accuracy step_hits reports

    def loss(self, batch: Batch) -> torch.Tensor: ...

    def step_hits(self, batch: Batch) -> tuple[list[int], list[int]]: ...


@dataclass
class LoopConfig:
    epochs: int = 1
    batch_tokens: int = 4096  # padded tokens per batch (B * longest sequence)
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    warmup_ratio: float = 0.03  # then cosine decay to 0
    seed: int = 0
    checkpoint_every_s: float = 300.0
    eval_every_steps: int = 0  # 0: once per epoch
    log_every_steps: int = 10
    progress: bool = True
    # bfloat16 autocast for the forward (weights, optimizer and loss stay float32): several times faster
    # matmuls on CPUs with AMX or AVX512-BF16, slower on others
    bf16: bool = False

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_tokens < 1:
            raise ValueError("epochs and batch_tokens must be at least 1")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch: int = 0  # next batch within the epoch
    losses: list[float] = field(default_factory=list)
    num_tokens: int = 0  # counted positions seen
    seconds: float = 0.0
    evals: list[dict] = field(default_factory=list)  # {"step", "accuracy": [step-k accuracy]}
    done: bool = False


def make_batches(lengths: Sequence[int], batch_tokens: int, seed: int, epoch: int, bucket: int = 64
                 ) -> list[list[int]]:
    """Sequence indices in batches of similar length (B * longest <= batch_tokens, at least one sequence),
    in an order fixed by (seed, epoch)."""
    r = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    r.shuffle(order)
    batches = []
    for b in range(0, len(order), bucket):
        current: list[int] = []
        for i in sorted(order[b:b + bucket], key=lambda i: lengths[i]):
            if current and (len(current) + 1) * lengths[i] > batch_tokens:
                batches.append(current)
                current = []
            current.append(i)
        batches.append(current)
    r.shuffle(batches)
    return batches


@torch.no_grad()
def evaluate(objective: Objective, data: Sequence[SequenceFeatures], batch_tokens: int = 4096) -> list[float]:
    """Teacher-forced step-k accuracy over data, k = 0 .. num_steps - 1 (in float32)."""
    was_training = objective.model.training
    objective.model.eval()
    hits, counts = [0] * objective.num_steps, [0] * objective.num_steps
    for indices in make_batches([len(f) for f in data], batch_tokens, 0, 0):
        h, c = objective.step_hits(collate([data[i] for i in indices]))
        hits = [a + b for a, b in zip(hits, h)]
        counts = [a + b for a, b in zip(counts, c)]
    objective.model.train(was_training)
    return [h / n if n else 0.0 for h, n in zip(hits, counts)]


def save_head(folder: str, config: dict, model: torch.nn.Module) -> None:
    """A drafter folder as the loaders read it: config.json, and model.safetensors with the module's state
    dict (floating tensors in float16)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {k: (v.detach().half() if v.is_floating_point() else v.detach()).contiguous()
               for k, v in model.state_dict().items()}
    save_file(tensors, os.path.join(folder, "model.safetensors"))


def _atomic_save(obj, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train(objective: Objective, data: Sequence[SequenceFeatures], held_out: Sequence[SequenceFeatures],
          config: LoopConfig, out_dir: str, resume: bool = False, max_steps: int | None = None,
          log: Callable[[str], None] = print) -> TrainState:
    """Trains objective.model on data; checkpoints to out_dir/checkpoint.pt every config.checkpoint_every_s
    seconds, at each epoch end, at max_steps (a planned stop) and on Ctrl-C. resume: continue from the
    checkpoint there (its config must match). Returns the state; state.done once every epoch ran."""
    os.makedirs(out_dir, exist_ok=True)
    lengths = [len(f) for f in data]
    plans = [make_batches(lengths, config.batch_tokens, config.seed, e) for e in range(config.epochs)]
    total = sum(len(p) for p in plans)
    params = [p for p in objective.model.parameters() if p.requires_grad]
    optimizer, schedule = _optimizer(params, config, total)
    path = os.path.join(out_dir, CHECKPOINT)
    state = TrainState()
    if resume:
        state = _resume(path, objective, optimizer, schedule, config, total, log)

    def checkpoint() -> None:
        _atomic_save({"model": objective.model.state_dict(), "optimizer": optimizer.state_dict(),
                      "schedule": schedule.state_dict(), "state": asdict(state), "config": asdict(config),
                      "num_batches": total}, path)

    def write_log(record: dict) -> None:
        with open(os.path.join(out_dir, LOG), "a") as f:
            f.write(json.dumps(record) + "\n")

    bar = _progress_bar(total, state.step) if config.progress else None
    objective.model.train()
    last_checkpoint, start = time.perf_counter(), time.perf_counter() - state.seconds
    try:
        while state.epoch < config.epochs:
            plan = plans[state.epoch]
            while state.batch < len(plan):
                if max_steps is not None and state.step >= max_steps:
                    state.seconds = time.perf_counter() - start
                    checkpoint()
                    return state
                batch = collate([data[i] for i in plan[state.batch]])
                state.losses.append(_optimizer_step(objective, batch, optimizer, schedule, params, config))
                state.step += 1
                state.batch += 1
                state.num_tokens += int(batch.valid.sum())
                state.seconds = time.perf_counter() - start
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{state.losses[-1]:.3f}", epoch=state.epoch + 1)
                if state.step % config.log_every_steps == 0:
                    write_log(_loss_record(state, config.log_every_steps, schedule.get_last_lr()[0]))
                if config.eval_every_steps and state.step % config.eval_every_steps == 0 and held_out:
                    _eval(objective, held_out, config, state, write_log, log)
                if time.perf_counter() - last_checkpoint > config.checkpoint_every_s:
                    checkpoint()
                    last_checkpoint = time.perf_counter()
            state.epoch += 1
            state.batch = 0
            if held_out and not config.eval_every_steps:
                _eval(objective, held_out, config, state, write_log, log)
            checkpoint()
        state.done = True
        checkpoint()
    except KeyboardInterrupt:
        state.seconds = time.perf_counter() - start
        checkpoint()
        log(f"interrupted: checkpoint at step {state.step} in {path}; continue with --resume")
        raise
    finally:
        if bar is not None:
            bar.close()
    return state


def _loss_record(state: TrainState, steps: int, lr: float) -> dict:
    """The training log's line for the last `steps` optimizer steps."""
    recent = state.losses[-steps:]
    return {"step": state.step, "epoch": state.epoch + 1, "loss": sum(recent) / len(recent), "lr": lr,
            "tokens": state.num_tokens, "seconds": round(state.seconds, 1)}


def _progress_bar(total: int, initial: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, desc="train")


def _optimizer_step(objective: Objective, batch, optimizer, schedule, params, config: LoopConfig) -> float:
    """One optimizer step on batch (gradients clipped to config.grad_clip); returns its loss."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16):
        loss = objective.loss(batch)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
    optimizer.step()
    schedule.step()
    return loss.item()


def _optimizer(params, config: LoopConfig, total: int):
    """AdamW, with linear warmup over config.warmup_ratio of the total steps, then cosine decay to 0."""
    warmup = max(1, int(config.warmup_ratio * total))
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(
        (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))))
    return optimizer, schedule


def _resume(path: str, objective: Objective, optimizer, schedule, config: LoopConfig, total: int, log) -> TrainState:
    """Model, optimizer, schedule and state from the checkpoint at path (a fresh state if there is none)."""
    if not os.path.exists(path):
        log(f"no checkpoint at {path}; starting from the beginning")
        return TrainState()
    ckpt = torch.load(path, weights_only=False)
    if ckpt["config"] != asdict(config) | {"progress": ckpt["config"]["progress"]} or ckpt["num_batches"] != total:
        raise ValueError(f"{path}: the checkpoint was made with another configuration or data set "
                         f"({ckpt['config']}, {ckpt['num_batches']} batches); start without --resume")
    objective.model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    schedule.load_state_dict(ckpt["schedule"])
    state = TrainState(**ckpt["state"])
    log(f"resumed at step {state.step}/{total} (epoch {state.epoch + 1}, batch {state.batch})")
    return state


def _eval(objective: Objective, held_out, config: LoopConfig, state: TrainState, write_log, log) -> None:
    accuracy = evaluate(objective, held_out, config.batch_tokens)
    state.evals.append({"step": state.step, "accuracy": accuracy})
    write_log({"step": state.step, "eval_step_accuracy": accuracy})
    log(f"step {state.step}: held-back teacher-forced accuracy by draft step "
        + ", ".join(f"{a:.3f}" for a in accuracy))
