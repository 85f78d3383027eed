"""What keeps one inference server answering under bad input and overload (docs/contract.md § Security
and limits): the limits (server flags), the admission gate of the generation routes, and the ASGI
middleware that enforces body size, API key and admission before any handler reads a byte.

Engine-free and FastAPI-free (plain asyncio + ASGI): tests/unit/test_limits.py drives all of it
without a server. inference_shim/server.py installs the middleware and calls check_generation().
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from inference_shim.backends.common import ContractError
from inference_shim.openai_protocol import ChatCompletionRequest, CompletionRequest

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The routes that run the engine: admission-controlled. Every /v1/ route needs the API key when one is set
# (the OpenAI client sends it to /v1/models too).
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
API_KEY_PREFIX = "/v1/"

# Seconds a client told "overloaded" should wait before it retries (the Retry-After header).
RETRY_AFTER_S = 1


class Limits(BaseModel):
    """Resource limits of one server (flags of `pipeline-rl serve`; defaults in docs/contract.md)."""

    max_body_bytes: int = Field(
        default=8 * 1024 * 1024, ge=1024, description="Largest request body in bytes; larger is 413."
    )
    max_concurrent_requests: int = Field(
        default=256, ge=1, description="Generation requests served at once; more wait in the queue."
    )
    max_queued_requests: int = Field(
        default=1024, ge=0, description="Generation requests waiting for a slot; beyond, 503 overloaded."
    )
    max_n: int = Field(default=64, ge=1, description="Largest `n` (choices per request).")
    max_stop: int = Field(default=16, ge=0, description="Most `stop` strings per request.")
    max_stop_chars: int = Field(default=256, ge=1, description="Longest `stop` string, in characters.")
    max_messages: int = Field(default=256, ge=1, description="Most chat `messages` per request.")


def check_generation(req: ChatCompletionRequest | CompletionRequest, limits: Limits) -> None:
    """Raise ContractError(400, "limit_exceeded") for a request beyond `limits` (checked before any
    tokenization, so an oversized request costs nothing)."""
    if req.n > limits.max_n:
        raise _exceeded(f"n is {req.n}; this server allows at most {limits.max_n} (--max-n)")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > limits.max_stop:
        raise _exceeded(
            f"{len(stop)} stop strings; this server allows at most {limits.max_stop} (--max-stop)"
        )
    longest = max((len(s) for s in stop), default=0)
    if longest > limits.max_stop_chars:
        raise _exceeded(
            f"a stop string has {longest} characters; at most {limits.max_stop_chars} (--max-stop-chars)"
        )
    if isinstance(req, ChatCompletionRequest) and len(req.messages) > limits.max_messages:
        raise _exceeded(
            f"{len(req.messages)} messages; this server allows at most {limits.max_messages} (--max-messages)"
        )


def _exceeded(detail: str) -> ContractError:
    return ContractError(400, "limit_exceeded", detail)


class Overloaded(Exception):
    """Every slot is taken and the wait queue is full: answer 503 with Retry-After."""


class AdmissionGate:
    """At most `max_active` generation requests at once, at most `max_queued` more waiting (FIFO);
    a request beyond both is refused at once (Overloaded) rather than left to stall.

    One event loop only (asyncio.Semaphore). A waiter that is cancelled (client gone) leaves the queue.
    """

    def __init__(self, max_active: int, max_queued: int) -> None:
        self.max_active = max_active
        self.max_queued = max_queued
        self._slots = asyncio.Semaphore(max_active)
        self.active = 0
        self.queued = 0

    async def acquire(self) -> None:
        if self.active + self.queued >= self.max_active + self.max_queued:
            raise Overloaded(
                f"{self.active} generation requests running and {self.queued} waiting (the most this "
                "server takes: --max-concurrent-requests, --max-queued-requests); retry later"
            )
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        self.active += 1

    def release(self) -> None:
        self.active -= 1
        self._slots.release()


def error_body(error: str, detail: str | None) -> bytes:
    """The contract's error body, `{"error", "detail"}` (protocol.ErrorResponse), as bytes."""
    return json.dumps({"error": error, "detail": detail}).encode()


async def send_error(
    send: Send, status: int, error: str, detail: str, headers: list[tuple[bytes, bytes]] = ()
) -> None:
    body = error_body(error, detail)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyTooLarge(HTTPException):
    """Raised from the body stream once it passes the limit. An HTTPException, because FastAPI re-raises
    those from its body reading (and turns anything else into a 400); the app's handler answers 413."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(413, _too_large_detail(size, limit), {"connection": "close"})


class GuardMiddleware:
    """Pure ASGI (it wraps streamed responses whole, which FastAPI's @middleware cannot do reliably):

    1. a body over `limits.max_body_bytes` is 413 body_too_large: at once when Content-Length says so,
       else as soon as the streamed (chunked) body passes the limit;
    2. with an API key, every /v1/ route needs `Authorization: Bearer <key>` (401 unauthorized);
    3. generation routes pass the AdmissionGate (503 overloaded + Retry-After when it is full) and hold
       their slot until the response, streamed or not, is completely sent.
    """

    def __init__(self, app: ASGIApp, limits: Limits, gate: AdmissionGate, api_key: str | None) -> None:
        self.app = app
        self.limits = limits
        self.gate = gate
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            # Answered without reading the body; the connection is closed rather than drained.
            await _too_large(send, declared, limit)
            return
        path = scope.get("path", "")
        if self.api_key is not None and path.startswith(API_KEY_PREFIX) and not _has_key(scope, self.api_key):
            await send_error(
                send, 401, "unauthorized", "send 'Authorization: Bearer <key>' (the server's --api-key)"
            )
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(received, limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        admitted = False
        try:
            if path in GENERATION_PATHS and scope.get("method") == "POST":
                try:
                    await self.gate.acquire()
                except Overloaded as e:
                    retry = [(b"retry-after", str(RETRY_AFTER_S).encode())]
                    await send_error(send, 503, "overloaded", str(e), retry)
                    return
                admitted = True
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if started:
                raise
            await _too_large(send, received, limit)
        finally:
            if admitted:
                self.gate.release()


async def _too_large(send: Send, size: int, limit: int) -> None:
    await send_error(send, 413, "body_too_large", _too_large_detail(size, limit), [(b"connection", b"close")])


def _too_large_detail(size: int, limit: int) -> str:
    return f"the request body has {size} bytes or more; this server takes at most {limit} (--max-body-bytes)"


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP layer refuses it; the streamed count still applies
    return None


def _has_key(scope: Scope, key: str) -> bool:
    header = b""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            header = value
            break
    return hmac.compare_digest(header, f"Bearer {key}".encode())
