"""Structured output on llguidance: compiles JSON schema, regex, choice and grammar specs for one tokenizer,
and follows each request through its grammar as token masks, with rollback for speculative decoding.

docs/structured_output.md has the measurements behind choosing llguidance over xgrammar.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any, Callable

import llguidance
import numpy as np
import torch

GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar")
ADMISSION_FORCED_TOKENS = 64  # forced tokens a new grammar is walked over before it is admitted
CACHE_SIZE = 256  # compiled grammars kept per compiler; each is a few KiB until a request walks it
# llguidance compiles by recursing through chains of rules and $refs, 3-8 KiB of stack a link: 2,500 links
# overflow a default 8 MiB thread stack, which crashes the process. Specs are bounded by MAX_SPEC_ITEMS (the
# worst chains within it took 33-48 MiB) and compile on a thread with COMPILE_STACK_BYTES of stack (reserved,
# touched only as used), a 5x margin.
MAX_SPEC_ITEMS = 10_000  # rules, groups, classes, choices, JSON objects and arrays in one spec
MAX_JSON_DEPTH = 100  # nesting of objects and arrays in a JSON schema (llguidance's parser stops at 128)
COMPILE_STACK_BYTES = 256 << 20

# JSON comes out the way json.dumps writes it: ", " and ": " and no other whitespace. With free whitespace a
# small model can pad forever, and no key of an object would be forced. A schema's "x-guidance" object
# overrides these (e.g. {"whitespace_flexible": true}).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Errors name what is wrong without dumping the parser state and grammar into a user-facing message.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class CompiledGrammar:
    """A spec compiled for one tokenizer: a matcher in the start state, which each request copies."""

    def __init__(self, kind: str, start: llguidance.LLMatcher, vocab_size: int, tokenizer_size: int,
                 eos_token_ids: frozenset[int]) -> None:
        self.kind = kind
        self.start = start
        self.vocab_size = vocab_size  # width of the masks (the model's logits)
        self.tokenizer_size = tokenizer_size  # ids at or past this are never allowed
        self.eos_token_ids = eos_token_ids
        self.num_words = (tokenizer_size + 31) // 32  # int32 words in one bitmask
        eos = np.zeros(self.num_words * 32, dtype=bool)
        eos[sorted(eos_token_ids)] = True
        self.eos_words = np.packbits(eos, bitorder="little").view("<i4")  # [num_words]: the bitmask of EOS only


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer, caching compiled grammars by spec (LRU).

    Kinds and their specs:
      "json": a JSON schema (dict or JSON string); "json_object": any JSON object (spec ignored);
      "regex": a regular expression (Rust regex syntax) the whole output matches;
      "choice": a list of strings, the output being exactly one of them;
      "grammar": a context-free grammar, either GBNF (llama.cpp's and xgrammar's EBNF, `root ::= ...`) or
        Lark (llguidance's dialect, `start: ...`); vLLM users send either as `guided_grammar`.
    An invalid spec raises ValueError saying what is wrong. One lock guards the cache, so compiling from
    several threads is safe; compilation itself drops the GIL.
    """

    def __init__(self, tokenizer, vocab_size: int) -> None:
        """tokenizer: specserve.tokenizer.Tokenizer; vocab_size: width of the model's logits (ids past the
        tokenizer's are never allowed)."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        eos_ids = sorted(tokenizer.eos_token_ids)
        if not eos_ids:
            raise ValueError(f"{tokenizer.source or 'tokenizer'}: no EOS token id, which ends a structured output")
        self.vocab_size = vocab_size
        self.tokenizer_size = tokenizer.vocab_size
        self.eos_token_ids = frozenset(eos_ids)
        self._ll_tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=self.tokenizer_size,
                                                    eos_token=eos_ids)
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, kind: str, spec: Any = None) -> CompiledGrammar:
        """The compiled grammar for `spec` of `kind` (one of GRAMMAR_KINDS), from the cache when seen before."""
        key = _cache_key(kind, spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = _on_compile_stack(self._compile_uncached, key)
        with self._lock:
            compiled = self._cache.setdefault(key, compiled)
            self._cache.move_to_end(key)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile_uncached(self, key: tuple) -> CompiledGrammar:
        label, grammar = _llguidance_grammar(key)
        start = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0, limits=_LIMITS)
        if start.is_error():
            raise ValueError(f"{label}: {start.get_error().strip()}")
        compiled = CompiledGrammar(key[0], start, self.vocab_size, self.tokenizer_size, self.eos_token_ids)
        _check_first_step(compiled, label)
        return compiled


_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is process-wide: set and restore it around one start


def _on_compile_stack(fn: Callable, *args):
    """fn(*args) on a new thread with COMPILE_STACK_BYTES of stack; returns its result or raises its exception."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            outcome["error"] = exc

    with _STACK_SIZE_LOCK:
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="specserve-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _check_first_step(compiled: CompiledGrammar, label: str) -> None:
    """ValueError unless a request can take its first free step in the grammar: a spec that compiles can still
    match no string at all (an empty character class, a schema that only refers to itself), which the matcher
    finds when it computes a mask. The check walks the text the grammar forces from the start (a tool call's
    `{"name": ..., "arguments": `), up to ADMISSION_FORCED_TOKENS tokens, and the mask after it."""
    matcher = GrammarMatcher(compiled)
    try:
        for _ in range(ADMISSION_FORCED_TOKENS):
            if not matcher.allowed_mask().any():
                raise GrammarError("no token may come next")
            forced = matcher.forced_tokens(1)
            if not forced or matcher.accept(forced) != 1:
                return
    except GrammarError as exc:
        raise ValueError(f"{label}: no string matches it (the matcher fails after "
                         f"{matcher.num_accepted} forced tokens: {exc.reason})") from exc


