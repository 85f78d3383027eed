"""vLLM's own tool-call parsers and structured output behind the engine-neutral interface of
inference_shim/tool_calls.py: the formats models write tool calls in are many and model-specific, and
vLLM maintains a parser for each (`--tool-call-parser NAME`, the same names as `vllm serve`).
"""

from __future__ import annotations

from inference_shim.openai_protocol import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta
from inference_shim.tool_calls import OutputConstraint, ParsedDelta, new_call_id


def vllm_tool_parser_class(name: str | None):
    """The vLLM parser class registered under `name` (None: None); an unknown name is a startup error
    that lists the known ones."""
    if name is None:
        return None
    from vllm.tool_parsers import ToolParserManager

    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError:
        known = sorted({*ToolParserManager.tool_parsers, *ToolParserManager.lazy_parsers})
        raise ValueError(f"--tool-call-parser {name!r} is not a vLLM tool parser; known: {known}") from None


def structured_outputs(constraint: OutputConstraint | None):
    """vLLM's StructuredOutputsParams for an engine-neutral constraint (None: unconstrained)."""
    if constraint is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if constraint.json_object:
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=constraint.json_schema)


class VllmToolParser:
    """One choice's parser: a vLLM ToolParser instance (it keeps streaming state) and the vLLM request
    object its methods read (`tools`, `tool_choice`)."""

    def __init__(self, parser_cls, tokenizer, tools: list[dict]) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        self.request = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": ""}], "tools": tools, "tool_choice": "auto"}
        )
        self.parser = parser_cls(tokenizer, self.request.tools)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        info = self.parser.extract_tool_calls(text, self.request)
        if not info.tools_called:
            return text, []
        calls = [
            ToolCall(
                id=c.id or new_call_id(),
                function=FunctionCall(name=c.function.name, arguments=c.function.arguments),
            )
            for c in info.tool_calls
        ]
        return info.content, calls

    def parse_delta(
        self, previous_text: str, current_text: str, previous_ids: list[int], new_ids: list[int]
    ) -> ParsedDelta | None:
        message = self.parser.extract_tool_calls_streaming(
            previous_text,
            current_text,
            current_text[len(previous_text) :],
            previous_ids,
            previous_ids + new_ids,
            new_ids,
            self.request,
        )
        if message is None:
            return None
        calls = [
            ToolCallDelta(
                index=c.index,
                id=c.id,
                type=c.type,
                function=None if c.function is None else FunctionCallDelta(**_function_fields(c.function)),
            )
            for c in message.tool_calls
        ]
        return ParsedDelta(content=message.content, tool_calls=calls)


def _function_fields(function) -> dict:
    # vLLM hands the function piece over as a model or as the dict of one (model_dump(exclude_none)).
    if isinstance(function, dict):
        return {k: function.get(k) for k in ("name", "arguments")}
    return {"name": function.name, "arguments": function.arguments}
