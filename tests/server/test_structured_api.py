"""Structured output through the official `openai` client: response_format, vLLM's structured_outputs and guided_*
fields, and tool calls ('required' and named), against two real servers, one plain and one speculating. Every
output must satisfy its constraint, and greedy output must be the same with speculation as without."""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import jsonschema_rs
import openai
import pytest

from specserve.server.tools import AUTO_NEEDS_PARSER, RequiredCallsReader
from tests.server.helpers import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024
MAX_TOKENS = 200
# Fixed draft length: with 20 requests in flight the adaptive policy could stop drafting, and these tests need
# drafts to go through grammar-masked verification (the prompts hold the schemas, for ngram and suffix to copy).
SPEC = {"method": "auto", "adaptive_draft_length": False}
SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "json_schemas.json").read_text())
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                       "properties": {"city": {"type": "string", "maxLength": 20},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The current time in a time zone",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["timezone"],
                       "properties": {"timezone": {"type": "string",
                                                   "pattern": "^[A-Z][a-z]{2,12}/[A-Z][a-z]{2,12}$"}}}}},
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WEATHER_CHAT = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def plain():
    proc = ServerProcess("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(256 << 20),
                         "--no-speculation")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def spec():
    proc = ServerProcess("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(256 << 20),
                         "--speculative-config", json.dumps(SPEC))
    yield proc
    proc.stop()


def on_both(plain, spec, calls: list[tuple[str, dict]]) -> tuple[list, list]:
    """Send every (endpoint, body) to both servers at once (each batches them); the answers per server, in
    order. endpoint: "chat" or "completions"; a streamed body's answer is its list of chunks."""

    async def one(client: openai.AsyncOpenAI, endpoint: str, body: dict):
        api = client.chat.completions if endpoint == "chat" else client.completions
        response = await api.create(model=MODEL, temperature=0, **body)
        return [chunk async for chunk in response] if body.get("stream") else response

    async def run():
        clients = [openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)
                   for s in (plain, spec)]
        answers = await asyncio.gather(*(one(c, endpoint, body) for c in clients for endpoint, body in calls))
        return answers[:len(calls)], answers[len(calls):]

    return asyncio.run(run())


def chat_body(content: str, max_tokens: int = MAX_TOKENS, **fields) -> dict:
    """A chat request; vLLM's own fields go in extra_body, as a client sends them."""
    extra = {k: fields.pop(k) for k in list(fields) if k in ("structured_outputs", "guided_json", "guided_regex",
                                                           "guided_choice", "guided_grammar")}
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "extra_body": extra,
            **fields}


def drafts(response) -> int:
    speculation = (response.usage.model_extra or {}).get("speculation") or {}
    return speculation.get("num_drafts", 0)


def validate(schema: dict, value) -> None:
    jsonschema_rs.validator_for(schema).validate(value)


# ------------------------------------------------------------------------------------------- JSON schemas


def _schema_request(i: int, entry: dict) -> dict:
    """The schema as OpenAI's response_format, vLLM's structured_outputs or its older guided_json, in turn."""
    content = f"{entry['prompt']} Answer in JSON following this schema: {json.dumps(entry['schema'])}"
    carrier = [{"response_format": {"type": "json_schema", "json_schema": {
                   "name": entry["name"], "schema": entry["schema"], "strict": True}}},
               {"structured_outputs": {"json": entry["schema"]}},
               {"guided_json": json.dumps(entry["schema"])}][i % 3]
    return chat_body(content, **carrier)


def test_json_schemas_are_followed_with_and_without_speculation(plain, spec):
    calls = [("chat", _schema_request(i, entry)) for i, entry in enumerate(SCHEMAS)]
    plain_out, spec_out = on_both(plain, spec, calls)
    for entry, a, b in zip(SCHEMAS, plain_out, spec_out):
        text = a.choices[0].message.content
        assert a.choices[0].finish_reason == "stop", (entry["name"], text)
        validate(entry["schema"], json.loads(text))
        assert b.choices[0].message.content == text, entry["name"]
    assert sum(map(drafts, spec_out)) > 0