def _cache_key(kind: str, spec: Any) -> tuple:
    """(kind, the spec in a canonical hashable form); ValueError when the spec is malformed."""
    if kind == "json":  # key order stays: properties come out in the schema's order
        return kind, json.dumps(_json_schema(spec))
    if kind == "json_object":
        return kind, None
    if kind in ("regex", "grammar"):
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"{kind}: expected a non-empty string, got {_short_repr(spec)}")
        _check_num_items(_num_text_items(spec), kind, "rules, groups and classes")
        return kind, spec
    if kind == "choice":
        if not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(s, str) and s for s in spec):
            raise ValueError(f"choice: expected a non-empty list of non-empty strings, got {_short_repr(spec)}")
        _check_num_items(len(spec), kind, "strings")
        return kind, tuple(spec)
    raise ValueError(f"unknown structured output kind {kind!r}; expected one of {GRAMMAR_KINDS}")


def _llguidance_grammar(key: tuple) -> tuple[str, str]:
    """(label for errors, llguidance grammar) for a cache key."""
    kind, spec = key
    if kind == "json":
        return "json schema", llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return "json object", llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return "regex", llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return "choice", llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in spec))
    try:
        return "grammar", llguidance.grammar_from("grammar", spec)
    except ValueError as e:  # GBNF that does not convert to Lark
        raise ValueError(f"grammar: {e}") from e


def _json_schema(spec: Any) -> dict:
    if isinstance(spec, str):
        spec = parse_json(spec, "json schema")
    if not isinstance(spec, dict):
        raise ValueError(f"json schema: expected a JSON object, got {type(spec).__name__}")
    check_json_value(spec, "json schema")
    return spec


def parse_json(text: str, what: str) -> Any:
    """json.loads, with ValueError naming `what` for invalid JSON and for nesting too deep to decode."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: not valid JSON ({e})") from e
    except RecursionError:
        raise ValueError(f"{what} {_TOO_DEEP}") from None


def check_json_value(value: Any, what: str) -> None:
    """ValueError naming `what` unless decoded JSON `value` nests objects and arrays at most MAX_JSON_DEPTH deep
    and holds at most MAX_SPEC_ITEMS of them: deeper values break recursive encoders and decoders (json,
    repr, llguidance's parser), and larger ones compile too deep a grammar. Iterative, so any value is safe."""
    pending, num_items = [(value, 1)], 0
    while pending:
        node, depth = pending.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"{what} {_TOO_DEEP}")
        num_items += 1
        _check_num_items(num_items, what, "objects and arrays")
        pending.extend((child, depth + 1) for child in children)


_TOO_DEEP = f"nests objects and arrays more than {MAX_JSON_DEPTH} levels deep; at most {MAX_JSON_DEPTH} are allowed"


# A Lark rule or terminal (`name:`, `?name.2:`, `NAME:`) or a GBNF rule (`name ::=`) starts a line.
_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*[ \t]*(::=|:)", re.MULTILINE)


def _num_text_items(text: str) -> int:
    """An upper bound on what a regex or grammar can chain or nest: its definitions, groups, classes and
    braces (`{` also opens the JSON of an inline `%json` schema)."""
    return len(_DEFINITION.findall(text)) + sum(text.count(c) for c in "([{")


def _check_num_items(num_items: int, what: str, items: str) -> None:
    if num_items > MAX_SPEC_ITEMS:
        raise ValueError(f"{what} holds more than {MAX_SPEC_ITEMS} {items}; at most {MAX_SPEC_ITEMS} are allowed")


def _short_repr(value: Any) -> str:
    """The start of repr(value) for an error message, even for a value too deep for repr."""
    try:
        return f"{value!r:.200}"
    except RecursionError:
        return f"a deeply nested {type(value).__name__}"


