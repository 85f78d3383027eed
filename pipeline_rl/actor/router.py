"""Which inference server gets the actor's next request: least loaded among the healthy ones, under a
per-server cap on requests in flight.

A connection error, 5xx or timeout marks a server unhealthy (the actor probes it on /health and marks
it healthy again); the failed request is retried elsewhere and its partial result never used. No
healthy server for `all_down_deadline_s` -> AllServersDown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import httpx

from inference_shim.client import AsyncShimClient, ShimError
from pipeline_rl.actor.errors import ActorError, AllServersDown

logger = logging.getLogger("pipeline_rl.actor")

POLL_S = 0.25  # safety net of every event-driven wait: re-check state at least this often


@dataclass
class Server:
    index: int
    url: str
    client: AsyncShimClient
    healthy: bool = True
    in_flight: int = 0
    assigned: int = 0
    failures: int = 0
    removed: bool = False  # taken out of the job (fleet.json): never picked or probed again


class Router:
    """Least-loaded choice among healthy servers under a per-server cap on requests in flight."""

    def __init__(self, servers: list[Server], cap: int, all_down_deadline_s: float, slot_deadline_s: float):
        self.servers = servers
        self.cap = cap
        self.all_down_deadline_s = all_down_deadline_s
        self.slot_deadline_s = slot_deadline_s
        self._changed = asyncio.Event()
        self._all_down_since: float | None = None if any(s.healthy for s in servers) else time.monotonic()

    def pick(self) -> Server | None:
        candidates = [s for s in self.servers if s.healthy and not s.removed and s.in_flight < self.cap]
        # Ties go to the server given the least work so far, so idle servers share the load evenly.
        return min(candidates, key=lambda s: (s.in_flight, s.assigned), default=None)

    async def acquire(self) -> Server:
        waited_since = time.monotonic()
        while True:
            server = self.pick()
            if server is not None:
                server.in_flight += 1
                server.assigned += 1
                return server
            now = time.monotonic()
            if self._all_down_since is not None:
                left = self._all_down_since + self.all_down_deadline_s - now
                if left <= 0:
                    raise AllServersDown(
                        f"no inference server answered /health for {self.all_down_deadline_s:.0f}s "
                        f"(actor.all_servers_down_deadline_s): {[s.url for s in self.servers]}. Check the "
                        "servers' logs in the run directory and that inference.urls is right."
                    )
            else:
                left = waited_since + self.slot_deadline_s - now
                if left <= 0:
                    raise ActorError(
                        f"no request slot freed for {self.slot_deadline_s:.0f}s although every request has "
                        "a timeout (actor.request_timeout_s): this is a bug in the actor's bookkeeping"
                    )
            self._changed.clear()  # no await since pick(): no release can slip in between
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, POLL_S))

    def add(self, server: Server) -> None:
        """A server added to the job: unhealthy until a probe finds it serving recent enough weights."""
        server.healthy = False
        self.servers.append(server)

    def remove(self, url: str) -> None:
        for server in self.servers:
            if server.url == url:
                server.removed, server.healthy = True, False
        self._changed.set()

    def release(self, server: Server) -> None:
        server.in_flight -= 1
        self._changed.set()

    def mark_failed(self, server: Server, reason: str) -> None:
        server.failures += 1
        if server.healthy:
            logger.warning("server %s marked unhealthy: %s", server.url, reason)
        server.healthy = False
        if self._all_down_since is None and not any(s.healthy for s in self.servers):
            self._all_down_since = time.monotonic()
            logger.error("every inference server is down; waiting up to %.0fs", self.all_down_deadline_s)
        self._changed.set()

    def mark_healthy(self, server: Server) -> None:
        if not server.healthy:
            logger.info("server %s is healthy again", server.url)
        server.healthy = True
        self._all_down_since = None
        self._changed.set()


def retryable(err: Exception) -> bool:
    """Errors another server may not have: transport failures, timeouts, 5xx. A 4xx is our bug."""
    return isinstance(err, httpx.TransportError) or (isinstance(err, ShimError) and err.status >= 500)
