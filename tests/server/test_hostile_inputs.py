"""Hostile values in every request field that takes JSON, against a real server on the default model: values of
every JSON type where a schema, a spec, a tool, a bias, a stop list or a message part goes, nested up to past what
the body parser decodes, given as values and as JSON text; huge repetition counts and deep nesting in regexes and
grammars; empty, huge and very many stop strings; out-of-range token ids. Each case gets a reply or a 400 naming
its field (never a 5xx), and after it a probe gets plain decoding's text, /health is 200, and the engine never
resets itself.

The classes of failure these found, and where each is handled:
- JSON text nested past Python's recursion limit where a schema goes (guided_json, structured_outputs.json):
  json.loads raised RecursionError on the engine thread, outside its ValueError handler, which ended the engine
  loop for good. Refused at parse time (`bounded_json`, server/protocol.py); grammar.parse_json turns the
  RecursionError into a ValueError for other callers; AsyncLLM fails a request whose admission raises anything
  alone (400 for a ValueError, 500 otherwise), on the engine thread and on the admission threads alike.
- Decoded values nested deep enough to break repr, json.dumps or a chat template (structured_outputs' fields,
  tool parameters, response_format's schema): a 500 from an error message's repr, or a 400 blaming `messages`.
  Refused at parse time naming the field (`bounded_json`, at most 100 levels and 10,000 objects and arrays).
- Chains of rules or $refs (Lark and GBNF rule chains, $defs chains, inline %json): llguidance recursed once per
  link and overflowed the thread's stack, a SIGSEGV that killed the server. Bounded (grammar.MAX_SPEC_ITEMS) and
  compiled on a thread with a 256 MiB stack (grammar._on_compile_stack).
- Grammars slow to compile (`a{50000}`: about a second): compiled on the engine thread, stalling every stream.
  Compiled on AsyncLLM's admission threads (tests/server/test_admission.py measures the other streams' gaps).
- A tool call's `arguments` nested too deep to decode: RecursionError while preparing the chat template, a 500.
  Kept as text, as arguments that are not JSON are (protocol._template_tool_call).
- Very many stop strings: each is searched for after every token on the engine thread (100,000 cost 15 ms a
  token). At most 256 (server/protocol.py MAX_STOP_STRINGS).
- A body nested past the body parser's depth: a 400 "There was an error parsing the body". Said plainly
  (api_server's HTTP error handler).
Handled before and kept: wrong JSON types and empty stop strings (400s at parse), out-of-range token ids in
prompts and stop_token_ids (ServingContext), logit_bias (refused unless empty), grammars whose matcher fails in a
step (that request alone, issue 42).
"""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.helpers import assert_never_reset, completion_text, hostile_server

MODEL = "SmolLM2-135M-Instruct"
TIMEOUT_S = 60
PROBE = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
CHAT = [{"role": "user", "content": "Reply in JSON."}]
VOCAB = 49152
FUZZ = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server():
    proc = hostile_server('{"method": "ngram", "num_speculative_tokens": 2}')
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def plain_text(server) -> str:
    return completion_text(server.url, PROBE, TIMEOUT_S)


@pytest.fixture(scope="module", autouse=True)
def never_reset(server):
    yield
    assert_never_reset(server.url)


def _send(server, path: str, body: dict, value_text: str | None = None) -> httpx.Response:
    """POST `body` (with the string "VALUE" replaced by the JSON text `value_text`, which may nest deeper than
    json.dumps writes) to /v1/`path`."""
    text = json.dumps({"model": MODEL, "max_tokens": 3, **body})
    if value_text is not None:
        text = text.replace('"VALUE"', value_text)
    return httpx.post(f"{server.url}/v1/{path}", content=text, headers={"content-type": "application/json"},
                      timeout=TIMEOUT_S)


def _check(server, plain_text: str, response: httpx.Response, fields) -> None:
    """A reply, or a 400 whose error names one of the request's `fields` (none only when the body does not
    parse, or for a request whose grammar failed while it generated); then the server serves plain decoding's
    text."""
    assert response.status_code in (200, 400), (response.status_code, response.text[:500])
    if response.status_code == 400:
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error", error
        named = error["param"] in fields
        assert named or "too deeply" in error["message"] or error["code"] == "request_failed", (fields, error)
    else:
        response.json()
    probe = httpx.post(server.url + "/v1/completions", json=PROBE, timeout=TIMEOUT_S)
    assert probe.status_code == 200 and probe.json()["choices"][0]["text"] == plain_text
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200


