"""`specserve bench structured`: batch-1 decode speed of JSON-schema-constrained requests, plain and with each
speculative method, against the same prompts unconstrained; the grammar's cost per step; validity and
sameness of the outputs.

Every constrained output must parse and follow its schema, and each speculative output must equal the
constrained plain output token for token (greedy); otherwise the command exits with status 1.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field

from specserve.bench.common import (
    environment_info, format_table, median, mismatch_exit_status, request_latencies, safe_div, write_json)

DEFAULT_METHODS = "ngram,suffix,auto"
DEFAULT_OUTPUT = "bench_results/structured.json"
UNCONSTRAINED, CONSTRAINED = "unconstrained", "constrained"

# Tasks with the schema the answer must follow: everyday records of the kind applications ask a model for.
TASKS = [
    ("a fictional person: their name, age and email address, and whether they are a student",
     {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                                       "email": {"type": "string", "maxLength": 60}, "student": {"type": "boolean"}},
      "required": ["name", "age", "email", "student"], "additionalProperties": False}),
    ("today's weather in Paris: temperature in Celsius, the condition and the wind speed in km/h",
     {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                       "temperature_celsius": {"type": "integer"},
                                       "condition": {"enum": ["sunny", "cloudy", "rain", "snow", "fog"]},
                                       "wind_kmh": {"type": "number"}},
      "required": ["city", "temperature_celsius", "condition", "wind_kmh"], "additionalProperties": False}),
    ("a recipe for pancakes with its ingredients (at most five) and the cooking time in minutes",
     {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                       "ingredients": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                                       "minItems": 2, "maxItems": 5},
                                       "minutes": {"type": "integer"}},
      "required": ["title", "ingredients", "minutes"], "additionalProperties": False}),
    ("a product listing for a pair of running shoes: name, price in euros, sizes in stock and the category",
     {"type": "object", "properties": {"product_name": {"type": "string", "maxLength": 40},
                                       "price_eur": {"type": "number"},
                                       "sizes_in_stock": {"type": "array", "items": {"type": "integer"}, "maxItems": 6},
                                       "category": {"enum": ["footwear", "clothing", "accessories"]}},
      "required": ["product_name", "price_eur", "sizes_in_stock", "category"], "additionalProperties": False}),
    ("a short book review: the title, the author, a rating from 1 to 5 and a one-sentence summary",
     {"type": "object", "properties": {"title": {"type": "string", "maxLength": 50},
                                       "author": {"type": "string", "maxLength": 40},
                                       "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                                       "summary": {"type": "string", "maxLength": 120}},
      "required": ["title", "author", "rating", "summary"], "additionalProperties": False}),
    ("a calendar event: a team meeting next Monday, with its start and end times and its attendees",
     {"type": "object", "properties": {"event_title": {"type": "string", "maxLength": 40},
                                       "start_time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                                       "end_time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                                       "attendees": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                                     "maxItems": 4}},
      "required": ["event_title", "start_time", "end_time", "attendees"], "additionalProperties": False}),
    ("a postal address in London: street, house number, postcode and country",
     {"type": "object", "properties": {"street": {"type": "string", "maxLength": 40},
                                       "house_number": {"type": "integer"},
                                       "postcode": {"type": "string", "maxLength": 10},
                                       "country": {"type": "string", "maxLength": 30}},
      "required": ["street", "house_number", "postcode", "country"], "additionalProperties": False}),
    ("an online order of two items: an order id, each item with its quantity, and the order status",
     {"type": "object", "properties": {
         "order_id": {"type": "string", "maxLength": 20},
         "items": {"type": "array", "maxItems": 3, "items": {
             "type": "object", "properties": {"item": {"type": "string", "maxLength": 30}, "quantity": {"type": "integer"}},
             "required": ["item", "quantity"], "additionalProperties": False}},
         "status": {"enum": ["pending", "shipped", "delivered"]}},
      "required": ["order_id", "items", "status"], "additionalProperties": False}),
]


@dataclass
class GrammarClock:
    """Seconds the runner spends on grammars (masks, advancing, cutting and forcing drafts), and its steps."""

    grammar_s: float = 0.0
    step_s: float = 0.0
    num_steps: int = 0
    num_masked_steps: int = 0

    def attach(self, runner) -> None:
        grammars = runner.grammars
        for name in ("logits_masks", "accept", "allowed_prefix", "forced_tokens"):
            setattr(grammars, name, self._timed(getattr(grammars, name), counts_step=name == "logits_masks"))
        execute = runner.execute_model

        def timed_step(sched):
            start = time.perf_counter()
            try:
                return execute(sched)
            finally:
                self.step_s += time.perf_counter() - start
                self.num_steps += 1

        runner.execute_model = timed_step

    def _timed(self, fn, counts_step: bool):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.grammar_s += time.perf_counter() - start
                self.num_masked_steps += counts_step

        return wrapper


@dataclass
class RunResult:
    method: str
    constrained: bool
    decode_tok_s: list[float] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    num_drafts: int = 0
    num_accepted: int = 0
    clock: GrammarClock = field(default_factory=GrammarClock)


def add_parser(bench_sub) -> None:
    from specserve.engine_args import add_engine_args

    p = bench_sub.add_parser(
        "structured", help="JSON-schema-constrained decoding: plain and speculative, against unconstrained",
        description="One request at a time (chat template, greedy, EOS ends a request): each task's prompt "
                    "unconstrained, constrained to its JSON schema, and constrained with each speculative "
                    "method; decode tokens/s, the grammar's cost per step, validity of every constrained output "
                    "and sameness with the constrained plain output (exit status 1 otherwise).")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="speculative methods (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=200, help="cap on new tokens per request")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="JSON results file (default: %(default)s)")
    add_engine_args(p, speculation_flags=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specserve.engine_args import engine_kwargs
    from specserve.llm import LLM

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    base = {k: v for k, v in engine_kwargs(args).items() if k != "speculative_config"}
    engines = {None: LLM(**base)}
    for method in methods:
        engines[method] = LLM(**base, speculative_config={"method": method})
    tokenizer = engines[None].get_tokenizer()
    prompts = [_prompt(tokenizer, instruction, schema) for instruction, schema in TASKS]
    runs = {(None, False): RunResult("plain", False), (None, True): RunResult("plain", True),
            **{(m, True): RunResult(m, True) for m in methods}}
    for key, result in runs.items():
        if key[1]:
            result.clock.attach(engines[key[0]].llm_engine.runner)
    for llm in engines.values():  # warm-up: kernels, the grammar compiler
        llm.generate(prompts[0], _params(args.max_tokens, TASKS[0][1]), use_tqdm=False)
    for i, (prompt, (_, schema)) in enumerate(zip(prompts, TASKS)):
        keys = list(runs)
        for method, constrained in keys[i % len(keys):] + keys[:i % len(keys)]:  # who runs first rotates
            out = engines[method].generate(prompt, _params(args.max_tokens, schema if constrained else None),
                                           use_tqdm=False)[0]
            _record(runs[(method, constrained)], out)
    mismatches = _check(runs, methods)
    _report(args, runs, mismatches)
    return mismatch_exit_status("structured", mismatches)


def _prompt(tokenizer, instruction: str, schema: dict) -> dict:
    message = (f"Return only a JSON object describing {instruction}. It must follow this JSON schema: "
               f"{json.dumps(schema)}")
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def _params(max_tokens: int, schema: dict | None):
    from specserve.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          structured_outputs={"json": schema} if schema is not None else None)


def _record(result: RunResult, out) -> None:
    latency = request_latencies(out)
    result.decode_tok_s.append(latency["decode_tokens_per_s"])
    result.num_tokens.append(latency["num_output_tokens"])
    result.token_ids.append(list(out.outputs[0].token_ids))
    result.texts.append(out.outputs[0].text)
    result.num_drafts += out.metrics.num_drafts
    result.num_accepted += out.metrics.num_accepted_tokens


def _check(runs: dict, methods: list[str]) -> list[str]:
    """Invalid constrained outputs, and speculative outputs that differ from constrained plain decoding's."""
    problems = []
    for (method, constrained), result in runs.items():
        if not constrained:
            continue
        for i, text in enumerate(result.texts):
            error = _schema_error(text, TASKS[i][1])
            if error:
                problems.append(f"{result.method} task {i}: {error}")
    plain = runs[(None, True)].token_ids
    for method in methods:
        for i, (ids, ref) in enumerate(zip(runs[(method, True)].token_ids, plain)):
            if ids != ref:
                problems.append(f"{method} task {i}: output differs from constrained plain decoding")
    return problems


