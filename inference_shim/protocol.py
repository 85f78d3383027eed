"""Wire models of the inference contract, shared by the server (inference_shim) and every client.

Torch-free and vLLM-free on purpose: the actor, the trainer-side weight sender and outside tools import
this module without pulling an engine. docs/contract.md is the prose version of this file; keep them in
step and bump CONTRACT_VERSION on any incompatible change.

Weight-update ordering (who does what, in which order):
  1. trainer (rank 0) hosts a TCPStore and its half of the process group; in parallel it POSTs
     /init_process_group to every server, whose workers join as ranks rank_offset..rank_offset+n-1.
  2. per update, trainer POSTs /request_weight_update(version, update_id, tensors, bucket_bytes) to every server.
     Each server validates (names, shapes, dtypes, version) BEFORE any collective and answers 200 or 4xx.
     On 200 the server's workers wait in a background thread for the decision key in the store.
  3. trainer writes store key decision_key(update_id) = "go" if every server accepted, else "abort"
     (every store value is signed with the server's token: sign_value / verify_value).
     On "go" it broadcasts the buckets planned by plan_buckets(); servers receive into staging buffers
     while they keep generating.
  4. each server applies the staged tensors (a short pause; with update_mode drain, first it waits for its
     turn among the group's servers, drain_ticket_key / drain_done_key, and lets its requests in flight
     end on the old weights), resets its prefix cache, publishes the new version, and writes result_key(update_id, server_id) = UpdateResult JSON. The trainer waits for every
     result key (deadline) and raises naming any server that failed or stayed silent.
"""

from __future__ import annotations

import hashlib
import hmac
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# docs/contract.md, "Changes", says what each version changed. 2.0: store values are signed (a 1.0
# trainer's unsigned ones read as an abort), so a weight update must say it signs them (store_signing).
# 2.1: adapter updates (WeightUpdateRequest.adapter) and /capabilities lora; a 2.0 peer sends and
# reads neither, so nothing it does changes. 2.2: drain-then-swap servers (/capabilities update_mode, the
# drain keys, 503 draining / drain_timeout); a 2.1 trainer pushes to them unchanged.
CONTRACT_VERSION = "2.2"
STORE_SIGNING = "hmac-sha256"

# Bytes per element of every dtype the weight transfer accepts (the torch dtype name without "torch.").
DTYPE_SIZES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}

# Every tensor inside a bucket starts at a multiple of this many bytes so that a typed view of the
# flat uint8 buffer is aligned for any dtype and for vectorized copies.
BUCKET_ALIGN_BYTES = 64

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


class _Strict(BaseModel):
    """Requests reject unknown fields: a typo in a client is a 422, not a silently ignored option."""

    model_config = ConfigDict(extra="forbid")


# ----------------------------------------------------------------------------------------------------
# Weight-transfer group
# ----------------------------------------------------------------------------------------------------
class InitProcessGroupRequest(_Strict):
    master_address: str = Field(description="Host of the trainer's TCPStore (rank 0).")
    master_port: int = Field(ge=1, le=65535, description="Port of the trainer's TCPStore.")
    rank_offset: int = Field(ge=1, description="Rank of this server's first worker; the trainer is rank 0.")
    world_size: int = Field(ge=2, description="Trainer + all workers of all servers in the group.")
    backend: Literal["gloo", "nccl"] = Field(description="gloo on CPU, nccl on GPU.")
    group_name: str = Field(
        default="weights", min_length=1, description="Namespace of the group's store keys."
    )
    server_id: str = Field(
        min_length=1, description="Name the trainer uses for this server in errors and keys."
    )
    timeout_s: float = Field(default=120.0, gt=0, le=3600, description="Deadline to join and per collective.")

    @model_validator(mode="after")
    def _rank_inside_world(self) -> InitProcessGroupRequest:
        # Caught here (422), not as a join that times out (504) because the rank can never join.
        if self.rank_offset >= self.world_size:
            raise ValueError(
                f"rank_offset {self.rank_offset} must be below world_size {self.world_size} "
                "(ranks are 0 .. world_size - 1; the trainer is rank 0)"
            )
        return self


class InitProcessGroupResponse(BaseModel):
    status: Literal["joined"] = "joined"
    ranks: list[int]
    join_seconds: float


class TensorMeta(_Strict):
    name: str = Field(
        min_length=1, description="Hugging Face checkpoint name, e.g. model.layers.0.mlp.up_proj.weight"
    )
    dtype: str = Field(description="One of DTYPE_SIZES, e.g. float32 or bfloat16.")
    shape: list[int]

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        value = value.removeprefix("torch.")
        if value not in DTYPE_SIZES:
            raise ValueError(f"dtype {value!r} is not supported; use one of {sorted(DTYPE_SIZES)}")
        return value

    @field_validator("shape")
    @classmethod
    def _non_negative(cls, value: list[int]) -> list[int]:
        if any(d < 0 for d in value):
            raise ValueError(f"shape {value} has a negative dimension")
        return value

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


