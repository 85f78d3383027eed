"""HTTP client of SGLang's native routes (API of SGLang 0.5.23, read from its http_server.py / io_struct.py).

Used only by the SGLang backend, against the private engine it started (sglang_process.py). Every call
has a deadline and raises on an error answer: EngineError for control routes (HTTP >= 400 or
`success: false`), ContractError (what the shim's client gets) for /generate.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx

from inference_shim.backends.common import ContractError


class EngineError(RuntimeError):
    """SGLang answered a control call with an error (HTTP >= 400 or success: false)."""


class SglangClient:
    """Control and generation calls to one SGLang server at base_url, authenticated with its API key."""

    def __init__(
        self, base_url: str, api_key: str, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.http = httpx.AsyncClient(
            base_url=base_url,
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=httpx.Timeout(60.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
            transport=transport,
        )
        self.has_sessions = True  # /begin_weight_update exists (SGLang >= 0.5.23); probed on first use

    async def aclose(self) -> None:
        await self.http.aclose()

    async def control(self, path: str, body: dict, timeout_s: float) -> dict:
        response = await self.http.post(path, json=body, timeout=timeout_s)
        return _check(response, path)

    async def get_json(self, path: str) -> dict:
        return _check(await self.http.get(path, timeout=30.0), path)

    # ------------------------------------------------------------------ weight updates
    async def pause(self, mode: str) -> None:
        await self.control("/pause_generation", {"mode": mode}, timeout_s=60)

    async def resume(self) -> None:
        # torch_empty_cache=false: returning cached blocks to the driver would lengthen the pause.
        await self.control("/continue_generation", {"torch_empty_cache": False}, timeout_s=60)

    async def begin_session(self, timeout_s: float) -> None:
        if not self.has_sessions:
            return
        response = await self.http.post("/begin_weight_update", json={}, timeout=timeout_s)
        if response.status_code == 404:
            # SGLang before 0.5.23 has no weight-update sessions and updates without one.
            self.has_sessions = False
            return
        _check(response, "/begin_weight_update")

    async def end_session(self, timeout_s: float) -> None:
        if self.has_sessions:
            await self.control("/end_weight_update", {}, timeout_s=timeout_s)

    # ------------------------------------------------------------------ generation
    async def generate(self, body: dict, timeout_s: float) -> AsyncIterator[dict]:
        """POST /generate with stream=true; yields every chunk (cumulative: SGLang's default)."""
        async with self.http.stream(
            "POST", "/generate", json=body, timeout=httpx.Timeout(timeout_s)
        ) as response:
            if response.status_code >= 400:
                detail = (await response.aread()).decode(errors="replace")[:500]
                raise ContractError(400 if response.status_code < 500 else 502, "engine_rejected", detail)
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                out = json.loads(line[6:])
                if "error" in out:
                    raise ContractError(502, "engine_error", str(out["error"]))
                yield out


def _check(response: httpx.Response, path: str) -> dict:
    """SGLang's control routes answer {"success": bool, "message": str}; anything else than success raises."""
    try:
        body = response.json()
    except ValueError:
        body = {"message": response.text[:500]}
    if response.status_code >= 400 or (isinstance(body, dict) and body.get("success") is False):
        raise EngineError(f"SGLang {path} answered {response.status_code}: {str(body)[:500]}")
    return body if isinstance(body, dict) else {"value": body}