def _schema_error(text: str, schema: dict) -> str | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc})"
    try:
        import jsonschema_rs
    except ImportError:  # the test extra's validator; without it, parsing is the check
        return None
    try:
        jsonschema_rs.validate(schema, value)
    except jsonschema_rs.ValidationError as exc:
        return f"does not follow the schema ({exc})"
    return None


def _report(args, runs: dict, mismatches: list[str]) -> None:
    base = median(runs[(None, False)].decode_tok_s)
    constrained_plain = median(runs[(None, True)].decode_tok_s)
    rows, records = [], []
    for (method, constrained), r in runs.items():
        label = f"{r.method} ({CONSTRAINED if constrained else UNCONSTRAINED})"
        speed = median(r.decode_tok_s)
        clock = r.clock
        mask_ms = 1e3 * safe_div(clock.grammar_s, clock.num_steps) if constrained else float("nan")
        share = safe_div(clock.grammar_s, clock.step_s) if constrained else float("nan")
        acceptance = 1 + safe_div(r.num_accepted, r.num_drafts) if r.num_drafts else float("nan")
        rows.append([label, f"{speed:.1f}", f"{safe_div(speed, base):.2f}x", f"{safe_div(speed, constrained_plain):.2f}x",
                     f"{median(r.num_tokens):.0f}", f"{acceptance:.2f}", f"{mask_ms:.3f}", f"{100 * share:.1f}%"])
        records.append({"method": r.method, "constrained": constrained, "decode_tokens_per_s": r.decode_tok_s,
                        "median_decode_tokens_per_s": speed, "num_output_tokens": r.num_tokens,
                        "num_drafts": r.num_drafts, "num_accepted_tokens": r.num_accepted,
                        "grammar_ms_per_step": mask_ms, "grammar_share_of_step": share,
                        "num_steps": clock.num_steps, "texts": r.texts})
    print(format_table(["run", "decode tok/s", "vs unconstrained", "vs constrained plain", "tokens",
                        "acceptance length", "grammar ms/step", "grammar share"], rows))
    if mismatches:
        print("\n".join(mismatches), file=sys.stderr)
    path = write_json(args.output, {"benchmark": "structured", "environment": environment_info(),
                                    "max_tokens": args.max_tokens, "tasks": [t for t, _ in TASKS],
                                    "runs": records, "problems": mismatches})
    print(f"results: {path}")
