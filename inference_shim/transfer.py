"""The weight-transfer data plane, shared by the trainer-side sender and the server-side receiver.

Torch only (no vLLM): inference_shim.weight_sender (rank 0) and inference_shim.vllm_worker (ranks >= 1)
both build their standalone process group and their flat buckets with these functions, so the two
sides cannot disagree on layout. The group never touches torch.distributed's default group: it has
its own TCPStore (hosted by the trainer) and its own ProcessGroupGloo / ProcessGroupNCCL object.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from inference_shim import fanout as fanout_mod
from inference_shim.protocol import Bucket, TensorMeta, plan_buckets

# Key prefix of the process group's own rendezvous keys inside the shared store, so they never collide
# with the update protocol's keys (decision/result) that live under "<group_name>/update/...".
_PG_PREFIX = "pg"


@dataclass
class WeightGroup:
    """A joined weight-transfer group: its store (for protocol keys) and its process group."""

    store: dist.Store
    pg: dist.ProcessGroup
    rank: int
    world_size: int
    backend: str
    group_name: str
    timeout_s: float

    @property
    def device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )


def connect_store(
    host: str, port: int, *, is_master: bool, world_size: int | None, timeout_s: float
) -> dist.TCPStore:
    """TCPStore server (trainer: port 0 picks a free port) or client (servers), with a deadline.

    The server listens on `host` only: torch's own TCPStore server binds every interface (`*:port`), which
    would expose the weight plane's keys to anyone who can reach the machine. We bind the listening socket
    ourselves and hand its descriptor to the store (`master_listen_fd`, libuv backend), which then owns it.
    """
    listen_fd = None
    if is_master:
        listener = socket.create_server((host, port), backlog=512)
        port = listener.getsockname()[1]
        listen_fd = listener.detach()  # the store owns the descriptor from here on
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master,
        timeout=dt.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listen_fd,
        use_libuv=True,
    )


def join_group(
    store: dist.Store, *, rank: int, world_size: int, backend: str, group_name: str, timeout_s: float
) -> WeightGroup:
    """Create this rank's process group. Blocks until every rank joined or raises after timeout_s."""
    prefix_store = dist.PrefixStore(f"{group_name}/{_PG_PREFIX}", store)
    timeout = dt.timedelta(seconds=timeout_s)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefix_store, rank, world_size, timeout)
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefix_store, rank, world_size, options)
    else:
        raise ValueError(f"backend {backend!r} is not supported; use gloo (CPU) or nccl (GPU)")
    # gloo connects lazily on some versions: a first tiny collective proves every rank is reachable
    # now, inside the deadline, instead of failing later in the middle of an update.
    probe = torch.zeros(1, device="cuda" if backend == "nccl" else "cpu")
    _wait(pg.allreduce([probe]), timeout_s, "joining the weight group")
    return WeightGroup(store, pg, rank, world_size, backend, group_name, timeout_s)


