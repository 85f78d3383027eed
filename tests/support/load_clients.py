"""The overload test's clients, each run in a spawned process of its own (tests/integration/test_overload.py).

Torch-free on purpose: a spawned child imports only this module, httpx and asyncio. The pytest process
has torch, vLLM and hundreds of tests' objects in its heap; one full garbage collection there takes
0.5 s or more (0.52 s measured with torch, transformers and vLLM imported alone), so a poller thread in
it would time the harness's pauses rather than the server's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import httpx

POLL_INTERVAL_S = 0.05
POLL_TIMEOUT_S = 10.0  # one /health call; beyond it the sample records status -1 and fails the test


def poll_health(url: str, max_s: float, started, stop, results) -> None:
    """GET /health every 50 ms until `stop` is set (or `max_s` passed); puts [(latency_s, status)]."""
    samples: list[tuple[float, int]] = []
    deadline = time.monotonic() + max_s
    try:
        with httpx.Client(base_url=url, timeout=POLL_TIMEOUT_S) as client:
            started.set()
            while not stop.is_set() and time.monotonic() < deadline:
                start = time.perf_counter()
                try:
                    status = client.get("/health").status_code
                except httpx.HTTPError:
                    status = -1  # no answer within POLL_TIMEOUT_S
                samples.append((time.perf_counter() - start, status))
                stop.wait(POLL_INTERVAL_S)
        results.put(("ok", samples))
    except BaseException as e:  # the parent reports it; a child's traceback alone would be lost in CI
        results.put(("error", f"{type(e).__name__}: {e}"))


async def _flood(url: str, requests: int, clients: int, deadline_s: float) -> list[tuple[int | str, float]]:
    # `clients` pools of requests/clients connections each, all requests in flight at once: one httpx pool
    # of 1,000 connections spends ~20 s of its own CPU getting them out (measured), which would time the
    # client.
    per_client = requests // clients
    limits = httpx.Limits(max_connections=per_client, max_keepalive_connections=per_client)
    async with contextlib.AsyncExitStack() as stack:
        pools = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits))
            for _ in range(clients)
        ]

        async def one(i: int) -> tuple[int | str, float]:
            client = pools[i % clients]
            body = {"prompt": [1, 2 + i % 50, 3], "max_tokens": 4, "temperature": 1.0, "seed": i}
            start = time.perf_counter()
            try:
                response = await client.post("/v1/completions", json=body)
            except httpx.HTTPError as e:
                return f"{type(e).__name__}: {e}", time.perf_counter() - start
            if response.status_code == 503:
                assert response.json()["error"] == "overloaded" and response.headers["retry-after"]
            elif response.status_code == 200:
                assert len(response.json()["choices"][0]["token_ids"]) >= 1
            return response.status_code, time.perf_counter() - start

        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(requests))), deadline_s)


def flood(
    url: str, requests: int, clients: int, deadline_s: float, nice: int, started, stop, results
) -> None:
    """`requests` concurrent completions at CPU priority `nice`; puts ("ok", [(status, seconds)]) or
    ("error", text). `stop` is unused: the flood ends when every request has its answer (or at
    `deadline_s`)."""
    os.nice(nice)
    started.set()
    try:
        results.put(("ok", asyncio.run(_flood(url, requests, clients, deadline_s))))
    except BaseException as e:
        results.put(("error", f"{type(e).__name__}: {e}"))