class AdapterSpec(_Strict):
    """A LoRA adapter update: what its tensors are (docs/contract.md § Adapter updates)."""

    rank: int = Field(ge=1, le=512, description="r: lora_A is [r, in_features], lora_B [out_features, r].")
    alpha: float = Field(
        gt=0, description="The adapter adds (alpha / rank) * lora_B @ lora_A to each weight."
    )
    target_modules: list[str] = Field(
        min_length=1,
        description="Last names of the linear layers with an adapter (q_proj, ...); every such layer of "
        "the model gets one, so the update carries a lora_A and a lora_B for each.",
    )


def adapter_tensor_names(module: str) -> tuple[str, str]:
    """The names of one layer's adapter tensors on the wire: those peft writes in adapter_model.safetensors,
    e.g. module model.layers.0.self_attn.q_proj -> base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    prefix = f"{PEFT_PREFIX}{module}"
    return f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"


PEFT_PREFIX = "base_model.model."  # what peft puts before the base model's module names
# A LoRA server serves the base plus the newest adapter under its model name; `model` set to the name
# plus this suffix asks for the base model alone (vLLM only; docs/lora.md, Naming).
BASE_MODEL_SUFFIX = ":base"


class WeightUpdateRequest(_Strict):
    version: int = Field(
        ge=0,
        description="Weight version these tensors are (0 = the start-up weights); must exceed the server's "
        "current one unless `restore` is set (409 stale_version otherwise).",
    )
    update_id: str = Field(
        default_factory=lambda: uuid.uuid4().hex,
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="Unique per attempt: names this attempt's store keys, so a refused attempt's 'abort' "
        "can never be read by a later attempt at the same version.",
    )
    restore: bool = Field(
        default=False,
        description="The trainer restores a checkpoint after a crash: `version` may be <= the served one, "
        "and the server then serves exactly `version`.",
    )
    tensors: list[TensorMeta] = Field(min_length=1, description="In broadcast order.")
    bucket_bytes: int = Field(
        default=DEFAULT_BUCKET_BYTES, ge=1024, description="Bucket size used by plan_buckets()."
    )
    timeout_s: float = Field(
        default=120.0, gt=0, le=3600, description="Deadline for the decision, transfer and apply."
    )
    fanout: Literal["broadcast", "chain"] = Field(
        default="broadcast",
        description="How each bucket travels: one broadcast from rank 0, or a chain relay in rank order "
        "(each rank forwards chunks to the next; only if the server lists it in capabilities.fanouts).",
    )
    fanout_chunk_bytes: int = Field(
        default=1 << 20, ge=4096, le=64 << 20, description="Chunk size of a chain relay."
    )
    adapter: AdapterSpec | None = Field(
        default=None,
        description="Set: the tensors are a LoRA adapter, every lora_A/lora_B of adapter_tensor_names() "
        "for the layers the spec targets, applied to the served base model in memory (only where "
        "/capabilities lora is in_memory). None: the tensors are every weight of the model.",
    )
    store_signing: Literal["hmac-sha256"] = Field(
        default=STORE_SIGNING,
        description="How the trainer signs its store values (§ Store values). Since contract 2.0 a server "
        "with a token refuses an update whose body does not carry it (400 unsigned_store): a 1.0 trainer, "
        "which writes unsigned values, would otherwise hang in the broadcast.",
    )


class WeightUpdateAccepted(BaseModel):
    status: Literal["accepted"] = "accepted"
    version: int
    num_buckets: int
    total_bytes: int


class UpdateResult(BaseModel):
    """Written by a server to result_key() once an update is applied (ok) or has failed (error)."""

    server_id: str
    version: int
    ok: bool
    error: str | None = None
    receive_seconds: float = 0.0
    # Building the new weights beside the live model after the receive, while decoding goes on (vLLM on
    # CPU, inference_shim/vllm_shadow.py); 0 where the engine applies inside the pause instead.
    prepare_seconds: float = 0.0
    apply_seconds: float = 0.0
    pause_seconds: float = 0.0
    total_bytes: int = 0
    # update_mode drain (docs/engines.md, "Drain-then-swap"): how long the server waited for its turn
    # (admitting), then drained (admitting nothing), and how many requests the drain's bound ended.
    turn_wait_seconds: float = 0.0
    drain_seconds: float = 0.0
    cut_requests: int = 0


def decision_key(group_name: str, update_id: str) -> str:
    return f"{group_name}/update/{update_id}/decision"


def received_key(group_name: str, update_id: str, rank: int) -> str:
    return f"{group_name}/update/{update_id}/received/{rank}"


def result_key(group_name: str, update_id: str, server_id: str) -> str:
    return f"{group_name}/update/{update_id}/result/{server_id}"


def drain_ticket_key(group_name: str, update_id: str) -> str:
    """A counter (store.add, so an unsigned integer): drain-mode servers of one update take turns in the
    order of the tickets they draw from it."""
    return f"{group_name}/update/{update_id}/drain/tickets"


def drain_done_key(group_name: str, update_id: str, ticket: int) -> str:
    """Set (signed, payload: the server_id) by the server holding `ticket` once it has applied (or given
    up): the holder of the next ticket may drain."""
    return f"{group_name}/update/{update_id}/drain/done/{ticket}"


# Store values are authenticated (docs/contract.md § Store values): anyone who can reach the trainer's
# TCPStore can write any key, so a value counts only if it carries an HMAC made with the server's token
# (the Bearer token the trainer already holds). The MAC covers the key name, which holds the group and
# update_id (and rank / server_id), so a value cannot be replayed under another key or another update.
SIGNED_VALUE_PREFIX = "hmac-sha256:"


class UnauthenticatedValue(ValueError):
    """A store value whose HMAC is missing or wrong: the caller treats it as invalid (never as data)."""


def _value_mac(token: str, key: str, payload: str) -> str:
    # Length-prefixed key, so no (key, payload) pair can be re-split into another with the same MAC.
    key_bytes = key.encode()
    message = b"%d:%s%s" % (len(key_bytes), key_bytes, payload.encode())
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def sign_value(token: str | None, key: str, payload: str) -> str:
    """The store value for `payload` under `key`: signed with `token`, unsigned when there is none
    (a tokenless server is for a loopback-only, single-user setup)."""
    if token is None:
        return payload
    return f"{SIGNED_VALUE_PREFIX}{_value_mac(token, key, payload)}:{payload}"


def verify_value(token: str | None, key: str, value: bytes | str) -> str:
    """The payload of the store value read from `key`; raises UnauthenticatedValue unless it was signed
    with `token` for exactly this key. Without a token nothing can be checked: a signed value's MAC is
    stripped, an unsigned value is taken as it is."""
    # Bytes that are not UTF-8 can only be forged: decoded with replacements, they fail the MAC.
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    signed = text.startswith(SIGNED_VALUE_PREFIX)
    mac, _, payload = text.removeprefix(SIGNED_VALUE_PREFIX).partition(":") if signed else ("", "", text)
    if token is None:
        return payload
    if not signed:
        raise UnauthenticatedValue(f"store value of {key} is not authenticated: unsigned, but a token is set")
    if not hmac.compare_digest(mac.encode(), _value_mac(token, key, payload).encode()):
        raise UnauthenticatedValue(
            f"store value of {key} is not authenticated: its HMAC does not verify (forged, copied from "
            "another key, or made with another token)"
        )
    return payload


def verify_decision(token: str | None, key: str, value: bytes | str, version: int) -> str:
    """The trainer's decision read from decision_key(): "go", or anything else (an abort). Raises
    UnauthenticatedValue, saying the update is refused, when it was not signed with `token`."""
    try:
        return verify_value(token, key, value)
    except UnauthenticatedValue as e:
        raise UnauthenticatedValue(
            f"the trainer's decision for version {version} was not authenticated, so the update was "
            f"refused and the old weights kept ({e})"
        ) from None


class BucketSlot(BaseModel):
    """Where one tensor lives inside a flat uint8 bucket."""

    index: int  # position in WeightUpdateRequest.tensors
    offset: int
    nbytes: int


class Bucket(BaseModel):
    nbytes: int
    slots: list[BucketSlot]


def plan_buckets(tensors: list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Pack tensors, in order, into flat byte buckets of at most bucket_bytes each.

    Sender and receivers call this with the same arguments and so agree on the layout without sending
    it. A tensor larger than bucket_bytes gets a bucket of its own. Offsets are BUCKET_ALIGN_BYTES-aligned.
    """
    buckets: list[Bucket] = []
    current: list[BucketSlot] = []
    used = 0
    for index, meta in enumerate(tensors):
        offset = -(-used // BUCKET_ALIGN_BYTES) * BUCKET_ALIGN_BYTES
        if current and offset + meta.nbytes > bucket_bytes:
            buckets.append(Bucket(nbytes=used, slots=current))
            current, used, offset = [], 0, 0
        current.append(BucketSlot(index=index, offset=offset, nbytes=meta.nbytes))
        used = offset + meta.nbytes
    if current:
        buckets.append(Bucket(nbytes=used, slots=current))
    return buckets


# ----------------------------------------------------------------------------------------------------
# Health, capabilities, debug
# ----------------------------------------------------------------------------------------------------
class HealthResponse(BaseModel):
    status: Literal["ok", "starting", "unhealthy", "awaiting_weights"]
    weight_version: int
    detail: str | None = None


class Capabilities(BaseModel):
    contract_version: str = CONTRACT_VERSION
    backend: str
    engine_version: str
    model: str
    workers: int
    transports: list[str]
    pause_modes: list[str]
    dtypes: list[str]
    per_token_versions: bool
    staged_receive: bool = Field(description="Receives while generating; pauses only to apply.")
    max_model_len: int
    fanouts: list[str] = Field(
        default=["broadcast"], description="Bucket fan-outs this server's workers can take part in."
    )
    tool_call_parser: str | None = Field(
        default=None, description="Format of tool calls read from free text (tool_choice auto); None: none."
    )
    structured_output: bool = Field(
        default=False, description="response_format json_object/json_schema and forced tool calls."
    )
    lora: Literal["in_memory", "none"] = Field(
        default="none",
        description="in_memory: takes adapter updates (WeightUpdateRequest.adapter) and applies them in "
        "memory between two decode steps; the served model is the base plus the newest adapter. none: full "
        "weights only (a LoRA trainer then pushes the adapter merged into full weights).",
    )
    lora_max_rank: int | None = Field(default=None, description="Largest adapter rank this server takes.")
    update_mode: Literal["inflight", "drain"] = Field(
        default="inflight",
        description="inflight: an update lands between two decode steps and requests in flight go on with "
        "the new weights. drain: the server stops admitting (503 draining), lets the requests in flight "
        "end on the old weights, then applies; no response mixes two versions.",
    )
    drain_timeout_s: float | None = Field(
        default=None,
        description="update_mode drain: the longest it waits for its turn, and then for its requests in "
        "flight, before it ends those still running (503 drain_timeout); None in inflight mode.",
    )


class UpdateTimings(BaseModel):
    version: int
    total_bytes: int
    receive_seconds: float
    prepare_seconds: float = 0.0
    apply_seconds: float
    pause_seconds: float
    finished_at: float = Field(default_factory=time.time)
    # update_mode drain: when the server stopped admitting (wall clock; it admits again at finished_at),
    # and UpdateResult's drain figures. None / 0 in inflight mode.
    drain_started_at: float | None = None
    turn_wait_seconds: float = 0.0
    drain_seconds: float = 0.0
    cut_requests: int = 0


class GroupState(BaseModel):
    """The weight group a server joined (DebugState.group): its /init_process_group request and the ranks
    its workers took. master_address and master_port (where the trainer's store listens) are None in the
    view of a caller without the server's token (redacted())."""

    master_address: str | None
    master_port: int | None
    rank_offset: int
    world_size: int
    backend: str
    group_name: str
    server_id: str
    timeout_s: float
    ranks: list[int]

    def redacted(self) -> GroupState:
        """This group without the store's address: who may reach the store may write its keys."""
        return self.model_copy(update={"master_address": None, "master_port": None})


class WorkerReceipt(BaseModel):
    """A worker's received_key() value: it received every bucket of an update (ok) or failed (error).

    Written by the worker (inference_shim/vllm_worker.py) into the trainer's store; the server waits for
    one per worker before it pauses generation to apply."""

    ok: bool
    rank: int
    error: str | None = None
    traceback: str | None = None
    receive_seconds: float = 0.0
    prepare_seconds: float = 0.0  # the shadow's load + prepack after the receive (0: apply will reload)
    bytes: int = 0


class DebugState(BaseModel):
    weight_version: int
    group: GroupState | None
    pending_update: int | None
    last_update: UpdateTimings | None
    last_error: str | None
    in_flight_requests: int
    paused: bool
    updates_applied: int
    # The engine applies an update in one call between two of its decode steps, without pausing
    # (vLLM: inference_shim/vllm_engine_core.py); false: pause, apply, label, resume.
    applies_between_steps: bool = False
    updates_failed: int = 0
    # Started with --await-weights and no update applied yet: generation answers 503 awaiting_weights.
    awaiting_weights: bool = False
    # Tokens whose KV an update dropped (kv_after_update=recompute) and the engine computes again.
    reprefilled_tokens: int = 0
    # update_mode drain: waiting for this server's turn to drain (still admitting), and draining (new
    # generation requests answer 503 draining until the update is applied).
    update_mode: Literal["inflight", "drain"] = "inflight"
    awaiting_drain_turn: bool = False
    draining: bool = False


class ErrorResponse(BaseModel):
    error: str
    detail: str | None = None
