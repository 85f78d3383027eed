"""Which inference server gets the actor's next request: least loaded among the healthy ones, under a
per-server cap on requests in flight.

A connection error, 5xx or timeout marks a server unhealthy (the actor probes it on /health and marks
it healthy again); the failed request is retried elsewhere and its partial result never used. No
healthy server for `all_down_deadline_s` -> AllServersDown.

A server that takes a weight update in drain mode answers 503 `draining` (new requests) or
`drain_timeout` (a request its drain ended) with Retry-After (docs/engines.md, "Drain-then-swap"): not a
failure. defer() keeps the server healthy, avoids it for Retry-After seconds and has the request sent
again, elsewhere or, with every server avoided, once one of them may be asked again.
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
# 503 codes of a server taking a weight update in drain mode: try elsewhere, not a failure.
DEFER_CODES = frozenset({"draining", "drain_timeout"})
DEFAULT_RETRY_AFTER_S = 1.0  # a deferral without a Retry-After header (a stream's in-band error)
MAX_RETRY_AFTER_S = 30.0  # a server cannot make the actor avoid it longer at once


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
    avoid_until: float = 0.0  # time.monotonic() before which it is not picked (it is draining)
    # First of the "not now" answers (defer) it has given since it last answered anything else.
    draining_since: float | None = None
    deferred: bool = False  # the request being released was deferred (defer, then release)


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
        now = time.monotonic()
        candidates = [
            s
            for s in self.servers
            if s.healthy and not s.removed and s.in_flight < self.cap and s.avoid_until <= now
        ]
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
            if any(s.healthy and not s.removed and s.avoid_until > now for s in self.servers):
                # A draining server will be asked again after its Retry-After (defer() bounds how long
                # a drain may last): that wait is no lost slot.
                waited_since = now
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
        if server.deferred:
            server.deferred = False
        else:  # it answered (or failed) this request: whatever drain it was in has moved on
            server.draining_since = None
        self._changed.set()

    def defer(self, server: Server, err: Exception) -> bool:
        """Whether `err` is `server` saying "not now" (503 draining / drain_timeout: it is taking a weight
        update); then the server stays healthy, is avoided for its Retry-After, and the caller sends the
        request again without counting a failure. False for any other error, and once the server has
        answered nothing but "not now" for longer than all_down_deadline_s (a drain is bounded by the
        server's own deadlines: past that it counts as failed). Call it right before the request's
        release(), with no await between (as the actor's _on_a_server does): release() tells a deferred
        request from an answered one."""
        if not (isinstance(err, ShimError) and err.error in DEFER_CODES):
            return False
        now = time.monotonic()
        if server.draining_since is None:
            server.draining_since = now
            logger.info("server %s is draining for a weight update: requests go elsewhere", server.url)
        elif now - server.draining_since > self.all_down_deadline_s:
            return False
        server.deferred = True
        wait = DEFAULT_RETRY_AFTER_S if err.retry_after is None else err.retry_after
        server.avoid_until = max(server.avoid_until, now + min(wait, MAX_RETRY_AFTER_S))
        self._changed.set()
        return True

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
