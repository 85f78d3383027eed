"""The trainer ranks' own process group: rank/world/device and the few collectives the trainer needs.

`accelerate launch` (torchrun underneath) starts the ranks and sets RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT; `init_comm` joins the default process group from them (gloo on CPU, nccl on GPU). Without
those variables (a plain `python` process, unit tests) it returns a single-rank Comm and every
collective below is the identity, so the same trainer code runs in-process.

This group is only the trainer ranks. The weight-transfer group towards the inference servers is a
separate, standalone one (inference_shim.weight_sender); the two never mix.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class RankFailure(RuntimeError):
    """Raised on every rank when an operation that only rank 0 runs (e.g. a weight push) failed there."""


@dataclass
class Comm:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (small JSON-able objects only).

        JSON bytes in uint8 tensors rather than torch's pickle-based object collectives: a rank must
        never unpickle what arrives over a socket (pickle runs code). Tuples arrive as lists.
        """
        if not self.distributed:
            return [obj]
        payload = self._encode(obj)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=self.device))
        lengths = [int(n.item()) for n in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=self.device)
        padded[: payload.numel()] = payload
        gathered = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(gathered, padded)
        return [_decode(buffer[:n]) for buffer, n in zip(gathered, lengths, strict=True)]

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` (JSON-able) on every rank; see all_gather_object for why not pickle."""
        if not self.distributed:
            return obj
        payload = self._encode(obj) if self.is_main else None
        size = torch.tensor(
            [0 if payload is None else payload.numel()], dtype=torch.int64, device=self.device
        )
        dist.broadcast(size, src=0)
        if payload is None:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(payload, src=0)
        return _decode(payload)

    def _encode(self, obj: Any) -> torch.Tensor:
        data = json.dumps(obj, separators=(",", ":")).encode()
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def on_main(self, fn: Callable[[], T], what: str) -> T | None:
        """Run `fn` on rank 0 only and tell every rank how it went; raises RankFailure everywhere if it failed.

        Rank 0 re-raises the original exception (its message names the culprit, e.g. a server URL);
        the other ranks raise RankFailure with the same text, so every rank stops at the same point.
        """
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - reported to every rank, then re-raised
                error = e
        message = self.broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        if message is not None:
            raise RankFailure(f"{what} failed on rank 0: {message}")
        return result

    def close(self) -> None:
        if self.distributed:
            dist.destroy_process_group()


def init_comm(timeout_s: float) -> Comm:
    """Join the trainer ranks' default group from the launcher's environment (or run single-rank)."""
    use_cuda = torch.cuda.is_available()
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        return Comm(rank=0, world=1, local_rank=0, device=device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        # Every collective of the trainer waits at most this long; the callers' own deadlines (data,
        # push) are shorter, so a collective only times out when a peer rank is gone.
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=dt.timedelta(seconds=timeout_s))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return Comm(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local_rank, device=device)


def _decode(buffer: torch.Tensor) -> Any:
    return json.loads(bytes(buffer.cpu().numpy().tobytes()).decode())
