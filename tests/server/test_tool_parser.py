"""tool_choice 'auto' with Hermes-format calls: the whole-output parser, the streaming splitter against it (every
chunking of the text must add up to the same answer), and the server over a scripted engine through the
official `openai` client."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest

from specserve.engine.outputs import CompletionOutput, RequestOutput
from specserve.server.api_server import build_app
from specserve.server.async_engine import AsyncLLM
from specserve.server.metrics import ServerMetrics
from specserve.server.protocol import FunctionCall
from specserve.server.serving import ServingContext
from specserve.server.tools import AUTO_NEEDS_PARSER, AutoCallReader, parse_tool_calls
from tests.server.fake_engine import FakeEngine, FakeTokenizer

NAMES = ["get_weather", "get_time"]
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}'
WEATHER_ARGS = json.dumps({"city": "Paris", "unit": "celsius"})
TIME_ARGS = json.dumps({"timezone": "Europe/Paris"})


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


# ------------------------------------------------------------------------------------------------- parser


def test_one_call():
    assert parse_tool_calls(block(WEATHER), NAMES) == (None, [_call("get_weather", WEATHER_ARGS)])


def test_two_calls():
    content, calls = parse_tool_calls(block(WEATHER) + "\n" + block(TIME), NAMES)
    assert content is None
    assert calls == [_call("get_weather", WEATHER_ARGS), _call("get_time", TIME_ARGS)]


def test_text_before_and_after_is_content():
    content, calls = parse_tool_calls(" Let me look.\n" + block(WEATHER) + "\nDone. ", NAMES)
    assert content == "Let me look.\n\nDone."
    assert calls == [_call("get_weather", WEATHER_ARGS)]


def test_malformed_json_is_kept_as_content():
    bad = block('{"name": "get_weather", "arguments": {"city": ')
    assert parse_tool_calls("Hi " + bad + " " + block(TIME), NAMES) == ("Hi " + bad, [_call("get_time", TIME_ARGS)])


def test_unknown_tool_is_kept_as_content():
    fly = block('{"name": "fly", "arguments": {}}')
    assert parse_tool_calls(fly, NAMES) == (fly, [])


def test_arguments_as_string_are_passed_through():
    text = block(json.dumps({"name": "get_time", "arguments": '{"timezone":"Asia/Tokyo"}'}))
    assert parse_tool_calls(text, NAMES) == (None, [_call("get_time", '{"timezone":"Asia/Tokyo"}')])


def test_unclosed_block_and_non_object_arguments_are_content():
    for text in ["Sure " + block(WEATHER)[:-3], block('{"name": "get_time", "arguments": "[1]"}'),
                 block('["get_time"]'), block('{"name": ["get_time"]}')]:
        assert parse_tool_calls(text, NAMES) == (text.strip(), [])


def test_missing_arguments_are_an_empty_object():
    assert parse_tool_calls(block('{"name": "get_time"}'), NAMES) == (None, [_call("get_time", "{}")])


def _call(name: str, arguments: str) -> FunctionCall:
    return FunctionCall(name=name, arguments=arguments)


# ----------------------------------------------------------------------------------------- streaming splitter

TEXTS = [
    block(WEATHER),
    "Checking both.\n" + block(WEATHER) + "\n" + block(TIME) + "\n",
    "  I will call <tool_call> now: " + block(WEATHER) + " and then a < b <tool_c",
    block('{"name": "fly", "arguments": {}}') + " x " + block(TIME) + "<tool_call>{\"name\": ",
    "no calls at all, just </tool_call> text <",
    "",
    "   \n ",
]


def streamed(text: str, cuts: list[int]) -> tuple[str | None, list[tuple[str, str]], int]:
    """The splitter fed `text` cut at `cuts`: (content, [(name, arguments)], number of calls it counted),
    checking each call's first delta is its header as OpenAI sends it."""
    reader = AutoCallReader(NAMES)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    deltas = [d for i, piece in enumerate(pieces) for d in reader.deltas(piece, final=i == len(pieces) - 1)]
    content = "".join(d.content for d in deltas if d.content is not None)
    calls: dict[int, list[str]] = {}
    for d in (t for d in deltas for t in d.tool_calls or ()):
        if d.index not in calls:
            assert d.id.startswith("call_") and d.type == "function" and d.function.arguments == "", d
            assert d.index == len(calls)
            calls[d.index] = [d.function.name, ""]
        else:
            assert d.id is None and d.function.name is None
            calls[d.index][1] += d.function.arguments
    return content or None, [tuple(c) for c in calls.values()], reader.num_calls


@pytest.mark.parametrize("text", TEXTS)
def test_every_chunking_streams_the_whole_parse(text):
    content, calls = parse_tool_calls(text, NAMES)
    whole = (content, [(c.name, c.arguments) for c in calls], len(calls))
    chunkings = [list(range(size, len(text), size)) for size in range(1, len(text) + 1)]
    rng = random.Random(0)
    chunkings += [sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) - 1))) for _ in range(200)
                  if len(text) > 1]
    for cuts in chunkings:
        assert streamed(text, cuts) == whole, cuts


