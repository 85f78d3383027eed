"""The chain relay (inference_shim/fanout.py) over real gloo: byte-exact at every rank, deadlines, and
one copy's time over a shaped trainer link across simulated hosts.

    .venv/bin/python -m pytest -q tests/integration/test_fanout.py                 # ~1 min, root for the last two
    .venv/bin/python -m pytest -q -m "not slow" tests/integration/test_fanout.py   # the in-process ones only

The in-process tests run every rank of a gloo group as a thread of this process (gloo releases the GIL
while it waits), on loopback. The simulated-host tests start the relay's sender on host `a` and one
receiver process per host (pipeline_rl/testing/hostrig.py's agent and peers, the benchmark's own
processes), each in its network namespace, and compare with a TCP stream over the same shaped link.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from inference_shim.fanout import FanoutError, relay, start_send
from inference_shim.transfer import WeightGroup, connect_store, join_group
from pipeline_rl.testing.simhosts import SimNet, available, measure_throughput

OK, WHY = available()
TIMEOUT_S = 30.0


def _threads(world: int, body) -> list:
    """Run body(group) for every rank of a fresh loopback gloo group, one thread per rank; results by rank."""
    store = connect_store("127.0.0.1", 0, is_master=True, world_size=None, timeout_s=TIMEOUT_S)
    results: list = [None] * world

    def rank_main(rank: int) -> None:
        try:
            s = store if rank == 0 else connect_store("127.0.0.1", store.port, is_master=False,
                                                       world_size=None, timeout_s=TIMEOUT_S)  # fmt: skip
            group = join_group(
                s, rank=rank, world_size=world, backend="gloo", group_name="t", timeout_s=TIMEOUT_S
            )
            results[rank] = body(group)
        except BaseException as e:  # handed to the test's thread
            results[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a rank hung past every deadline"
    return results


def test_relay_is_byte_exact_at_every_rank_in_any_order_with_buckets_in_flight():
    """Four ranks, an order that is not rank order, sizes that are not multiples of the chunk, two
    buckets in flight at the source (slots 0 and 1) as WeightSender keeps them."""
    order = [0, 2, 3, 1]
    sizes = [3_000_001, 17, 2_500_000]
    chunk = 256 * 1024
    source = torch.randint(
        0, 256, (sum(sizes),), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
    )

    def body(group: WeightGroup) -> torch.Tensor:
        buffer = source.clone() if group.rank == 0 else torch.zeros_like(source)
        offset, pending = 0, None
        for i, size in enumerate(sizes):
            view = buffer[offset : offset + size]
            offset += size
            if group.rank == 0:
                handle = start_send(group.pg, view, order=order, chunk_bytes=chunk, slot=i % 2)
                if pending is not None:
                    pending.wait(TIMEOUT_S)
                pending = handle
            else:
                relay(
                    group.pg,
                    view,
                    rank=group.rank,
                    order=order,
                    timeout_s=TIMEOUT_S,
                    chunk_bytes=chunk,
                    slot=i % 2,
                )
        if pending is not None:
            pending.wait(TIMEOUT_S)
        return buffer

    results = _threads(4, body)
    for rank, got in enumerate(results):
        assert not isinstance(got, BaseException), f"rank {rank}: {got!r}"
        assert torch.equal(got, source), f"rank {rank} received different bytes"


def test_a_rank_whose_predecessor_never_sends_fails_within_its_deadline_naming_the_peer():
    def body(group: WeightGroup):
        if group.rank == 0:
            time.sleep(2.5)  # the source never sends; it only outlives the receiver's deadline
            return None
        start = time.monotonic()
        with pytest.raises(FanoutError, match="rank 1: receiving chunk 0 from rank 0") as caught:
            relay(group.pg, torch.zeros(1000, dtype=torch.uint8), rank=1, order=[0, 1], timeout_s=1.0)
        return time.monotonic() - start, caught.value

    results = _threads(2, body)
    assert not isinstance(results[1], BaseException), repr(results[1])
    elapsed, _ = results[1]
    assert 0.9 <= elapsed <= 5.0, elapsed


@pytest.mark.slow
@pytest.mark.skipif(not OK, reason=WHY)
def test_chain_across_hosts_is_byte_exact_and_costs_one_copy_over_the_shaped_trainer_link(tmp_path: Path):
    """Sender on a (link shaped to 200 Mbit/s), three receivers on three other hosts (links unshaped).

    A broadcast makes a's link carry several copies; the chain carries one, so it must take about as long
    as one TCP stream of the same bytes over that link (plus the pipeline fill, a few 1 MiB chunks).
    """
    from pipeline_rl.testing.hostrig import HostRig

    nbytes = 20_000_000  # ~0.8 s per copy at 200 Mbit/s: long against the fill and the noise
    with SimNet(["a", "r1", "r2", "r3"]) as net:
        a = net["a"]
        rig = HostRig(a, [net["r1"], net["r2"], net["r3"]], hosts=[3], work=tmp_path, nbytes=nbytes)
        for algo in ("chain", "bcast"):  # warm-up: first touch of every receive buffer
            rig.round(3, algo)
        a.shape("200mbit")
        one_copy = nbytes / measure_throughput(a, net["r1"], megabytes=nbytes / 1e6)
        chain = rig.round(3, "chain", verify=True)
        bcast = rig.round(3, "bcast", verify=True)
        rig.close()
    assert chain["byte_exact"] == [True, True, True], chain
    assert bcast["byte_exact"] == [True, True, True], bcast
    # Generous bounds (shared 2-core VM): one copy + fill, and clearly below the broadcast's copies.
    assert chain["seconds"] <= 1.3 * one_copy + 0.2, (chain, one_copy)
    assert chain["seconds"] < 0.8 * bcast["seconds"], (chain, bcast)


@pytest.mark.slow
@pytest.mark.skipif(not OK, reason=WHY)
def test_a_cut_link_in_the_middle_of_the_chain_fails_the_ranks_behind_it_within_the_deadline(tmp_path: Path):
    """r2's cable is cut mid-relay: the round fails at the sender (its barrier after the sends, or a send,
    times out) within the processes' deadline instead of hanging."""
    from pipeline_rl.testing import hostrig as multihost

    deadline_s = 10.0
    with SimNet(["a", "r1", "r2", "r3"]) as net:
        targets = [net["r1"], net["r2"], net["r3"]]
        rig = multihost.HostRig(
            net["a"], targets, hosts=[3], work=tmp_path, nbytes=40_000_000, timeout_s=deadline_s
        )
        rig.round(3, "chain")
        net["a"].shape("50mbit")  # ~6 s per copy: time to cut in flight
        n = rig.n
        multihost._write_json(rig.rpc / f"cmd-{n}.json", {"op": "round", "n": 3, "algo": "chain", "verify": False,
                                                          "chunk_bytes": 1 << 20, "sizes": None})  # fmt: skip
        rig.n += 1
        time.sleep(2.0)
        net["r2"].link(False)
        start = time.monotonic()
        reply = rig._wait_file(rig.rpc / f"reply-{n}.json", 3 * deadline_s)
        assert not reply["ok"], reply
        assert time.monotonic() - start <= 2 * deadline_s, reply
