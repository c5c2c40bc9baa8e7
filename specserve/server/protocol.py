"""The OpenAI wire format (completions, chat completions, models, errors) as pydantic models, with vLLM's
extra sampling fields; requests turn themselves into `SamplingParams`.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from specserve.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from specserve.structured.grammar import check_json_value, parse_json

# torch.Generator.manual_seed takes anything in [-2^63, 2^64).
_SEED_MIN, _SEED_MAX = -(2 ** 63), 2 ** 64 - 1
MAX_N = 128
# Sampling runs in float32: a top_p that rounds to 0 or a repetition penalty that overflows the logits breaks
# it, so the server takes these narrower ranges than SamplingParams (top_p this small is greedy anyway).
MIN_TOP_P = 1e-6
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
# Each stop string is searched for after every token, on the engine thread (100,000 of them take 15 ms a token).
MAX_STOP_STRINGS = 256


class OpenAIModel(BaseModel):
    # Unknown fields are ignored (OpenAI clients send e.g. `store`, `metadata`); NaN and inf are refused.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def bounded_json(value: Any) -> Any:
    """A field that takes any JSON (a schema, or its text): refused when it nests or holds more objects and
    arrays than a grammar may (structured.grammar's limits), before anything walks it recursively (repr, json,
    a chat template, the grammar compiler)."""
    if value is not None:
        check_json_value(parse_json(value, "the JSON text") if isinstance(value, str) else value, "the value")
    return value


# ------------------------------------------------------------------------------------------- errors


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# ------------------------------------------------------------------------------------------- requests


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    include_token_sources: bool | None = Field(
        False, description="specserve's extension: each streamed choice carries `token_sources`, how each of "
                           "its new tokens was produced (see TokenSource)")


class JsonSchemaFormat(OpenAIModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="accepted; the output always follows the schema")

    _bounded = field_validator("schema_")(bounded_json)


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _needs_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type 'json_schema' needs json_schema.schema")
        return self

    def constraint(self) -> "OutputConstraint | None":
        if self.type == "json_object":
            return OutputConstraint("response_format", {"json_object": True}, "response_format")
        if self.type == "json_schema":
            return OutputConstraint("response_format", {"json": self.json_schema.schema_},
                                    "response_format.json_schema.schema")
        return None


@dataclass(frozen=True)
class OutputConstraint:
    """A request field that constrains the output. `fields` are StructuredOutputsParams' keyword arguments;
    errors about them ("structured_outputs.json ...") name the field as `label` (None: as they are)."""

    param: str
    fields: dict[str, Any]
    label: str | None = None


class SamplingFields(OpenAIModel):
    """Fields both endpoints share: OpenAI's, then vLLM's extras."""

    model: str | None = Field(None, description="a served model name; omitted = the first one")
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, description="default 1.0; 0 = greedy")
    top_p: float | None = Field(None, ge=MIN_TOP_P, le=1)
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, description="not supported: must be empty")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, description="0 or -1 = no top-k")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    num_speculative_tokens: int | None = Field(
        None, ge=0, description="draft tokens per step for this request: 0 = no speculation, "
                                "omitted = the server's speculative_config")
    draft_tree: Literal["chain", "auto"] | None = Field(
        None, description="\"chain\": one draft continuation per step for this request; omitted or \"auto\": "
                          "trees where the server's speculative_config draft_tree allows")
    # Structured output: at most one of these (response_format is OpenAI's, the others vLLM's).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = Field(
        None, description="one of json (a JSON schema), regex, choice (a list of strings), grammar (EBNF), "
                          "json_object (true)")
    guided_json: str | dict[str, Any] | None = Field(None, description="older name of structured_outputs.json")
    guided_regex: str | None = Field(None, description="older name of structured_outputs.regex")
    guided_choice: list[str] | None = Field(None, description="older name of structured_outputs.choice")
    guided_grammar: str | None = Field(None, description="older name of structured_outputs.grammar")

    _bounded = field_validator("structured_outputs", "guided_json")(bounded_json)

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword arguments common to both endpoints (None = SamplingParams' default)."""
        kwargs = dict(
            n=self.n, temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop=self.stop,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, num_speculative_tokens=self.num_speculative_tokens,
            draft_tree=self.draft_tree)
        return {k: v for k, v in kwargs.items() if v is not None}

    def output_constraints(self) -> list[OutputConstraint]:
        """Every field of this request that constrains the output (more than one is an error)."""
        found = []
        if self.response_format is not None and (constraint := self.response_format.constraint()):
            found.append(constraint)
        if self.structured_outputs is not None:
            found.append(OutputConstraint("structured_outputs", self.structured_outputs))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                found.append(OutputConstraint(f"guided_{kind}", {kind: value}, f"guided_{kind}"))
        return found

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def include_token_sources_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_token_sources)


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[Annotated[int, Field(ge=0)]], list[list[Annotated[int, Field(ge=0)]]]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, description="not supported beyond n")
    suffix: str | None = Field(None, description="not supported")

    def to_sampling_params(self, max_tokens: int | None,
                           structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        return SamplingParams(**self.sampling_kwargs(), max_tokens=max_tokens, logprobs=self.logprobs,
                              structured_outputs=structured_outputs)


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ImageURL(OpenAIModel):
    url: str = Field(description="a base64 data URL 'data:image/<png|jpeg|webp>;base64,...' (nothing is fetched)")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="accepted and ignored, as in vLLM")


