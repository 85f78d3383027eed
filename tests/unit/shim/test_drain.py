"""Drain-then-swap (--update-mode drain), without an engine: the update template's drain
(inference_shim/backends/base.py) on the fake engine of tests/support/fake_backend.py, over the real app,
and the turn-taking of an update's servers (inference_shim/backends/drain.py) on a real torch TCPStore on
loopback.

    .venv/bin/python -m pytest -q tests/unit/shim/test_drain.py

What is checked: a draining server answers new generation requests 503 draining with Retry-After while
the requests in flight finish on the old weights, and applies only once none is in flight; past
--drain-timeout-s (or 3/4 of the update's timeout_s) it ends the rest (503 drain_timeout, never an answer
computed after the cut) and applies; the servers of one update drain one at a time, a predecessor that
never hands its turn on (died) or hands it on unsigned delays the next only until its deadline.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time

import httpx
import pytest
import torch.distributed as tdist
from support.fake_backend import FakeBackend

from inference_shim.backends.base import DRAIN_RETRY_AFTER_S
from inference_shim.backends.drain import DrainTurn
from inference_shim.backends.torch_backend import TorchBackend, TorchOptions
from inference_shim.cli import build_parser, engine_options
from inference_shim.metrics import ShimMetrics
from inference_shim.protocol import (
    GroupState,
    TensorMeta,
    WeightUpdateRequest,
    decision_key,
    drain_done_key,
    result_key,
    sign_value,
    verify_value,
)
from inference_shim.server import create_app

TOKEN = "drain-token"
BODY = {"prompt": [1, 2], "max_tokens": 1}


def _group(server_id: str = "s") -> GroupState:
    return GroupState(
        master_address="127.0.0.1",
        master_port=1,
        rank_offset=1,
        world_size=3,
        backend="gloo",
        group_name="weights",
        server_id=server_id,
        timeout_s=5,
        ranks=[1],
    )


def _request(update_id: str = "u1", timeout_s: float = 10.0, version: int = 1) -> WeightUpdateRequest:
    return WeightUpdateRequest(
        version=version,
        update_id=update_id,
        timeout_s=timeout_s,
        tensors=[TensorMeta(name="w", dtype="float32", shape=[2])],
    )


def _draining_backend(drain_timeout_s: float = 60.0) -> FakeBackend:
    backend = FakeBackend()
    backend.update_mode, backend.drain_timeout_s = "drain", drain_timeout_s
    backend.hold = True  # requests stay in flight until the test sets backend.release
    return backend


def _client(backend: FakeBackend, token: str | None = None) -> httpx.AsyncClient:
    app = create_app(backend, backend.metrics, token)  # sets backend.token: signs its store values
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shim")


async def _until(condition, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.005)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


# ------------------------------------------------------------------ flags and /capabilities
def test_flags_reach_capabilities_and_sglang_refuses_drain():
    args = build_parser().parse_args(["--model", "m", "--update-mode", "drain", "--drain-timeout-s", "5"])
    assert (args.update_mode, args.drain_timeout_s) == ("drain", 5.0)
    assert build_parser().parse_args(["--model", "m"]).update_mode == "inflight"
    backend = TorchBackend(TorchOptions(model="/m/tiny-t"), ShimMetrics())  # never started
    caps = backend.capabilities()
    assert (caps.update_mode, caps.drain_timeout_s, caps.contract_version) == ("inflight", None, "2.2")
    backend.update_mode, backend.drain_timeout_s = args.update_mode, args.drain_timeout_s
    caps = backend.capabilities()
    assert (caps.update_mode, caps.drain_timeout_s) == ("drain", 5.0)
    sglang = build_parser().parse_args(["--model", "m", "--backend", "sglang", "--update-mode", "drain"])
    with pytest.raises(SystemExit, match="cannot stage"):
        engine_options(sglang)


# ------------------------------------------------------------------ one server's drain
def test_a_draining_server_refuses_new_requests_and_applies_once_nothing_is_in_flight():
    backend = _draining_backend()

    async def scenario():
        async with _client(backend) as client:
            old = asyncio.create_task(client.post("/v1/completions", json=BODY))
            await _until(lambda: backend.in_flight == 1, "the request is in flight")
            backend.pending = 1
            update = asyncio.create_task(backend._run_update(_request(), _group(), None))
            await _until(lambda: backend.draining, "the drain begins")
            state = (await client.get("/debug/state")).json()
            assert (state["update_mode"], state["draining"], state["in_flight_requests"]) == (
                "drain",
                True,
                1,
            )
            refused = await client.post("/v1/completions", json=BODY)
            assert refused.status_code == 503 and refused.json()["error"] == "draining", refused.text
            assert refused.headers["retry-after"] == str(DRAIN_RETRY_AFTER_S)
            assert (await client.get("/health")).status_code == 200  # draining is not unhealthy
            await asyncio.sleep(0.1)
            assert not update.done() and backend.version == 0 and "apply" not in backend.calls
            backend.release.set()  # the request in flight ends, on the old weights
            answered = await old
            await update
            assert answered.status_code == 200, answered.text
            assert backend.version == 1 and not backend.draining and backend.last_error is None
            assert backend.calls == [
                "wait_received",
                "pause",
                "apply",
                "set_version_label",
                "reset_cache",
                "resume",
            ]
            last = backend.last_update
            assert last.cut_requests == 0 and last.drain_started_at is not None
            assert last.drain_started_at <= last.finished_at
            again = await client.post("/v1/completions", json=BODY)  # admitting again
            assert again.status_code == 200, again.text

    _run(scenario())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("bound", ["drain_timeout_s", "update_timeout_s"])
def test_requests_still_running_at_the_drain_bound_get_503_drain_timeout_and_the_update_applies(
    stream, bound
):
    # Either bound ends the drain: --drain-timeout-s, or 3/4 of the update's timeout_s (the apply keeps
    # the last quarter, so the trainer never waits past timeout_s for a long answer).
    backend = _draining_backend(drain_timeout_s=0.2 if bound == "drain_timeout_s" else 60.0)
    req = _request(timeout_s=10.0 if bound == "drain_timeout_s" else 0.4)

    async def scenario():
        async with _client(backend) as client:
            old = asyncio.create_task(client.post("/v1/completions", json={**BODY, "stream": stream}))
            await _until(lambda: backend.in_flight == 1, "the request is in flight")
            backend.pending = 1
            await backend._run_update(req, _group(), None)
            assert backend.version == 1 and backend.last_error is None
            assert backend.last_update.cut_requests == 1 and "abort_in_flight" in backend.calls
            # The engine hands its output over only now, after the apply: the client never sees it.
            backend.release.set()
            cut = await old
            assert cut.status_code == 503 and cut.json()["error"] == "drain_timeout", cut.text
            assert cut.headers["retry-after"] == str(DRAIN_RETRY_AFTER_S)
            assert (await client.post("/v1/completions", json=BODY)).status_code == 200

    _run(scenario())


def test_inflight_mode_admits_during_an_update_and_never_cuts():
    backend = FakeBackend()  # the default mode
    backend.hold = True

    async def scenario():
        async with _client(backend) as client:
            assert (await client.get("/capabilities")).json()["update_mode"] == "inflight"
            old = asyncio.create_task(client.post("/v1/completions", json=BODY))
            await _until(lambda: backend.in_flight == 1, "the request is in flight")
            backend.pending = 1
            await backend._run_update(_request(), _group(), None)  # applied with the request in flight
            assert backend.version == 1 and backend.last_update.drain_started_at is None
            backend.release.set()
            assert (await old).status_code == 200

    _run(scenario())


# ------------------------------------------------------------------ turns between servers (real TCPStore)
@pytest.fixture
def store():
    master = tdist.TCPStore("127.0.0.1", 0, None, True, timeout=dt.timedelta(seconds=10))
    yield master


def _client_store(master):
    return tdist.TCPStore("127.0.0.1", master.port, None, False, timeout=dt.timedelta(seconds=10))


def test_turns_follow_tickets_and_are_handed_on_signed(store):
    async def scenario():
        turns = [DrainTurn(_client_store(store), TOKEN, "weights", "u1", f"s{i}") for i in range(3)]
        far = time.monotonic() + 20
        assert await turns[0].take(far) == "first"
        second = asyncio.create_task(turns[1].take(far))
        await _until(lambda: turns[1].ticket is not None, "the second server has its ticket")
        third = asyncio.create_task(turns[2].take(far))
        await _until(lambda: turns[2].ticket is not None, "the third server has its ticket")
        assert [t.ticket for t in turns] == [1, 2, 3]  # in the order they got there
        await asyncio.sleep(0.3)
        assert not second.done() and not third.done()  # one server drains at a time
        await turns[0].release()
        assert await second == "given"
        await asyncio.sleep(0.3)
        assert not third.done()
        await turns[1].release()
        assert await third == "given"
        key = drain_done_key("weights", "u1", 1)
        assert verify_value(TOKEN, key, store.get(key)) == "s0"  # signed, naming who handed it on

    _run(scenario())


@pytest.mark.parametrize("predecessor", ["died", "forged"])
def test_a_predecessor_that_never_hands_on_delays_the_next_only_until_its_deadline(store, predecessor):
    async def scenario():
        first = DrainTurn(_client_store(store), TOKEN, "weights", "u2", "s0")
        second = DrainTurn(_client_store(store), TOKEN, "weights", "u2", "s1")
        assert await first.take(time.monotonic() + 20) == "first"
        if predecessor == "forged":  # someone else who reaches the store writes the key
            key = drain_done_key("weights", "u2", 1)
            store.set(key, sign_value("another-token", key, "s0"))
        started = time.monotonic()
        assert await second.take(started + 0.5) == "deadline"
        assert time.monotonic() - started >= 0.5  # never before its deadline

    _run(scenario())


def test_two_draining_servers_of_one_update_drain_one_after_the_other(store):
    """The whole lifecycle on two fake engines sharing the trainer's store: the second does not stop
    admitting until the first has applied, then drains and applies; both write their results."""
    a, b = _draining_backend(), _draining_backend()
    a.store, b.store = _client_store(store), _client_store(store)
    a.hold, b.hold = True, False  # only a has a request in flight
    decision = decision_key("weights", "u3")
    store.set(decision, sign_value(TOKEN, decision, "go"))  # the trainer's

    async def scenario():
        async with _client(a, TOKEN) as client_a, _client(b, TOKEN) as client_b:
            old = asyncio.create_task(client_a.post("/v1/completions", json=BODY))
            await _until(lambda: a.in_flight == 1, "a's request is in flight")
            req = _request(update_id="u3")
            a.pending = b.pending = 1
            update_a = asyncio.create_task(a._run_update(req, _group("a"), a.store))
            await _until(lambda: a.draining, "a drains")
            update_b = asyncio.create_task(b._run_update(req, _group("b"), b.store))
            await _until(lambda: b.awaiting_drain_turn, "b waits for its turn")
            # While a drains, b admits: a router sends a's refused requests there.
            assert (await client_a.post("/v1/completions", json=BODY)).status_code == 503
            assert (await client_b.post("/v1/completions", json=BODY)).status_code == 200
            await asyncio.sleep(0.2)
            assert b.version == 0 and not b.draining
            a.release.set()
            await asyncio.gather(update_a, update_b)
            assert (await old).status_code == 200
            assert a.version == b.version == 1
            assert a.last_update.finished_at <= b.last_update.drain_started_at  # never both at once
            assert b.last_update.turn_wait_seconds > 0
            for server in ("a", "b"):
                key = result_key("weights", "u3", server)
                assert '"ok":true' in verify_value(TOKEN, key, store.get(key))

    _run(scenario())