def test_regex_choice_grammar_and_json_object(plain, spec):
    date, phone = r"\d{4}-\d{2}-\d{2}", r"\(\d{3}\) \d{3}-\d{4}"
    grammar = 'root ::= ("red" | "green" | "blue") " " ("cat" | "dog")'
    calls = [
        ("chat", chat_body("When did the Apollo 11 mission land on the Moon?", 32, guided_regex=date)),
        ("completions", {"prompt": "For support, call our office at", "max_tokens": 32,
                         "extra_body": {"structured_outputs": {"regex": phone}}}),
        ("chat", chat_body("Is Paris the capital of France?", 8, guided_choice=["yes", "no"])),
        ("completions", {"prompt": "Review: 'I loved every minute of it.' Sentiment:", "max_tokens": 8,
                         "extra_body": {"structured_outputs": {"choice": ["positive", "negative", "neutral"]}}}),
        ("chat", chat_body("Name a colorful pet.", 16, structured_outputs={"grammar": grammar})),
        ("chat", chat_body("Describe a city as a JSON object with the keys name and country.",
                           response_format={"type": "json_object"})),
        ("completions", {"prompt": "A person as JSON:", "max_tokens": MAX_TOKENS,  # vLLM's extension
                         "extra_body": {"response_format": {"type": "json_schema", "json_schema": {
                             "name": "person", "schema": SCHEMAS[0]["schema"]}}}}),
    ]
    plain_out, spec_out = on_both(plain, spec, calls)
    texts = [r.choices[0].message.content if endpoint == "chat" else r.choices[0].text
             for (endpoint, _), r in zip(calls, plain_out)]
    assert texts == [r.choices[0].message.content if endpoint == "chat" else r.choices[0].text
                     for (endpoint, _), r in zip(calls, spec_out)]
    assert re.fullmatch(date, texts[0]) and re.fullmatch(phone, texts[1]), texts[:2]
    assert texts[2] in ("yes", "no") and texts[3] in ("positive", "negative", "neutral"), texts[2:4]
    assert re.fullmatch(r"(red|green|blue) (cat|dog)", texts[4]), texts[4]
    assert isinstance(json.loads(texts[5]), dict), texts[5]
    validate(SCHEMAS[0]["schema"], json.loads(texts[6]))


# ------------------------------------------------------------------------------------------- tools


def _tool_request(tool_choice, stream: bool, **fields) -> dict:
    return {"messages": WEATHER_CHAT, "max_tokens": MAX_TOKENS, "tools": TOOLS, "tool_choice": tool_choice,
            "stream": stream, **fields}


def _streamed_calls(chunks) -> tuple[list[dict], str | None]:
    """The tool calls a stream spells out, checked to arrive as OpenAI streams them (arguments as they are
    generated, in several pieces), and its finish_reason."""
    calls: dict[int, dict] = {}
    pieces: dict[int, int] = {}
    finish_reason = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or ():
                if delta.index not in calls:  # the first delta of a call: id, type, name, empty arguments
                    assert delta.id.startswith("call_") and delta.type == "function" and delta.function.name
                    assert delta.function.arguments == ""
                    calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and delta.function.name is None
                    calls[delta.index]["arguments"] += delta.function.arguments
                    pieces[delta.index] = pieces.get(delta.index, 0) + 1
    assert sorted(calls) == list(range(len(calls))) and all(pieces[i] > 1 for i in calls), pieces
    return [calls[i] for i in sorted(calls)], finish_reason