class ImageURLContentPart(OpenAIModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[Union[TextContentPart, ImageURLContentPart], Field(discriminator="type")]


class FunctionCall(OpenAIModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON string")


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCall(OpenAIModel):
    id: str = Field(default_factory=new_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant turn's earlier tool calls")
    tool_call_id: str | None = Field(None, description="a tool turn: the call it answers")

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(p.type == "image_url" for p in self.content)

    def as_template_dict(self) -> dict:
        """The message as chat templates expect it, developer shown as system: text parts joined, or, when
        it holds images, the parts kept as dicts for `split_chat_images`."""
        content = self.content
        if self.has_images:
            content = [part.model_dump(exclude_none=True) for part in content]
        elif isinstance(content, list):
            content = "\n".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": content or "", "name": self.name}
        if self.tool_calls:
            message["tool_calls"] = [_template_tool_call(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _template_tool_call(call: ToolCall) -> dict:
    """Chat templates (as in transformers) expect a call's arguments as a dict, not OpenAI's JSON string."""
    try:
        arguments = json.loads(call.function.arguments)
    except (ValueError, RecursionError):  # not JSON, or nested too deep to decode: the text as it is
        arguments = call.function.arguments
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema; omitted = no arguments")
    strict: bool | None = Field(None, description="accepted; constrained calls always follow the schema")

    _bounded = field_validator("parameters")(bounded_json)


class ChatTool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI: use max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: 'auto' with tools, else 'none'; 'auto' reads Hermes-style <tool_call> blocks "
                          "where the chat template renders tools, and is refused otherwise")
    parallel_tool_calls: bool | None = Field(None, description="false: 'required' makes exactly one call")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def to_sampling_params(self, max_tokens: int | None,
                           structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        num_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(**self.sampling_kwargs(), max_tokens=max_tokens, logprobs=num_logprobs,
                              structured_outputs=structured_outputs)


# ------------------------------------------------------------------------------------------- responses


class SpeculationUsage(OpenAIModel):
    """This request's speculative decoding: drafts verified, tokens drafted and accepted."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float
    mean_acceptance_length: float


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    speculation: SpeculationUsage | None = None


class CompletionLogprobs(OpenAIModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TokenSource(OpenAIModel):
    """specserve's stream extension (opt in with stream_options.include_token_sources): one output token, its
    text (the texts of a choice's tokens add up to its generated text, up to a stop string) and how it was
    produced."""

    text: str
    source: Literal["accepted", "bonus", "correction", "target"] = Field(
        description="accepted: a draft token the target accepted; bonus: the target's token after all the "
                    "step's drafts were accepted; correction: the target's token in place of the first rejected "
                    "draft; target: the target's token in a step without drafts")
    drafter: str | None = Field(None, description="the drafter of the step's drafts (e.g. suffix, ngram, "
                                                  "draft_model, grammar); omitted for `target`")

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ExtendedChoice(OpenAIModel):
    """A streamed choice; `token_sources` appears only when the request opted in (OpenAI clients ignore it)."""

    token_sources: list[TokenSource] | None = None

    @model_serializer(mode="wrap")
    def _drop_unrequested(self, handler):
        body = handler(self)
        sources = body.pop("token_sources", None)
        if sources is not None:
            body["token_sources"] = sources  # after the standard fields
        return body


class CompletionChoice(ExtendedChoice):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(None, description="the stop string or token id that ended it")


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(OpenAIModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaModel(OpenAIModel):
    @model_serializer(mode="wrap")
    def _drop_nones(self, handler):
        # A delta carries only what changed: the role once, then content; a tool call's id and name once.
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(DeltaModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(DeltaModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(DeltaModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(ExtendedChoice):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
