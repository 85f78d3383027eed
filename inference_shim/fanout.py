"""Pipelined chain relay of a flat buffer over a process group's point-to-point links.

A gloo broadcast from the trainer (rank 0) to N servers on other hosts makes the trainer's link carry
several copies of every bucket: gloo's broadcast is a binomial tree whose root sends the whole buffer
to ceil(log2(N + 1)) peers at once, and a peer forwards only after its whole buffer arrived. Over equal
links a push to 2 hosts takes about twice the one-host time and to 4 about four times
(docs/benchmarks.md#multihost).
Here the ranks form a chain instead, source first:

    order[0] -> order[1] -> order[2] -> ... -> order[-1]

The buffer is cut into chunks; a rank forwards chunk i to the next rank while chunk i+1 is still
arriving from the previous one. Every link then carries exactly one copy in each direction, and the
whole relay takes about one copy's time plus (len(order) - 2) chunks of pipeline fill.

    from inference_shim.fanout import relay, start_send
    # source (order[0]): returns a handle at once, so the next bucket can be packed meanwhile
    handle = start_send(pg, bucket, order=[0, 1, 2, 3], slot=i % 2)
    ...; handle.wait(timeout_s)
    # every other rank in `order`: returns when its copy is complete and forwarded
    relay(pg, bucket, rank=pg.rank(), order=[0, 1, 2, 3], timeout_s=60, slot=i % 2)

Ordering contract: every rank in `order` calls with the same buffer length, chunk_bytes, order and
slot, in the same sequence of buckets. Ranks outside `order` call nothing. Two relays may be in flight
at once only with different slots (the chunk tags of slot s are [s * MAX_CHUNKS, (s + 1) * MAX_CHUNKS)).
Every wait has a deadline and raises FanoutError naming the rank, chunk and peer. After a failure the
group is not reusable (chunks may still be posted), exactly as after a failed broadcast: leave it and
form a new one.

Torch only: works on any ProcessGroup with send/recv (gloo on CPU; nccl on GPU would also work, but a
GPU cluster should use nccl's own broadcast, which already pipelines).
"""

from __future__ import annotations

import datetime as dt
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

# 1 MiB: at 1 Gbit/s a chunk takes ~8 ms per hop, so 4 hops add ~25 ms of pipeline fill; small
# enough chunks that Python-level bookkeeping per chunk (~tens of µs) is still negligible.
DEFAULT_CHUNK_BYTES = 1 << 20
# Receives posted ahead of the one being waited on, and forwards left in flight: enough to keep both
# directions of a link busy without an unbounded number of outstanding operations.
DEFAULT_WINDOW = 8
MAX_CHUNKS = 1 << 20  # chunks per relay; tags of slot s start at s * MAX_CHUNKS
MAX_SLOTS = 2000  # tags are int32 in torch's gloo binding: 2000 * 2**20 < 2**31


class FanoutError(RuntimeError):
    """A chunk was not received or forwarded within the deadline (or the peer failed)."""


@dataclass(frozen=True)
class ChainPosition:
    """Where a rank sits in the chain: who it receives from and who it forwards to (None: nobody)."""

    previous: int | None
    next: int | None


def position(order: list[int], rank: int) -> ChainPosition:
    if len(set(order)) != len(order):
        raise ValueError(f"a chain visits each rank once: {order}")
    if rank not in order:
        raise ValueError(f"rank {rank} is not in the chain {order}")
    i = order.index(rank)
    return ChainPosition(order[i - 1] if i > 0 else None, order[i + 1] if i + 1 < len(order) else None)


