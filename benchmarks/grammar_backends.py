"""`python benchmarks/grammar_backends.py`: xgrammar against llguidance on the default model's tokenizer
(tokenizer setup, grammar compilation, per-token masks, rollback, memory); prints a table and writes JSON.

Each engine runs in its own subprocess so its import time and memory are measured alone; an engine that is
not installed is skipped with a message. The answers walked through each grammar are fixed valid outputs,
tokenized by the model's tokenizer, so both engines do the same work.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

DEFAULT_OUTPUT = "bench_results/grammar_backends.json"
ENGINES = ("llguidance", "xgrammar")
NUM_DRAFTS = 4  # drafts per speculative step in the "draft masks" row

# JSON as `json.dumps` writes it, the separators specserve.structured uses (no other whitespace).
ITEM_SEPARATOR, KEY_SEPARATOR = ", ", ": "

# ---------------------------------------------------------------- workloads: (name, kind, spec, a valid output)

_ADDRESS = {"type": "object", "properties": {
    "street": {"type": "string"}, "city": {"type": "string"},
    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "country": {"enum": ["US", "CA", "MX"]}},
    "required": ["street", "city", "zip"], "additionalProperties": False}

JSON_SCHEMAS: list[tuple[str, dict, Any]] = [
    ("person", {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}, "address": _ADDRESS},
        "required": ["name", "age", "email", "address"], "additionalProperties": False},
     {"name": "Ada Lovelace", "age": 36, "email": "ada.lovelace@example.org", "tags": ["math", "engines"],
      "address": {"street": "12 St James's Square", "city": "London", "zip": "10001", "country": "US"}}),
    ("weather", {"type": "object", "properties": {
        "temperature_celsius": {"type": "integer"}, "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
        "wind": {"type": "object", "properties": {"speed_kmh": {"type": "number", "minimum": 0},
                                                  "direction": {"enum": ["N", "E", "S", "W"]}},
                 "required": ["speed_kmh", "direction"], "additionalProperties": False}},
        "required": ["temperature_celsius", "conditions", "wind"], "additionalProperties": False},
     {"temperature_celsius": -3, "conditions": "snow", "wind": {"speed_kmh": 22.5, "direction": "N"}}),
    ("order", {"type": "object", "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
            "required": ["sku", "quantity", "price"], "additionalProperties": False}},
        "status": {"enum": ["pending", "paid", "shipped", "delivered"]}, "shipping": _ADDRESS},
        "required": ["order_id", "items", "status"], "additionalProperties": False},
     {"order_id": "ORD-004217", "items": [{"sku": f"SKU-{i:03d}-{c}", "quantity": i + 1, "price": 4.5 + 3 * i}
                                          for i, c in enumerate(["red", "blue", "green", "black", "white", "gray",
                                                                 "navy", "teal"])],
      "status": "shipped", "shipping": {"street": "1 Infinite Loop", "city": "Cupertino", "zip": "95014"}}),
    ("tool_call", {"type": "object", "properties": {
        "name": {"enum": ["get_weather", "search_web", "send_email"]},
        "arguments": {"type": "object", "properties": {"location": {"type": "string"},
                                                       "unit": {"enum": ["celsius", "fahrenheit"]}},
                      "required": ["location"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
     {"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}),
    ("catalog_refs", {"$defs": {"variant": {"type": "object", "properties": {
        "color": {"type": "string"}, "size": {"enum": ["S", "M", "L", "XL"]}, "in_stock": {"type": "boolean"}},
        "required": ["color", "size", "in_stock"], "additionalProperties": False}},
        "type": "object", "properties": {"product": {"type": "string"},
                                         "variants": {"type": "array", "items": {"$ref": "#/$defs/variant"}}},
        "required": ["product", "variants"], "additionalProperties": False},
     {"product": "Trail Runner 2", "variants": [{"color": "slate", "size": "M", "in_stock": True},
                                                {"color": "sand", "size": "XL", "in_stock": False}]}),
    ("event", {"type": "object", "properties": {
        "title": {"type": "string"}, "start": {"type": "string", "format": "date-time"},
        "attendees": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "email": {"type": "string", "format": "email"}},
            "required": ["name", "email"], "additionalProperties": False}},
        "recurrence": {"anyOf": [{"enum": ["daily", "weekly", "monthly"]}, {"type": "null"}]}},
        "required": ["title", "start", "attendees", "recurrence"], "additionalProperties": False},
     {"title": "Design review", "start": "2026-12-03T14:30:00Z",
      "attendees": [{"name": "Grace", "email": "grace@example.com"}, {"name": "Linus", "email": "linus@example.com"}],
      "recurrence": None}),
    ("recipe", {"type": "object", "properties": {
        "title": {"type": "string"}, "servings": {"type": "integer", "minimum": 1},
        "ingredients": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "amount": {"type": "number"}, "unit": {"enum": ["g", "ml", "tsp", "pcs"]}},
            "required": ["name", "amount", "unit"], "additionalProperties": False}},
        "steps": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
        "required": ["title", "servings", "ingredients", "steps"], "additionalProperties": False},
     {"title": "Pancakes", "servings": 4, "ingredients": [{"name": "flour", "amount": 200, "unit": "g"},
                                                          {"name": "milk", "amount": 300, "unit": "ml"},
                                                          {"name": "eggs", "amount": 2, "unit": "pcs"}],
      "steps": ["Whisk everything together.", "Fry in a hot pan until golden."]}),
    ("error_response", {"type": "object", "properties": {
        "code": {"type": "integer"}, "message": {"type": "string"},
        "details": {"type": "array", "items": {"type": "string"}}},
        "required": ["code", "message"], "additionalProperties": False},
     {"code": 404, "message": "No user with id 17 exists.", "details": ["checked primary", "checked replica"]}),
    ("issue", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 80},
        "labels": {"type": "array", "items": {"enum": ["bug", "feature", "docs", "performance"]}},
        "assignee": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "priority": {"enum": ["low", "medium", "high"]}, "estimate_hours": {"type": "number", "minimum": 0}},
        "required": ["title", "labels", "assignee", "priority"], "additionalProperties": False},
     {"title": "Mask computation stalls on long regexes", "labels": ["bug", "performance"], "assignee": "mgreen",
      "priority": "high", "estimate_hours": 6}),
    ("sentiment", {"type": "object", "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]}, "confidence": {"type": "number"},
        "spans": {"type": "array", "items": {"type": "object", "properties": {
            "start": {"type": "integer"}, "end": {"type": "integer"}},
            "required": ["start", "end"], "additionalProperties": False}}},
        "required": ["label", "confidence", "spans"], "additionalProperties": False},
     {"label": "negative", "confidence": 0.87, "spans": [{"start": 4, "end": 19}, {"start": 27, "end": 40}]}),
]

REGEX = ("phone", r"\+?1?[ -]?\(?[0-9]{3}\)?[ -]?[0-9]{3}-[0-9]{4}", "+1 (415) 555-0134")
CHOICE = ("choice", ["positive", "negative", "neutral", "mixed feelings"], "mixed feelings")
GBNF = ("sql_gbnf", r'''root ::= "SELECT " columns " FROM " ident where? ";"
columns ::= "*" | ident (", " ident)*
where ::= " WHERE " ident " " op " " value
op ::= "=" | "<" | ">" | "<=" | ">="
value ::= [0-9]+ | "'" [a-zA-Z ]* "'"
ident ::= [a-z_] [a-z_0-9]*''', "SELECT name, age FROM users WHERE age >= 21;")


def workloads() -> list[tuple[str, str, Any, str]]:
    """(name, kind, spec, answer text) for every grammar the benchmark compiles and walks."""
    rows = [(name, "json", schema, json.dumps(answer)) for name, schema, answer in JSON_SCHEMAS]
    rows.append(("json_object", "json_object", None, json.dumps(JSON_SCHEMAS[2][2])))
    rows += [(REGEX[0], "regex", REGEX[1], REGEX[2]), (CHOICE[0], "choice", CHOICE[1], CHOICE[2]),
             (GBNF[0], "grammar", GBNF[1], GBNF[2])]
    return rows


# ---------------------------------------------------------------- engines


class Llguidance:
    """llguidance: a compiled grammar is a fresh LLMatcher; each request deep-copies it."""

    name = "llguidance"

    def __init__(self) -> None:
        import llguidance  # not llguidance.torch: importing it runs torch.compile's setup (seconds, ~100 MiB)

        self.llg = llguidance

    def tokenizer_info(self, tokenizer) -> Any:
        return self.llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                    eos_token=sorted(tokenizer.eos_token_ids))

    def compile(self, info, kind: str, spec) -> Any:
        options = {"whitespace_flexible": False, "item_separator": ITEM_SEPARATOR, "key_separator": KEY_SEPARATOR}
        from_schema = self.llg.LLMatcher.grammar_from_json_schema
        if kind == "json":
            grammar = from_schema(spec, overrides=options)
        elif kind == "json_object":
            grammar = from_schema({"type": "object"}, overrides=options)
        elif kind == "regex":
            grammar = self.llg.LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            grammar = self.llg.grammar_from("choice", spec)
        else:
            grammar = self.llg.grammar_from("grammar", spec)
        matcher = self.llg.LLMatcher(info, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher, bitmask) -> None:  # bitmask: [1, ceil(vocab / 32)] int32
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    def consume(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id)

    def rollback(self, matcher, num_tokens: int) -> None:
        matcher.rollback(num_tokens)

    def cached_compile(self, info, kind, spec) -> Callable[[], Any] | None:
        return None  # llguidance has no compile cache; specserve.structured keeps compiled grammars itself

    def compiled_bytes(self, compiled) -> int | None:
        return None


class Xgrammar:
    """xgrammar: a GrammarCompiler per tokenizer (with and without its cache); a GrammarMatcher per request."""

    name = "xgrammar"

    def __init__(self) -> None:
        import xgrammar

        self.xgr = xgrammar

    def tokenizer_info(self, tokenizer) -> Any:
        # Special tokens are spelled as empty strings: xgrammar otherwise allows <|im_start|> and the like
        # inside JSON strings, since their text is valid there.
        vocab = [""] * tokenizer.vocab_size
        special = set(tokenizer.all_special_ids)
        for token, token_id in tokenizer.backend.get_vocab(with_added_tokens=True).items():
            if token_id not in special:
                vocab[token_id] = token
        info = self.xgr.TokenizerInfo(vocab, self.xgr.VocabType.BYTE_LEVEL, vocab_size=tokenizer.vocab_size,
                                      stop_token_ids=sorted(tokenizer.eos_token_ids))
        self.cold = self.xgr.GrammarCompiler(info, cache_enabled=False)
        self.cached = self.xgr.GrammarCompiler(info, cache_enabled=True)
        return info

    def compile(self, info, kind: str, spec, compiler=None) -> Any:
        compiler = compiler or self.cold
        try:
            if kind == "json":
                return compiler.compile_json_schema(spec, any_whitespace=False,
                                                    separators=(ITEM_SEPARATOR, KEY_SEPARATOR))
            if kind == "json_object":
                return compiler.compile_json_schema({"type": "object"}, any_whitespace=False,
                                                    separators=(ITEM_SEPARATOR, KEY_SEPARATOR))
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))
            return compiler.compile_grammar(spec)
        except RuntimeError as e:
            raise ValueError(str(e)) from e

    def matcher(self, compiled) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask) -> None:
        matcher.fill_next_token_bitmask(bitmask)

    def consume(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)

    def rollback(self, matcher, num_tokens: int) -> None:
        matcher.rollback(num_tokens)

    def cached_compile(self, info, kind, spec) -> Callable[[], Any] | None:
        self.compile(info, kind, spec, self.cached)
        return lambda: self.compile(info, kind, spec, self.cached)

    def compiled_bytes(self, compiled) -> int | None:
        return compiled.memory_size_bytes


# ---------------------------------------------------------------- measuring one engine


def rss_mib() -> float:
    """Resident memory of this process now (Linux), in MiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    return statistics.median(timed(fn)[0] for _ in range(repeats))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def walk(engine, matcher, token_ids: list[int], bitmask) -> tuple[list[float], list[float]]:
    """Mask then consume each answer token; checks each token is allowed by its mask. Returns the mask and
    consume times, in seconds."""
    mask_s, consume_s = [], []
    for token_id in token_ids:
        elapsed, _ = timed(lambda: engine.fill(matcher, bitmask))
        mask_s.append(elapsed)
        if not (int(bitmask[0, token_id // 32]) >> (token_id % 32)) & 1:
            raise RuntimeError(f"{engine.name}: the answer's token {token_id} is not in its mask")
        elapsed, ok = timed(lambda: engine.consume(matcher, token_id))
        consume_s.append(elapsed)
        if not ok:
            raise RuntimeError(f"{engine.name}: the answer's token {token_id} was refused")
    return mask_s, consume_s


def rollback_and_drafts(engine, matcher, token_ids: list[int], bitmask) -> dict[str, list[float]]:
    """Along the answer: rollback of 4 and 16 tokens (then re-consume), and one speculative step's masks
    (now and after each of NUM_DRAFTS drafts, then rollback)."""
    times: dict[str, list[float]] = {"rollback_4": [], "rollback_16": [], "draft_masks": []}
    body = token_ids[:-1]  # not the EOS: the matcher ends there
    for i, token_id in enumerate(body):
        engine.consume(matcher, token_id)
        for k in (4, 16):
            if i + 1 >= k and (k == 4 or i % 8 == 0):
                times[f"rollback_{k}"].append(timed(lambda: engine.rollback(matcher, k))[0])
                for t in body[i + 1 - k:i + 1]:
                    engine.consume(matcher, t)
        drafts = body[i + 1:i + 1 + NUM_DRAFTS]
        if len(drafts) == NUM_DRAFTS:
            times["draft_masks"].append(timed(lambda: _draft_masks(engine, matcher, drafts, bitmask))[0])
    return times


def _draft_masks(engine, matcher, drafts: list[int], bitmask) -> None:
    engine.fill(matcher, bitmask)
    for token_id in drafts:
        engine.consume(matcher, token_id)
        engine.fill(matcher, bitmask)
    engine.rollback(matcher, len(drafts))


def measure_engine(name: str, repeats: int) -> dict:
    """Every number for one engine, in this process (import first, so its time and memory count)."""
    import torch

    rss_start = rss_mib()
    import_s, engine = timed({"llguidance": Llguidance, "xgrammar": Xgrammar}[name])
    from specserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    rss_before_info = rss_mib()
    info_s = [timed(lambda: engine.tokenizer_info(tokenizer))[0] for _ in range(repeats)]
    info = engine.tokenizer_info(tokenizer)
    rss_after_info = rss_mib()
    bitmask = torch.zeros(1, (tokenizer.vocab_size + 31) // 32, dtype=torch.int32)  # [1, ceil(vocab / 32)]

    per_grammar, json_mask, other_mask, warm_json_mask, consume = [], [], [], [], []
    spec_times: dict[str, list[float]] = {}
    compiled_bytes = 0
    for wname, kind, spec, answer in workloads():
        ids = tokenizer.encode(answer, add_special_tokens=False) + [min(tokenizer.eos_token_ids)]
        compile_s, first_mask_s, new_matcher_s = [], [], []
        for _ in range(repeats):
            elapsed, compiled = timed(lambda: engine.compile(info, kind, spec))
            compile_s.append(elapsed)
            matcher = engine.matcher(compiled)
            masks, consumed = walk(engine, matcher, ids, bitmask)  # first request on a fresh grammar
            first_mask_s.append(masks[0])
            (json_mask if kind.startswith("json") else other_mask).extend(masks)
            consume.extend(consumed)
            elapsed, matcher = timed(lambda: engine.matcher(compiled))  # a later request, same grammar
            new_matcher_s.append(elapsed)
            masks, _ = walk(engine, matcher, ids, bitmask)
            if kind.startswith("json"):
                warm_json_mask.extend(masks)
            for key, values in rollback_and_drafts(engine, engine.matcher(compiled), ids, bitmask).items():
                spec_times.setdefault(key, []).extend(values)
        compiled_bytes += engine.compiled_bytes(compiled) or 0
        cached = engine.cached_compile(info, kind, spec)
        per_grammar.append({
            "name": wname, "kind": kind, "num_answer_tokens": len(ids),
            "compile_ms": 1e3 * statistics.median(compile_s),
            "cached_compile_ms": 1e3 * median_time(cached, repeats) if cached else None,
            "new_matcher_us": 1e6 * statistics.median(new_matcher_s),
            "first_mask_ms": 1e3 * statistics.median(first_mask_s)})
    json_rows = [g for g in per_grammar if g["kind"] == "json"]
    return {
        "engine": name, "version": _version(name), "import_s": import_s,
        "tokenizer_info_ms": 1e3 * statistics.median(info_s),
        "tokenizer_info_rss_mib": rss_after_info - rss_before_info,
        "json_compile_ms_median": statistics.median(g["compile_ms"] for g in json_rows),
        "json_compile_ms_max": max(g["compile_ms"] for g in json_rows),
        "mask_us": _quantiles(json_mask + other_mask), "json_mask_us": _quantiles(json_mask),
        "json_mask_warm_us": _quantiles(warm_json_mask), "other_mask_us": _quantiles(other_mask),
        "consume_us": _quantiles(consume),
        **{f"{key}_us": _quantiles(values) for key, values in spec_times.items()},
        "compiled_grammar_bytes": compiled_bytes or None,
        "rss_total_mib": rss_mib() - rss_start, "grammars": per_grammar,
    }


def _quantiles(seconds: list[float]) -> dict:
    return {"median": 1e6 * statistics.median(seconds), "p99": 1e6 * percentile(seconds, 99),
            "max": 1e6 * max(seconds), "n": len(seconds)}


def _version(name: str) -> str:
    from specserve.bench.common import package_version

    return package_version(name)


def measure_unpack(vocab_size: int, repeats: int = 2000) -> dict:
    """Bitmask -> bool mask conversions (engine-independent): torch shifts over the int32 words, and numpy's
    unpackbits over their bytes (what specserve.structured uses)."""
    import numpy as np
    import torch

    words = torch.randint(-2**31, 2**31 - 1, ((vocab_size + 31) // 32,), dtype=torch.int32)  # [ceil(vocab/32)]
    shifts = torch.arange(32, dtype=torch.int32)
    array = words.numpy()
    ways = {
        "torch_shifts": lambda: ((words.unsqueeze(1) >> shifts) & 1).view(-1)[:vocab_size].bool(),
        "numpy_unpackbits": lambda: torch.from_numpy(
            np.unpackbits(array.view(np.uint8), count=vocab_size, bitorder="little")).view(torch.bool),
    }
    if not torch.equal(ways["torch_shifts"](), ways["numpy_unpackbits"]()):
        raise RuntimeError("the two bitmask conversions disagree")
    for fn in ways.values():
        median_time(fn, repeats // 10)  # warm up
    return {name: 1e6 * median_time(fn, repeats) for name, fn in ways.items()}


def measure_specserve(repeats: int) -> dict | None:
    """specserve.structured's GrammarMatcher (llguidance plus the bool unpacking) over the JSON answers:
    allowed_mask per token, and allowed_masks for NUM_DRAFTS drafts; None when llguidance is missing."""
    if importlib.util.find_spec("llguidance") is None:
        return None
    from specserve.structured.grammar import GrammarCompiler, GrammarMatcher
    from specserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    mask_s, drafts_s = [], []
    for _, kind, spec, answer in workloads():
        ids = tokenizer.encode(answer, add_special_tokens=False) + [min(tokenizer.eos_token_ids)]
        for _ in range(repeats):
            matcher = GrammarMatcher(compiler.compile(kind, spec))
            for i, token_id in enumerate(ids):
                mask_s.append(timed(matcher.allowed_mask)[0])
                drafts = ids[i:i + NUM_DRAFTS]
                if len(drafts) == NUM_DRAFTS:
                    drafts_s.append(timed(lambda: matcher.allowed_masks(drafts))[0])
                matcher.accept([token_id])
    return {"allowed_mask_us": _quantiles(mask_s), "allowed_masks_us": _quantiles(drafts_s)}


# ---------------------------------------------------------------- driver


def run_in_subprocess(name: str, repeats: int) -> dict | None:
    """One engine's numbers from a fresh interpreter, or None (with a message) when it is not installed."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder, "result.json")
        proc = subprocess.run([sys.executable, __file__, "--engine", name,
                               "--repeats", str(repeats), "--output", str(out)], capture_output=True, text=True)
        if proc.returncode == 3:
            print(f"skipping {name}: not installed (pip install {name})", file=sys.stderr)
            return None
        if proc.returncode != 0:
            raise RuntimeError(f"measuring {name} failed:\n{proc.stderr}")
        return json.loads(out.read_text())


def report(results: list[dict], unpack: dict, wrapper: dict | None) -> str:
    from specserve.bench.common import format_table

    def q(r, key):
        return f"{r[key]['median']:.1f} / {r[key]['p99']:.1f}"

    rows = [
        ("import (s)", *(r["import_s"] for r in results)),
        ("tokenizer info (ms)", *(r["tokenizer_info_ms"] for r in results)),
        ("tokenizer info RSS (MiB)", *(r["tokenizer_info_rss_mib"] for r in results)),
        ("JSON schema compile, median / max (ms)",
         *(f"{r['json_compile_ms_median']:.2f} / {r['json_compile_ms_max']:.2f}" for r in results)),
        *[(f"{g['kind']} compile: {g['name']} (ms)", *(r["grammars"][i]["compile_ms"] for r in results))
          for i, g in enumerate(results[0]["grammars"]) if g["kind"] != "json"],
        ("cached compile, median (ms)", *(_median_or_none(r, "cached_compile_ms") for r in results)),
        ("new matcher, median (us)", *(_median_or_none(r, "new_matcher_us") for r in results)),
        ("first mask after compile, median (ms)", *(_median_or_none(r, "first_mask_ms") for r in results)),
        ("mask, JSON, 1st request: p50 / p99 (us)", *(q(r, "json_mask_us") for r in results)),
        ("mask, JSON, 2nd request: p50 / p99 (us)", *(q(r, "json_mask_warm_us") for r in results)),
        ("mask, regex/choice/GBNF: p50 / p99 (us)", *(q(r, "other_mask_us") for r in results)),
        ("consume a token: p50 / p99 (us)", *(q(r, "consume_us") for r in results)),
        ("rollback 4 tokens: p50 / p99 (us)", *(q(r, "rollback_4_us") for r in results)),
        ("rollback 16 tokens: p50 / p99 (us)", *(q(r, "rollback_16_us") for r in results)),
        (f"{NUM_DRAFTS + 1} masks for {NUM_DRAFTS} drafts + rollback: p50 / p99 (us)",
         *(q(r, "draft_masks_us") for r in results)),
        ("RSS growth, whole run (MiB)", *(r["rss_total_mib"] for r in results)),
    ]
    table = format_table(["", *(f"{r['engine']} {r['version']}" for r in results)], rows)
    n = results[0]["json_mask_us"]["n"]
    lines = [table, "", f"JSON mask samples per engine: {n}. Bitmask -> bool [vocab] (median): "
             + ", ".join(f"{k} {v:.1f} us" for k, v in unpack.items())]
    if wrapper:
        lines.append("specserve.structured GrammarMatcher (llguidance), p50 / p99: allowed_mask "
                     f"{q(wrapper, 'allowed_mask_us')} us, allowed_masks({NUM_DRAFTS} drafts) "
                     f"{q(wrapper, 'allowed_masks_us')} us")
    return "\n".join(lines)


def _median_or_none(result: dict, key: str) -> float | None:
    values = [g[key] for g in result["grammars"] if g[key] is not None]
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="compiles and walks per grammar (default: %(default)s)")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="JSON results (default: %(default)s)")
    p.add_argument("--engine", help=argparse.SUPPRESS)  # internal: measure one engine in this process
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.engine:
        if importlib.util.find_spec(args.engine) is None:
            return 3
        result = measure_engine(args.engine, args.repeats)
        Path(args.output).write_text(json.dumps(result))
        return 0
    from specserve.bench.common import environment_info, write_json
    from specserve.tokenizer import load_tokenizer

    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ENGINES))
    if unknown:
        p.error(f"unknown engine(s) {unknown}; choose from {list(ENGINES)}")
    results = [r for r in (run_in_subprocess(n, args.repeats) for n in names) if r is not None]
    if not results:
        print("no grammar engine is installed; nothing to measure", file=sys.stderr)
        return 1
    unpack = measure_unpack(load_tokenizer(None).vocab_size)
    wrapper = measure_specserve(args.repeats)
    print(report(results, unpack, wrapper))
    path = write_json(args.output, {"environment": environment_info(), "repeats": args.repeats,
                                    "bitmask_to_bool_us": unpack, "specserve_matcher": wrapper,
                                    "engines": results})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
