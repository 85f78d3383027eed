"""Capture backend: receives a trainer's weight pushes like a server does, without an engine.

    python -m inference_shim --backend capture --model artifacts/tiny-arith --port 8100 [--capture-dir DIR]
    # then point a trainer at it: inference.urls=[http://127.0.0.1:8100]

It joins the trainer's weight group as one real gloo peer and receives with the vLLM worker's own code
(vllm_worker.receive_update), checks every update like every backend (base.validate_update: names,
shapes, dtypes, version, restore) and keeps the tensors of the last applied update (`received`) and the
history of versions (`history`). With --capture-dir they are also written out after every update:
DIR/weights.safetensors (replaced atomically) and one line per update in DIR/history.jsonl.
Uses: running a trainer without an inference engine (dry runs) and tests that compare what a trainer
pushed with what it holds. It cannot generate (501), so actors must never be pointed at it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from pydantic import BaseModel, Field

from inference_shim.backends.base import Backend
from inference_shim.backends.common import ChoiceDelta, ContractError, SamplingRequest, served_name
from inference_shim.backends.join import join_weight_group
from inference_shim.metrics import ShimMetrics
from inference_shim.protocol import (
    CONTRACT_VERSION,
    Capabilities,
    GroupState,
    HealthResponse,
    InitProcessGroupRequest,
    UpdateResult,
    WeightUpdateRequest,
    WorkerReceipt,
)


class CaptureOptions(BaseModel):
    """Settings of the capture backend (CLI flags of `python -m inference_shim --backend capture`)."""

    model: str = Field(description="Hugging Face model directory: the tensor names and shapes to accept.")
    served_model_name: str | None = Field(
        default=None, description="Name in /capabilities; default: the directory name."
    )
    capture_dir: str | None = Field(
        default=None,
        description="Write each applied update to DIR/weights.safetensors and DIR/history.jsonl.",
    )


class CaptureBackend(Backend):
    name = "capture"

    def __init__(self, options: CaptureOptions, metrics: ShimMetrics) -> None:
        super().__init__(metrics)
        self.options = options
        self.received: dict[str, torch.Tensor] = {}  # the last applied update, by checkpoint name
        self.history: list[dict] = []  # one entry per applied update: version, restore, time
        self._weight_group = None  # inference_shim.transfer.WeightGroup once joined
        self._receiving: asyncio.Future | None = None
        self._staged: list[tuple[str, torch.Tensor]] | None = None

    @property
    def model_name(self) -> str:
        return served_name(self.options.model, self.options.served_model_name)

    async def start(self) -> None:
        from inference_shim.checkpoint_table import checkpoint_tensor_table

        self.table = checkpoint_tensor_table(self.options.model)
        if self.options.capture_dir:
            Path(self.options.capture_dir).mkdir(parents=True, exist_ok=True)

    async def _stop_engine(self) -> None:
        self._weight_group = None

    def health(self) -> HealthResponse:
        if self.unhealthy:
            return HealthResponse(status="unhealthy", weight_version=self.version, detail=self.unhealthy)
        return HealthResponse(status="ok", weight_version=self.version)

    def capabilities(self) -> Capabilities:
        return Capabilities(
            contract_version=CONTRACT_VERSION,
            backend=self.name,
            engine_version="none",
            model=self.model_name,
            workers=1,
            transports=["gloo"],
            pause_modes=[],
            dtypes=sorted({dtype for dtype, _ in self.table.values()}),
            per_token_versions=False,
            staged_receive=True,
            fanouts=["broadcast", "chain"],
            max_model_len=0,
        )

    # ------------------------------------------------------------------ generation: none
    async def generate(
        self, prompt_ids: list[int], params: SamplingRequest, stream: bool
    ) -> AsyncIterator[list[ChoiceDelta]]:
        raise _cannot_generate()
        yield  # unreachable; makes this an async generator like every backend's generate

    def chat_prompt_ids(
        self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None
    ) -> list[int]:
        raise _cannot_generate()

    def text_prompt_ids(self, text: str) -> list[int]:
        raise _cannot_generate()

    # ------------------------------------------------------------------ update hooks (base.Backend)
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

    async def _apply(self, req: WeightUpdateRequest, result: UpdateResult) -> None:
        start = time.perf_counter()
        received = {name: tensor.clone() for name, tensor in self._staged}
        entry = {"version": req.version, "restore": req.restore, "time": time.time()}
        if self.options.capture_dir:
            await asyncio.to_thread(_write_capture, Path(self.options.capture_dir), received, entry)
        self.received, self._staged = received, None
        self.history.append(entry)
        result.apply_seconds = time.perf_counter() - start

    async def _discard(self) -> None:
        self._staged = None

    def _partially_applied(self, applying: bool) -> bool:
        return False  # applying swaps one dict: all or nothing


def _cannot_generate() -> ContractError:
    return ContractError(501, "not_supported", "the capture backend receives weights; it cannot generate")


def _in_daemon_thread(fn) -> asyncio.Future:
    """fn() in a daemon thread (never raising): a receive blocked on a trainer that went away must
    not hold up the shim's exit, as a thread of asyncio's default executor would."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        result = fn()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

    threading.Thread(target=run, name="capture-receive", daemon=True).start()
    return future


def _write_capture(directory: Path, tensors: dict[str, torch.Tensor], entry: dict) -> None:
    from safetensors.torch import save_file

    tmp = directory / "weights.safetensors.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, directory / "weights.safetensors")  # readers never see half a file
    with open(directory / "history.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
