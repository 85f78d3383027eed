"""Which wire a push uses, decided once at connect from the servers' /capabilities.

- The wire format: "contract" (our buckets with 64-byte aligned slots, docs/contract.md) or "c10d"
  (SGLang's own update_weights_from_distributed: tensors back to back, a group built like torch's).
- The fan-out on the contract wire: one broadcast per bucket, or a chain relay (inference_shim/fanout.py).
Used by inference_shim/weight_sender.py; tests call these directly.
"""

from __future__ import annotations

import datetime as dt
from urllib.parse import urlsplit

import torch

from inference_shim.protocol import Bucket, BucketSlot
from inference_shim.transfer import WeightGroup


class WeightPushError(RuntimeError):
    """A push failed; `servers` names the servers at fault. The trainer must stop, not continue."""

    def __init__(self, message: str, servers: list[str]) -> None:
        super().__init__(message)
        self.servers = servers


def choose_fanout(choice: str, urls: list[str], fanouts: list[list[str]], wire: str, backend: str) -> str:
    """How buckets leave the trainer: "broadcast" (one collective) or "chain" (servers relay, fanout.py).

    A broadcast makes the trainer's link carry several copies (gloo: a binomial tree, measured 2x the
    one-server time for 2 server hosts, 4x for 4); the chain carries one copy whatever the number of
    servers, at the price of each server forwarding what it receives. That pays only when the servers
    sit on other hosts than each other, so "auto" picks the chain when the server URLs name more than
    one host and every server offers it on our wire (gloo, contract); on one host it keeps the broadcast.
    """
    offered = wire == "contract" and backend == "gloo" and all("chain" in f for f in fanouts)
    if choice == "chain":
        if not offered:
            raise ValueError(
                "fanout=chain needs the contract wire over gloo and servers whose /capabilities list "
                f"'chain' in fanouts (got {fanouts}, wire {wire}, backend {backend})"
            )
        return "chain"
    if choice == "broadcast":
        return "broadcast"
    hosts = {urlsplit(u).hostname for u in urls}
    return "chain" if offered and len(hosts) > 1 else "broadcast"


def choose_wire(urls: list[str], transports: list[list[str]], backend: str) -> str:
    """The wire format every server offers for `backend`: "contract" ("gloo"), else "c10d" ("gloo:c10d")."""
    for wire, name in (("contract", backend), ("c10d", f"{backend}:c10d")):
        if all(name in offered for offered in transports):
            return wire
    offers = "; ".join(f"{url}: {offered}" for url, offered in zip(urls, transports, strict=True))
    raise WeightPushError(
        f"no weight transport for backend {backend!r} that every server offers ({offers}); one group "
        "cannot mix servers of different wire formats: push to them with separate WeightSenders",
        urls,
    )


def packed_bucket(bucket: Bucket) -> Bucket:
    """The same tensors as `bucket`, packed back to back without alignment gaps (the "c10d" wire format)."""
    slots, offset = [], 0
    for slot in bucket.slots:
        slots.append(BucketSlot(index=slot.index, offset=offset, nbytes=slot.nbytes))
        offset += slot.nbytes
    return Bucket(nbytes=offset, slots=slots)


def join_c10d_group(
    store: torch.distributed.Store,
    *,
    rank: int,
    world_size: int,
    backend: str,
    group_name: str,
    timeout_s: float,
) -> WeightGroup:
    """Rank 0 of a group built like torch's own groups, as SGLang's init_weights_update_group builds its side.

    The rendezvous keys must match the engine's byte for byte, so this uses torch's group helper (the
    same one SGLang calls) under the store prefix `group_name`. No probe collective: the engine runs
    none, so a probe would wait forever. gloo connects every rank inside the helper (a barrier with a
    deadline); nccl connects lazily on the first broadcast.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = dt.timedelta(seconds=timeout_s)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {r: r for r in range(world_size)}
    return WeightGroup(store, pg, rank, world_size, backend, group_name, timeout_s)
