"""The shard format of a `specserve synthesize-data` folder: conversations as compressed token ids with the
tokens the target generated as the assistant, a manifest that lists every shard with its checksum, and the
repetition loops that end some answers (a small target's greedy answer can fall into one and repeat it up to
the token limit).

A folder holds `shard-NNNNN.npz` files (uint16 token ids of the whole conversation as the chat template renders
it, the packed assistant mask, and per-conversation JSON: the user turns, system prompt, source, answer
sampling and finish reasons) and `manifest.json` (model, seed, config, commands, one entry per shard with its
seed, counts and sha256).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

@dataclass
class Conversation:
    """token_ids: [T] the conversation as the chat template renders it, through the last answer;
    assistant: [T] bool, tokens the target generated as the assistant; meta: the user turns' text, system
    prompt, source, answer sampling and finish reasons."""

    token_ids: np.ndarray
    assistant: np.ndarray
    meta: dict

    @property
    def loss_mask(self) -> np.ndarray:
        """[T] bool: positions whose next token is an assistant token (what a drafter is trained to predict)."""
        mask = np.zeros_like(self.assistant)
        mask[:-1] = self.assistant[1:]
        return mask

    def without_loop_tails(self, keep_periods: int = 2) -> "Conversation":
        """The conversation with each answer's repetition loop (first_loop) cut after keep_periods periods, so a
        drafter still learns that the text repeats but does not spend its training on hundreds of tokens of
        it: a loop ending the last answer is cut off; one inside an earlier answer stays as context and its
        tokens stop being assistant tokens (no prediction of them counts)."""
        assistant, end = self.assistant.copy(), len(self.token_ids)
        for a, b in answer_spans(self.assistant):
            kept = loop_cut(self.token_ids[a:b], keep_periods)
            if kept is not None:
                cut = a + kept
                assistant[cut:b] = False
                if b == end:
                    end = cut
        return Conversation(self.token_ids[:end], assistant[:end], self.meta)


def write_shard(path: str, conversations: Sequence[Conversation]) -> str:
    """Writes the shard atomically; returns its sha256."""
    tokens = np.concatenate([c.token_ids for c in conversations]) if conversations else np.zeros(0, np.int64)
    dtype = np.uint16 if tokens.size == 0 or int(tokens.max()) < 1 << 16 else np.uint32
    offsets = np.cumsum([0] + [len(c.token_ids) for c in conversations]).astype(np.int64)
    assistant = np.concatenate([c.assistant for c in conversations]) if conversations else np.zeros(0, bool)
    meta = json.dumps([c.meta for c in conversations], ensure_ascii=False).encode()
    buf = io.BytesIO()
    np.savez_compressed(buf, tokens=tokens.astype(dtype), offsets=offsets,
                        assistant=np.packbits(assistant.astype(bool)), meta=np.frombuffer(meta, np.uint8))
    data = buf.getvalue()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return hashlib.sha256(data).hexdigest()


def read_shard(path: str) -> list[Conversation]:
    with np.load(path) as z:
        tokens, offsets = z["tokens"].astype(np.int64), z["offsets"]
        assistant = np.unpackbits(z["assistant"], count=len(tokens)).astype(bool)
        meta = json.loads(z["meta"].tobytes().decode())
    return [Conversation(tokens[a:b], assistant[a:b], m) for a, b, m in zip(offsets[:-1], offsets[1:], meta)]


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def shard_stats(conversations: Sequence[Conversation]) -> dict:
    return dict(conversations=len(conversations), turns=sum(len(c.meta["users"]) for c in conversations),
                tokens=int(sum(len(c.token_ids) for c in conversations)),
                answer_tokens=int(sum(int(c.assistant.sum()) for c in conversations)))


def config_changes(config, recorded: dict, num_made: int) -> list[str]:
    """The settings of config that would make any of a folder's first num_made shards differently from its
    recorded config. A key the record lacks has its default (what the shards made before it existed used); a
    key ending in `_from` is a shard index a behaviour starts at (None: never), so moving it changes nothing
    as long as the shards already made stay on the same side of it."""
    new = json.loads(json.dumps(asdict(config)))
    old = {**json.loads(json.dumps(asdict(type(config)()))), **recorded}

    def effective(key: str, value):
        return min(num_made, num_made if value is None else value) if key.endswith("_from") else value

    return [k for k in sorted(set(new) | set(old)) if effective(k, new.get(k)) != effective(k, old.get(k))]


class Manifest:
    """manifest.json of a data folder: the command, model, seed and config, and one entry per shard."""

    def __init__(self, folder: str) -> None:
        self.folder, self.path = folder, os.path.join(folder, "manifest.json")
        self.data = json.load(open(self.path)) if os.path.exists(self.path) else None

    def start(self, model: str, seed: int, config, command: str) -> None:
        """Starts or resumes a run. config: the dataclass of what a shard is made of; a resumed run must make
        the shards already there the same way (config_changes), and the manifest then records its config."""
        run = json.loads(json.dumps(dict(model=model, seed=seed, config=asdict(config))))
        if self.data is not None:
            changed = [k for k in ("model", "seed") if self.data.get(k) != run[k]]
            changed += [f"config.{k}" for k in config_changes(config, self.data["config"], len(self.shards))]
            if changed:
                raise ValueError(f"{self.folder}: the shards there were made with another {', '.join(changed)}; "
                                 f"use another --out")
            self.data["config"] = run["config"]
            self.data["commands"] = list(dict.fromkeys(self.data.get("commands", []) + [command]))
        else:
            self.data = dict(format=1, **run, commands=[command], shards=[])
        self.save()

    @property
    def shards(self) -> list[dict]:
        return self.data["shards"] if self.data else []

    def add(self, entry: dict) -> None:
        self.data["shards"].append(entry)
        keys = ("conversations", "turns", "tokens", "answer_tokens")
        self.data["totals"] = {k: sum(s[k] for s in self.shards) for k in keys}
        self.save()

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)

    def verified_shards(self) -> list[dict]:
        """The listed shards, each checked against its checksum (a missing or changed file is an error)."""
        for s in self.shards:
            path = os.path.join(self.folder, s["file"])
            if not os.path.exists(path) or file_sha256(path) != s["sha256"]:
                raise ValueError(f"{path}: missing or not the file the manifest lists (sha256 differs)")
        return self.shards


def read_conversations(folder: str) -> list[Conversation]:
    """Every conversation of a data folder's shards, in shard order."""
    manifest = Manifest(folder)
    if manifest.data is None:
        raise FileNotFoundError(f"{folder}: no manifest.json (make one with `specserve synthesize-data`)")
    return [c for s in manifest.verified_shards() for c in read_shard(os.path.join(folder, s["file"]))]