def chunk_spans(nbytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[tuple[int, int]]:
    """(start, end) byte offsets of the chunks of an nbytes buffer."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    spans = [(s, min(s + chunk_bytes, nbytes)) for s in range(0, nbytes, chunk_bytes)]
    if len(spans) > MAX_CHUNKS:
        raise ValueError(f"{len(spans)} chunks exceed {MAX_CHUNKS}: use larger chunks")
    return spans


def _tag(slot: int, chunk: int) -> int:
    if not 0 <= slot < MAX_SLOTS:
        raise ValueError(f"slot must be in [0, {MAX_SLOTS}), got {slot}")
    return slot * MAX_CHUNKS + chunk


def _flat(buffer: torch.Tensor) -> torch.Tensor:
    if buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError("relay needs a flat contiguous buffer (a bucket)")
    return buffer


def _wait(work: dist.Work, deadline: float, what: str) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise FanoutError(f"{what}: deadline passed before it completed")
    try:
        ok = work.wait(dt.timedelta(seconds=left))
    except RuntimeError as e:  # gloo reports both a timeout and a dead peer this way
        raise FanoutError(f"{what} failed or timed out: {e}") from e
    if ok is False:
        raise FanoutError(f"{what} timed out")


class SendHandle:
    """The source's chunk sends of one relay, all posted; wait() blocks until the first hop took them."""

    def __init__(self, works: list[dist.Work], to: int | None, nbytes: int) -> None:
        self._works = works
        self.to = to
        self.nbytes = nbytes

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for i, work in enumerate(self._works):
            _wait(work, deadline, f"source: sending chunk {i} of {len(self._works)} to rank {self.to}")
        self._works = []


def start_send(
    pg: dist.ProcessGroup,
    buffer: torch.Tensor,
    *,
    order: list[int],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    slot: int = 0,
) -> SendHandle:
    """Source side (order[0]): post every chunk's send to order[1] and return without waiting.

    All at once rather than windowed: the chunks are views of the caller's buffer (no extra memory),
    and the transport writes them in posting order, so the source's link never idles between chunks.
    The buffer must stay untouched until the handle's wait() returned.
    """
    flat = _flat(buffer)
    nxt = position(order, order[0]).next
    if nxt is None or flat.numel() == 0:
        return SendHandle([], nxt, flat.numel())
    works = [
        pg.send([flat[s:e]], nxt, _tag(slot, i))
        for i, (s, e) in enumerate(chunk_spans(flat.numel(), chunk_bytes))
    ]
    return SendHandle(works, nxt, flat.numel())


def relay(
    pg: dist.ProcessGroup,
    buffer: torch.Tensor,
    *,
    rank: int,
    order: list[int],
    timeout_s: float,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    slot: int = 0,
    window: int = DEFAULT_WINDOW,
) -> None:
    """One rank's part of a chain relay of `buffer`; returns when this rank's part is done.

    The source (order[0]) sends from `buffer` and waits for it (start_send + wait). Every other rank
    receives into `buffer` (a flat uint8 tensor of the same length as the source's) and forwards each
    chunk to the next rank as soon as it arrived. `timeout_s` bounds the whole call, not each chunk.
    """
    flat = _flat(buffer)
    where = position(order, rank)
    if where.previous is None:
        start_send(pg, flat, order=order, chunk_bytes=chunk_bytes, slot=slot).wait(timeout_s)
        return
    deadline = time.monotonic() + timeout_s
    spans = chunk_spans(flat.numel(), chunk_bytes)
    receives: dict[int, dist.Work] = {}

    def post_receive(i: int) -> None:
        s, e = spans[i]
        receives[i] = pg.recv([flat[s:e]], where.previous, _tag(slot, i))

    for i in range(min(window, len(spans))):
        post_receive(i)
    forwards: deque[tuple[int, dist.Work]] = deque()
    for i, (s, e) in enumerate(spans):
        _wait(receives.pop(i), deadline, f"rank {rank}: receiving chunk {i} from rank {where.previous}")
        if i + window < len(spans):
            post_receive(i + window)
        if where.next is not None:
            forwards.append((i, pg.send([flat[s:e]], where.next, _tag(slot, i))))
            if len(forwards) > window:
                j, work = forwards.popleft()
                _wait(work, deadline, f"rank {rank}: forwarding chunk {j} to rank {where.next}")
    for j, work in forwards:
        _wait(work, deadline, f"rank {rank}: forwarding chunk {j} to rank {where.next}")