class GrammarError(RuntimeError):
    """A request's matcher failed: its grammar cannot go on from where the output is."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"grammar matcher failed: {reason}")
        self.reason = reason


class GrammarMatcher:
    """One request's position in its grammar.

    Masks are [vocab_size] bool tensors, True where the next token is allowed; EOS ids are allowed only
    where the grammar may end. The engine fills an int32 bitmask (one bit per token) that numpy unpacks.
    EOS is tracked here rather than in llguidance, which counts it inconsistently once the grammar has
    stopped; nothing is accepted after it.
    """

    def __init__(self, compiled: CompiledGrammar) -> None:
        self._compiled = compiled
        self._matcher = compiled.start.deep_copy()
        self._num_accepted = 0  # tokens that rollback may undo, the EOS included
        self._ended = False  # an EOS has been accepted

    def accept(self, token_ids: list[int]) -> int:
        """Advance by each token while it is allowed; returns how many were accepted."""
        if self._ended:
            return 0
        body, eos_next = self._split_at_eos(token_ids)
        accepted = self._matcher.try_consume_tokens(body)
        if accepted == len(body) and eos_next and self._matcher.is_accepting():
            self._ended = True
            accepted += 1
        self._num_accepted += accepted
        return accepted

    def validate(self, token_ids: list[int]) -> int:
        """How many leading tokens `accept` would take from the current state; the state is unchanged."""
        if self._ended:
            return 0
        body, eos_next = self._split_at_eos(token_ids)
        valid = self._matcher.validate_tokens(body)
        if valid < len(body) or not eos_next:
            return valid
        self._matcher.try_consume_tokens(body)  # may the grammar end after the body?
        ends = self._matcher.is_accepting()
        self._matcher.rollback(len(body))
        return valid + ends

    @property
    def num_accepted(self) -> int:
        return self._num_accepted

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if not 0 <= num_tokens <= self._num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._num_accepted} were accepted")
        self._num_accepted -= num_tokens
        if num_tokens and self._ended:
            self._ended, num_tokens = False, num_tokens - 1
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def allowed_mask(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens allowed next."""
        bitmask = np.empty((1, self._compiled.num_words), dtype=np.int32)  # [1, words]
        self._fill(bitmask[0])
        return self._unpack(bitmask)[0]

    def allowed_masks(self, draft_ids: list[int]) -> torch.Tensor:
        """[len(draft_ids) + 1, vocab_size] bool: the mask now, after draft 1, ..., after all drafts.

        Every draft must be allowed (`validate` first); the state is unchanged on return.
        """
        bitmask = np.empty((len(draft_ids) + 1, self._compiled.num_words), dtype=np.int32)  # [1 + drafts, words]
        self._fill(bitmask[0])
        for i, token_id in enumerate(draft_ids):
            if self.accept([token_id]) != 1:
                self.rollback(i)
                raise ValueError(f"draft token {i} (id {token_id}) is not allowed by the grammar; validate first")
            self._fill(bitmask[i + 1])
        self.rollback(len(draft_ids))
        return self._unpack(bitmask)

    def forced_tokens(self, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens spelling the text the grammar forces next: the tokenizer's own spelling
        of it, which the grammar accepts, leaving out a last token that a longer one could extend. The state
        is unchanged."""
        if max_tokens <= 0 or self.is_terminated():
            return []
        return self._matcher.compute_ff_tokens()[:max_tokens]

    def is_terminated(self) -> bool:
        """The grammar has finished: only a stop token may follow, or one has been accepted."""
        return self._ended or self._matcher.is_stopped()

    def _split_at_eos(self, token_ids: list[int]) -> tuple[list[int], bool]:
        """(the ids before the first EOS or unknown id, whether an EOS comes next). Unknown ids (past the
        tokenizer's) would put llguidance's matcher into its error state for good."""
        body = []
        for token_id in token_ids:
            if token_id in self._compiled.eos_token_ids:
                return body, True
            if not 0 <= token_id < self._compiled.tokenizer_size:
                break
            body.append(token_id)
        return body, False

    def _fill(self, words: np.ndarray) -> None:
        """Write the next-token bitmask into `words` ([num_words] int32, contiguous)."""
        if self._ended:
            words[:] = self._compiled.eos_words
            return
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error().strip().splitlines()[0])

    def _unpack(self, bitmask: np.ndarray) -> torch.Tensor:
        """[rows, words] int32 bitmask -> [rows, vocab_size] bool; ids past the tokenizer's are False."""
        bits = np.unpackbits(bitmask.astype("<i4", copy=False).view(np.uint8), axis=1,
                             count=self._compiled.vocab_size, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)
