"""Self-synthesized chat data for drafter training (Magpie, Xu et al. 2024): the target writes the users'
messages itself and answers them, so a drafter learns the target's own answers to the broad requests a chat
model gets, with nothing downloaded.

    specserve synthesize-data --out data/selfchat --shards 80

A user turn is sampled from the target's chat template cut where a user message starts (with or without a
system prompt), then filtered: length, degenerate text (repetition, non-text, template tokens), exact and
near duplicates of every earlier user turn (MinHash over word 3-grams), and any turn sharing more than 30%
of its word 5-grams with a Spec-Bench prompt (the evaluation set). A share of first turns comes from the
task templates of `specserve.train.prompts` instead, and from the shard `--documents-from` names on, a share
are requests about a document (summarize it, list or extract from it, rewrite or translate it, or a question
about it that the target writes itself), the document being one of the target's own earlier answers or a
standard-library docstring, so the data holds long user turns whose answers draw on them, as summarization and
retrieval-augmented requests do. The target answers through the engine's batched
generation (greedy, or sampled at temperature 0.7-1.0), and a share of conversations goes on: the target
writes the next user turn after its own answer, and answers it. A small target's greedy answer can fall into a
repetition loop and repeat it to the token limit; from the shard `--stop-loops-from` names on, such an answer
ends once its loop shows (finish reason "loop"), which saves the generation the loop would cost (a quarter of
all answer tokens in the first shards) and is what `train-drafter --loop-tails cut` keeps of it anyway.

Each shard is one compressed file of token ids (`shard-NNNNN.npz`: the whole conversation as the template
renders it, and which tokens the target generated as the assistant) plus the user turns' text; the manifest
(`manifest.json`) lists every shard with its seed, counts and checksum. Shard i depends only on the seed, the
model and the shards before it, so an interrupted run resumes at the first missing shard.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specserve.train.documents import document_turn, passage_key, passages_of
from specserve.train.shards import (Conversation, Manifest, first_loop, read_conversations, read_shard,
                                    shard_stats, write_shard)
from specserve.train.text_filters import Filters, OverlapGuard, degenerate_reason, specbench_texts, words

# System prompts the synthesized conversations start with (written for this project, Apache-2.0); "" means
# none, so the template's own default applies.
SYSTEM_PROMPTS = (
    "",
    "You are a helpful assistant.",
    "You are a knowledgeable assistant. Answer clearly and accurately.",
    "You are a concise assistant: answer in a few sentences.",
    "You are a friendly assistant who explains things step by step.",
    "You are an expert programmer who writes clean, commented code.",
    "You are a patient math tutor. Show your reasoning.",
    "You are a creative writer who helps with stories, poems and letters.",
    "You are a travel and lifestyle advisor.",
    "You are a science teacher for curious students.",
    "You are a careful editor who improves and rewrites text.",
    "You are a business and career coach.",
    "You are a helpful assistant for cooking, health and everyday life.",
    "You are a history and geography expert.",
)
# ---------------------------------------------------------------- generation


@dataclass(frozen=True)
class SynthConfig:
    """What a shard is made of (the manifest records it; a resumed run must match it)."""

    conversations_per_shard: int = 256
    template_share: float = 0.1
    no_system_share: float = 0.4
    user_temperature: float = 0.9
    user_top_p: float = 0.95
    user_max_tokens: int = 160
    answer_max_tokens: int = 640
    sampled_share: float = 0.3
    sampled_temperature: tuple[float, float] = (0.7, 1.0)
    multi_turn_share: float = 0.35
    max_turns: int = 3
    max_seq_tokens: int = 2048
    # Shards from this index on end an answer once it falls into a repetition loop (shards.first_loop), with
    # finish reason "loop", instead of generating the loop up to answer_max_tokens; None: never.
    stop_loops_from: int | None = None
    # Shards from this index on make document_share of their first turns requests about a document (an earlier
    # shard's finished answer of passage_tokens tokens, or a docstring); None: never.
    documents_from: int | None = None
    document_share: float = 0.2
    passage_tokens: tuple[int, int] = (100, 600)

    def stops_loops(self, index: int) -> bool:
        return self.stop_loops_from is not None and index >= self.stop_loops_from

    def has_documents(self, index: int) -> bool:
        return self.documents_from is not None and index >= self.documents_from


class _Answer:
    """What make_shard reads of a finished generation (a RequestOutput, or one stopped in a loop)."""

    def __init__(self, token_ids: list[int], text: str, finish_reason: str, error: str | None = None) -> None:
        self.token_ids, self.text, self.finish_reason, self.error = token_ids, text, finish_reason, error


def generate_answers(llm, prompts: list[list[int]], params: list, stop_loops: bool,
                     check_every: int = 16) -> list[_Answer]:
    """The target's answers through the engine's batched generation. stop_loops: every check_every tokens an
    answer is checked for a repetition loop (first_loop) and, once one shows, aborted: its tokens so far are
    the answer, with finish reason "loop"."""
    if not stop_loops:
        return [_Answer(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason, o.error)
                for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = llm.llm_engine
    ids = [f"synth-{i}" for i in range(len(prompts))]
    done: dict[str, _Answer] = {}
    for rid, prompt, p in zip(ids, prompts, params):
        try:
            engine.add_request(rid, prompt, p)
        except ValueError as exc:
            done[rid] = _Answer([], "", "error", str(exc))
    checked = dict.fromkeys(ids, 0)
    while engine.has_unfinished_requests():
        for out in engine.step():
            o = out.outputs[0]
            if out.finished:
                done[out.request_id] = _Answer(list(o.token_ids), o.text, o.finish_reason, out.error)
            elif len(o.token_ids) >= checked[out.request_id] + check_every:
                checked[out.request_id] = len(o.token_ids)
                if first_loop(o.token_ids) is not None:
                    engine.abort_request(out.request_id)
                    done[out.request_id] = _Answer(list(o.token_ids), o.text, "loop")
    return [done[rid] for rid in ids]


def pre_query(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the chat template rendered for messages + a user turn, cut where the user's text starts."""
    sentinel = "\u2063SENTINEL\u2063"
    text = tokenizer.apply_chat_template(messages + [{"role": "user", "content": sentinel}], add_generation_prompt=False)
    return tokenizer.encode(text[:text.index(sentinel)], add_special_tokens=False)


