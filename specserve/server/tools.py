"""Tool calling on the chat endpoint: the output constraint a tool_choice asks for (vLLM's JSON schemas), the
constrained output read back as tool_calls, and 'auto's free text split into content and Hermes-format calls.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Collection, Protocol

from specserve.server.protocol import (
    ChatCompletionRequest, ChatTool, DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall,
    NamedToolChoice, OutputConstraint, ToolCall, new_tool_call_id)
from specserve.server.serving import bad_request

AUTO_NEEDS_PARSER = ("tool_choice 'auto' needs a tool-call parser for this model's chat template; "
                     "use 'required' or a named function")
# A function declared without parameters is called with an empty object.
NO_PARAMETERS = {"type": "object", "properties": {}}


def tool_constraint(request: ChatCompletionRequest, chat_template: str | None) -> OutputConstraint | None:
    """Check tools and tool_choice; the output constraint that 'required' or a named function sets (None for
    'none', and for 'auto', which generates freely). 'auto' is refused for a chat template that does not render
    tools: its model was not taught the Hermes <tool_call> format that AutoCallReader reads."""
    choice = request.effective_tool_choice
    tools = request.tools or []
    _check_tools(tools, choice)
    if choice == "none":
        return None
    if choice == "auto":
        if renders_tools(chat_template):
            return None
        raise bad_request(AUTO_NEEDS_PARSER + " (this chat template does not render tools)", "tool_choice")
    if choice == "required":
        return OutputConstraint("tools", {"json": required_schema(tools, request.parallel_tool_calls)}, "tools")
    index = next(i for i, tool in enumerate(tools) if tool.function.name == choice.function.name)
    return OutputConstraint("tools", {"json": parameters(tools[index])}, f"tools[{index}].function.parameters")


def renders_tools(chat_template: str | None) -> bool:
    # Templates that render tools (Qwen2.5, Hermes and their kin) teach the Hermes <tool_call> format.
    return bool(chat_template) and "tools" in chat_template


def _check_tools(tools: list[ChatTool], choice: str | NamedToolChoice) -> None:
    if choice != "none" and not tools:
        raise bad_request("tool_choice needs tools: declare the functions the model may call", "tool_choice")
    names = [tool.function.name for tool in tools]
    duplicate = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if duplicate is not None:
        raise bad_request(f"tools declares the function {duplicate!r} twice", "tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                          f"({', '.join(map(repr, names))})", "tool_choice")


def parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or NO_PARAMETERS


def required_schema(tools: list[ChatTool], parallel_tool_calls: bool | None) -> dict[str, Any]:
    """vLLM's schema for tool_choice 'required': a JSON array of at least one {"name", "parameters"} object,
    any of the tools; each tool's $defs move to the top, where its "#/$defs/..." references point."""
    defs: dict[str, Any] = {}
    alternatives = []
    for tool in tools:
        params = dict(parameters(tool))
        tool_defs = params.pop("$defs", None) if isinstance(params.get("$defs"), dict) else None
        for name, definition in (tool_defs or {}).items():
            if defs.setdefault(name, definition) != definition:
                raise bad_request(f"tools define $defs.{name} differently; 'required' needs one definition per "
                                  "name", "tools")
        alternatives.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                            "parameters": params},
                             "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": alternatives}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


# ------------------------------------------------------------------------------------------- reading calls


class ToolCallReader(Protocol):
    """One choice's output as tool calls: whole, or as deltas while the text streams in."""

    def tool_calls(self, text: str) -> list[ToolCall] | None:
        """The calls in the finished output, or None when it holds none (cut short, say)."""

    def deltas(self, text: str) -> list[DeltaToolCall]:
        """The tool-call deltas that `text`, the output's next piece, completes."""

    def finish_reason(self, reason: str) -> str:
        ...


def tool_call_reader(request: ChatCompletionRequest) -> ToolCallReader | None:
    """A new reader for one choice of this request, or None when its output is plain content."""
    choice = request.effective_tool_choice
    if isinstance(choice, NamedToolChoice):
        return NamedCallReader(choice.function.name)
    return RequiredCallsReader() if choice == "required" else None


def _header(index: int, call_id: str, name: str) -> DeltaToolCall:
    # As OpenAI streams a call: id, type and name first, with empty arguments.
    return DeltaToolCall(index=index, id=call_id, type="function", function=DeltaFunctionCall(name=name, arguments=""))


