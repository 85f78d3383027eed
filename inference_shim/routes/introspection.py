"""Curl-friendly introspection routes: /health (503 unless ok), /capabilities, /debug/state (on loopback
open but the weight group's store address only for the token holder; off loopback the token holder's
only) and Prometheus /metrics (open everywhere: what a scraper expects; it holds counts, no prompts)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from inference_shim.backends.base import Backend
from inference_shim.backends.common import ContractError
from inference_shim.metrics import ShimMetrics
from inference_shim.routes.auth import token_check


def introspection_router(
    backend: Backend, metrics: ShimMetrics, token: str | None, exposed: bool = False
) -> APIRouter:
    router = APIRouter()
    require_token = token_check(token)

    @router.get("/health")
    async def health():
        h = backend.health_now()
        return JSONResponse(status_code=200 if h.status == "ok" else 503, content=h.model_dump())

    @router.get("/capabilities")
    async def capabilities():
        return backend.capabilities().model_dump()

    @router.get("/debug/state")
    async def debug_state(request: Request):
        if exposed:  # in-flight requests, the update's timings and the group: not for the whole network
            require_token(request)
        state = backend.debug_state()
        try:
            require_token(request)
        except ContractError:
            # Introspection stays open, but where the trainer's store listens is for the token holder:
            # whoever reaches the store can tamper with its keys (unsigned rendezvous, forged values).
            if state.group is not None:
                state.group = state.group.redacted()
        return state.model_dump()

    @router.get("/metrics")
    async def prometheus():
        return Response(content=metrics.render(), media_type="text/plain; version=0.0.4")

    return router
