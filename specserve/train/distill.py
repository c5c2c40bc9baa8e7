"""Self-distillation: the engine's own batched generation answers the training prompts, so a drafter learns
the target's outputs. Results go to a JSON-lines file one record per prompt, appended chunk by chunk, so an
interrupted run resumes where it stopped.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.sampling_params import SamplingParams


@dataclass
class DistilledSequence:
    id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


def read_prompts(path: str) -> list[dict]:
    """A JSON-lines file of {"prompt": str} (or {"messages": [...]}) rows, "id" optional (default: line
    number); a plain text file is read as one prompt per non-empty line."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            if not path.endswith((".jsonl", ".json")):
                rows.append({"id": n, "messages": [{"role": "user", "content": line}]})
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n + 1}: not valid JSON ({exc})") from None
            if "messages" not in row and not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{n + 1}: each row needs a string \"prompt\" or a \"messages\" list")
            messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
            rows.append({"id": int(row.get("id", n)), "messages": messages})
    if not rows:
        raise ValueError(f"{path}: no prompts")
    if len({r["id"] for r in rows}) != len(rows):
        raise ValueError(f"{path}: prompt ids must be unique")
    return rows


def read_distilled(path: str) -> list[DistilledSequence]:
    out = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    out.append(DistilledSequence(r["id"], r["prompt_token_ids"], r["output_token_ids"]))
    return out


def distill(llm, prompts: Sequence[dict], out_path: str, params: SamplingParams, chunk: int = 128,
            log=print) -> list[DistilledSequence]:
    """Answers every prompt not yet in out_path (chat template applied), appending as it goes; returns all
    records in out_path. llm: a specserve LLM on the target."""
    done = {s.id for s in read_distilled(out_path)}
    todo = [p for p in prompts if p["id"] not in done]
    start, tokens = time.perf_counter(), 0
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    for b in range(0, len(todo), chunk):
        rows = todo[b:b + chunk]
        outputs = llm.chat([r["messages"] for r in rows], params, use_tqdm=False)
        with open(out_path, "a") as f:
            for row, out in zip(rows, outputs):
                if out.error:
                    log(f"prompt {row['id']} skipped: {out.error}")
                    continue
                ids = list(out.outputs[0].token_ids)
                tokens += len(ids)
                f.write(json.dumps({"id": row["id"], "prompt_token_ids": list(out.prompt_token_ids),
                                    "output_token_ids": ids, "finish_reason": out.outputs[0].finish_reason}) + "\n")
        elapsed = time.perf_counter() - start
        n = min(b + chunk, len(todo))
        eta = elapsed / n * (len(todo) - n)
        log(f"distill: {len(done) + n}/{len(prompts)} prompts, {tokens} tokens generated, "
            f"{tokens / elapsed:.0f} tok/s, ETA {eta / 60:.1f} min")
    return read_distilled(out_path)