def _wait(work: dist.Work, timeout_s: float, what: str) -> None:
    try:
        ok = work.wait(dt.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise TimeoutError(f"{what} failed or timed out after {timeout_s:.0f}s: {e}") from e
    if ok is False:
        raise TimeoutError(f"{what} timed out after {timeout_s:.0f}s")


def start_broadcast(group: WeightGroup, buffer: torch.Tensor) -> dist.Work:
    """Start broadcasting one flat uint8 bucket from rank 0 into every rank's buffer; wait with wait_work."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return group.pg.broadcast([buffer], opts)


def wait_work(group: WeightGroup, work: dist.Work, what: str) -> None:
    _wait(work, group.timeout_s, what)


def broadcast_bucket(group: WeightGroup, buffer: torch.Tensor, what: str) -> None:
    """Broadcast one bucket and wait for it (deadline: the group's timeout)."""
    wait_work(group, start_broadcast(group, buffer), what)


class BucketSend:
    """The sender's bucket i in flight, by either fan-out; wait() blocks until it left the trainer."""

    def __init__(self, group: WeightGroup, packed: torch.Tensor, fanout: str, chunk_bytes: int, slot: int):
        self.group = group
        if fanout == "chain":
            order = list(range(group.world_size))
            self._chain = fanout_mod.start_send(
                group.pg, packed, order=order, chunk_bytes=chunk_bytes, slot=slot
            )
            self._work = None
        else:
            self._chain = None
            self._work = start_broadcast(group, packed)

    def wait(self, what: str) -> None:
        if self._chain is not None:
            self._chain.wait(self.group.timeout_s)
        else:
            wait_work(self.group, self._work, what)


def pack_bucket(
    bucket: Bucket, tensors: list[torch.Tensor], out: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Copy the bucket's tensors into the flat uint8 buffer `out` (at least bucket.nbytes long).

    Each tensor is copied through a typed view of its slot (cast to `dtype` on the way when given),
    which is faster than a byte copy and needs no intermediate for non-contiguous or cast tensors.
    Run it with one torch thread (see `single_thread`): a parallel copy on a shared core is many times
    slower than a serial one.
    """
    for slot in bucket.slots:
        src = tensors[slot.index].detach()
        target = dtype or src.dtype
        raw = out[slot.offset : slot.offset + slot.nbytes]
        if slot.offset % target.itemsize == 0:
            raw.view(target).view(src.shape).copy_(src)
        else:  # an unaligned slot (the back-to-back "c10d" wire): bytes of a cast, contiguous copy
            raw.copy_(src.to(target).contiguous().reshape(-1).view(torch.uint8))
    return out[: bucket.nbytes]


@contextlib.contextmanager
def single_thread():
    """Run torch ops in this block on one intra-op thread (copies, casts), then restore the setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def unpack_bucket(
    bucket: Bucket, metas: list[TensorMeta], buffer: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """Typed views (no copy) of the tensors inside a received bucket."""
    views = []
    for slot in bucket.slots:
        meta = metas[slot.index]
        raw = buffer[slot.offset : slot.offset + slot.nbytes]
        views.append((meta.name, raw.view(getattr(torch, meta.dtype)).view(meta.shape)))
    return views


def receive_buckets(
    group: WeightGroup,
    metas: list[TensorMeta],
    bucket_bytes: int,
    buffers: list[torch.Tensor] | None = None,
    *,
    fanout: str = "broadcast",
    chunk_bytes: int = fanout_mod.DEFAULT_CHUNK_BYTES,
) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """Receiver side of one update: every bucket into its own staging buffer. Returns (named views, bytes).

    `fanout` is the update's (WeightUpdateRequest.fanout): "broadcast" (one collective per bucket) or
    "chain" (inference_shim/fanout.py: ranks relay chunks in rank order, so the trainer's link carries
    one copy whatever the number of servers). Bucket i uses relay slot i % 2, as the sender does.

    `buffers`, when given, is a cache kept by the caller between updates: bucket i is received into
    buffers[i] when it is large enough (grown or added otherwise). Fresh pages cost a first touch on
    every update (measured ~0.75 s/GB on these VMs, half the receive speed); reused ones do not. The
    caller must be done with the previous update's views before it passes the cache again.
    """
    staged: list[tuple[str, torch.Tensor]] = []
    total = 0
    for i, bucket in enumerate(plan_buckets(metas, bucket_bytes)):
        if buffers is None:
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device)
        else:
            if len(buffers) <= i:
                buffers.append(torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device))
            elif buffers[i].numel() < bucket.nbytes or buffers[i].device != group.device:
                buffers[i] = torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device)
            buffer = buffers[i][: bucket.nbytes]
        if fanout == "chain":
            order = list(range(group.world_size))
            fanout_mod.relay(
                group.pg,
                buffer,
                rank=group.rank,
                order=order,
                timeout_s=group.timeout_s,
                chunk_bytes=chunk_bytes,
                slot=i % 2,
            )
        else:
            broadcast_bucket(group, buffer, f"receiving bucket {i} ({bucket.nbytes} bytes)")
        staged.extend(unpack_bucket(bucket, metas, buffer))
        total += bucket.nbytes
    return staged, total


def tensor_meta(name: str, tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(name=name, dtype=str(tensor.dtype).removeprefix("torch."), shape=list(tensor.shape))