# ---- every field that takes JSON, with generated values --------------------------------------------------------

def _tool(parameters) -> list:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


# field (dotted path of the value) -> (endpoint, body with "VALUE" where the value goes)
PLACES = {
    "response_format": ("chat/completions", {"messages": CHAT, "response_format": "VALUE"}),
    "response_format.json_schema.schema": ("chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": "VALUE"}}}),
    "guided_json": ("completions", {"prompt": "x", "guided_json": "VALUE"}),
    "structured_outputs": ("completions", {"prompt": "x", "structured_outputs": "VALUE"}),
    "structured_outputs.json": ("completions", {"prompt": "x", "structured_outputs": {"json": "VALUE"}}),
    "structured_outputs.regex": ("completions", {"prompt": "x", "structured_outputs": {"regex": "VALUE"}}),
    "structured_outputs.choice": ("completions", {"prompt": "x", "structured_outputs": {"choice": "VALUE"}}),
    "structured_outputs.grammar": ("completions", {"prompt": "x", "structured_outputs": {"grammar": "VALUE"}}),
    "tools": ("chat/completions", {"messages": CHAT, "tools": "VALUE"}),
    "tools.parameters": ("chat/completions", {"messages": CHAT, "tools": _tool("VALUE"), "tool_choice": "required"}),
    "logit_bias": ("completions", {"prompt": "x", "logit_bias": "VALUE"}),
    "stop": ("completions", {"prompt": "x", "stop": "VALUE"}),
    "messages.content": ("chat/completions", {"messages": [{"role": "user", "content": "VALUE"}]}),
    "messages.content.part": ("chat/completions", {"messages": [{"role": "user", "content": ["VALUE"]}]}),
    "messages.content.text": ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "VALUE"}]}]}),
    "messages.tool_calls.arguments": ("chat/completions", {"messages": [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "VALUE"}}]},
        {"role": "user", "content": "Go on."}]}),
    "prompt": ("completions", {"prompt": "VALUE"}),
}
LEAVES = st.sampled_from(["null", "true", "0", "-1", str(2 ** 70), "1.5e308", '""', '"a"', "{}", "[]",
                          '{"type": "string"}', '{"$ref": "#"}'])
# The opening and closing of one level of each container kind.
LEVELS = {"array": ("[", "]"), "object": ('{"a": ', "}"), "both": ('{"a": [', "]}")}
# Past the schema limit (101 levels), past Python's recursion limit for repr and json (600), past the body
# parser's (5000).
DEPTHS = [101, 600, 5000]


def _nested(depth: int, kind: str, leaf: str) -> str:
    """JSON text: `leaf` inside `depth` levels of arrays, objects or both."""
    opening, closing = LEVELS[kind]
    return opening * depth + leaf + closing * depth


@st.composite
def json_values(draw) -> str:
    """A leaf of any JSON type nested 0 to 5000 levels deep, as a value or as JSON text in a string."""
    text = _nested(draw(st.sampled_from([0, 1, 3, *DEPTHS])), draw(st.sampled_from(list(LEVELS))), draw(LEAVES))
    return json.dumps(text) if draw(st.booleans()) else text


@pytest.mark.parametrize("depth", DEPTHS, ids=lambda d: f"depth-{d}")
@pytest.mark.parametrize("field", list(PLACES))
def test_deeply_nested_values_in_every_json_field(server, plain_text, field, depth):
    """A schema-like value nested `depth` levels deep, as a value and as JSON text; each field gets each
    container kind at one of the depths."""
    path, body = PLACES[field]
    kind = list(LEVELS)[(list(PLACES).index(field) + DEPTHS.index(depth)) % len(LEVELS)]
    value = _nested(depth, kind, '{"type": "string"}')
    for text in (value, json.dumps(value)):
        _check(server, plain_text, _send(server, path, body, text), set(body))


@FUZZ
@given(field=st.sampled_from(list(PLACES)), value=json_values())
def test_generated_values_in_every_json_field(server, plain_text, field, value):
    path, body = PLACES[field]
    _check(server, plain_text, _send(server, path, body, value), set(body))


