"""The transport ceiling of a weight push: a raw gloo broadcast of the same bucket sizes between plain
processes, with the same inference_shim.transfer group code the trainer and servers use, and no HTTP,
no engine, no packing and no apply.

    with RawGloo(receivers=2) as gloo:                 # this process is rank 0; receivers are children
        seconds = gloo.broadcast(source, [bucket.nbytes for bucket in buckets])

Receivers are `python -m benchmarks.gloo_ceiling --port P --rank R --world W` child processes. Rounds are
driven through the group's TCPStore: rank 0 writes round i's bucket sizes to a key and every rank meets
at a barrier. A round's time is defined exactly as a push's transfer time is (benchmarks/weight_sync.py):
the longer of rank 0's broadcast (first send to last completion) and the slowest receiver's receive,
because gloo's root can finish sending while bytes still sit in socket buffers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time

import torch

from inference_shim.transfer import (
    WeightGroup,
    broadcast_bucket,
    connect_store,
    join_group,
    start_broadcast,
    wait_work,
)

_GROUP = "bench-gloo"
TIMEOUT_S = 120.0


def _round_key(i: int) -> str:
    return f"{_GROUP}/round/{i}"


def _received_key(i: int, rank: int) -> str:
    return f"{_GROUP}/round/{i}/received/{rank}"


def _barrier(group: WeightGroup) -> None:
    wait_work(group, group.pg.allreduce([torch.zeros(1)]), "barrier")


class RawGloo:
    """Rank 0 of a gloo group with `receivers` child processes as ranks 1..receivers."""

    def __init__(self, receivers: int) -> None:
        self.receivers = receivers
        self._round = 0
        self._procs: list[subprocess.Popen] = []
        self.group: WeightGroup | None = None

    def __enter__(self) -> RawGloo:
        world = self.receivers + 1
        store = connect_store("127.0.0.1", 0, is_master=True, world_size=None, timeout_s=TIMEOUT_S)
        for rank in range(1, world):
            cmd = [sys.executable, "-m", "benchmarks.gloo_ceiling", "--port", str(store.port)]
            cmd += ["--rank", str(rank), "--world", str(world)]
            self._procs.append(subprocess.Popen(cmd))
        self.group = join_group(
            store, rank=0, world_size=world, backend="gloo", group_name=_GROUP, timeout_s=TIMEOUT_S
        )
        return self

    def broadcast(self, source: torch.Tensor, sizes: list[int], fresh: bool = False) -> float:
        """Seconds to broadcast consecutive slices of `source` with these sizes to every receiver.

        fresh=True: receivers allocate new buffers for the round (as a server's staging does) instead of
        reusing buffers they have already touched, which exposes the cost of first-touch page faults.
        """
        group = self.group
        group.store.set(_round_key(self._round), json.dumps({"sizes": sizes, "fresh": fresh}))
        self._round += 1
        _barrier(group)
        start = time.perf_counter()
        # Two buckets on the wire at a time, as WeightSender.push does.
        in_flight = None
        offset = 0
        for size in sizes:
            work = start_broadcast(group, source[offset : offset + size])
            offset += size
            if in_flight is not None:
                wait_work(group, in_flight, "raw broadcast")
            in_flight = work
        if in_flight is not None:
            wait_work(group, in_flight, "raw broadcast")
        seconds = time.perf_counter() - start
        _barrier(group)  # every receiver has written its receive time
        received = [
            float(group.store.get(_received_key(self._round - 1, rank)))
            for rank in range(1, self.receivers + 1)
        ]
        return max(seconds, *received)

    def __exit__(self, *exc: object) -> None:
        if self.group is not None:
            self.group.store.set(_round_key(self._round), json.dumps({"stop": True}))
        for proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _receiver(port: int, rank: int, world: int) -> None:
    store = connect_store("127.0.0.1", port, is_master=False, world_size=None, timeout_s=TIMEOUT_S)
    group = join_group(
        store, rank=rank, world_size=world, backend="gloo", group_name=_GROUP, timeout_s=TIMEOUT_S
    )
    staging = torch.empty(0, dtype=torch.uint8)
    i = 0
    while True:
        key = _round_key(i)
        # Rounds may be minutes apart (the benchmark pushes to servers in between). The store lives in
        # the benchmark process, so if that process dies this wait fails at once and we exit.
        try:
            store.wait([key], dt.timedelta(hours=2))
        except Exception:
            return
        spec = json.loads(store.get(key))
        if spec.get("stop"):
            return
        total = sum(spec["sizes"])
        if spec["fresh"] or staging.numel() < total:
            staging = torch.empty(total, dtype=torch.uint8)
        _barrier(group)
        start = time.perf_counter()
        offset = 0
        for size in spec["sizes"]:
            broadcast_bucket(group, staging[offset : offset + size], "raw receive")
            offset += size
        store.set(_received_key(i, rank), str(time.perf_counter() - start))
        _barrier(group)
        if spec["fresh"]:
            staging = torch.empty(0, dtype=torch.uint8)
        i += 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A raw gloo broadcast receiver (spawned by RawGloo).")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    args = parser.parse_args()
    _receiver(args.port, args.rank, args.world)
