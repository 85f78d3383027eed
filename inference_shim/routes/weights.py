"""Weight-transfer routes (the control plane; docs/contract.md): join the trainer's weight group, accept
an update, leave the group. Each needs the server's --token; the lifecycle itself is the backend's
(inference_shim/backends/base.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from inference_shim.backends.base import Backend
from inference_shim.protocol import InitProcessGroupRequest, WeightUpdateRequest
from inference_shim.routes.auth import token_check


def weights_router(backend: Backend, token: str | None) -> APIRouter:
    router = APIRouter()
    require_token = token_check(token)

    @router.post("/init_process_group", dependencies=[Depends(require_token)])
    async def init_process_group(req: InitProcessGroupRequest):
        return (await backend.init_process_group(req)).model_dump()

    @router.post("/request_weight_update", dependencies=[Depends(require_token)])
    async def request_weight_update(req: WeightUpdateRequest):
        return (await backend.request_weight_update(req)).model_dump()

    @router.post("/destroy_process_group", dependencies=[Depends(require_token)])
    async def destroy_process_group():
        await backend.destroy_process_group()
        return {"status": "destroyed"}

    return router