# ---- regexes, grammars, stops and token ids ----------------------------------------------------------------------

def _rule_chain(num_rules: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(num_rules)) + f'r{num_rules}: "a"'


def _ref_chain(num_links: int) -> dict:
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(num_links)}
    return {"$defs": {**defs, f"d{num_links}": {"type": "string"}}, "$ref": "#/$defs/d0"}


def _completion(**fields) -> tuple[str, dict]:
    return "completions", {"prompt": "x", **fields}


def _chat(**fields) -> tuple[str, dict]:
    return "chat/completions", {"messages": CHAT, **fields}


_LARK_GROUPS = "start: " + "(" * 5000 + '"a"' + ")" * 5000
_GBNF_GROUPS = "root ::= " + "(" * 3000 + '"a"' + ")" * 3000
_GBNF_CHAIN = _rule_chain(3000).replace(": ", " ::= ").replace("start", "root")
_INLINE_JSON = "start: %json " + "[" * 3000 + "]" * 3000
_DEEP_ARGUMENTS = [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
    "name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}]}, {"role": "user", "content": "Go on."}]
# (case id, (endpoint, body), the status it gets, the field its 400 names: None where it fails in a step)
CASES = [
    ("regex a{50000}", _completion(guided_regex="a{50000}"), 200, None),
    ("regex (a{1000}){1000}", _completion(guided_regex="(a{1000}){1000}"), 400, None),
    ("regex a{10^9}", _completion(guided_regex="a{1000000000}"), 400, None),
    ("lark repetition", _completion(guided_grammar='start: "a"{100000}'), 400, None),
    ("lark regex repetition", _completion(guided_grammar="start: /[ab]{20000}/"), 200, None),
    ("lark nested groups", _completion(guided_grammar=_LARK_GROUPS), 400, "guided_grammar"),
    ("gbnf nested groups", _completion(guided_grammar=_GBNF_GROUPS), 400, "guided_grammar"),
    ("lark rule chain within the limit", _completion(guided_grammar=_rule_chain(9000)), 200, None),
    ("lark rule chain past the limit", _completion(guided_grammar=_rule_chain(20000)), 400, "guided_grammar"),
    ("gbnf rule chain", _completion(guided_grammar=_GBNF_CHAIN), 200, None),
    ("$ref chain within the limit", _completion(guided_json=_ref_chain(4000)), 200, None),
    ("$ref chain past the limit", _chat(tools=_tool(_ref_chain(6000)), tool_choice="required"), 400, "tools"),
    ("inline %json nesting", _completion(guided_grammar=_INLINE_JSON), 400, "guided_grammar"),
    ("empty stop string", _completion(stop=[""]), 400, "stop"),
    ("empty stop", _completion(stop=""), 400, "stop"),
    ("huge stop string", _completion(stop=["a" * 1_000_000]), 200, None),
    ("256 stop strings", _completion(stop=[f"zq{i}" for i in range(256)]), 200, None),
    ("100000 stop strings", _completion(stop=[f"zq{i}" for i in range(100_000)]), 400, "stop"),
    ("prompt id past the vocabulary", ("completions", {"prompt": [1, VOCAB]}), 400, "prompt"),
    ("prompt id past int64", ("completions", {"prompt": [1, 2 ** 70]}), 400, "prompt"),
    ("negative prompt id", ("completions", {"prompt": [1, -1]}), 400, "prompt"),
    ("stop token id past int64", _completion(stop_token_ids=[2 ** 70]), 400, "stop_token_ids"),
    ("logit_bias id past the vocabulary", _completion(logit_bias={str(VOCAB): 5}), 400, "logit_bias"),
    ("logit_bias negative id", _chat(logit_bias={"-3": -100}), 400, "logit_bias"),
    ("tool call arguments too deep to decode", ("chat/completions", {"messages": _DEEP_ARGUMENTS}), 200, None),
]


@pytest.mark.parametrize("endpoint_and_body, status, param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_regexes_grammars_stops_and_token_ids(server, plain_text, endpoint_and_body, status, param):
    path, body = endpoint_and_body
    r = _send(server, path, body)
    assert r.status_code == status, r.text[:500]
    if param is not None:
        assert r.json()["error"]["param"] == param, r.text[:500]
    _check(server, plain_text, r, set(body))
