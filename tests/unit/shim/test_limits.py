"""The server's limits without an engine: request checks, the admission gate, and the app's answers to
bad input and overload (body size, API key, unknown paths, route-labelled metrics, weights_incomplete),
driven in-process through httpx's ASGI transport against tests/support/fake_backend.py.

    .venv/bin/python -m pytest -q tests/unit/test_limits.py
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from support.fake_backend import VOCAB, FakeBackend

from inference_shim.backends.common import ContractError
from inference_shim.limits import AdmissionGate, Limits, Overloaded, check_generation
from inference_shim.openai_protocol import ChatCompletionRequest, CompletionRequest
from inference_shim.server import ServeConfig, create_app

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def _app(backend: FakeBackend | None = None, **kwargs):
    backend = backend or FakeBackend()
    limits = kwargs.pop("limits", Limits())
    return backend, create_app(backend, backend.metrics, limits=limits, **kwargs)


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shim")


def _is_error(response: httpx.Response, status: int, error: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "detail"} and body["error"] == error, body


# ---------------------------------------------------------------------------------------------- checks
def test_check_generation_refuses_each_limit_with_400():
    limits = Limits(max_n=4, max_stop=2, max_stop_chars=3, max_messages=2)
    check_generation(
        ChatCompletionRequest(messages=[{"role": "user", "content": "a"}], n=4, stop=["a", "bc"]), limits
    )
    bad = [
        CompletionRequest(prompt="a", n=5),
        CompletionRequest(prompt="a", stop=["a", "b", "c"]),
        CompletionRequest(prompt="a", stop="abcd"),
        ChatCompletionRequest(messages=[{"role": "user", "content": "a"}] * 3),
    ]
    for req in bad:
        with pytest.raises(ContractError) as e:
            check_generation(req, limits)
        assert e.value.status == 400 and e.value.error == "limit_exceeded" and "--max-" in e.value.detail


def test_serve_config_refuses_a_network_bind_without_token_or_api_key():
    ServeConfig(host="127.0.0.1")
    assert ServeConfig(host="10.0.0.5", token="t", api_key="k").exposed
    assert not ServeConfig(host="127.0.0.1").exposed
    with pytest.raises(ValueError, match="set a token"):
        ServeConfig(host="0.0.0.0", api_key="k")
    with pytest.raises(ValueError, match=r"serve generation \(/v1/\*\) to anyone.*PIPELINE_RL_API_KEY"):
        ServeConfig(host="10.0.0.5", token="t")
    ServeConfig(host="10.0.0.5", token="t", allow_open_v1=True)  # the explicit opt-out, behind a gateway


# ---------------------------------------------------------------------------------------------- gate
def test_gate_admits_max_active_queues_max_queued_and_refuses_the_rest():
    async def scenario():
        gate = AdmissionGate(max_active=2, max_queued=1)
        await gate.acquire()
        await gate.acquire()
        waiter = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        assert (gate.active, gate.queued) == (2, 1) and not waiter.done()
        with pytest.raises(Overloaded):
            await gate.acquire()
        gate.release()  # the queued one takes the freed slot
        await waiter
        assert (gate.active, gate.queued) == (2, 0)
        # A waiter whose client went away leaves the queue and takes no slot.
        gone = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert (gate.active, gate.queued) == (2, 0)
        gate.release()
        gate.release()
        assert gate.active == 0
        await gate.acquire()  # free slots are usable again

    _run(scenario())


# ---------------------------------------------------------------------------------------------- app
def test_unknown_paths_and_methods_answer_the_error_body():
    async def scenario():
        _, app = _app()
        async with _client(app) as c:
            _is_error(await c.get("/no/such/route"), 404, "not_found")
            response = await c.get("/v1/completions")
            _is_error(response, 405, "method_not_allowed")
            assert "POST" in response.headers.get("allow", "")
            _is_error(
                await c.post("/v1/completions", content=b"{", headers={"content-type": "application/json"}),
                400,
                "invalid_json",
            )
            _is_error(
                await c.post(
                    "/v1/completions",
                    content="é".encode("latin-1"),
                    headers={"content-type": "application/json"},
                ),
                400,
                "invalid_json",
            )

    _run(scenario())


def test_body_over_the_limit_is_413_declared_or_streamed():
    async def scenario():
        _, app = _app(limits=Limits(max_body_bytes=4096))
        async with _client(app) as c:
            big = json.dumps({"prompt": "a" * 10_000}).encode()
            _is_error(
                await c.post("/v1/completions", content=big, headers={"content-type": "application/json"}),
                413,
                "body_too_large",
            )

            async def chunks():  # no Content-Length: counted as it streams in
                for _ in range(10):
                    yield b" " * 1000

            response = await c.post(
                "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
            )
            _is_error(response, 413, "body_too_large")
            # The control routes have the same limit.
            _is_error(
                await c.post(
                    "/request_weight_update", content=big, headers={"content-type": "application/json"}
                ),
                413,
                "body_too_large",
            )
            assert (
                await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
            ).status_code == 200

    _run(scenario())


def test_api_key_guards_the_v1_routes_only():
    async def scenario():
        _, app = _app(api_key="k3y", token="t0k")
        async with _client(app) as c:
            _is_error(await c.post("/v1/chat/completions", json=CHAT), 401, "unauthorized")
            _is_error(await c.get("/v1/models"), 401, "unauthorized")
            _is_error(
                await c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer t0k"}),
                401,
                "unauthorized",
            )
            ok = await c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer k3y"})
            assert ok.status_code == 200, ok.text
            assert (await c.get("/v1/models", headers={"Authorization": "Bearer k3y"})).status_code == 200
            assert (await c.get("/health")).status_code == 200  # introspection stays open
            # Control routes still take the token, not the key.
            _is_error(
                await c.post("/destroy_process_group", headers={"Authorization": "Bearer k3y"}),
                401,
                "unauthorized",
            )

    _run(scenario())


def test_bad_generation_input_is_4xx():
    async def scenario():
        _, app = _app(limits=Limits(max_n=2))
        async with _client(app) as c:
            _is_error(await c.post("/v1/completions", json={"prompt": [VOCAB]}), 422, "invalid_request")
            _is_error(await c.post("/v1/completions", json={"prompt": [-1]}), 422, "invalid_request")
            for seed in (2**64, -1):
                _is_error(
                    await c.post("/v1/completions", json={"prompt": [1], "seed": seed}),
                    422,
                    "invalid_request",
                )
            # n = 2 samples choice 1 with seed + 1, which would overflow the engine's generator.
            _is_error(
                await c.post("/v1/completions", json={"prompt": [1], "seed": 2**63 - 1, "n": 2}),
                422,
                "invalid_request",
            )
            _is_error(await c.post("/v1/completions", json={"prompt": [1], "n": 3}), 400, "limit_exceeded")
            _is_error(await c.post("/v1/completions", json={"prompt": []}), 400, "empty_prompt")
            join = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 3, "world_size": 2}
            join |= {"backend": "gloo", "server_id": "s"}
            _is_error(await c.post("/init_process_group", json=join), 422, "invalid_request")
            assert (
                await c.post("/v1/completions", json={"prompt": [VOCAB - 1], "seed": 2**63 - 1})
            ).status_code == 200

    _run(scenario())


def test_overload_is_503_with_retry_after_and_health_stays_fast():
    async def scenario():
        backend, app = _app(limits=Limits(max_concurrent_requests=2, max_queued_requests=3))
        backend.hold = True
        async with _client(app) as c:
            held = [asyncio.create_task(c.post("/v1/completions", json={"prompt": [1]})) for _ in range(5)]
            while backend.in_flight < 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            refused = await c.post("/v1/completions", json={"prompt": [1]})
            _is_error(refused, 503, "overloaded")
            assert refused.headers["retry-after"] == "1"
            assert backend.in_flight == 2  # two slots, three waiting, none beyond
            assert (await c.get("/health")).status_code == 200
            backend.release.set()
            assert [r.status_code for r in await asyncio.gather(*held)] == [200] * 5
            assert (await c.post("/v1/completions", json={"prompt": [1]})).status_code == 200

    _run(scenario())


def test_weights_incomplete_refuses_generation_with_503():
    async def scenario():
        backend, app = _app()
        backend.unhealthy = "weights may be partially applied (version 3): injected; restart the server"
        async with _client(app) as c:
            _is_error(await c.post("/v1/chat/completions", json=CHAT), 503, "weights_incomplete")
            _is_error(
                await c.post("/v1/completions", json={"prompt": [1], "stream": True}),
                503,
                "weights_incomplete",
            )
            health = await c.get("/health")
            assert health.status_code == 503 and "partially applied" in health.json()["detail"]

    _run(scenario())


def test_metrics_label_by_route_template_and_stay_bounded():
    async def scenario():
        backend, app = _app()
        async with _client(app) as c:
            for i in range(300):
                await c.get(f"/random-{i}")
            await c.get("/health")
            await c.post("/v1/completions", json={"prompt": [1]})
            text = (await c.get("/metrics")).text
        lines = [line for line in text.splitlines() if line.startswith("shim_requests_total{")]
        assert 'route="<unmatched>",status="404"} 300.0' in text, lines
        assert any('route="/health"' in line for line in lines)
        assert any('route="/v1/completions",status="200"' in line for line in lines)
        assert len(lines) <= 4, lines

    _run(scenario())


def test_await_weights_refuses_generation_until_the_first_update_then_serves():
    async def scenario():
        backend, app = _app()
        backend.awaiting_weights = True
        async with _client(app) as c:
            _is_error(await c.post("/v1/chat/completions", json=CHAT), 503, "awaiting_weights")
            health = await c.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "awaiting_weights"
            assert (await c.get("/debug/state")).json()["awaiting_weights"] is True
            from inference_shim.protocol import UpdateResult

            backend._publish_update(UpdateResult(server_id="s", version=4, ok=False))
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
            health = await c.get("/health")
            assert health.status_code == 200 and health.json() == {
                "status": "ok",
                "weight_version": 4,
                "detail": None,
            }

    _run(scenario())
