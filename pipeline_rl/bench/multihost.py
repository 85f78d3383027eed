"""Benchmark 6, multihost: weight-push fan-out from one trainer host to N server hosts over shaped links.

    pipeline-rl bench multihost                    # 100 MB model; links 1 and 10 Gbit/s; N = 1, 2, 4 hosts
    pipeline-rl bench multihost --quick            # 10 MB, 1 Gbit/s, N = 1, 2: smoke test (< 2 min)
    pipeline-rl bench multihost --rates 1gbit --hosts 1,2,4,8 --chunk-kib 1024 --sizes 500mb

Root only (simulated hosts, pipeline_rl/simhosts.py): host `a` plays the trainer, hosts s1..sN each run
one capture-backend server (`python -m inference_shim --backend capture`: the real server and receive
path, no engine) and one bare peer process. Every host's link (both directions) is shaped to the same
rate, as a cluster whose hosts all have the same NIC. Each repeat measures, in a rotated order:

  tcp        one plain TCP stream a -> s1 of the model's bytes (simhosts.measure_throughput): the ceiling
  push N     WeightSender.push_tensors to the servers on s1..sN: what the system does today (gloo broadcast)
  bcast N    a raw gloo broadcast of the same buckets from a to the peers on s1..sN
  chain N    the same buckets relayed along a -> s1 -> ... -> sN (inference_shim/fanout.py), same peers

bcast and chain run on the same processes and groups, so they compare the two algorithms and nothing
else; push vs bcast shows what the servers add. A raw round's time is the longer of the source's sends
and the slowest peer's receive, as in pipeline_rl/bench/gloo_ceiling.py.

The processes of this benchmark (started by it, one per host, inside the host's namespace):
    python -m pipeline_rl.bench.multihost agent --rpc-dir D --address A --model M --hosts 1,2,4 [URL ...]
    python -m pipeline_rl.bench.multihost peer --master A --port P --index I --hosts 1,2,4
The agent (rank 0 of every raw group, and the WeightSender) is driven through command files in D, as
tests/integration/simhost_sender.py is; peers follow the rounds the agent writes into its TCPStore.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import itertools
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline_rl.bench.common import (
    MB,
    BenchContext,
    StealMeter,
    goal_line,
    markdown_table,
    median,
    publish,
    rotate,
    section,
)

# Every collective, relay, push and command of this benchmark; the agent and peers take theirs from
# --timeout-s (set once at process start, in _main), the driver from HostRig(timeout_s=...).
TIMEOUT_S = 120.0
TOKEN = "bench-multihost"  # the capture servers' control token (private namespaces only)
SERVER_PORT = 8100
GROUP_PREFIX = "mh"
ALGORITHMS = ("bcast", "chain")
FLAT_WITHIN = 1.25  # "close to flat": push to the most hosts within this factor of push to one


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
    from pipeline_rl.bench.models import load_named_tensors

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
        argv = [sys.executable, "-m", "pipeline_rl.bench.multihost", "agent", "--rpc-dir", str(self.rpc)]
        argv += ["--address", source.address, *spec, "--nbytes", str(nbytes)]
        argv += ["--model", str(model)] if model else []
        env = source.env(PIPELINE_RL_TOKEN=token, PYTHONUNBUFFERED="1")
        self.proc = source.run([*argv, *urls], env=env, log_path=self.log)
        port = self._wait_file(self.rpc / "store.json", timeout_s)["port"]
        self.peers = []
        for i, host in enumerate(targets[: max(hosts)], start=1):
            argv = [sys.executable, "-m", "pipeline_rl.bench.multihost", "peer", "--master", source.address]
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
@dataclass
class Plan:
    size: str
    rates: list[str]
    hosts: list[int]
    chunk_bytes: int


@dataclass
class Results:
    nbytes: int = 0
    # (rate, variant, n) -> seconds per repeat; variant in tcp | push | bcast | chain
    seconds: dict[tuple[str, str, int], list[float]] = field(default_factory=dict)
    pushes: dict[tuple[str, int], list[dict]] = field(default_factory=dict)
    byte_exact: bool = True

    def add(self, key: tuple[str, str, int], seconds: float) -> None:
        self.seconds.setdefault(key, []).append(seconds)

    def med(self, key: tuple[str, str, int]) -> float:
        return median(self.seconds.get(key, []))


def _plan(ctx: BenchContext) -> Plan:
    from inference_shim.fanout import DEFAULT_CHUNK_BYTES

    sizes = ctx.options.get("sizes") or (["10mb"] if ctx.quick else ["100mb"])
    rates = ctx.options.get("rates") or (["1gbit"] if ctx.quick else ["1gbit", "10gbit"])
    hosts = sorted(set(ctx.options.get("hosts") or ([1, 2] if ctx.quick else [1, 2, 4])))
    chunk = ctx.options.get("chunk_kib")
    return Plan(sizes[0], rates, hosts, chunk * 1024 if chunk else DEFAULT_CHUNK_BYTES)


def servers_needed(ctx: BenchContext) -> list:
    return []  # its servers live on simulated hosts, started by run() itself


def _measure(ctx: BenchContext, plan: Plan, model: Path, results: Results) -> None:
    from inference_shim.procs import wait_healthy
    from pipeline_rl.simhosts import SimNet, measure_throughput

    work = ctx.out_dir / "multihost"
    shutil.rmtree(work / "rpc", ignore_errors=True)  # command files of an earlier run
    work.mkdir(parents=True, exist_ok=True)
    top = max(plan.hosts)
    with SimNet(["a", *(f"s{i}" for i in range(1, top + 1))]) as net:
        a, targets = net["a"], [net[f"s{i}"] for i in range(1, top + 1)]
        servers = []
        for i, host in enumerate(targets, start=1):
            log_path = work / f"server{i}.log"
            url, proc = host.start_server(
                model, SERVER_PORT, token=TOKEN, log_path=log_path, extra=["--backend", "capture"]
            )
            servers.append((url, proc, log_path))
        with a.entered():
            for url, proc, log_path in servers:
                wait_healthy(url, TIMEOUT_S, proc, log_path)
        ctx.log(f"multihost: {top} capture servers up on {[h.address for h in targets]}")
        rig = HostRig(a, targets, hosts=plan.hosts, work=work, model=model, urls=[s[0] for s in servers])
        for rate in plan.rates:
            for host in net.hosts.values():
                host.shape(rate)
            # Warm-up, untimed: first-touch of every buffer; byte-exactness checked once per rate.
            for n in plan.hosts:
                for algo in ALGORITHMS:
                    reply = rig.round(n, algo, verify=True, chunk_bytes=plan.chunk_bytes)
                    if not all(reply["byte_exact"]):
                        results.byte_exact = False
                        ctx.log(f"multihost: {algo} to {n} hosts at {rate} NOT byte-exact: {reply}")
            variants = [("tcp", 1)] + [(v, n) for v in ("push", *ALGORITHMS) for n in plan.hosts]
            for rep in range(ctx.repeats):
                ctx.log(f"multihost {rate}: repeat {rep + 1}/{ctx.repeats}")
                for variant, n in rotate(variants, rep):
                    if variant == "tcp":
                        rate_bps = measure_throughput(a, targets[0], megabytes=results.nbytes / MB)
                        results.add((rate, "tcp", 1), results.nbytes / rate_bps)
                    elif variant == "push":
                        reply = rig.push(n)
                        results.add((rate, "push", n), reply["seconds"])
                        results.pushes.setdefault((rate, n), []).append(reply)
                    else:
                        reply = rig.round(n, variant, chunk_bytes=plan.chunk_bytes)
                        results.add((rate, variant, n), reply["seconds"])
        rig.close()


def _rows(plan: Plan, results: Results) -> tuple[str, list[dict]]:
    rows, summary = [], []
    for rate in plan.rates:
        tcp = results.med((rate, "tcp", 1))
        link = results.nbytes / tcp
        base = {v: results.med((rate, v, plan.hosts[0])) for v in ("push", *ALGORITHMS)}
        for n in plan.hosts:
            push, bcast, chain = (results.med((rate, v, n)) for v in ("push", *ALGORITHMS))
            transfer = median([p["transfer_seconds"] for p in results.pushes.get((rate, n), [])])
            row = {
                "rate": rate,
                "link_mbs": link / MB,
                "hosts": n,
                "push_s": push,
                "transfer_s": transfer,
                "push_of_link": tcp / push,
                "transfer_of_link": tcp / transfer,
                "push_vs_first": push / base["push"],
                "bcast_s": bcast,
                "bcast_vs_first": bcast / base["bcast"],
                "chain_s": chain,
                "chain_of_link": tcp / chain,
                "chain_vs_first": chain / base["chain"],
            }
            summary.append(row)
            rows.append(
                [
                    rate,
                    row["link_mbs"],
                    str(n),
                    push,
                    f"{100 * row['push_of_link']:.0f}%",
                    f"{row['push_vs_first']:.2f}x",
                    transfer,
                    bcast,
                    f"{row['bcast_vs_first']:.2f}x",
                    chain,
                    f"{100 * row['chain_of_link']:.0f}%",
                    f"{row['chain_vs_first']:.2f}x",
                ]
            )
    headers = [
        "link",
        "TCP MB/s",
        "server hosts",
        "push s",
        "push / link",
        "push vs 1 host",
        "push transfer s",
        "bcast s",
        "bcast vs 1 host",
        "chain s",
        "chain / link",
        "chain vs 1 host",
    ]
    return markdown_table(headers, rows), summary


def _goals(plan: Plan, results: Results, summary: list[dict]) -> list[str]:
    name = "full push over a shaped link >= 80% of the link's raw TCP throughput for models >= 100 MB"
    single = [s for s in summary if s["hosts"] == 1]
    if results.nbytes < 100 * MB or not single:
        link_goal = goal_line(name, None, f"model of {results.nbytes / MB:.0f} MB in this run.")
    else:
        per_rate = "; ".join(
            f"{s['rate']}: push {100 * s['push_of_link']:.0f}% end to end, {100 * s['transfer_of_link']:.0f}% "
            f"for its transfer phase, chain relay {100 * s['chain_of_link']:.0f}%"
            for s in single
        )
        link_goal = goal_line(
            name,
            min(s["push_of_link"] for s in single) >= 0.8,
            f"To 1 server host, of the link's TCP throughput: {per_rate}.",
        )
    top = max(plan.hosts)
    widest = [s for s in summary if s["hosts"] == top]
    name = f"push time close to flat in the number of server hosts ({top} hosts within {FLAT_WITHIN}x of 1)"
    if len(plan.hosts) < 2 or not widest:
        flat_goal = goal_line(name, None, "one host count only.")
    else:
        per_rate = "; ".join(
            f"{s['rate']}: push {s['push_vs_first']:.2f}x, raw broadcast {s['bcast_vs_first']:.2f}x, "
            f"chain relay {s['chain_vs_first']:.2f}x"
            for s in widest
        )
        flat_goal = goal_line(
            name,
            max(s["push_vs_first"] for s in widest) <= FLAT_WITHIN,
            f"Time to {top} hosts over time to 1 host: {per_rate}. Today's push is the gloo broadcast; the "
            "chain relay (inference_shim/fanout.py) is not wired into the servers yet and was measured "
            "between bare processes. Every raw round was checked byte-exact at every peer once per rate: "
            f"{'all equal' if results.byte_exact else 'MISMATCH, see the log'}.",
        )
    return [link_goal, flat_goal]


def run(ctx: BenchContext) -> dict:
    from pipeline_rl.bench.models import bench_model, weight_bytes
    from pipeline_rl.simhosts import available

    plan = _plan(ctx)
    ok, why = available()
    results = Results()
    steal = StealMeter()
    intro = (
        f"Simulated hosts (network namespaces on one bridge, `pipeline_rl/simhosts.py`): the trainer on host "
        f"`a`, one capture-backend server and one bare peer process on each of hosts s1..sN, every host's "
        f"link shaped (tbf, both directions) to the rate in the first column. Medians of {ctx.repeats} "
        "interleaved repeats. `TCP MB/s`: one plain TCP stream a -> s1 of the same bytes, the link's "
        "ceiling; `push`: `WeightSender.push_tensors` end to end (HTTP, gloo broadcast, apply, results) to "
        "the N capture servers; `push transfer`: its broadcast/receive phase alone; `bcast`: a raw gloo "
        "broadcast of the same buckets to the N peers; `chain`: the same buckets relayed a -> s1 -> ... -> "
        f"sN in {plan.chunk_bytes // 1024} KiB chunks (`inference_shim/fanout.py`) through the same peers. "
        "`x / link` = TCP time / x time for the same bytes; `vs 1 host` = time over the time to one host. "
        "All processes share this VM's 2 cores: at 10 Gbit/s the CPU, not the link, bounds the relays."
    )
    if not ok:
        ctx.log(f"multihost: skipped: {why}")
        table = markdown_table(["link", "server hosts", "push / link"], [["-", "-", f"skipped: {why}"]])
        markdown = section(ctx, "6. multihost", intro, [table], [goal_line("multihost", None, why)])
        publish(ctx, "multihost", markdown)
        data = {"summary": [], "skipped": why}
        ctx.save_json("multihost", data)
        return data
    model = bench_model(plan.size)
    results.nbytes = weight_bytes(model)
    ctx.log(f"multihost: {plan.size} ({results.nbytes / MB:.0f} MB), rates {plan.rates}, hosts {plan.hosts}")
    _measure(ctx, plan, model, results)
    table, summary = _rows(plan, results)
    markdown = section(
        ctx, "6. multihost", intro, [table], _goals(plan, results, summary), (), steal.percent()
    )
    publish(ctx, "multihost", markdown)
    data = {
        "summary": summary,
        "bytes": results.nbytes,
        "byte_exact": results.byte_exact,
        "seconds": {str(k): v for k, v in results.seconds.items()},
        "pushes": {str(k): v for k, v in results.pushes.items()},
    }
    ctx.save_json("multihost", data)
    return data


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
