"""The interface every engine backend implements, and the checks all of them share.

The FastAPI app (inference_shim/server.py) only talks to a Backend; one file per engine implements it
(vllm_backend.py, sglang_backend.py). Everything here is engine-free.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from inference_shim.protocol import (
    Capabilities,
    DebugState,
    HealthResponse,
    InitProcessGroupRequest,
    InitProcessGroupResponse,
    UpdateResult,
    UpdateTimings,
    VersionSpan,
    WeightUpdateAccepted,
    WeightUpdateRequest,
)

log = logging.getLogger("inference_shim")


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

    # Shared by every backend: each keeps these attributes up to date.
    tokenizer: Any
    version: int
    group: dict | None
    pending: int | None
    last_update: UpdateTimings | None
    last_error: str | None
    in_flight: int
    paused: bool
    updates_applied: int
    unhealthy: str | None
    metrics: Any  # inference_shim.metrics.ShimMetrics

    def debug_state(self) -> DebugState:
        return DebugState(
            weight_version=self.version,
            group=self.group,
            pending_update=self.pending,
            last_update=self.last_update,
            last_error=self.last_error,
            in_flight_requests=self.in_flight,
            paused=self.paused,
            updates_applied=self.updates_applied,
        )

    def _publish_update(self, result: UpdateResult) -> None:
        """An update was applied: serve its version and record its timings (both backends)."""
        result.ok = True
        self.version = result.version
        self.updates_applied += 1
        self.last_update = UpdateTimings(
            version=result.version,
            total_bytes=result.total_bytes,
            receive_seconds=result.receive_seconds,
            apply_seconds=result.apply_seconds,
            pause_seconds=result.pause_seconds,
        )
        self.metrics.record_update(result)

    def _record_failed_update(
        self, result: UpdateResult, error: BaseException, partially_applied: bool
    ) -> None:
        """An update failed: report it; if some tensors may be loaded, never serve the mix silently."""
        lines = str(error).strip().splitlines()
        result.error = f"{type(error).__name__}: {(lines[0] if lines else '')[:400]}"
        self.last_error = f"update to version {result.version} failed: {result.error}"
        log.error(self.last_error)
        self.metrics.updates.labels(result="error").inc()
        if partially_applied:
            self.unhealthy = f"weights may be partially applied (version {result.version}): {result.error}; restart the server"

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """The model's own chat template, rendered straight to token ids (never re-tokenized later)."""
        return list(
            self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
            )
        )

    def text_prompt_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

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


def prompt_room(prompt_ids: list[int], max_model_len: int) -> int:
    """Tokens left for the completion; a prompt that alone fills the context is the client's error."""
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise ContractError(
            400, "prompt_too_long", f"prompt has {len(prompt_ids)} tokens; max_model_len is {max_model_len}"
        )
    return room


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
