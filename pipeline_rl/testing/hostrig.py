"""The processes of the multihost benchmark (benchmarks/multihost.py) and the rig that runs them.

One per simulated host, inside the host's namespace (pipeline_rl/testing/simhosts.py):
    python -m pipeline_rl.testing.hostrig agent --rpc-dir D --address A --model M --hosts 1,2,4 [URL ...]
    python -m pipeline_rl.testing.hostrig peer --master A --port P --index I --hosts 1,2,4
The agent (rank 0 of every raw group, and the WeightSender) is driven through command files in D, as
tests/integration/simhost_sender.py is; peers follow the rounds the agent writes into its TCPStore.
HostRig starts them (and one capture-backend server per server host) and runs rounds; the benchmark and
tests/integration/test_fanout.py use it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import itertools
import json
import os
import sys
import time
from pathlib import Path

# Every collective, relay, push and command of this benchmark; the agent and peers take theirs from
# --timeout-s (set once at process start, in _main), the driver from HostRig(timeout_s=...).
TIMEOUT_S = 120.0
TOKEN = "bench-multihost"  # the capture servers' control token (private namespaces only)
SERVER_PORT = 8100
GROUP_PREFIX = "mh"
ALGORITHMS = ("bcast", "chain")


# ---------------------------------------------------------------------------------------------------
# Processes on the simulated hosts: the agent (rank 0, trainer stand-in) and the peers
# ---------------------------------------------------------------------------------------------------
def _round_key(i: int) -> str:
    return f"{GROUP_PREFIX}/round/{i}"


def _received_key(i: int, rank: int) -> str:
    return f"{GROUP_PREFIX}/round/{i}/received/{rank}"


def _groups(store, rank: int, hosts: list[int]) -> dict:
    """Join the raw group of every N >= rank: group N has the agent (rank 0) and peers 1..N.

    Every process joins in increasing N, so no join waits on a process still blocked in another.
    """
    from inference_shim.transfer import join_group

    return {
        n: join_group(
            store,
            rank=rank,
            world_size=n + 1,
            backend="gloo",
            group_name=f"{GROUP_PREFIX}{n}",
            timeout_s=TIMEOUT_S,
        )
        for n in sorted(hosts)
        if n >= rank
    }


def _barrier(group) -> None:
    import torch

    from inference_shim.transfer import wait_work

    wait_work(group, group.pg.allreduce([torch.zeros(1)]), "barrier")


def _digest(buffer) -> str:
    return hashlib.sha256(buffer.numpy().tobytes()).hexdigest()


def _transfer(group, buffer, sizes: list[int], algo: str, rank: int, chunk_bytes: int) -> None:
    """Every bucket of `buffer` from rank 0 to the group's other ranks, two buckets in flight at rank 0
    (as WeightSender.push keeps them), one at a time on the receiving side (as receive_buckets does)."""
    from inference_shim.fanout import relay, start_send
    from inference_shim.transfer import broadcast_bucket, start_broadcast, wait_work

    order = list(range(group.world_size))
    offset, in_flight = 0, None
    for i, size in enumerate(sizes):
        view = buffer[offset : offset + size]
        offset += size
        what = f"bucket {i} ({algo})"
        if rank != 0:
            if algo == "bcast":
                broadcast_bucket(group, view, what)
            else:
                relay(
                    group.pg,
                    view,
                    rank=rank,
                    order=order,
                    timeout_s=TIMEOUT_S,
                    chunk_bytes=chunk_bytes,
                    slot=i % 2,
                )
            continue
        if algo == "bcast":
            work = start_broadcast(group, view)
            waiter = lambda w=work, what=what: wait_work(group, w, what)  # noqa: E731
        else:
            handle = start_send(group.pg, view, order=order, chunk_bytes=chunk_bytes, slot=i % 2)
            waiter = lambda h=handle: h.wait(TIMEOUT_S)  # noqa: E731
        if in_flight is not None:
            in_flight()
        in_flight = waiter
    if in_flight is not None:
        in_flight()


def _peer(args: argparse.Namespace) -> None:
    import torch

    from inference_shim.transfer import connect_store

    torch.set_num_threads(1)
    store = connect_store(args.master, args.port, is_master=False, world_size=None, timeout_s=TIMEOUT_S)
    groups = _groups(store, args.index, args.hosts)
    staging = torch.empty(0, dtype=torch.uint8)
    for i in itertools.count():
        try:  # rounds may be minutes apart; if the agent is gone the wait fails at once and we exit
            store.wait([_round_key(i)], dt.timedelta(hours=2))
        except Exception:
            return
        spec = json.loads(store.get(_round_key(i)))
        if spec.get("stop"):
            return
        if args.index > spec["n"]:
            continue  # not in this round's group
        group, total = groups[spec["n"]], sum(spec["sizes"])
        if staging.numel() < total:
            staging = torch.zeros(total, dtype=torch.uint8)  # reused afterwards, like a server's staging
        if spec["verify"]:
            staging.zero_()  # nothing left over from an earlier round can pass the check
        _barrier(group)
        start = time.perf_counter()
        _transfer(group, staging, spec["sizes"], spec["algo"], args.index, spec["chunk_bytes"])
        seconds = time.perf_counter() - start
        digest = _digest(staging[:total]) if spec["verify"] else None
        store.set(_received_key(i, args.index), json.dumps({"seconds": seconds, "digest": digest}))
        _barrier(group)


def _agent_round(store, groups: dict, i: int, spec: dict, source) -> dict:
    n, total = spec["n"], sum(spec["sizes"])
    store.set(_round_key(i), json.dumps(spec))
    group = groups[n]
    _barrier(group)
    start = time.perf_counter()
    _transfer(group, source, spec["sizes"], spec["algo"], 0, spec["chunk_bytes"])
    source_seconds = time.perf_counter() - start
    _barrier(group)  # every peer has written its receipt
    receipts = [json.loads(store.get(_received_key(i, rank))) for rank in range(1, n + 1)]
    reply = {
        "seconds": max(source_seconds, *(r["seconds"] for r in receipts)),
        "source_seconds": source_seconds,
        "receive_seconds": [r["seconds"] for r in receipts],
    }
    if spec["verify"]:
        want = _digest(source[:total])
        reply["byte_exact"] = [r["digest"] == want for r in receipts]
    return reply


def _agent(args: argparse.Namespace) -> None:
    """Rank 0 of the raw groups and the trainer's WeightSender, on the trainer's host; see the docstring."""
    import logging

    import torch

    from inference_shim.protocol import DEFAULT_BUCKET_BYTES, plan_buckets
    from inference_shim.transfer import connect_store, tensor_meta
    from inference_shim.weight_sender import WeightSender
    from pipeline_rl.testing.models import load_named_tensors

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)  # a trainer computes nothing during a push; the peers need the cores
    rpc = Path(args.rpc_dir)
    store = connect_store(args.address, 0, is_master=True, world_size=None, timeout_s=TIMEOUT_S)
    _write_json(rpc / "store.json", {"port": store.port})
    groups = _groups(store, 0, args.hosts)

    if args.model:
        named = load_named_tensors(Path(args.model))
        metas = [tensor_meta(name, t) for name, t in named]
        sizes = [b.nbytes for b in plan_buckets(metas, DEFAULT_BUCKET_BYTES)]
    else:
        named, sizes = [], [int(args.nbytes)]
    seed = torch.Generator().manual_seed(0)
    source = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8, generator=seed)
    version = itertools.count(1_000_000)  # above anything the servers served; strictly increasing
    rounds = itertools.count()

    def execute(cmd: dict) -> dict:
        if cmd["op"] == "round":
            spec = {k: cmd[k] for k in ("n", "algo", "verify", "chunk_bytes")}
            spec["sizes"] = cmd.get("sizes") or sizes
            return _agent_round(store, groups, next(rounds), spec, source)
        if cmd["op"] == "push":
            sender = WeightSender(
                args.urls[: cmd["n"]], token=os.environ.get("PIPELINE_RL_TOKEN"), timeout_s=TIMEOUT_S,
                master_address=args.address,
            )  # fmt: skip
            sender.connect()
            try:
                sender.push_tensors(next(version), named)  # untimed: the sender's pack buffers, once
                report = sender.push_tensors(next(version), named)
            finally:
                sender.close()
            receive = max(r.receive_seconds for r in report.results)
            return {
                "seconds": report.total_seconds,
                "transfer_seconds": max(report.broadcast_seconds, receive),
                "request_seconds": report.request_seconds,
                "apply_seconds": max(r.apply_seconds for r in report.results),
                "bytes": report.total_bytes,
            }
        raise ValueError(f"unknown op {cmd['op']!r}")

    parent = os.getppid()
    for n in itertools.count():
        path = rpc / f"cmd-{n}.json"
        while not path.exists():
            if os.getppid() != parent:  # the driver died: nobody will ever ask us to stop
                return
            time.sleep(0.02)
        cmd = json.loads(path.read_text())
        if cmd["op"] == "close":
            store.set(_round_key(next(rounds)), json.dumps({"stop": True}))
            _write_json(rpc / f"reply-{n}.json", {"ok": True})
            return
        try:
            reply = {"ok": True, **execute(cmd)}
        except Exception as e:  # reported to the driver, which raises with it
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        _write_json(rpc / f"reply-{n}.json", reply)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name("." + path.name)
    tmp.write_text(json.dumps(data))
    tmp.rename(path)  # readers never see half a file


# ---------------------------------------------------------------------------------------------------
# The driver side: a rig of agent + peers (+ servers), used by the benchmark and tests/integration/test_fanout.py
# ---------------------------------------------------------------------------------------------------
class HostRig:
    """An agent on `source` and one peer per host in `targets` (SimHosts), ranks in that order.

        with SimNet(["a", "s1", "s2"]) as net:
            rig = HostRig(net["a"], [net["s1"], net["s2"]], hosts=[1, 2], work=Path(tmp), nbytes=10**7)
            rig.round(2, "chain", verify=True)    # {"seconds": ..., "byte_exact": [True, True], ...}

    model: the agent pushes that checkpoint (push) and raw rounds use its bucket layout; without one,
    raw rounds move one bucket of `nbytes` random bytes. urls: the servers a push goes to, in host order.
    Everything is stopped with the SimNet.
    """

    def __init__(
        self,
        source,
        targets: list,
        *,
        hosts: list[int],
        work: Path,
        model: Path | None = None,
        nbytes: int = 0,
        urls: list[str] = (),
        token: str = TOKEN,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        if max(hosts) > len(targets):
            raise ValueError(f"{max(hosts)} hosts requested, {len(targets)} given")
        self.rpc = work / "rpc"
        self.rpc.mkdir(parents=True)
        self.log = work / "agent.log"
        self.n = 0
        self.timeout_s = timeout_s
        spec = ["--hosts", ",".join(map(str, hosts)), "--timeout-s", str(timeout_s)]
        argv = [sys.executable, "-m", "pipeline_rl.testing.hostrig", "agent", "--rpc-dir", str(self.rpc)]
        argv += ["--address", source.address, *spec, "--nbytes", str(nbytes)]
        argv += ["--model", str(model)] if model else []
        env = source.env(PIPELINE_RL_TOKEN=token, PYTHONUNBUFFERED="1")
        self.proc = source.run([*argv, *urls], env=env, log_path=self.log)
        port = self._wait_file(self.rpc / "store.json", timeout_s)["port"]
        self.peers = []
        for i, host in enumerate(targets[: max(hosts)], start=1):
            argv = [
                sys.executable,
                "-m",
                "pipeline_rl.testing.hostrig",
                "peer",
                "--master",
                source.address,
            ]
            argv += ["--port", str(port), "--index", str(i), *spec]
            self.peers.append(
                host.run(argv, env=host.env(PYTHONUNBUFFERED="1"), log_path=work / f"peer{i}.log")
            )

    def _wait_file(self, path: Path, deadline_s: float) -> dict:
        from inference_shim.procs import log_tail

        deadline = time.monotonic() + deadline_s
        while not path.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited ({self.proc.returncode}); log:\n{log_tail(self.log)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"agent: no {path.name} in {deadline_s:.0f}s; log:\n{log_tail(self.log)}")
            time.sleep(0.02)
        return json.loads(path.read_text())

    def call(self, op: str, **args: object) -> dict:
        n, self.n = self.n, self.n + 1
        _write_json(self.rpc / f"cmd-{n}.json", {"op": op, **args})
        reply = self._wait_file(self.rpc / f"reply-{n}.json", 3 * self.timeout_s)
        if not reply["ok"]:
            raise RuntimeError(f"agent: {op} {args} failed: {reply['error']}")
        return reply

    def round(self, n: int, algo: str, *, verify: bool = False, chunk_bytes: int | None = None,
              sizes: list[int] | None = None) -> dict:  # fmt: skip
        """One raw transfer to the peers 1..n with `algo` ("bcast" or "chain")."""
        from inference_shim.fanout import DEFAULT_CHUNK_BYTES

        chunk = chunk_bytes or DEFAULT_CHUNK_BYTES
        return self.call("round", n=n, algo=algo, verify=verify, chunk_bytes=chunk, sizes=sizes)

    def push(self, n: int) -> dict:
        """A full WeightSender push of the model to the first n servers (a fresh group, one untimed push)."""
        return self.call("push", n=n)

    def close(self) -> None:
        self.call("close")
        for proc in [self.proc, *self.peers]:
            proc.wait(timeout=30)


# ---------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------


def _main() -> None:
    global TIMEOUT_S
    p = argparse.ArgumentParser(description="multihost benchmark processes (started by the benchmark)")
    roles = p.add_subparsers(dest="role", required=True)
    hosts = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    agent = roles.add_parser("agent")
    agent.add_argument("--rpc-dir", required=True)
    agent.add_argument("--address", required=True, help="this host's address: the store listens there")
    agent.add_argument("--hosts", type=hosts, required=True)
    agent.add_argument("--model", default=None)
    agent.add_argument("--nbytes", type=int, default=0, help="raw rounds without a model: bytes per round")
    agent.add_argument("urls", nargs="*")
    peer = roles.add_parser("peer")
    peer.add_argument("--master", required=True)
    peer.add_argument("--port", type=int, required=True)
    peer.add_argument("--index", type=int, required=True)
    peer.add_argument("--hosts", type=hosts, required=True)
    for role in (agent, peer):
        role.add_argument("--timeout-s", type=float, default=TIMEOUT_S)
    args = p.parse_args()
    TIMEOUT_S = args.timeout_s  # this process's deadline for everything (see the constant)
    (_agent if args.role == "agent" else _peer)(args)


if __name__ == "__main__":
    _main()