def test_content_before_a_call_streams_before_the_call_closes():
    reader = AutoCallReader(NAMES)
    assert [d.content for d in reader.deltas("Hello <tool", final=False)] == ["Hello"]
    assert reader.deltas('_call>{"name": "get_time", ', final=False) == []
    deltas = reader.deltas('"arguments": {}}</tool_call>', final=True)
    assert [d.tool_calls[0].function.arguments for d in deltas] == ["", "{}"]
    assert reader.finish_reason("stop") == "tool_calls" and AutoCallReader(NAMES).finish_reason("length") == "length"


# -------------------------------------------------------------------------------------------- server, end to end

MODEL = "fake"
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
         for name in NAMES]
ANSWER = "Let me check.\n" + block(WEATHER) + "\n" + block(TIME)


class ToolsTokenizer(FakeTokenizer):
    """FakeTokenizer with a chat template that renders tools (the server only reads whether it mentions them)."""

    chat_template = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}...{% endfor %}"

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
        names = ",".join(t["function"]["name"] for t in tools or ())
        return f"<tools>{names}\n" + super().apply_chat_template(messages, add_generation_prompt)


class ScriptedEngine(FakeEngine):
    """FakeEngine whose every request generates `script`, a few characters per step, then stops."""

    def __init__(self, script: str, chars_per_step: int = 3) -> None:
        super().__init__()
        self.script, self.chars_per_step = script, chars_per_step

    def step(self) -> list[RequestOutput]:
        outputs = []
        for rid in list(self.order[: self.max_running]):
            _, _, out = self.requests[rid]
            c = out.outputs[0]
            new = self.script[len(c.text):len(c.text) + self.chars_per_step]
            c.text += new
            c.token_ids += [ord(ch) for ch in new]
            out.metrics.first_token_time = out.metrics.last_token_time = time.time()
            if len(c.text) == len(self.script):
                c.finish_reason, out.finished = "stop", True
                del self.requests[rid]
                self.order.remove(rid)
            outputs.append(RequestOutput(out.request_id, out.prompt, out.prompt_token_ids,
                                         [CompletionOutput(0, c.text, list(c.token_ids), None, None,
                                                           c.finish_reason)], out.finished, out.metrics))
        time.sleep(0.001)
        return outputs


def with_client(tokenizer, script: str, use):
    """Run `use(client)` against the app over a scripted engine, in process."""
    engine = AsyncLLM(ScriptedEngine(script))
    metrics = ServerMetrics(engine, MODEL)
    engine.stat_logger = metrics
    ctx = ServingContext(engine, tokenizer, [MODEL], max_model_len=4096, vocab_size=0x110000)
    app = build_app(ctx, metrics)

    async def main():
        engine.start()
        try:
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
            async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http,
                                          max_retries=0) as client:
                return await use(client)
        finally:
            await engine.shutdown()

    return asyncio.run(asyncio.wait_for(main(), 30))


def test_auto_over_the_server_whole_and_streamed():
    async def use(client):
        kw = {"model": MODEL, "messages": [{"role": "user", "content": "Weather and time in Paris?"}],
              "tools": TOOLS, "max_tokens": 500}
        whole = await client.chat.completions.create(**kw)
        chunks = [c async for c in await client.chat.completions.create(stream=True, tool_choice="auto", **kw)]
        return whole, chunks

    whole, chunks = with_client(ToolsTokenizer(), ANSWER, use)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert [(c.type, c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("function", "get_weather", WEATHER_ARGS), ("function", "get_time", TIME_ARGS)]
    assert all(c.id.startswith("call_") for c in choice.message.tool_calls)

    content, calls = "", {}
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or ():
            if d.id is not None:
                calls[d.index] = [d.id, d.function.name, ""]
            calls[d.index][2] += d.function.arguments or ""
    assert content == "Let me check."
    assert [(name, args) for _, name, args in calls.values()] == [("get_weather", WEATHER_ARGS),
                                                                  ("get_time", TIME_ARGS)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_auto_without_calls_is_plain_content():
    async def use(client):
        return await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    tools=TOOLS, max_tokens=100)

    r = with_client(ToolsTokenizer(), "Hello there.", use)
    assert r.choices[0].message.content == "Hello there." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_auto_with_a_template_without_tools_is_400():
    class PlainTokenizer(FakeTokenizer):
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    async def use(client):
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 tools=TOOLS, max_tokens=10)
        return info.value

    error = with_client(PlainTokenizer(), ANSWER, use)
    assert AUTO_NEEDS_PARSER in error.body["message"] and error.body["param"] == "tool_choice"
