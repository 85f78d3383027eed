"""Receiving a weight push in the shim's own process: the update hooks of engines that hold their weights
as torch tensors right here (the capture backend, the torch engine), not in separate worker processes.

The server joins the trainer's weight group as one gloo peer and receives every bucket with the vLLM
worker's own code (vllm_worker.receive_update) in a daemon thread, while generation goes on; the staged
(name, tensor) pairs wait in `self._staged` until the update is applied (or discarded).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import torch

from inference_shim.backends.join import join_weight_group
from inference_shim.protocol import (
    GroupState,
    InitProcessGroupRequest,
    UpdateResult,
    WeightUpdateRequest,
    WorkerReceipt,
)


class StagedReceive:
    """Mixin for a Backend: _join_group, _leave_group, _arm_receive, _wait_received and _discard."""

    _weight_group = None  # inference_shim.transfer.WeightGroup once joined
    _receiving: asyncio.Future | None = None
    _staged: list[tuple[str, torch.Tensor]] | None = None

    async def _join_group(self, req: InitProcessGroupRequest, timeout_s: float) -> list[int]:
        group = await asyncio.to_thread(
            join_weight_group,
            self.store,
            rank=req.rank_offset,
            world_size=req.world_size,
            backend=req.backend,
            group_name=req.group_name,
            timeout_s=timeout_s,
        )
        group.timeout_s = req.timeout_s  # per collective from now on
        self._weight_group = group
        return [req.rank_offset]

    async def _leave_group(self, group: GroupState) -> None:
        self._weight_group = None

    async def _arm_receive(self, req: WeightUpdateRequest) -> None:
        from inference_shim.vllm_worker import receive_update

        group = self._weight_group
        args = (group, req.version, req.update_id, req.tensors, req.bucket_bytes, req.timeout_s)
        self._staged = None
        self._receiving = _in_daemon_thread(
            lambda: receive_update(
                *args, token=self.token, fanout=req.fanout, chunk_bytes=req.fanout_chunk_bytes
            )
        )

    async def _wait_received(self, req: WeightUpdateRequest, result: UpdateResult) -> None:
        receipt: WorkerReceipt
        receipt, self._staged = await self._receiving
        if not receipt.ok:
            raise RuntimeError(f"receiving failed: {receipt.error}")
        result.receive_seconds, result.total_bytes = receipt.receive_seconds, receipt.bytes

    async def _discard(self) -> None:
        self._staged = None


def _in_daemon_thread(fn) -> asyncio.Future:
    """fn() in a daemon thread (never raising): a receive blocked on a trainer that went away must
    not hold up the shim's exit, as a thread of asyncio's default executor would."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        result = fn()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

    threading.Thread(target=run, name="staged-receive", daemon=True).start()
    return future