def loop_tail(token_ids: Sequence[int], max_period: int = 128, min_run: int = 32) -> tuple[int, int] | None:
    """(start, period) of the repetition loop a token sequence ends in, or None. A loop is a tail that repeats
    a period of at most max_period tokens exactly for at least two periods and min_run tokens; the longest
    such tail wins (the smallest period on a tie), and start is where its first period begins."""
    ids = np.asarray(token_ids)
    n, best = len(ids), None
    for p in range(1, min(max_period, n // 3) + 1):
        breaks = np.flatnonzero(ids[p:] != ids[:-p])
        run = n - p - (int(breaks[-1]) + 1 if len(breaks) else 0)
        if run >= max(2 * p, min_run) and (best is None or run > best[1]):
            best = (p, run)
    if best is None:
        return None
    p, run = best
    return n - run - p, p


def first_loop(token_ids: Sequence[int], max_period: int = 128, min_run: int = 32) -> tuple[int, int, int] | None:
    """(start, period, end) of the first repetition loop in a token sequence: end is the shortest prefix that
    loop_tail finds a loop at the end of, and (start, period) is what it finds there. It depends on the tokens
    up to end only, so a generation stopped once a loop shows gives the same result as the whole text."""
    ids = np.asarray(token_ids)
    first = None
    for p in range(1, min(max_period, len(ids) // 3) + 1):
        equal = ids[p:] == ids[:-p]  # equal[j]: token j + p repeats token j
        positions = np.arange(len(equal))
        runs = positions - np.maximum.accumulate(np.where(equal, -1, positions))
        hits = np.flatnonzero(runs >= max(2 * p, min_run))
        if len(hits) and (first is None or int(hits[0]) + p + 1 < first):
            first = int(hits[0]) + p + 1
    if first is None:
        return None
    start, period = loop_tail(ids[:first], max_period, min_run)
    return start, period, first


def loop_cut(token_ids: Sequence[int], keep_periods: int = 2) -> int | None:
    """How many tokens of an answer to keep when its repetition loop (first_loop) is cut after keep_periods
    periods; None: it has no loop."""
    loop = first_loop(token_ids)
    return None if loop is None else loop[0] + keep_periods * loop[1]


def answer_spans(assistant: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of assistant tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], assistant.astype(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in edges.reshape(-1, 2)]
