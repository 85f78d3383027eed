"""Tool calls and JSON-constrained output of chat requests, engine-neutral (torch-free, vLLM-free).

A request's output becomes tool calls in one of three ways (ChatCompletionRequest.tool_mode):
- auto (the default when `tools` are given): the model writes calls in its own format (Hermes'
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, Llama's JSON, ...); the engine's parser for
  that format reads them (Backend.tool_parser: vLLM's own parsers on the vLLM backend, chosen with
  `--tool-call-parser`).
- named (`tool_choice: {"type": "function", ...}`): the engine's structured output constrains the text to
  the function's arguments object, so the text IS the call.
- required: constrained to a JSON array `[{"name": ..., "parameters": {...}}, ...]` (the shape vLLM uses
  for the same feature), at least one call, one at most when `parallel_tool_calls` is false.
`response_format` (json_object, json_schema) uses the same constraint, with no tool calls.

The text a choice generated is never lost: whatever is not read as a call is the message's content (a
cut-off forced call, for example, arrives as content with finish_reason "length").
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from inference_shim.openai_protocol import (
    AssistantDelta,
    AssistantMessage,
    ChatCompletionRequest,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
)

ANY_OBJECT = {"type": "object"}


@dataclass
class OutputConstraint:
    """Structured output for the engine: text valid for `json_schema`, or any JSON object."""

    json_schema: dict | None = None
    json_object: bool = False


def output_constraint(req: ChatCompletionRequest) -> OutputConstraint | None:
    """What the engine must constrain this request's text to (forced tool calls take precedence over
    response_format, as on OpenAI's API), or None."""
    mode = req.tool_mode
    if mode == "named":
        [tool] = [t for t in req.tools or [] if t.function.name == req.tool_choice.function.name]
        return OutputConstraint(json_schema=tool.function.parameters or ANY_OBJECT)
    if mode == "required":
        one_of_the_tools = [
            {
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": t.function.parameters or ANY_OBJECT,
                },
                "required": ["name", "parameters"],
            }
            for t in req.tools or []
        ]
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": one_of_the_tools}}
        if not req.parallel_tool_calls:
            schema["maxItems"] = 1
        return OutputConstraint(json_schema=schema)
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return OutputConstraint(json_object=True)
    return OutputConstraint(json_schema=fmt.json_schema.json_schema or ANY_OBJECT)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedDelta:
    """What a piece of streamed text adds to the message: content, and pieces of tool calls."""

    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallParser(Protocol):
    """Reads tool calls written in the model's own format from one choice's text. One instance per
    choice: a streaming parser keeps state between pieces."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole text: (content outside the calls, the calls)."""
        ...

    def parse_delta(self, previous_text: str, current_text: str, previous_ids: list[int], new_ids: list[int]):
        """A new piece of a streamed text: a ParsedDelta, or None while the parser holds text back (for
        example a prefix of its call tag)."""
        ...


def forced_calls(req: ChatCompletionRequest, text: str) -> list[ToolCall] | None:
    """The calls of a named/required request's constrained text, or None when the text is not a
    complete call (cut off by max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if req.tool_mode == "named":
        if not isinstance(value, dict):
            return None
        name = req.tool_choice.function.name
        return [ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=_json(value)))]
    if not isinstance(value, list) or not all(isinstance(c, dict) and "name" in c for c in value):
        return None
    return [
        ToolCall(
            id=new_call_id(), function=FunctionCall(name=c["name"], arguments=_json(c.get("parameters", {})))
        )
        for c in value
    ]


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _finish(mode: str, finish_reason: str | None, called: bool) -> str | None:
    # As OpenAI answers: a turn that ended by itself with calls it chose to make (auto, required) ends
    # for "tool_calls"; a forced named call ends with "stop"; a cut-off one stays "length".
    return "tool_calls" if called and finish_reason == "stop" and mode != "named" else finish_reason


class ChoiceTools:
    """Turns one choice's generated text into the assistant message (whole) or message deltas (stream),
    following the request's tool mode. `parser` reads auto-mode calls (None in other modes)."""

    def __init__(self, req: ChatCompletionRequest, parser: ToolCallParser | None) -> None:
        self.req = req
        self.mode = req.tool_mode
        self.parser = parser
        self.text = ""
        self.ids: list[int] = []
        self.content_sent = 0  # characters of content streamed so far
        self.called = False

    def message(self, text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
        if self.mode == "none":
            return AssistantMessage(content=text), finish_reason
        if self.mode == "auto":
            content, calls = self.parser.parse(text)
        else:
            calls = forced_calls(self.req, text)
            content = None if calls else text
        return AssistantMessage(content=content, tool_calls=calls or None), _finish(
            self.mode, finish_reason, bool(calls)
        )

    def piece(
        self, text: str, ids: list[int], finish_reason: str | None
    ) -> tuple[AssistantDelta, str | None]:
        """The delta to stream for a new piece of the choice (empty content and no calls: nothing to show
        yet; the chunk still carries the piece's token ids)."""
        if self.mode == "none":
            return AssistantDelta(content=text if text or finish_reason is None else None), finish_reason
        previous_text, previous_ids = self.text, self.ids
        self.text, self.ids = previous_text + text, previous_ids + ids
        content, calls = None, []
        if self.mode == "auto" and (text or ids):
            parsed = self.parser.parse_delta(previous_text, self.text, previous_ids, ids)
            if parsed is not None:
                content, calls = parsed.content, parsed.tool_calls
                self.content_sent += len(content or "")
        if finish_reason is not None:
            content, calls = self._last(content, calls)
        self.called = self.called or bool(calls)
        return AssistantDelta(content=content or None, tool_calls=calls or None), _finish(
            self.mode, finish_reason, self.called
        )

    def _last(
        self, content: str | None, calls: list[ToolCallDelta]
    ) -> tuple[str | None, list[ToolCallDelta]]:
        """At the end of the choice: forced calls are read now; text a streaming parser held back and
        never read as a call is released as content."""
        if self.mode in ("named", "required"):
            whole = forced_calls(self.req, self.text)
            if whole is None:
                return self.text, []
            return None, [
                ToolCallDelta(
                    index=i,
                    id=c.id,
                    type="function",
                    function=FunctionCallDelta(name=c.function.name, arguments=c.function.arguments),
                )
                for i, c in enumerate(whole)
            ]
        if self.called or calls:
            return content, calls
        whole_content, whole_calls = self.parser.parse(self.text)
        if whole_calls:
            return content, calls
        rest = (whole_content or "")[self.content_sent :]
        return (content or "") + rest, calls