def render(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


class _Conv:
    def __init__(self, system: str, source: str, first_user: str, answer: dict, turns: int,
                 about: dict | None = None) -> None:
        self.system, self.source, self.answer, self.turns = system, source, answer, turns
        self.about = about or {}  # a request about a document: its task and passage key
        self.messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": first_user}]
        self.users = [first_user]
        self.spans: list[tuple[int, int]] = []
        self.token_ids: list[int] = []
        self.finish: list[str] = []

    def add_answer(self, prompt_ids: list[int], out_ids: list[int], text: str, finish: str) -> bool:
        """Appends an answer turn; False (and nothing added) if the template's rendering of the conversation
        so far does not start with the tokens kept so far (a tokenization that does not round-trip)."""
        if prompt_ids[:len(self.token_ids)] != self.token_ids:
            return False
        self.spans.append((len(prompt_ids), len(prompt_ids) + len(out_ids)))
        self.token_ids = list(prompt_ids) + list(out_ids)
        self.messages.append({"role": "assistant", "content": text})
        self.finish.append(finish)
        return True

    def record(self) -> Conversation:
        assistant = np.zeros(len(self.token_ids), bool)
        for a, b in self.spans:
            assistant[a:b] = True
        meta = dict(source=self.source, system=self.system, users=self.users[:len(self.spans)],
                    answer=self.answer, finish=self.finish, **self.about)
        return Conversation(np.asarray(self.token_ids, np.int64), assistant, meta)


def document_firsts(llm, rng, c: SynthConfig, filters: Filters, passages: Sequence[str], system_choice, user_params,
                    about: dict[int, dict], offset: int) -> list[tuple[str, str, str]]:
    """c.document_share of a shard's first turns as requests about passages (document_turn), each passage at
    most once (filters.passages_used); a question the target writes passes the user-turn filters on its own.
    about[offset + i] records each one's task and passage key."""
    want = int(round(c.conversations_per_shard * c.document_share))
    tok = llm.get_tokenizer()
    drafts = []  # (system, kind, text, asks, key)
    for j in rng.permutation(len(passages))[:3 * want]:
        key = passage_key(passages[j])
        if key not in filters.passages_used:
            kind, text, asks = document_turn(rng, passages[j])
            drafts.append((system_choice(), kind, text, asks, key))
    asking = [d for d in drafts if d[3]]
    questions = llm.generate([pre_query(tok, [{"role": "system", "content": s}] if s else []) + tok.encode(text)
                              for s, _, text, _, _ in asking], [user_params() for _ in asking], use_tqdm=False)
    written = {id(d): out.outputs[0] for d, out in zip(asking, questions)}
    out = []
    for d in drafts:
        system, kind, text, asks, key = d
        if len(out) >= want:
            break
        if key in filters.passages_used:
            continue
        if asks:
            q = written[id(d)]
            why = "unfinished" if q.finish_reason != "stop" else degenerate_reason(q.text.strip()) or \
                (None if "?" in q.text else "no question")
            if why is not None:
                filters.rejected[why] += 1
                continue
            text = f"{text} {q.text.strip()}"
        if filters.accept(text, max_words=2 * c.passage_tokens[1] + 200, max_chars=8 * c.passage_tokens[1] + 1600):
            filters.passages_used.add(key)
            about[offset + len(out)] = dict(task=kind, passage=key)
            out.append((system, "document", text))
    return out


def converse(llm, convs: list[_Conv], c: SynthConfig, stop_loops: bool, filters: Filters, user_params) -> None:
    """Answers each conversation's turns: the target answers every active conversation in one batch, and one
    that wants another turn (and whose answer ended by itself, with room left) gets the next user turn the
    target writes after its answer, if that passes the filters."""
    from specserve.sampling_params import SamplingParams

    tok = llm.get_tokenizer()
    active = list(convs)
    for turn in range(c.max_turns):
        prompt_ids = [render(tok, conv.messages) for conv in active]
        params = [SamplingParams(temperature=conv.answer["temperature"], seed=conv.answer.get("seed", 0) + turn,
                                 max_tokens=min(c.answer_max_tokens, max(1, c.max_seq_tokens - len(ids))))
                  for conv, ids in zip(active, prompt_ids)]
        going = []
        for conv, ids, o in zip(active, prompt_ids, generate_answers(llm, prompt_ids, params, stop_loops)):
            if o.error or not conv.add_answer(ids, o.token_ids, o.text, o.finish_reason):
                continue
            if len(conv.spans) < conv.turns and o.finish_reason == "stop" \
                    and len(conv.token_ids) < c.max_seq_tokens - c.answer_max_tokens // 2:
                going.append(conv)
        if not going:
            break
        outs = llm.generate([pre_query(tok, conv.messages) for conv in going], [user_params() for _ in going],
                            use_tqdm=False)
        active = []
        for conv, out in zip(going, outs):
            text = out.outputs[0].text.strip()
            if out.outputs[0].finish_reason != "stop":
                filters.rejected["unfinished"] += 1
            elif filters.accept(text):
                conv.messages.append({"role": "user", "content": text})
                conv.users.append(text)
                active.append(conv)
        if not active:
            break


def make_shard(llm, index: int, seed: int, config: SynthConfig, filters: Filters, template_prompts: Sequence[str],
               passages: Sequence[str] = (), log=print) -> list[Conversation]:
    """One shard of conversations, deterministic for (seed, index, the filters' state, the passages)."""
    from specserve.sampling_params import SamplingParams

    tok = llm.get_tokenizer()
    rng = np.random.default_rng([seed, index])
    c = config
    n_template = int(round(c.conversations_per_shard * c.template_share))

    def seed_of() -> int:
        return int(rng.integers(0, 2 ** 31 - 1))

    def system_choice() -> str:
        return "" if rng.random() < c.no_system_share else str(rng.choice(SYSTEM_PROMPTS[1:]))

    def user_params() -> SamplingParams:
        return SamplingParams(temperature=c.user_temperature, top_p=c.user_top_p, max_tokens=c.user_max_tokens,
                              seed=seed_of())

    firsts: list[tuple[str, str, str]] = []  # (system, source, text)
    for j in rng.permutation(len(template_prompts))[:4 * n_template] if n_template else []:
        if len(firsts) >= n_template:
            break
        if filters.accept(template_prompts[j]):
            firsts.append((system_choice(), "template", template_prompts[j]))
    about: dict[int, dict] = {}  # index in firsts -> a document request's task and passage
    if c.has_documents(index) and passages:
        firsts += document_firsts(llm, rng, c, filters, passages, system_choice, user_params, about, len(firsts))
    for _ in range(6):
        need = c.conversations_per_shard - len(firsts)
        if need <= 0:
            break
        systems = [system_choice() for _ in range(int(need * 1.6) + 8)]
        prompts = [pre_query(tok, [{"role": "system", "content": s}] if s else []) for s in systems]
        outs = llm.generate(prompts, [user_params() for _ in systems], use_tqdm=False)
        for s, out in zip(systems, outs):
            text = out.outputs[0].text.strip()
            if len(firsts) >= c.conversations_per_shard:
                break
            if out.outputs[0].finish_reason != "stop":
                filters.rejected["unfinished"] += 1
            elif filters.accept(text):
                firsts.append((s, "magpie", text))

    convs = []
    for i, (system, source, text) in enumerate(firsts):
        sampled = rng.random() < c.sampled_share
        answer = dict(temperature=round(float(rng.uniform(*c.sampled_temperature)), 3), seed=seed_of()) \
            if sampled else dict(temperature=0.0)
        turns = 1 if rng.random() >= c.multi_turn_share else int(rng.integers(2, c.max_turns + 1))
        convs.append(_Conv(system, source, text, answer, turns, about.get(i, {})))

    converse(llm, convs, c, c.stops_loops(index), filters, user_params)
    return [conv.record() for conv in convs if conv.spans]


def synthesize(llm, folder: str, num_shards: int, seed: int, config: SynthConfig, model_name: str,
               command: str = "", guard: OverlapGuard | None = None, template_prompts: Sequence[str] = (),
               documents: Sequence[str] = (), log=print) -> Manifest:
    """Makes shards until the folder has num_shards; resumes after the last complete one. Requests about a
    document (config.documents_from) draw on documents and on the earlier shards' answers (passages_of)."""
    os.makedirs(folder, exist_ok=True)
    manifest = Manifest(folder)
    manifest.start(model_name, seed, config, command)
    filters = Filters(guard=guard)
    with_documents = config.documents_from is not None
    passages = list(documents) if with_documents else []
    for s in manifest.verified_shards():  # earlier shards' user turns: later shards must not repeat them
        convs = read_shard(os.path.join(folder, s["file"]))
        for conv in convs:
            for text in conv.meta["users"]:
                filters.near.add(text)
            if "passage" in conv.meta:
                filters.passages_used.add(conv.meta["passage"])
        if with_documents:
            passages += passages_of(llm.get_tokenizer(), convs, config.passage_tokens)
    for index in range(len(manifest.shards), num_shards):
        start = time.perf_counter()
        convs = make_shard(llm, index, seed, config, filters, template_prompts, passages, log=log)
        if with_documents:
            passages += passages_of(llm.get_tokenizer(), convs, config.passage_tokens)
        name = f"shard-{index:05d}.npz"
        sha = write_shard(os.path.join(folder, name), convs)
        stats = shard_stats(convs)
        seconds = time.perf_counter() - start
        manifest.add(dict(file=name, index=index, seed=[seed, index], sha256=sha, seconds=round(seconds, 1),
                          rejected=dict(filters.rejected), **stats))
        filters.rejected.clear()
        log(f"shard {index + 1}/{num_shards}: {stats['conversations']} conversations, {stats['turns']} turns, "
            f"{stats['answer_tokens']} answer tokens in {seconds / 60:.1f} min "
            f"({stats['answer_tokens'] / seconds:.0f} answer tok/s); total {manifest.data['totals']}")
    return manifest


# ---------------------------------------------------------------- the mix


TASK_KEYWORDS = (
    ("code", r"\b(python|code|function|program|javascript|java|sql|script|api|debug|html|css|c\+\+|algorithm)\b"),
    ("math", r"\b(solve|equation|calculate|math|sum|percent|probability|number|integer|\d+\s*[-+*/x]\s*\d+)\b"),
    ("writing", r"\b(write|poem|story|essay|letter|email|blog|article|song|script|rewrite|draft)\b"),
    ("list/plan", r"\b(list|plan|steps|ideas|tips|suggest|recommend|ways|schedule)\b"),
    ("explain", r"\b(explain|what is|what are|why|how does|how do|describe|difference)\b"),
    ("advice", r"\b(help|advice|should i|i need|i'm|i am|my)\b"),
)


def task_of(text: str) -> str:
    t = text.lower()
    return next((name for name, pattern in TASK_KEYWORDS if re.search(pattern, t)), "other")


def describe(folder: str, guard: OverlapGuard | None = None) -> dict:
    """The mix of a data folder: sources, system prompts, turns, answer sampling and length, task kinds of
    the first user turns (keyword rules; a request about a document: its task), distinct word n-grams of the user turns, and the largest
    Spec-Bench 5-gram share of any user turn."""
    convs = read_conversations(folder)
    users = [u for c in convs for u in c.meta["users"]]
    all_words = [words(u) for u in users]

    def distinct(n: int) -> float:
        grams = [tuple(w[i:i + n]) for w in all_words for i in range(len(w) - n + 1)]
        return len(set(grams)) / max(1, len(grams))

    answer_lengths = [int(c.assistant.sum()) for c in convs]
    out = dict(
        conversations=len(convs), user_turns=len(users),
        tokens=int(sum(len(c.token_ids) for c in convs)), answer_tokens=int(sum(answer_lengths)),
        sources=dict(Counter(c.meta["source"] for c in convs)),
        turns=dict(sorted(Counter(len(c.meta["users"]) for c in convs).items())),
        system_prompt=dict(none=sum(not c.meta["system"] for c in convs),
                           some=sum(bool(c.meta["system"]) for c in convs)),
        sampled=sum(c.meta["answer"]["temperature"] > 0 for c in convs),
        finish=dict(Counter(f for c in convs for f in c.meta["finish"])),
        answer_tokens_median=float(np.median(answer_lengths)) if convs else 0.0,
        tasks=dict(Counter(f"document: {c.meta['task']}" if "task" in c.meta else task_of(c.meta["users"][0])
                           for c in convs).most_common()),
        distinct_1=round(distinct(1), 4), distinct_2=round(distinct(2), 4), distinct_3=round(distinct(3), 4))
    if guard is not None:
        out["max_specbench_5gram_share"] = round(max((guard.share(u) for u in users), default=0.0), 3)
    return out


def add_synthesize_parser(sub) -> None:
    p = sub.add_parser("synthesize-data", help="self-synthesized chat data for drafter training (Magpie)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="data folder (shards and manifest.json)")
    p.add_argument("--shards", type=int, default=None, help="make shards until the folder has this many")
    p.add_argument("--model", default=None, help="target: HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--conversations-per-shard", type=int, default=SynthConfig.conversations_per_shard)
    p.add_argument("--answer-max-tokens", type=int, default=SynthConfig.answer_max_tokens)
    p.add_argument("--stop-loops-from", type=int, default=None, metavar="SHARD",
                   help="shards from this index on end an answer once it falls into a repetition loop instead of "
                        "generating the loop to the token limit (default: the folder's recorded setting; a new "
                        "folder: 0); -1: never")
    p.add_argument("--documents-from", type=int, default=None, metavar="SHARD",
                   help="shards from this index on make a share of their first turns requests about a document "
                        "(summaries, extraction, rewriting, questions) over earlier answers and standard-library "
                        "docstrings (default: the folder's recorded setting; a new folder: 0); -1: never")
    p.add_argument("--max-num-seqs", type=int, default=128, help="generation batch")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=4 << 30)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--describe", action="store_true", help="print the folder's mix as JSON and exit")
    p.set_defaults(func=cmd_synthesize)


def shard_from(args, key: str) -> int | None:
    """A `*_from` setting: the command line's (-1: never), else the folder's recorded one, else 0."""
    given = getattr(args, key)
    if given is not None:
        return None if given < 0 else given
    recorded = Manifest(args.out).data
    return recorded["config"].get(key) if recorded else 0


def cmd_synthesize(args) -> int:
    guard = OverlapGuard(specbench_texts())
    if args.describe:
        print(json.dumps(describe(args.out, guard), indent=1))
        return 0
    if args.shards is None:
        raise SystemExit("specserve synthesize-data: --shards is required (or --describe)")
    import torch

    from specserve.llm import LLM
    from specserve.train.prompts import build_prompts, stdlib_docs

    if args.threads:
        torch.set_num_threads(args.threads)
    config = SynthConfig(conversations_per_shard=args.conversations_per_shard,
                         answer_max_tokens=args.answer_max_tokens, stop_loops_from=shard_from(args, "stop_loops_from"),
                         documents_from=shard_from(args, "documents_from"))
    llm = LLM(model=args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, seed=args.seed)
    templates = [p["prompt"] for p in build_prompts(4000, args.seed)] if config.template_share else []
    documents = [d.doc for d in stdlib_docs(min_chars=500, max_chars=3000)] \
        if config.documents_from is not None else []
    command = "specserve " + " ".join(shlex.quote(a) for a in args.argv)
    synthesize(llm, args.out, args.shards, args.seed, config, os.path.basename(str(args.model or "default")),
               command, guard, templates, documents)
    return 0
