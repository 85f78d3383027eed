"""Capture backend: receives a trainer's weight pushes like a server does, without an engine.

    python -m inference_shim --backend capture --model artifacts/tiny-arith --port 8100 [--capture-dir DIR]
    # then point a trainer at it: inference.urls=[http://127.0.0.1:8100]

It joins the trainer's weight group as one real gloo peer and receives in the shim's process
(staged_receive.StagedReceive, the vLLM worker's own receive code), checks every update like every backend (base.validate_update: names,
shapes, dtypes, version, restore) and keeps the tensors of the last applied update (`received`) and the
history of versions (`history`). With --capture-dir they are also written out after every update:
DIR/weights.safetensors (replaced atomically) and one line per update in DIR/history.jsonl.
Uses: running a trainer without an inference engine (dry runs) and tests that compare what a trainer
pushed with what it holds. It cannot generate (501), so actors must never be pointed at it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from pydantic import BaseModel, Field

from inference_shim.backends.base import Backend
from inference_shim.backends.common import ChoiceDelta, ContractError, SamplingRequest, served_name
from inference_shim.backends.staged_receive import StagedReceive
from inference_shim.metrics import ShimMetrics
from inference_shim.protocol import UpdateResult, WeightUpdateRequest


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
    lora_max_rank: int | None = Field(
        default=None, ge=1, description="Take LoRA adapter updates of at most this rank (and only those)."
    )


class CaptureBackend(StagedReceive, Backend):
    # What /capabilities reports (base.Backend.capabilities builds it). No engine: it labels no tokens
    # and has nothing to pause; it receives in the background like the torch engine (StagedReceive).
    name = "capture"
    transports = ("gloo",)
    pause_modes = ()
    per_token_versions = False
    staged_receive = True
    fanouts = ("broadcast", "chain")
    adapters_in_memory = True  # it keeps what it receives, adapter or not

    def __init__(self, options: CaptureOptions, metrics: ShimMetrics) -> None:
        super().__init__(metrics)
        self.options = options
        self.lora_max_rank = options.lora_max_rank
        self.engine_version = "none"
        self.received: dict[str, torch.Tensor] = {}  # the last applied update, by checkpoint name
        self.history: list[dict] = []  # one entry per applied update: version, restore, time

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
    # Joining, receiving and discarding: StagedReceive.
    async def _apply(self, req: WeightUpdateRequest, result: UpdateResult) -> None:
        start = time.perf_counter()
        received = {name: tensor.clone() for name, tensor in self._staged}
        entry = {"version": req.version, "restore": req.restore, "time": time.time()}
        if req.adapter is not None:
            entry["adapter"] = req.adapter.model_dump()
        if self.options.capture_dir:
            await asyncio.to_thread(_write_capture, Path(self.options.capture_dir), received, entry)
        self.received, self._staged = received, None
        self.history.append(entry)
        result.apply_seconds = time.perf_counter() - start

    def _partially_applied(self, applying: bool) -> bool:
        return False  # applying swaps one dict: all or nothing


def _cannot_generate() -> ContractError:
    return ContractError(501, "not_supported", "the capture backend receives weights; it cannot generate")


def _write_capture(directory: Path, tensors: dict[str, torch.Tensor], entry: dict) -> None:
    from safetensors.torch import save_file

    tmp = directory / "weights.safetensors.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, directory / "weights.safetensors")  # readers never see half a file
    with open(directory / "history.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