def _arguments(index: int, text: str) -> DeltaToolCall:
    return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=text))


class NamedCallReader:
    """tool_choice names a function: the whole output is its arguments (finish_reason stays as OpenAI's and
    vLLM's: "stop")."""

    def __init__(self, name: str) -> None:
        self.name, self.call_id, self.started = name, new_tool_call_id(), False

    def tool_calls(self, text: str) -> list[ToolCall]:
        return [ToolCall(id=self.call_id, function=FunctionCall(name=self.name, arguments=text))]

    def deltas(self, text: str) -> list[DeltaToolCall]:
        out = [] if self.started else [_header(0, self.call_id, self.name)]
        self.started = True
        return out + ([_arguments(0, text)] if text else [])

    def finish_reason(self, reason: str) -> str:
        return reason


class RequiredCallsReader:
    """tool_choice 'required': the output is a JSON array of {"name", "parameters"}; each element is one call,
    its arguments the parameters' text as generated, streamed as it grows."""

    def __init__(self) -> None:
        self.text = ""
        self.ids: list[str] = []
        self.sent: list[int] = []  # per call: characters of its arguments sent

    def _id(self, index: int) -> str:
        while len(self.ids) <= index:
            self.ids.append(new_tool_call_id())
        return self.ids[index]

    def tool_calls(self, text: str) -> list[ToolCall] | None:
        try:
            items = json.loads(text)
        except ValueError:
            return None
        spans = scan_calls(text)
        if not isinstance(items, list) or len(spans) != len(items) or not all(s.complete for s in spans):
            return None
        return [ToolCall(id=self._id(i), function=FunctionCall(name=s.name, arguments=text[s.start:s.end]))
                for i, s in enumerate(spans)]

    def deltas(self, text: str) -> list[DeltaToolCall]:
        self.text += text
        out = []
        for i, span in enumerate(scan_calls(self.text)):
            if span.name is None:
                break  # calls stream in order: this one's name is still being generated
            if i == len(self.sent):
                self.sent.append(0)
                out.append(_header(i, self._id(i), span.name))
            if span.start is not None and span.end - span.start > self.sent[i]:
                out.append(_arguments(i, self.text[span.start + self.sent[i]:span.end]))
                self.sent[i] = span.end - span.start
        return out

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if reason == "stop" else reason


@dataclass
class CallSpan:
    """One {"name": ..., "parameters": ...} element of a tool-call array: the name once its string is complete,
    and where the parameters' text lies (`end` grows while it is being generated)."""

    name: str | None = None
    start: int | None = None
    end: int | None = None
    closed: bool = False

    @property
    def complete(self) -> bool:
        return self.closed and self.name is not None and self.start is not None


def scan_calls(text: str) -> list[CallSpan]:
    """The calls in a JSON array of call objects, possibly unfinished. Depth 1 is the array, depth 2 a call
    object, whose keys and values this follows; deeper text belongs to the value being read."""
    calls: list[CallSpan] = []
    depth, in_string, escaped = 0, False, False
    state, key, start = None, None, 0  # state at depth 2: "key?", "key", "colon", "value?", "value"
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 2 and state == "key":
                    key, state = _loads(text[start:i + 1]), "colon"
                elif depth == 2 and state == "value" and key == "name":
                    name = _loads(text[start:i + 1])
                    calls[-1].name = name if isinstance(name, str) else None
            if state == "value" and key == "parameters":
                calls[-1].end = i + 1
            continue
        if ch.isspace():
            continue
        if depth == 2 and state == "value?":  # a value's first character
            state, start = "value", i
            if key == "parameters":
                calls[-1].start = i
        if ch == '"':
            in_string = True
            if depth == 2 and state == "key?":
                state, start = "key", i
        elif ch in "[{":
            depth += 1
            if depth == 2:
                calls.append(CallSpan())
                state = "key?"
        elif ch in "]}":
            depth -= 1
            if depth == 1 and calls and state is not None:  # a call object closed
                calls[-1].closed, state = True, None
        elif ch == ":" and depth == 2 and state == "colon":
            state = "value?"
        elif ch == "," and depth == 2:
            state = "key?"
            continue
        if state == "value" and key == "parameters":
            calls[-1].end = i + 1
    return calls


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


