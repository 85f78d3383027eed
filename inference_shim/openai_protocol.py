"""Wire models of the OpenAI-compatible generation routes, with our extensions (torch-free).

Requests honour the fields below and tolerate unknown ones, as OpenAI servers do. Responses add
`prompt_token_ids`, per-choice `token_ids` and `weight_versions` (spans of tokens per weight version,
checked to tile each whole choice). docs/contract.md "Generation" is the prose version; the weight
transfer's models are in inference_shim/protocol.py.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class VersionSpan(BaseModel):
    """Tokens [start, end) of a completion were produced by weight version `version`."""

    version: int
    start: int
    end: int


class ContentPart(BaseModel):
    """One part of a message's `content` list. Only `text` parts can be served; the app answers any other
    type (image_url, input_audio, file, refusal, ...) with 400 unsupported_content, not a 422."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_has_text(self):
        if self.type == "text" and self.text is None:
            raise ValueError("a content part of type 'text' needs a `text` string")
        return self


class ChatMessage(BaseModel):
    """A chat message as OpenAI clients send it. `content` may be a string, a list of parts, or null
    (an assistant message that carries `tool_calls`); `tool_call_id`, `tool_calls`, `name` and any other
    fields are passed on to the model's chat template as they came."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict] | None = None

    def unsupported_part(self) -> str | None:
        """The type of the first content part that is not text, or None."""
        parts = self.content if isinstance(self.content, list) else []
        return next((p.type for p in parts if p.type != "text"), None)

    def template_dict(self) -> dict:
        """What the chat template sees: text parts joined in order into one string, `content` always a
        string (null, as an assistant message with `tool_calls` sends it, becomes "": a simple template
        would otherwise print the word None), other fields only when the client sent them."""
        message = self.model_dump(exclude_unset=True)
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(p.text or "" for p in content)
        message["content"] = content
        return message


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict | None = Field(default=None, description="JSON schema of the arguments object.")


class ToolSpec(BaseModel):
    """One entry of `tools`: a function the model may call (the only tool type of the Chat API)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the one function the model must call."""

    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = "response"
    json_schema: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: text (no constraint), any JSON object, or JSON valid for a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs a `json_schema` object")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    # OpenAI clients send many optional fields; unknown ones are tolerated, the ones below are honoured.
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    n: int = Field(default=1, ge=1, le=256)
    # vLLM seeds a torch generator: a seed outside [0, 2**63) is an OverflowError deep in the engine.
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

    @model_validator(mode="after")
    def _seeds_of_all_choices_fit(self):
        # With n > 1 the engine samples choice i with seed + i: each of those must fit as well.
        if self.seed is not None and self.seed + self.n - 1 >= 2**63:
            raise ValueError(
                f"seed + n - 1 must be < 2**63 (choice i is sampled with seed + i); got seed {self.seed}"
            )
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[ToolSpec] | None = Field(default=None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _tool_choice_fits_tools(self):
        choice = self.tool_choice
        if choice is None or choice == "none":
            return self
        names = [t.function.name for t in self.tools or []]
        if not names:
            raise ValueError(f"tool_choice {choice if isinstance(choice, str) else 'function'} needs `tools`")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not one of tools {names}")
        return self

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """How tool calls are read from this request's output: not at all (no tools, or tool_choice
        none), parsed from free text (auto, the default with tools), or forced by a JSON schema."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"


class CompletionRequest(_SamplingFields):
    prompt: str | list[Annotated[int, Field(ge=0)]] = Field(
        description="Text, or token ids (no chat template applied; each in the model's vocabulary)."
    )
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


# Responses tolerate unknown fields (OpenAI adds fields over time). Extensions beyond OpenAI's schema:
# `prompt_token_ids`, and per choice `token_ids` and `weight_versions`.
class _Response(BaseModel):
    # -inf logprobs go out as -Infinity (what json.dumps writes and Python's json reads), not null.
    model_config = ConfigDict(extra="allow", ser_json_inf_nan="constants")


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str = Field(description="The arguments as a JSON text, as OpenAI sends them.")


class ToolCall(_Response):
    id: str
    type: str = "function"
    function: FunctionCall


class FunctionCallDelta(_Response):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Response):
    """A piece of tool call `index` in a stream: its id, type and name come first, then argument text."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta | None = None


class AssistantMessage(_Response):
    role: str | None = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class AssistantDelta(_Response):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] | None = None
    token_logprobs: list[float] | None = None
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] | None = None


class _ChoiceBase(_Response):
    """In a stream chunk `token_ids` are the piece's NEW tokens and the final piece's `weight_versions`
    span the whole choice."""

    index: int = 0
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(default=None, description="Extension: the sampled token ids.")
    weight_versions: list[VersionSpan] | None = Field(
        default=None, description="Extension: tokens [start, end) came from weight version `version`."
    )


class _WholeChoice(_ChoiceBase):
    @model_validator(mode="after")
    def _spans_tile_the_tokens(self):
        # Contiguous, non-empty, from 0 to len(token_ids). Versions need not increase: a trainer that
        # restores a checkpoint (WeightUpdateRequest.restore) may lower the version mid-request.
        spans, ids = self.weight_versions, self.token_ids
        if spans is None or not ids:
            return self
        edges = [0, *(e for s in spans for e in (s.start, s.end)), len(ids)]
        if edges[0::2] != edges[1::2] or any(s.start >= s.end for s in spans):
            raise ValueError(f"weight_versions {[s.model_dump() for s in spans]} do not tile [0, {len(ids)})")
        return self


class ChatChoice(_WholeChoice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None

    @model_validator(mode="after")
    def _one_logprob_per_token(self):
        content = self.logprobs.content if self.logprobs else None
        if content is not None and self.token_ids is not None and len(content) != len(self.token_ids):
            raise ValueError(f"{len(content)} logprobs for {len(self.token_ids)} token_ids")
        return self


class CompletionChoice(_WholeChoice):
    text: str
    logprobs: CompletionLogprobs | None = None


class ChatChunkChoice(_ChoiceBase):
    delta: AssistantDelta = Field(default_factory=AssistantDelta)
    logprobs: ChatLogprobs | None = None


class CompletionChunkChoice(_ChoiceBase):
    text: str = ""
    logprobs: CompletionLogprobs | None = None
    token_logprobs: list[float] | None = Field(default=None, description="Extension: logprobs of token_ids.")


class _Generated(_Response):
    # Subclasses narrow `object` and `choices`; declared here so the JSON keeps OpenAI's key order.
    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list
    prompt_token_ids: list[int] | None = Field(
        default=None, description="Extension: the prompt's token ids (in a stream: on each role chunk)."
    )
    usage: Usage | None = None


class ChatCompletionResponse(_Generated):
    object: str = "chat.completion"
    choices: list[ChatChoice]


class ChatCompletionChunk(_Generated):
    object: str = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionResponse(_Generated):
    object: str = "text_completion"
    choices: list[CompletionChoice]


class CompletionChunk(_Generated):
    object: str = "text_completion"
    choices: list[CompletionChunkChoice]


class StreamError(_Response):
    """Sent in-band as `data: {"error": {...}}` when a stream fails after its 200 status line."""

    message: str
    type: str
