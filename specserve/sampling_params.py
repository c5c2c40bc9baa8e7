"""Per-request sampling parameters, with vLLM's names, defaults and valid ranges.

Validation raises ValueError naming the field, the allowed range and the value received.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass

# Temperatures below this are treated as greedy decoding (as in vLLM).
_SAMPLING_EPS = 1e-5
# Upper bound on `logprobs` (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require(ok: bool, name: str, allowed: str, value) -> None:
    if not ok:
        _fail(name, allowed, value)


def _as_list(value, name: str, allowed: str, scalar: type) -> list:
    if value is None:
        return []
    if scalar is str and isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)):
        _fail(name, allowed, value)
    return list(value)


def _fail(name: str, allowed: str, value):
    raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass
class StructuredOutputsParams:
    """vLLM's structured output constraint: exactly one of json (a JSON schema, dict or string), regex,
    choice (the output is one of these strings), grammar (EBNF), or json_object=True (any JSON object)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        set_fields = [name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object (got {', '.join(set_fields) or 'none'})")
        _require(self.json is None or isinstance(self.json, (str, dict)), "structured_outputs.json",
                 "a JSON schema (dict or JSON string)", self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, str) and value), f"structured_outputs.{name}",
                     "a non-empty string", value)
        if self.choice is not None:
            ok = isinstance(self.choice, (list, tuple)) and self.choice and all(isinstance(c, str) for c in self.choice)
            _require(ok, "structured_outputs.choice", "a non-empty list of strings", self.choice)
            self.choice = list(self.choice)
        _require(self.json_object in (None, True, False), "structured_outputs.json_object", "a bool",
                 self.json_object)

    @property
    def kind(self) -> str:
        return next(name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False))

    @property
    def spec(self):
        return getattr(self, self.kind)

    @classmethod
    def coerce(cls, value) -> "StructuredOutputsParams | None":
        """None, a StructuredOutputsParams, or a dict of its fields."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            _fail("structured_outputs", "a StructuredOutputsParams or a dict of its fields", value)
        unknown = sorted(set(value) - set(STRUCTURED_KINDS))
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0]} is not a field (fields: {', '.join(STRUCTURED_KINDS)})")
        return cls(**value)


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class SamplingParams:
    """How to sample one request's output; defaults and ranges follow vLLM.

    `num_speculative_tokens`: None = engine default, 0 = no speculation, k = at most k drafts per step.
    `draft_tree`: None or "auto" = the engine's speculative_config draft_tree, "chain" = one continuation per
    step for this request even where the engine drafts trees.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    num_speculative_tokens: int | None = None
    draft_tree: str | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        self._normalize()
        self._verify_sampling()
        self._verify_penalties()
        self._verify_lengths()
        self._verify_stops()
        self._verify_outputs()

    def _normalize(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        self.stop = _as_list(self.stop, "stop", "a str, a list of str or None", str)
        self.stop_token_ids = _as_list(self.stop_token_ids, "stop_token_ids",
                                       "a list of ints or None", int)

    def _verify_sampling(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", ">= 1", self.n)
        t = self.temperature
        _require(_is_number(t) and t >= 0, "temperature", ">= 0", t)
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _require(_is_int(self.top_k) and self.top_k >= 0, "top_k", ">= 0 (or -1 to disable)", self.top_k)
        _require(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _require(self.seed is None or _is_int(self.seed), "seed", "an int or None", self.seed)

    def _verify_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_number(value) and -2 <= value <= 2, name, "in [-2, 2]", value)
        rp = self.repetition_penalty
        _require(_is_number(rp) and rp > 0, "repetition_penalty", "> 0", rp)

    def _verify_lengths(self) -> None:
        mt = self.max_tokens
        _require(mt is None or (_is_int(mt) and mt >= 1), "max_tokens", ">= 1 or None", mt)
        mn = self.min_tokens
        _require(_is_int(mn) and mn >= 0, "min_tokens", ">= 0", mn)
        if mt is not None:
            _require(mn <= mt, "min_tokens", f"<= max_tokens ({mt})", mn)
        k = self.num_speculative_tokens
        _require(k is None or (_is_int(k) and k >= 0), "num_speculative_tokens", ">= 0 or None", k)
        _require(self.draft_tree in (None, "chain", "auto"), "draft_tree", "'chain', 'auto' or None", self.draft_tree)

    def _verify_stops(self) -> None:
        for s in self.stop:
            _require(isinstance(s, str) and s != "", "stop", "non-empty strings", s)
        for t in self.stop_token_ids:
            _require(_is_int(t) and t >= 0, "stop_token_ids", "ints >= 0", t)

    def _verify_outputs(self) -> None:
        lp = self.logprobs
        ok = lp is None or (_is_int(lp) and 0 <= lp <= MAX_LOGPROBS)
        _require(ok, "logprobs", f"in [0, {MAX_LOGPROBS}] or None", lp)
        _require(self.prompt_logprobs is None, "prompt_logprobs", "None (not supported yet)",
                 self.prompt_logprobs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self) -> SamplingParams:
        """A deep copy (stop lists are not shared)."""
        return copy.deepcopy(self)
