"""Trainer-side weight sender: pushes the trainer's weights into every running inference server.

Torch only, no vLLM. Runs on trainer rank 0 (the other trainer ranks only help gather ZeRO-3/FSDP
shards through the `fetch` callback). Ordering contract:

    sender = WeightSender(urls, token=..., backend="gloo")   # nothing happens yet
    sender.connect()        # hosts the TCPStore, asks each server to join, joins as rank 0
    sender.push(version, metas, fetch)   # after EVERY optimizer step; version strictly increasing
    sender.push(version, metas, fetch, settle=False)   # returns once the bytes are sent; then
    sender.settle()         # waits for the servers' results (the next push() calls it first)
    sender.reconnect()      # only after a failed push: every server leaves the broken group, a new one forms
    sender.reconnect(urls)  # the same with other servers (membership changes only when a group forms)
    sender.close()

push(): 1) POST /request_weight_update to every server in parallel (they validate before any
collective); 2) if all accepted, write "go" to the decision key, else "abort" and raise naming the
servers that refused (every value this sender writes is signed with `token` and every result it reads
must be signed with it: protocol.sign_value; so all servers of one sender share one token); 3) broadcast the buckets (fetch(indices) returns full tensors for one bucket, so
sharded trainers never materialize the whole model); 4) wait for every server's result key and raise,
naming the server, if any failed or stayed silent past the deadline. With settle=False, step 4 is left
to settle(): the servers load and swap the new weights while the caller goes on (a trainer computes
its next step); settle() raises what step 4 would have raised, and the next push() settles first, so a
server is never asked for an update while it still applies the previous one.

Wire formats (chosen in connect() from every server's /capabilities `transports`, never from its
backend name): "<backend>" is the contract's own (group under the store prefix "<group_name>/pg", a
join probe, 64-byte aligned buckets); "<backend>:c10d" is the one engines with a built-in receiver
use (SGLang's init_weights_update_group: a torch c10d group named <group_name>, no probe, each bucket
packed back to back). One group has one format, so every server must offer the one chosen.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from inference_shim.client import ShimClient, ShimError, answers_http, leave_weight_group
from inference_shim.faults import fault_point
from inference_shim.protocol import (
    CONTRACT_VERSION,
    DEFAULT_BUCKET_BYTES,
    AdapterSpec,
    InitProcessGroupRequest,
    TensorMeta,
    UnauthenticatedValue,
    UpdateResult,
    WeightUpdateRequest,
    decision_key,
    plan_buckets,
    result_key,
    sign_value,
    verify_value,
)
from inference_shim.transfer import (
    BucketSend,
    WeightGroup,
    connect_store,
    join_group,
    pack_bucket,
    single_thread,
    tensor_meta,
)
from inference_shim.wires import (
    WeightPushError,
    choose_fanout,
    choose_wire,
    join_c10d_group,
    packed_bucket,
)

log = logging.getLogger("inference_shim.weight_sender")

# While waiting for results: look at the missing servers every RESULT_SLICE_S (an engine busy applying
# still answers /health: its HTTP loop is free; client.answers_http).
RESULT_SLICE_S = 2.0  # (torch logs a warning at each slice that ends before the results: not often)

FetchFn = Callable[[list[int]], list[torch.Tensor]]


@dataclass
class PushReport:
    version: int
    total_bytes: int
    num_buckets: int
    request_seconds: float
    broadcast_seconds: float
    total_seconds: float  # from the request to every server's result (settled) or to the return (not)
    results: list[UpdateResult]  # empty until settled
    settled: bool = True  # False: push(settle=False) returned before the results; settle() has them

    @property
    def blocked_seconds(self) -> float:
        """How long push() held its caller: the request and the transfer, plus the results if settled."""
        return self.total_seconds if self.settled else self.request_seconds + self.broadcast_seconds

    @property
    def max_pause_seconds(self) -> float:
        return max((r.pause_seconds for r in self.results), default=0.0)


@dataclass
class _PendingPush:
    """A push whose bytes are sent and whose results are not yet read (push(settle=False))."""

    report: PushReport
    update_id: str
    started: float  # perf_counter at the request


class LoraMismatch(RuntimeError):
    """Servers that cannot take this trainer's updates as they are (adapters vs full weights): a
    configuration error, not a failing server, so it is never handled by ejecting them."""


def check_lora(adapter: AdapterSpec | None, urls: list[str], caps: list) -> None:
    """Raise LoraMismatch, naming the servers and what to change, unless every server takes what this
    trainer sends: adapters of its rank (lora in_memory) with an adapter, full weights without one."""
    if adapter is None:
        wrong = [u for u, c in zip(urls, caps, strict=True) if c.lora != "none"]
        if wrong:
            raise LoraMismatch(
                f"servers {wrong} serve a LoRA adapter (--lora-max-rank) but this trainer trains every "
                "weight: set trainer.lora, or start them without --lora-max-rank"
            )
        return
    wrong = [
        f"{u} (lora {c.lora}, max rank {c.lora_max_rank})"
        for u, c in zip(urls, caps, strict=True)
        if c.lora != "in_memory" or (c.lora_max_rank or 0) < adapter.rank
    ]
    if wrong:
        raise LoraMismatch(
            f"trainer.lora (rank {adapter.rank}) pushes adapters, which these servers cannot take: "
            + ", ".join(wrong)
            + f"; start them with --lora-max-rank {adapter.rank} or more on an engine that takes adapters in "
            "memory (vllm, torch; docs/lora.md)"
        )


class WeightSender:
    def __init__(
        self,
        server_urls: list[str],
        *,
        token: str | None = None,
        backend: str = "gloo",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 120.0,
        master_address: str = "127.0.0.1",
        group_name: str = "weights",
        fanout: str = "auto",
        adapter: AdapterSpec | None = None,
    ) -> None:
        """adapter: every push is that LoRA adapter's tensors (servers must say /capabilities lora
        in_memory, of a rank that holds it); None: every push is every weight."""
        if not server_urls:
            raise ValueError("WeightSender needs at least one server URL")
        self.adapter = adapter
        self._token = token  # also keys the HMAC of every store value (decision out, results in)
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.server_urls: list[str] = []
        self.clients: list[ShimClient] = []
        self._use_servers(server_urls)
        self.master_address = master_address
        self.group_name = group_name
        self.group: WeightGroup | None = None
        self.wire = "contract"  # or "c10d": see the module docstring
        if fanout not in ("auto", "broadcast", "chain"):
            raise ValueError(f"fanout {fanout!r}: use auto, broadcast or chain")
        self.fanout_choice = fanout
        self.fanout = "broadcast"  # what connect() chose: see choose_fanout
        self.target_dtype: str | None = None
        self._pool = ThreadPoolExecutor(
            max_workers=max(2, len(server_urls)), thread_name_prefix="weight-sender"
        )
        self._buffers: list[torch.Tensor] = []
        self._pending: _PendingPush | None = None

    # ------------------------------------------------------------------ group
    def connect(self) -> None:
        caps = list(self._pool.map(lambda c: c.capabilities(), self.clients))
        ours = CONTRACT_VERSION.split(".")[0]
        other = [(u, c.contract_version) for u, c in zip(self.server_urls, caps, strict=True)]
        other = [(u, v) for u, v in other if v.split(".")[0] != ours]
        if other:
            raise WeightPushError(
                f"servers speak another major version of the contract than this trainer's {CONTRACT_VERSION}: "
                + ", ".join(f"{u} {v}" for u, v in other)
                + " (docs/contract.md, Changes): run the same pipeline-rl version on both sides",
                [u for u, _ in other],
            )
        check_lora(self.adapter, self.server_urls, caps)
        dtypes = {d for c in caps for d in c.dtypes}
        if len(dtypes) != 1:
            raise WeightPushError(f"servers disagree on the weight dtype: {sorted(dtypes)}", self.server_urls)
        self.target_dtype = dtypes.pop()
        self.wire = choose_wire(self.server_urls, [c.transports for c in caps], self.backend)
        world_size = 1 + sum(c.workers for c in caps)
        self.fanout = choose_fanout(
            self.fanout_choice, self.server_urls, [c.fanouts for c in caps], self.wire, self.backend
        )
        store = connect_store(
            self.master_address, 0, is_master=True, world_size=None, timeout_s=self.timeout_s
        )
        offsets, next_rank = [], 1
        for c in caps:
            offsets.append(next_rank)
            next_rank += c.workers
        futures = [
            self._pool.submit(
                client.init_process_group,
                InitProcessGroupRequest(
                    master_address=self.master_address,
                    master_port=store.port,
                    rank_offset=offset,
                    world_size=world_size,
                    backend=self.backend,
                    group_name=self.group_name,
                    server_id=client.base_url,
                    timeout_s=self.timeout_s,
                ),
            )
            for client, offset in zip(self.clients, offsets, strict=True)
        ]
        join = join_group if self.wire == "contract" else join_c10d_group
        try:
            self.group = join(
                store,
                rank=0,
                world_size=world_size,
                backend=self.backend,
                group_name=self.group_name,
                timeout_s=self.timeout_s,
            )
        except Exception as e:
            # The group's deadline has passed: give the HTTP calls only a moment to report why.
            failed = self._failed_futures(futures, wait_s=2.0) or self.server_urls
            raise WeightPushError(
                f"weight group did not form within {self.timeout_s:.0f}s ({e}); servers that did not join: {failed}",
                failed,
            ) from e
        failed = self._failed_futures(futures, wait_s=self.timeout_s + 20)
        if failed:
            raise WeightPushError(f"servers failed to join the weight group: {failed}", failed)
        log.info(
            "weight group ready: %d servers, world size %d, store port %d",
            len(self.clients),
            world_size,
            store.port,
        )

    def _failed_futures(self, futures, wait_s: float) -> list[str]:
        failed = []
        deadline = time.monotonic() + wait_s
        for url, future in zip(self.server_urls, futures, strict=True):
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                failed.append(f"{url} (no answer to /init_process_group)")
            except Exception as e:
                failed.append(f"{url} ({e})")
        return failed

    def close(self) -> None:
        if self._pending is not None:  # the servers finish applying it on their own
            log.info("closing with version %d not settled", self._pending.report.version)
            self._pending = None
        for client in self.clients:
            try:
                client.destroy_process_group()
            except Exception as e:  # closing is best effort; the servers may already be gone
                log.warning("destroy_process_group on %s failed: %s", client.base_url, e)
            client.close()
        self._pool.shutdown(wait=False)
        self._drop_group()

    def _use_servers(self, urls: list[str]) -> None:
        for client in self.clients:
            client.close()
        self.server_urls = [u.rstrip("/") for u in urls]
        timeout_s = min(self.timeout_s, 60.0)
        self.clients = [ShimClient(u, token=self._token, timeout_s=timeout_s) for u in self.server_urls]

    def reconnect(self, server_urls: list[str] | None = None) -> None:
        """Leave the weight group on every server and form a new one, e.g. after a failed push; with
        `server_urls`, the new group has those servers (a server left out is not asked to leave).

        A broadcast that failed (a partition, a timeout) leaves the group unusable on every rank, while
        the servers keep serving their old weights and stay joined to it. This asks each server to
        leave it (waiting, up to timeout_s, for one still finishing the failed update: 409
        update_in_progress), drops this side, and runs connect() again. Raises WeightPushError naming
        the servers that could not leave.
        """
        self._settle_quietly()  # a server still applying would answer 409 to the request to leave
        if server_urls is not None:
            stay = {u.rstrip("/") for u in server_urls}
            self._use_servers([u for u in self.server_urls if u in stay])
        deadline = time.monotonic() + self.timeout_s
        answers = list(self._pool.map(lambda c: _try(lambda: leave_weight_group(c, deadline)), self.clients))
        failed = [f"{url}: {err}" for url, (_, err) in zip(self.server_urls, answers, strict=True) if err]
        if failed:
            raise WeightPushError(
                "servers could not leave the old weight group: " + "; ".join(failed),
                [f.split(": ")[0] for f in failed],
            )
        self._drop_group()
        if server_urls is not None:
            self._use_servers(server_urls)
        self.connect()

    def _drop_group(self) -> None:
        if self.group is not None and self.wire == "c10d":
            # c10d groups are registered by name in torch.distributed: free the name for a later connect().
            try:
                torch.distributed.destroy_process_group(self.group.pg)
            except Exception as e:
                log.warning("destroying the c10d weight group failed: %s", e)
        self.group = None

    # ------------------------------------------------------------------ updates
    def metas_of(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
        """Metadata in the servers' dtype (the sender casts while packing)."""
        metas = []
        for name, tensor in named_tensors:
            meta = tensor_meta(name, tensor)
            metas.append(meta.model_copy(update={"dtype": self.target_dtype or meta.dtype}))
        return metas

    def push_tensors(
        self,
        version: int,
        named_tensors: list[tuple[str, torch.Tensor]],
        *,
        restore: bool = False,
        settle: bool = True,
    ) -> PushReport:
        """push() for weights that are already whole in memory (DDP, single process)."""
        tensors = [t for _, t in named_tensors]
        return self.push(
            version,
            self.metas_of(named_tensors),
            lambda indices: [tensors[i] for i in indices],
            restore=restore,
            settle=settle,
        )

    def push(
        self,
        version: int,
        metas: list[TensorMeta],
        fetch: FetchFn,
        *,
        restore: bool = False,
        settle: bool = True,
    ) -> PushReport:
        """One update. restore=True lets `version` be <= the served one (resuming from a checkpoint).
        settle=False returns once every byte is sent, before the servers' results: call settle() (or
        the next push, which does) to learn whether they applied it. Raises WeightPushError for this
        update, or for the previous one if it was not settled and failed (nothing of this one is sent
        then)."""
        group = self.group
        if group is None:
            raise RuntimeError("WeightSender.push before connect()")
        self.settle()
        start = time.perf_counter()
        request = WeightUpdateRequest(
            version=version,
            tensors=metas,
            bucket_bytes=self.bucket_bytes,
            timeout_s=self.timeout_s,
            restore=restore,
            fanout=self.fanout,
            adapter=self.adapter,
        )
        answers = self._request_all(request)
        refused = [
            f"{url}: {err}"
            for url, (_, err) in zip(self.server_urls, answers, strict=True)
            if err is not None
        ]
        if refused:
            self._decide(group, request.update_id, "abort")
            raise WeightPushError(
                f"weight update to version {version} refused, nothing was sent: " + "; ".join(refused),
                [r.split(": ")[0] for r in refused],
            )
        request_seconds = time.perf_counter() - start
        self._decide(group, request.update_id, "go")

        broadcast_start = time.perf_counter()
        buckets = plan_buckets(metas, self.bucket_bytes)
        if self.wire == "c10d":
            buckets = [packed_bucket(b) for b in buckets]
        dtype = getattr(torch, self.target_dtype) if self.target_dtype else None
        try:
            in_flight = None  # (work, bucket index): bucket i is packed while bucket i-1 is on the wire
            for i, bucket in enumerate(buckets):
                indices = [slot.index for slot in bucket.slots]
                full: list[torch.Tensor | None] = [None] * len(metas)
                for index, tensor in zip(indices, fetch(indices), strict=True):
                    full[index] = tensor
                with single_thread():  # the trainer computes nothing during a push; see pack_bucket
                    packed = pack_bucket(bucket, full, self._buffer(i, bucket.nbytes, group.device), dtype)
                # Bucket i uses relay slot i % 2, matching the alternating pack buffers: a buffer is
                # repacked only after the send that used it was waited on.
                send = BucketSend(group, packed, self.fanout, request.fanout_chunk_bytes, slot=i % 2)
                fault_point("sender.broadcast")  # chaos tests: the sender dies with a bucket on the wire
                if in_flight is not None:
                    in_flight[0].wait(f"sending bucket {in_flight[1]} of version {version}")
                in_flight = (send, i)
            if in_flight is not None:
                in_flight[0].wait(f"sending bucket {in_flight[1]} of version {version}")
        except Exception as e:
            self._cancel(group, request.update_id)
            raise WeightPushError(f"broadcast of version {version} failed: {e}", self.server_urls) from e
        broadcast_seconds = time.perf_counter() - broadcast_start

        report = PushReport(
            version=version,
            total_bytes=sum(b.nbytes for b in buckets),
            num_buckets=len(buckets),
            request_seconds=request_seconds,
            broadcast_seconds=broadcast_seconds,
            total_seconds=time.perf_counter() - start,
            results=[],
            settled=False,
        )
        self._pending = _PendingPush(report, request.update_id, start)
        if not settle:
            return report
        settled = self.settle()
        assert settled is not None
        return settled

    def settle(self) -> PushReport | None:
        """Wait for the results of the push made with settle=False, if one is pending: its report,
        complete (results, total_seconds up to the last result). Raises WeightPushError naming the
        servers that failed or stayed silent (the update is cancelled for any still receiving)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        report = pending.report
        try:
            results = self._collect_results(report.version, pending.update_id)
        except WeightPushError:
            if self.group is not None:
                self._cancel(self.group, pending.update_id)
            raise
        return dataclasses.replace(
            report, results=results, settled=True, total_seconds=time.perf_counter() - pending.started
        )

    def _settle_quietly(self) -> None:
        try:
            self.settle()
        except WeightPushError as e:  # the group is formed again next: its first push restores
            log.warning("the last update did not settle: %s", e)

    def _request_all(self, request: WeightUpdateRequest) -> list[tuple[object, str | None]]:
        """POST /request_weight_update to every server in parallel: (answer, error) per server. Waits in
        slices; once a server still silent has a silent /health too (stopped, cut off), it counts as
        refused at once rather than at the HTTP timeout (its call times out alone; the push is aborted,
        so servers that did accept see "abort"). Servers still answering are then reported as (None, None)."""
        futures = [
            self._pool.submit(_try, lambda c=c: c.request_weight_update(request)) for c in self.clients
        ]
        while True:
            _, pending = wait(futures, timeout=RESULT_SLICE_S)
            if not pending:
                return [f.result() for f in futures]
            silent = {
                f
                for url, f in zip(self.server_urls, futures, strict=True)
                if f in pending and not answers_http(url)
            }
            if silent:
                down = "no answer: down, stopped or cut off (its /health is silent too)"
                return [
                    (None, down) if f in silent else (None, None) if f in pending else f.result()
                    for f in futures
                ]

    def _wait_results(self, version: int, keys: dict[str, str]) -> None:
        """Wait for every result key until the deadline, in slices: between them, a server whose key is
        missing and whose /health does not answer at all (killed, stopped, cut off) fails the push at
        once, naming it, instead of at the deadline. A server that answers is only slow: waited for."""
        store = self.group.store
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                store.wait(list(keys.values()), dt.timedelta(seconds=max(0.001, min(RESULT_SLICE_S, left))))
                return
            except Exception:
                missing = [url for url, key in keys.items() if not store.check([key])]
            if time.monotonic() >= deadline:
                raise WeightPushError(
                    f"no result for version {version} within {self.timeout_s:.0f}s from: {missing} (server down or stuck?)",
                    missing,
                ) from None
            silent = [
                url
                for url, alive in zip(missing, self._pool.map(answers_http, missing), strict=True)
                if not alive
            ]
            if silent:
                raise WeightPushError(
                    f"no result for version {version} from {silent}, which no longer answer HTTP (down, "
                    "stopped or cut off)",
                    silent,
                )

    def _decide(self, group: WeightGroup, update_id: str, decision: str) -> None:
        key = decision_key(self.group_name, update_id)
        group.store.set(key, sign_value(self._token, key, decision))

    def _cancel(self, group: WeightGroup, update_id: str) -> None:
        """The push failed after "go": overwrite the decision, so a server whose buckets arrive late (a
        link that comes back, a server resumed from SIGSTOP) discards them instead of applying a
        version we reported as failed (servers re-read the decision before they pause to apply).
        Best effort: a server that had already started applying still applies."""
        try:
            self._decide(group, update_id, "cancel")
        except Exception as e:  # the store itself may be what failed
            log.warning("could not cancel update %s: %s", update_id, e)

    def _buffer(self, i: int, nbytes: int, device: torch.device) -> torch.Tensor:
        # Two buffers, alternating: bucket i is packed into one while bucket i-1 is broadcast from the
        # other; the broadcast of bucket i-2 (same buffer) has been waited for before we get here.
        slot = i % 2
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=device))
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._buffers[slot]

    def _collect_results(self, version: int, update_id: str) -> list[UpdateResult]:
        store = self.group.store
        keys = {url: result_key(self.group_name, update_id, url) for url in self.server_urls}
        self._wait_results(version, keys)
        results, forged = [], {}
        for url, key in keys.items():
            try:
                payload = verify_value(self._token, key, store.get(key))
            except UnauthenticatedValue as e:  # not the server's word: never count it as applied
                forged[url] = str(e)
                continue
            results.append(UpdateResult.model_validate_json(payload))
        if forged:
            raise WeightPushError(
                f"result of version {version} not authenticated (a forged value, or the server runs with "
                "another --token): " + "; ".join(f"{url}: {e}" for url, e in forged.items()),
                list(forged),
            )
        failed = [r for r in results if not r.ok]
        if failed:
            raise WeightPushError(
                f"weight update to version {version} failed on: "
                + "; ".join(f"{r.server_id}: {r.error}" for r in failed),
                [r.server_id for r in failed],
            )
        return results


def _try(fn):
    try:
        return fn(), None
    except ShimError as e:
        return None, f"{e.status} {e.error}: {e.detail}"
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
