"""A hand-written stand-in for an engine backend, for unit tests of what lies around the engine: the
app's limits and error bodies (test_limits.py) and the update template's deadlines and recovery
(test_update_deadlines.py).

Why a fake: these tests inject faults no healthy real engine shows on demand (a pause that never
returns, an apply that fails half-way, a generation that holds its slot until the test lets go), and
they run in a second without starting vLLM. tests/integration covers the same routes on a real engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from inference_shim.backends.base import Backend
from inference_shim.backends.common import ChoiceDelta, SamplingRequest
from inference_shim.metrics import ShimMetrics
from inference_shim.protocol import (
    Capabilities,
    GroupState,
    HealthResponse,
    InitProcessGroupRequest,
    UpdateResult,
    WeightUpdateRequest,
)

VOCAB = 100
PAUSE_BETWEEN_STEPS_S = 0.002  # what the fake engine reports as its time without a step for an update


class FakeBackend(Backend):
    """Generates one token per request (id = prompt length); each hook can be told to hang or fail."""

    name = "fake"

    def __init__(self) -> None:
        super().__init__(ShimMetrics())
        self.vocab_size = VOCAB
        self.table = {"w": ("float32", [2])}
        self.hang: set[str] = set()  # hook names that never return
        self.fail: set[str] = set()  # hook names that raise
        self.calls: list[str] = []
        self.release = asyncio.Event()  # set by a test: generation waits on it when `hold` is true
        self.hold = False

    async def _hook(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise RuntimeError(f"{name} failed (injected)")
        if name in self.hang:
            await asyncio.Event().wait()

    async def start(self) -> None:
        return None

    async def _stop_engine(self) -> None:
        return None

    def health(self) -> HealthResponse:
        if self.unhealthy:
            return HealthResponse(status="unhealthy", weight_version=self.version, detail=self.unhealthy)
        return HealthResponse(status="ok", weight_version=self.version)

    def capabilities(self) -> Capabilities:
        return Capabilities(
            backend=self.name,
            engine_version="0",
            model="fake",
            workers=1,
            transports=["gloo"],
            pause_modes=["keep"],
            dtypes=["float32"],
            per_token_versions=True,
            staged_receive=True,
            max_model_len=64,
        )

    def chat_prompt_ids(
        self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None
    ) -> list[int]:
        return [1] * (1 + sum(len(m["content"]) for m in messages))

    def text_prompt_ids(self, text: str) -> list[int]:
        return [1] * max(1, len(text))

    def token_text(self, token_id: int) -> str:
        return "x"

    async def generate(
        self, prompt_ids: list[int], params: SamplingRequest, stream: bool
    ) -> AsyncIterator[list[ChoiceDelta]]:
        self.in_flight += 1
        try:
            if self.hold:
                await self.release.wait()
            yield [
                ChoiceDelta(
                    index=i,
                    text="x",
                    token_ids=[len(prompt_ids) % VOCAB],
                    logprobs=[-1.0],
                    finish_reason="length",
                )
                for i in range(params.n)
            ]
        finally:
            self.in_flight -= 1

    async def _join_group(self, req: InitProcessGroupRequest, timeout_s: float) -> list[int]:
        return [req.rank_offset]

    async def _leave_group(self, group: GroupState) -> None:
        return None

    async def _wait_received(self, req: WeightUpdateRequest, result: UpdateResult) -> None:
        await self._hook("wait_received")

    async def _pause(self) -> None:
        await self._hook("pause")

    async def _apply(self, req: WeightUpdateRequest, result: UpdateResult) -> None:
        await self._hook("apply")

    async def _apply_between_steps(self, req: WeightUpdateRequest, result: UpdateResult) -> None:
        await self._hook("apply_between_steps")
        result.pause_seconds = PAUSE_BETWEEN_STEPS_S

    async def _set_version_label(self, version: int) -> None:
        await self._hook("set_version_label")

    async def _reset_cache(self) -> None:
        await self._hook("reset_cache")

    async def _resume(self) -> None:
        await self._hook("resume")

    async def _discard(self) -> None:
        await self._hook("discard")

    async def _abort_in_flight(self) -> None:
        await self._hook("abort_in_flight")