# ------------------------------------------------------------------------------------ 'auto': Hermes calls

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


def auto_call_reader(request: ChatCompletionRequest) -> AutoCallReader | None:
    """A new reader for one choice of this request when tool_choice is 'auto', else None."""
    if request.effective_tool_choice != "auto":
        return None
    return AutoCallReader([tool.function.name for tool in request.tools or []])


def read_call(block: str, names: Collection[str]) -> FunctionCall | None:
    """The call in one <tool_call> block's text: JSON {"name", "arguments"} naming one of `names`, its arguments
    an object or an object's JSON text (absent: no arguments); None for anything else."""
    call = _loads(block)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call["name"] not in names:
        return None
    arguments = call.get("arguments", {})
    parsed = _loads(arguments) if isinstance(arguments, str) else arguments
    if not isinstance(parsed, dict):
        return None
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return FunctionCall(name=call["name"], arguments=text)


def parse_tool_calls(text: str, names: Collection[str]) -> tuple[str | None, list[FunctionCall]]:
    """A whole output in the Hermes format: the calls of its <tool_call> blocks, and its other text, stripped,
    as content (None when empty). A block that is not a call of a declared tool, or is never closed, stays in
    the content as it was generated."""
    content, calls, pos = [], [], 0
    while (start := text.find(TOOL_CALL_START, pos)) >= 0:
        end = text.find(TOOL_CALL_END, start + len(TOOL_CALL_START))
        if end < 0:
            break
        content.append(text[pos:start])
        call = read_call(text[start + len(TOOL_CALL_START):end], names)
        if call is None:
            content.append(text[start:end + len(TOOL_CALL_END)])
        else:
            calls.append(call)
        pos = end + len(TOOL_CALL_END)
    content.append(text[pos:])
    return "".join(content).strip() or None, calls


class AutoCallReader:
    """tool_choice 'auto': one choice's free text as content and Hermes-format tool calls, whole or streamed.

    Streaming sends content as it comes, except text that may be the start of <tool_call>; a block is held
    until </tool_call> closes it, then sent as a call (id, type and name with empty arguments, then the
    arguments) or, when it is not a call, as content. The deltas add up to what `parse` returns."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.num_calls = 0
        self.buffer = ""        # text not yet sent: a held-back prefix of <tool_call>, or an open block's text
        self.in_block = False   # whether the buffer is an open block's text (after <tool_call>)
        self.started = False    # whether any content has been sent (leading whitespace is dropped)
        self.space = ""         # whitespace held back: sent only if more content follows

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = parse_tool_calls(text, self.names)
        self.num_calls = len(calls)
        return content, [ToolCall(function=call) for call in calls]

    def deltas(self, text: str, final: bool) -> list[DeltaMessage]:
        """The content and tool-call deltas that `text`, the output's next piece, completes; `final` flushes
        what is held back (an unclosed block, a partial <tool_call>) as content."""
        self.buffer += text
        out = []
        while (found := self.buffer.find(TOOL_CALL_END if self.in_block else TOOL_CALL_START)) >= 0:
            piece = self.buffer[:found]
            self.buffer = self.buffer[found + len(TOOL_CALL_END if self.in_block else TOOL_CALL_START):]
            if not self.in_block:
                out += self._content(piece)
            elif (call := read_call(piece, self.names)) is not None:
                out += self._call(call)
            else:
                out += self._content(TOOL_CALL_START + piece + TOOL_CALL_END)
            self.in_block = not self.in_block
        if final:
            out += self._content((TOOL_CALL_START if self.in_block else "") + self.buffer)
            self.buffer, self.in_block = "", False
        elif not self.in_block:
            keep = _partial_suffix(self.buffer, TOOL_CALL_START)
            out += self._content(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
        return out

    def _content(self, piece: str) -> list[DeltaMessage]:
        text = self.space + piece if self.started else piece.lstrip()
        body = text.rstrip()
        self.space = text[len(body):]
        if not body:
            return []
        self.started = True
        return [DeltaMessage(content=body)]

    def _call(self, call: FunctionCall) -> list[DeltaMessage]:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return [DeltaMessage(tool_calls=[_header(index, new_tool_call_id(), call.name)]),
                DeltaMessage(tool_calls=[_arguments(index, call.arguments)])]

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.num_calls else reason


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (without being all of it)."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)
