"""The actor's router and servers that drain for a weight update (--update-mode drain), without servers:
a 503 draining / drain_timeout is no failure, the server is avoided for its Retry-After and the request
goes elsewhere, or waits for it when it is the only one; a server that says "not now" for ever counts
as failed in the end.

    .venv/bin/python -m pytest -q tests/unit/actor/test_router_drain.py

The draining answer itself comes from the real app over the fake engine of tests/support/fake_backend.py
(through the actor's own AsyncShimClient), so the code and header the router reads are the server's.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from support.fake_backend import FakeBackend

from inference_shim.client import AsyncShimClient, ShimError
from inference_shim.server import create_app
from pipeline_rl.actor import Router, Server
from pipeline_rl.actor.router import DEFAULT_RETRY_AFTER_S, retryable


def _servers(count: int) -> list[Server]:
    return [
        Server(i, f"http://127.0.0.1:{9 + i}", AsyncShimClient(f"http://127.0.0.1:{9 + i}"))
        for i in range(count)
    ]


def _draining(retry_after: float | None = 0.2, code: str = "draining") -> ShimError:
    return ShimError("http://s", 503, code, "a weight update", retry_after)


async def _ask(router: Router, work, retries: int = 0) -> tuple[object, int]:
    """The actor's _on_a_server, in its order: defer before release, then the failure count."""
    failures = 0
    while True:
        server = await router.acquire()
        try:
            result = await work(server)
        except Exception as err:
            if router.defer(server, err):
                continue
            assert retryable(err)
            router.mark_failed(server, str(err))
            failures += 1
            if failures > retries:
                raise
            continue
        finally:
            router.release(server)
        return result, failures


def test_the_draining_answer_carries_its_code_and_retry_after():
    backend = FakeBackend()
    backend.draining = True  # what base.Backend._drain sets

    async def scenario():
        client = AsyncShimClient("http://shim")
        await client._http.aclose()
        app = create_app(backend, backend.metrics)
        client._http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shim")
        with pytest.raises(ShimError) as e:
            await client.completion([1, 2], max_tokens=1)
        await client.aclose()
        return e.value

    err = asyncio.run(scenario())
    assert (err.status, err.error, err.retry_after) == (503, "draining", 1.0)
    router = Router(_servers(1), cap=4, all_down_deadline_s=5, slot_deadline_s=30)
    assert router.defer(router.servers[0], err)


def test_a_draining_server_is_avoided_for_retry_after_and_its_requests_go_elsewhere():
    async def scenario():
        servers = _servers(2)
        router = Router(servers, cap=4, all_down_deadline_s=5, slot_deadline_s=30)
        asked = []

        async def work(server: Server):
            asked.append(server.index)
            if server.index == 0 and len(asked) == 1:
                raise _draining(retry_after=30.0)
            return server.index

        result, failures = await _ask(router, work)
        assert (result, failures, asked) == (1, 0, [0, 1])  # elsewhere at once, no failure counted
        assert servers[0].healthy and servers[0].failures == 0
        for _ in range(3):  # avoided while its Retry-After lasts, though it is the least loaded
            assert (await _ask(router, work))[0] == 1
        servers[0].avoid_until = time.monotonic()  # its Retry-After is over
        assert (await _ask(router, work))[0] == 0
        for s in servers:
            await s.client.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize("code", ["draining", "drain_timeout"])
def test_with_one_server_the_request_waits_for_retry_after_and_is_sent_again(code):
    async def scenario():
        servers = _servers(1)
        router = Router(servers, cap=4, all_down_deadline_s=5, slot_deadline_s=30)
        sent = []

        async def work(server: Server):
            sent.append(time.monotonic())
            if len(sent) < 3:
                raise _draining(retry_after=0.2, code=code)
            return "answer"

        assert await _ask(router, work) == ("answer", 0)
        gaps = [b - a for a, b in zip(sent, sent[1:], strict=False)]
        assert all(g >= 0.2 for g in gaps), gaps  # never before the server's Retry-After
        await servers[0].client.aclose()

    asyncio.run(scenario())


def test_a_stream_cut_by_a_drain_is_deferred_without_retry_after():
    # A stream ended in-band (status line already sent): the client raises 500 with the code, no header.
    router = Router(_servers(1), cap=4, all_down_deadline_s=5, slot_deadline_s=30)
    server = router.servers[0]
    before = time.monotonic()
    assert router.defer(server, ShimError("http://s", 500, "drain_timeout", "cut", None))
    assert server.avoid_until >= before + DEFAULT_RETRY_AFTER_S


def test_other_errors_are_not_deferred():
    router = Router(_servers(1), cap=4, all_down_deadline_s=5, slot_deadline_s=30)
    server = router.servers[0]
    for err in (
        ShimError("http://s", 503, "overloaded", "full", 1.0),
        ShimError("http://s", 503, "weights_incomplete", "mixed", None),
        ShimError("http://s", 500, "internal_error", "boom", None),
        httpx.ConnectError("refused"),
    ):
        assert not router.defer(server, err)
    assert server.avoid_until == 0.0 and server.draining_since is None


def test_a_server_that_only_ever_says_not_now_counts_as_failed_after_the_deadline():
    async def scenario():
        servers = _servers(1)
        router = Router(servers, cap=4, all_down_deadline_s=0.3, slot_deadline_s=30)

        async def work(server: Server):
            raise _draining(retry_after=0.05)

        with pytest.raises(ShimError, match="draining"):
            await _ask(router, work, retries=0)
        assert servers[0].failures == 1 and not servers[0].healthy
        await servers[0].client.aclose()

    asyncio.run(scenario())


def test_an_answer_between_two_drains_starts_the_count_again():
    router = Router(_servers(1), cap=4, all_down_deadline_s=5, slot_deadline_s=30)
    server = router.servers[0]
    server.in_flight = 2
    assert router.defer(server, _draining())
    router.release(server)
    since = server.draining_since
    assert since is not None
    router.release(server)  # a request it answered: the drain moved on
    assert server.draining_since is None