def _whole_calls(response) -> tuple[list[dict], str | None]:
    message = response.choices[0].message
    assert message.content is None and all(c.id.startswith("call_") and c.type == "function"
                                           for c in message.tool_calls)
    return ([{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls],
            response.choices[0].finish_reason)


def test_tool_choice_required_and_named_give_valid_calls_streamed_or_not(plain, spec):
    named = {"type": "function", "function": {"name": "get_weather"}}
    calls = [("chat", _tool_request(choice, stream, **extra))
             for choice, extra in (("required", {}), ("required", {"parallel_tool_calls": False}), (named, {}))
             for stream in (False, True)]
    plain_out, spec_out = on_both(plain, spec, calls)
    for out in (plain_out, spec_out):
        answers = [_streamed_calls(r) if body["stream"] else _whole_calls(r) for (_, body), r in zip(calls, out)]
        for (_, body), (tool_calls, finish_reason) in zip(calls, answers):
            assert finish_reason == ("stop" if body["tool_choice"] == named else "tool_calls")
            assert len(tool_calls) >= 1
            if body["tool_choice"] == named or body.get("parallel_tool_calls") is False:
                assert len(tool_calls) == 1
            for call in tool_calls:
                assert body["tool_choice"] != named or call["name"] == "get_weather"
                validate(TOOL_SCHEMAS[call["name"]], json.loads(call["arguments"]))
        assert answers[0::2] == answers[1::2]  # streamed = whole
        if out is plain_out:
            plain_answers = answers
    assert answers == plain_answers  # with speculation = without


@pytest.mark.parametrize("text", [
    '[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}", "unit": "celsius"}}]',
    '[{"name": "a", "parameters": {"x": [1, {"y": "]"}]}}, {"parameters": {}, "name": "b"}]',
    '[ { "name" : "a" , "parameters" : 5 } ]',
])
def test_required_calls_stream_as_they_come_whole(text):
    """The 'required' reader, on any split of the output into pieces, streams the calls it reads whole."""
    whole = [(c.function.name, c.function.arguments) for c in RequiredCallsReader().tool_calls(text)]
    assert [json.loads(args) for _, args in whole] == [item["parameters"] for item in json.loads(text)]
    for step in (1, 2, 3, 7):
        reader, streamed = RequiredCallsReader(), {}
        for start in range(0, len(text), step):
            for delta in reader.deltas(text[start:start + step]):
                name, args = streamed.get(delta.index, (delta.function.name, ""))
                streamed[delta.index] = (name, args + delta.function.arguments)
        assert [streamed[i] for i in sorted(streamed)] == whole
    assert RequiredCallsReader().tool_calls(text[:-2]) is None  # cut short: no calls


def test_conversation_with_tool_turns_renders(plain):
    client = openai.OpenAI(base_url=plain.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*WEATHER_CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                       max_tokens=4, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


# ------------------------------------------------------------------------------------------- refusals


_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
_NAMED = {"type": "function", "function": {"name": "get_weather"}}
_BAD = [
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format", ()),
    ("chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", ()),
    ("chat/completions", {"response_format": {"type": "xml"}}, "response_format", ()),
    ("chat/completions", {"guided_json": {"type": "nonsense"}}, "guided_json", ()),
    ("chat/completions", {"guided_regex": "("}, "guided_regex", ()),
    ("chat/completions", {"structured_outputs": {"regex": "("}}, "structured_outputs", ()),
    ("chat/completions", {"guided_grammar": "root ::= ("}, "guided_grammar", ()),
    ("chat/completions", {"guided_choice": []}, "guided_choice", ()),
    ("chat/completions", {"structured_outputs": {"json": _SCHEMA, "regex": "a"}}, "structured_outputs", ()),
    ("chat/completions", {"structured_outputs": {"shape": "round"}}, "structured_outputs", ()),
    ("chat/completions", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice",
     ("guided_regex", "guided_choice")),
    ("chat/completions", {"response_format": {"type": "json_object"}, "structured_outputs": {"json": _SCHEMA}},
     "structured_outputs", ("response_format", "structured_outputs")),
    ("chat/completions", {"tools": TOOLS, "tool_choice": "required", "guided_json": _SCHEMA}, "tools",
     ("guided_json", "tools")),
    ("chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
     "tool_choice", ("'fly'",)),
    ("chat/completions", {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", (AUTO_NEEDS_PARSER,)),
    ("chat/completions", {"tools": TOOLS}, "tool_choice", (AUTO_NEEDS_PARSER,)),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice", ()),
    ("chat/completions", {"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", ("'get_weather'",)),
    ("chat/completions", {"tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "nonsense"}}}], "tool_choice": _NAMED}, "tools", ()),
    ("completions", {"guided_regex": "("}, "guided_regex", ()),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format", ()),
    ("completions", {"guided_json": _SCHEMA, "guided_regex": "a"}, "guided_regex", ("guided_json", "guided_regex")),
    # grammars that compile but match no string: refused before they reach a step
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#"}}}}, "response_format", ("no string matches it",)),
    ("chat/completions", {"structured_outputs": {"regex": "[^\\x00-\\U0010FFFF]"}}, "structured_outputs",
     ("no string matches it",)),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "$ref": "#"}}}], "tool_choice": _NAMED}, "tools", ("tools[0].function.parameters", "no string matches it")),
]


@pytest.mark.parametrize("path,override,param,mentions", _BAD,
                         ids=[f"{p}-{param}-{i}" for i, (p, _, param, _) in enumerate(_BAD)])
def test_bad_structured_request_is_400_naming_the_field(plain, path, override, param, mentions):
    body = {"model": MODEL, "max_tokens": 4}
    body.update({"prompt": "Hello"} if path == "completions" else {"messages": WEATHER_CHAT})
    body.update(override)
    r = httpx.post(f"{plain.url}/v1/{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert all(m in error["message"] for m in mentions), error["message"]


def test_tool_choice_none_ignores_tools_and_text_format_is_plain(plain):
    client = openai.OpenAI(base_url=plain.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    reference = client.chat.completions.create(model=MODEL, messages=WEATHER_CHAT, max_tokens=8, temperature=0)
    for extra in ({"tools": TOOLS, "tool_choice": "none"}, {"response_format": {"type": "text"}}):
        r = client.chat.completions.create(model=MODEL, messages=WEATHER_CHAT, max_tokens=8, temperature=0, **extra)
        assert r.choices[0].message.content == reference.choices[0].message.content
        assert not r.choices[0].message.tool_calls
