"""Thin, stateless clients of one inference server: every call has a timeout and raises on HTTP errors.

    client = ShimClient("http://127.0.0.1:8000", token="...")   # api_key: default $PIPELINE_RL_API_KEY
    client.health(); client.request_weight_update(WeightUpdateRequest(...))

`ShimClient` (sync, httpx) serves the trainer and tools; `AsyncShimClient` serves the actor's event loop.
Both speak only the wire models of inference_shim.protocol: generation calls return the typed responses
(a body that breaks the contract raises pydantic's ValidationError, a ValueError), and
`AsyncShimClient.chat_stream` yields typed chunks. The generation calls also work against any
OpenAI-compatible server (the extensions are then None).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from inference_shim.openai_protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    StreamError,
)
from inference_shim.protocol import (
    Capabilities,
    DebugState,
    HealthResponse,
    InitProcessGroupRequest,
    InitProcessGroupResponse,
    WeightUpdateAccepted,
    WeightUpdateRequest,
)


class ShimError(RuntimeError):
    """A server answered with an error status; `status` and `error` come from its ErrorResponse,
    `retry_after` (seconds) from its Retry-After header (503 overloaded, draining, drain_timeout), None
    without one."""

    def __init__(
        self, url: str, status: int, error: str, detail: str | None, retry_after: float | None = None
    ) -> None:
        super().__init__(f"{url} answered {status} {error}: {detail}")
        self.url = url
        self.status = status
        self.error = error
        self.detail = detail
        self.retry_after = retry_after


def _retry_after(response: httpx.Response) -> float | None:
    """The Retry-After header in seconds; None when absent or an HTTP date (no server of ours sends one)."""
    try:
        return max(0.0, float(response.headers["retry-after"]))
    except (KeyError, ValueError):
        return None


def _raise_for(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            body = response.json()
            error, detail = body.get("error", "error"), body.get("detail")
        except ValueError:
            error, detail = "error", response.text[:500]
        raise ShimError(str(response.url), response.status_code, str(error), detail, _retry_after(response))
    return response.json()


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _api_key(api_key: str | None) -> str | None:
    # The server's --api-key defaults to $PIPELINE_RL_API_KEY; so does the key its clients send.
    return api_key if api_key is not None else (os.environ.get("PIPELINE_RL_API_KEY") or None)


class ShimClient:
    def __init__(
        self, base_url: str, token: str | None = None, timeout_s: float = 30.0, api_key: str | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, headers=_headers(token), timeout=timeout_s)
        # Generation (/v1/) routes take the API key where control routes take the token.
        self._v1 = _headers(_api_key(api_key))

    def close(self) -> None:
        self._http.close()

    def _get(self, path: str) -> Any:
        return _raise_for(self._http.get(path))

    def _post(self, path: str, body: dict | None, timeout_s: float | None = None) -> Any:
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
        headers = self._v1 if path.startswith("/v1/") else None
        return _raise_for(self._http.post(path, json=body or {}, timeout=timeout, headers=headers))

    def health(self) -> HealthResponse:
        response = self._http.get("/health")
        if response.status_code not in (200, 503):
            _raise_for(response)
        return HealthResponse.model_validate(response.json())

    def capabilities(self) -> Capabilities:
        return Capabilities.model_validate(self._get("/capabilities"))

    def debug_state(self) -> DebugState:
        return DebugState.model_validate(self._get("/debug/state"))

    def init_process_group(self, req: InitProcessGroupRequest) -> InitProcessGroupResponse:
        # The server answers once it joined (or failed) within req.timeout_s: wait a little longer.
        return InitProcessGroupResponse.model_validate(
            self._post("/init_process_group", req.model_dump(), req.timeout_s + 15)
        )

    def request_weight_update(self, req: WeightUpdateRequest) -> WeightUpdateAccepted:
        return WeightUpdateAccepted.model_validate(self._post("/request_weight_update", req.model_dump()))

    def destroy_process_group(self) -> None:
        self._post("/destroy_process_group", None)

    def chat(self, messages: list[dict], **params: Any) -> ChatCompletionResponse:
        """POST /v1/chat/completions (not streamed); `params` are ChatCompletionRequest fields."""
        body = {"messages": messages, **params}
        return ChatCompletionResponse.model_validate(self._post("/v1/chat/completions", body))

    def completion(self, prompt: str | list[int], **params: Any) -> CompletionResponse:
        """POST /v1/completions (not streamed); `params` are CompletionRequest fields."""
        body = {"prompt": prompt, **params}
        return CompletionResponse.model_validate(self._post("/v1/completions", body))


class AsyncShimClient:
    def __init__(
        self, base_url: str, token: str | None = None, timeout_s: float = 300.0, api_key: str | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._v1 = _headers(_api_key(api_key))  # sent on the generation (/v1/) routes
        # Expire idle connections well before uvicorn does (5 s): reusing a connection the server is
        # closing at that moment fails with a ReadError that no server log explains.
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512, keepalive_expiry=2.0)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=_headers(token), timeout=timeout_s, limits=limits
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def health(self) -> HealthResponse:
        response = await self._http.get("/health", timeout=5.0)
        if response.status_code not in (200, 503):
            _raise_for(response)
        return HealthResponse.model_validate(response.json())

    async def debug_state(self) -> DebugState:
        return DebugState.model_validate(_raise_for(await self._http.get("/debug/state", timeout=5.0)))

    async def models(self) -> list[str]:
        """Ids of the served models (GET /v1/models)."""
        response = await self._http.get("/v1/models", timeout=30.0, headers=self._v1)
        return [m["id"] for m in _raise_for(response)["data"]]

    async def chat(self, messages: list[dict], **params: Any) -> ChatCompletionResponse:
        """POST /v1/chat/completions (not streamed); `params` are ChatCompletionRequest fields."""
        body = {"messages": messages, **params}
        return ChatCompletionResponse.model_validate(
            _raise_for(await self._http.post("/v1/chat/completions", json=body, headers=self._v1))
        )

    async def completion(self, prompt: str | list[int], **params: Any) -> CompletionResponse:
        """POST /v1/completions (not streamed); `params` are CompletionRequest fields."""
        body = {"prompt": prompt, **params}
        return CompletionResponse.model_validate(
            _raise_for(await self._http.post("/v1/completions", json=body, headers=self._v1))
        )

    async def chat_stream(self, messages: list[dict], **params: Any) -> AsyncIterator[ChatCompletionChunk]:
        """POST /v1/chat/completions with stream=true: one chunk per SSE event, as it arrives.

        A failure after the 200 status line (the server's in-band `{"error": ...}`) raises ShimError with
        status 500: the server failed mid-request, which another server may not."""
        body = {"messages": messages, **params, "stream": True}
        async with self._http.stream("POST", "/v1/chat/completions", json=body, headers=self._v1) as response:
            if response.status_code >= 400:
                await response.aread()
                _raise_for(response)
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    err = StreamError.model_validate(event["error"])
                    raise ShimError(str(response.url), 500, err.type, err.message)
                yield ChatCompletionChunk.model_validate(event)


LIVENESS_S = 3.0


def answers_http(url: str, timeout_s: float = LIVENESS_S) -> bool:
    """Whether a server answers GET /health at all (any status) within timeout_s: a killed, stopped or
    cut-off server does not; one that is busy, starting or unhealthy does."""
    try:
        httpx.get(f"{url}/health", timeout=timeout_s)
        return True
    except httpx.HTTPError:
        return False


def leave_weight_group(client: ShimClient, deadline: float, poll_s: float = 0.5) -> bool:
    """Ask a server to leave its weight group; False if it was in none.

    A server still finishing an update of the old group answers 409 update_in_progress until that update
    fails on its own deadline: retry until the monotonic `deadline`, then raise the ShimError.
    """
    while True:
        try:
            client.destroy_process_group()
            return True
        except ShimError as e:
            if e.error == "no_process_group":
                return False
            if e.error != "update_in_progress" or time.monotonic() > deadline:
                raise
        time.sleep(poll_s)


def served_version(urls: list[str], timeout_s: float = 10.0, token: str | None = None) -> int:
    """The newest weight version any of these servers serves (each one's /debug/state; off loopback it
    needs the token)."""
    versions = []
    for url in urls:
        client = ShimClient(url, token=token, timeout_s=timeout_s)
        try:
            versions.append(client.debug_state().weight_version)
        finally:
            client.close()
    return max(versions)
