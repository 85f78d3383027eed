"""The interface every engine backend implements, and the checks all of them share.

The FastAPI app (inference_shim/server.py) only talks to a Backend; one file per engine implements it
(vllm_backend.py, sglang_backend.py). Everything here is engine-free.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from inference_shim.protocol import (
    Capabilities,
    DebugState,
    HealthResponse,
    InitProcessGroupRequest,
    InitProcessGroupResponse,
    VersionSpan,
    WeightUpdateAccepted,
    WeightUpdateRequest,
)


class ContractError(Exception):
    """An error the client caused or must act on; the app turns it into `status` + ErrorResponse."""

    def __init__(self, status: int, error: str, detail: str | None = None) -> None:
        super().__init__(error if detail is None else f"{error}: {detail}")
        self.status = status
        self.error = error
        self.detail = detail


@dataclass
class SamplingRequest:
    """Engine-neutral generation parameters, built from an OpenAI request by the app."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    n: int
    seed: int | None
    stop: list[str]
    top_logprobs: int  # 0 = only the sampled token's logprob (always returned)
    ignore_eos: bool = False


@dataclass
class ChoiceDelta:
    """New tokens of one choice (streaming) or the whole choice (non-streaming)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    version_spans: list[VersionSpan] | None = None  # set on the final piece of a choice
    token_strings: list[str] = field(default_factory=list)


class Backend(abc.ABC):
    name: str

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...

    @abc.abstractmethod
    def health(self) -> HealthResponse: ...

    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abc.abstractmethod
    def debug_state(self) -> DebugState: ...

    @abc.abstractmethod
    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]: ...

    @abc.abstractmethod
    def text_prompt_ids(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def generate(
        self, prompt_ids: list[int], params: SamplingRequest, stream: bool
    ) -> AsyncIterator[list[ChoiceDelta]]:
        """Yields lists of deltas while streaming; a single list of complete choices otherwise."""

    @abc.abstractmethod
    async def init_process_group(self, req: InitProcessGroupRequest) -> InitProcessGroupResponse: ...

    @abc.abstractmethod
    async def request_weight_update(self, req: WeightUpdateRequest) -> WeightUpdateAccepted: ...

    @abc.abstractmethod
    async def destroy_process_group(self) -> None: ...

    def prometheus_extra(self) -> dict[str, float]:
        """Backend-specific gauges for /metrics."""
        return {}


def validate_update(
    req: WeightUpdateRequest,
    table: dict[str, tuple[str, list[int]]],
    current_version: int,
    pending_version: int | None,
    group_joined: bool,
) -> None:
    """All checks that must pass BEFORE any collective starts; raises ContractError (4xx) otherwise."""
    if not group_joined:
        raise ContractError(
            409, "no_process_group", "call POST /init_process_group before requesting an update"
        )
    if pending_version is not None:
        raise ContractError(
            409, "update_in_progress", f"version {pending_version} is still being received or applied"
        )
    if req.version <= current_version and not req.restore:
        raise ContractError(
            409,
            "stale_version",
            f"version {req.version} is not newer than the served version {current_version}",
        )
    seen: set[str] = set()
    problems: list[str] = []
    for meta in req.tensors:
        if meta.name in seen:
            problems.append(f"{meta.name}: sent twice")
        seen.add(meta.name)
        expected = table.get(meta.name)
        if expected is None:
            problems.append(f"{meta.name}: unknown tensor name")
            continue
        dtype, shape = expected
        if list(meta.shape) != list(shape):
            problems.append(f"{meta.name}: shape {meta.shape} != expected {shape}")
        if meta.dtype != dtype:
            problems.append(f"{meta.name}: dtype {meta.dtype} != expected {dtype}")
    missing = sorted(set(table) - seen)
    if missing:
        problems.append(
            f"missing {len(missing)} tensor(s), e.g. {missing[:3]}: an update must carry every weight"
        )
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise ContractError(422, "invalid_tensors", shown)
