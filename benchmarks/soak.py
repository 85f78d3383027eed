"""`python -m benchmarks soak`: one launched run under random faults from every role, for a fixed time.

    python -m benchmarks soak                       # demo recipe, 30 min, >= 20 faults, seed 0
    python -m benchmarks soak --run-s 600 --first-seed 3   # 10 minutes (>= 7 faults), seed 3
    python -m benchmarks soak --quick               # tiny model on the torch engine, 170 s, >= 5 faults
    python -m benchmarks soak --quick --hosts 1     # the same over two simulated hosts (root)

The driver draws a seeded schedule of faults spread over the run, every role in turn before any twice:
SIGKILL of an actor, a preprocessor, a server, the trainer and the run's Redis; SIGSTOP of an actor, a
preprocessor or a server for a few seconds, then SIGCONT; and, over simulated hosts, the servers' host's
link cut for a few seconds, then healed. Each fault is logged (time, kind, target, pid); after a kill
the driver waits for the launcher's "restarted <name>", after a cut for every server to serve the
trainer's version again, before the next one. The run ends at max_wall_s (the trainer checkpoints and
stops). What must hold: the launcher exits 0; every server serves the last version; the sample ledger's
positive accounting establishes lost = 0 and no sample trained twice (pipeline_rl/ledger.py); every
role restarted. Reported: steps, restarts per role, lost / abandoned / located, trained samples per
second in windows over the run with each fault marked on the plot.

Over simulated hosts (the full soak by default where root allows, `--hosts 1` asks for it, `--hosts 0`
runs on one host): network namespaces on one switch (pipeline_rl/testing/simhosts.py), one cluster
file, `pipeline-rl launch --cluster F --node X` in each: host `a` runs Redis, the trainer, the
preprocessor and the actor, host `b` the two servers, so a cut of b's link takes every server away
from the trainer and the actor at once: a push that meets the cut fails on both servers, and with no
server left to go on with the trainer exits and is restarted from its checkpoint by a's launcher, which
re-admits them once the link is back; the actor's requests stall, then resume or are retried.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil

from benchmarks.common import REPO_ROOT, BenchContext, first_seed, goal_line, markdown_table, publish, section

NAME = "soak"
RUN_S = {"full": 1800, "quick": 170}
MIN_FAULTS = {"full": 20, "quick": 5}  # at RUN_S; other lengths at the full density
STOP_S = (2.0, 6.0)  # how long a SIGSTOP lasts
RESTART_WAIT_S = 240.0
# (role of the target, what is done to it); the kills of every role come first in each round
KILLS = [
    ("actor", "kill"),
    ("preprocessor", "kill"),
    ("server", "kill"),
    ("trainer", "kill"),
    ("redis", "kill"),
]
STOPS = [("actor", "stop"), ("preprocessor", "stop"), ("server", "stop")]
LINK_CUTS = [("link", "cut")]  # over simulated hosts only: the servers' host's cable
LINK_CUT_S = (4.0, 10.0)  # how long a link stays cut
FAULT_SETTINGS = [
    "trainer.checkpoint_every=4",
    "trainer.push_timeout_s=30",
    "trainer.rejoin_check_s=1",
    "supervision.actor.backoff_s=0.5",
    "supervision.preprocessor.backoff_s=0.5",
    "supervision.server.backoff_s=0.5",
    "supervision.trainer.backoff_s=0.5",
    "supervision.redis.backoff_s=0.2",
    "supervision.actor.max_restarts=100",
    "supervision.preprocessor.max_restarts=100",
    "supervision.server.max_restarts=100",
    "supervision.trainer.max_restarts=100",
    "supervision.redis.max_restarts=100",
    "actor.stats_interval_s=1",
    "eval.every_s=0",
]


def servers_needed(ctx: BenchContext) -> list:
    return []  # the run starts its own servers through the launcher


@dataclass
class Fault:
    at_s: float  # planned, from the run's start
    role: str
    action: str  # kill | stop
    target: str = ""  # the process, e.g. actor0
    pid: int = 0
    fired_s: float = 0.0  # when it was sent, from the run's start
    recovered_s: float | None = None  # restarted (kill) or continued (stop), from the run's start
    error: str | None = None


def schedule(seed: int, span_s: float, min_faults: int, link_cuts: bool = False) -> list[Fault]:
    """`min_faults` faults spread over `span_s` seconds (from the moment the run is up), each round every
    kind once (kills of all five roles and, over simulated hosts, the link cut first, shuffled; then the
    stops, shuffled)."""
    rng = random.Random(seed)
    kinds: list[tuple[str, str]] = []
    while len(kinds) < min_faults:
        kills, stops = KILLS + (LINK_CUTS if link_cuts else []), list(STOPS)
        rng.shuffle(kills)
        rng.shuffle(stops)
        kinds += kills + stops
    kinds = kinds[:min_faults]
    start, end = 0.05 * span_s, span_s
    gap = (end - start) / max(1, len(kinds) - 1)
    return [
        Fault(at_s=start + i * gap + rng.uniform(-0.2, 0.2) * gap, role=role, action=action)
        for i, (role, action) in enumerate(kinds)
    ]


class LaunchedRun:
    """`pipeline-rl launch` as a child; its output kept in memory by a reader thread."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self.started = time.monotonic()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self.log.write(line)
            self.log.flush()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def wait_for(self, pattern: str, timeout_s: float, after: int = 0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if re.search(pattern, "".join(self.lines[after:])):
                return True
            time.sleep(0.2)
        return bool(re.search(pattern, "".join(self.lines[after:])))

    def pid_of(self, name: str) -> int | None:
        found = re.findall(rf"(?:re)?started {name} \(pid (\d+)\)", self.output)
        return int(found[-1]) if found else None

    def redis_pid(self) -> int | None:
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.Error:
            return None
        return next((c.pid for c in children if c.name() == "redis-server"), None)


class Job:
    """The launched job the faults hit: one launcher on this host, or one per simulated host (`net`).

    Where each role runs (`run_of`), the status of every launcher, and HTTP to the job's servers from where
    the job sees them (inside host a over simulated hosts)."""

    def __init__(self, runs: dict[str, LaunchedRun], status_ports: dict[str, int], net=None) -> None:
        self.runs = runs  # node name -> its launcher ("local" on one host)
        self.status_ports = status_ports
        self.net = net
        self.server_urls: list[str] = []

    @property
    def main(self) -> LaunchedRun:
        """The launcher of the trainer, Redis, actors and preprocessors."""
        return self.runs["a" if self.net is not None else "local"]

    def run_of(self, role: str) -> LaunchedRun:
        return self.runs["b"] if self.net is not None and role == "server" else self.main

    def _inside(self, node: str):
        return self.net[node].entered() if self.net is not None else contextlib.nullcontext()

    def status(self, node: str) -> dict:
        with self._inside(node):
            return httpx.get(f"http://127.0.0.1:{self.status_ports[node]}/status", timeout=10).json()

    def restarts(self) -> dict[str, int]:
        """Restarts per role, summed over the launchers (those that could not be asked are left out)."""
        total: dict[str, int] = {}
        for node in self.runs:
            try:
                counts = self.status(node)["restarts"]
            except (httpx.HTTPError, ValueError, KeyError):
                continue
            for role, n in counts.items():
                total[role] = total.get(role, 0) + n
        return total

    def server_versions(self) -> list[int | None]:
        """Each server's weight version by its /health, asked from the trainer's host (None: no answer)."""
        versions = []
        with self._inside("a" if self.net is not None else "local"):
            for url in self.server_urls:
                try:
                    versions.append(httpx.get(f"{url}/health", timeout=5).json().get("weight_version"))
                except (httpx.HTTPError, ValueError):
                    versions.append(None)
        return versions


def _target(job: Job, fault: Fault, rng: random.Random, counts: dict[str, int]) -> None:
    run = job.run_of(fault.role)
    if fault.role == "redis":
        fault.target, fault.pid = "redis", run.redis_pid() or 0
        return
    name = "trainer" if fault.role == "trainer" else f"{fault.role}{rng.randrange(counts[fault.role])}"
    fault.target, fault.pid = name, run.pid_of(name) or 0


def fire(job: Job, fault: Fault, rng: random.Random, counts: dict[str, int]) -> None:
    """Send the fault and wait until the run recovered from it (bounded)."""
    if fault.action == "cut":
        cut_link(job, fault, rng)
        return
    _target(job, fault, rng, counts)
    if not fault.pid:
        fault.error = f"no pid for {fault.target}"
        return
    run = job.run_of(fault.role)
    mark = len(run.lines)
    fault.fired_s = job.main.elapsed()
    try:
        if fault.action == "kill":
            # A process group (the server's engine, the trainer's ranks) dies whole; Redis is one process.
            (
                psutil.Process(fault.pid).kill()
                if fault.role == "redis"
                else _killpg(fault.pid, signal.SIGKILL)
            )
            if run.wait_for(rf"restarted {fault.target}\b", RESTART_WAIT_S, after=mark):
                fault.recovered_s = job.main.elapsed()
            else:
                fault.error = f"{fault.target} was not restarted within {RESTART_WAIT_S:.0f}s"
        else:
            _killpg(fault.pid, signal.SIGSTOP)
            try:
                time.sleep(rng.uniform(*STOP_S))
            finally:
                _killpg(fault.pid, signal.SIGCONT)
            fault.recovered_s = job.main.elapsed()
    except (ProcessLookupError, psutil.Error) as e:
        fault.error = f"{type(e).__name__}: {e}"


def cut_link(job: Job, fault: Fault, rng: random.Random) -> None:
    """Cut the servers' host's cable for a few seconds, heal it, and wait until every server serves the
    trainer's version of the moment the link came back (ejected, re-admitted, pushed to)."""
    host = job.net["b"]
    fault.target = "b"
    fault.fired_s = job.main.elapsed()
    try:
        host.link(False)
        try:
            time.sleep(rng.uniform(*LINK_CUT_S))
        finally:
            host.link(True)
        healed_version = job.status("a")["weight_version"]
    except (httpx.HTTPError, ValueError, KeyError, OSError, RuntimeError, subprocess.SubprocessError) as e:
        fault.error = (
            f"cutting or healing b's link, or the launcher's /status after it: {type(e).__name__}: {e}"
        )
        return
    deadline = time.monotonic() + RESTART_WAIT_S
    while time.monotonic() < deadline and job.main.proc.poll() is None:
        versions = job.server_versions()
        if all(v is not None and v >= healed_version for v in versions):
            fault.recovered_s = job.main.elapsed()
            return
        time.sleep(1.0)
    fault.error = (
        f"servers on {job.server_versions()} {RESTART_WAIT_S:.0f}s after the link came back, the trainer "
        f"at version {healed_version} then"
    )


def _killpg(pid: int, sig: int) -> None:
    os.killpg(pid, sig)


def throughput(run_dir: Path, started_at: float, window_s: float) -> list[tuple[float, float]]:
    """(window start from the run's start, trained samples per second in it) over the run."""
    path = run_dir / "trainer_metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    # Each step's own samples ("samples"; "samples_consumed" is the running total): steps a resumed
    # trainer redoes count again, as the work they are.
    points = [(r["time"] - started_at, r.get("samples", 0)) for r in rows if "time" in r]
    if not points:
        return []
    end = max(t for t, _ in points)
    out = []
    t = 0.0
    while t <= end:
        n = sum(s for at, s in points if t <= at < t + window_s)
        out.append((t, n / window_s))
        t += window_s
    return out


def plot(path: Path, series: list[tuple[float, float]], faults: list[Fault], title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.2))
    if series:
        ax.step([t for t, _ in series], [v for _, v in series], where="post", color="#1f77b4")
    colors = {"kill": "#d62728", "stop": "#ff7f0e", "cut": "#9467bd"}
    for f in faults:
        if f.fired_s:
            ax.axvline(f.fired_s, color=colors[f.action], alpha=0.7, linewidth=1)
            ax.annotate(
                f"{f.action} {f.target}", (f.fired_s, 0), rotation=90, fontsize=6, va="bottom", ha="right"
            )
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("trained samples/s")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


SECRET_ENVS = ("PIPELINE_RL_TOKEN", "PIPELINE_RL_API_KEY", "PIPELINE_RL_REDIS_PASSWORD")
SERVER_PORTS = (8001, 8002)


def _cluster_file(path: Path, net, run_dir: Path, overrides: list[str]) -> Path:
    """Host a: Redis, the trainer, the preprocessor, the actor; host b: both servers."""
    import yaml

    from pipeline_rl.testing.simhosts import HOST_IFNAME

    hosts = [
        {"name": "a", "address": net["a"].address, "redis_port": 6390, "trainer_ranks": 1,
         "preprocessors": 1, "actors": 1},
        {"name": "b", "address": net["b"].address, "server_ports": list(SERVER_PORTS)},
    ]  # fmt: skip
    spec = {"ifname": HOST_IFNAME, "run_dir": str(run_dir), "rendezvous_port": 29555}
    path.write_text(yaml.safe_dump({**spec, "overrides": overrides, "hosts": hosts}))
    return path


def _start_job(ctx: BenchContext, net, overrides: list[str], run_dir: Path) -> Job:
    """The launcher(s) of the run: on this host, or one per simulated host (b's servers first)."""
    launch = [sys.executable, "-m", "pipeline_rl.cli", "launch", "--progress-every", "5"]
    logs = run_dir.parent
    if net is None:
        port = _free_port()
        cmd = [
            *launch,
            "--status-port",
            str(port),
            f"run_dir={run_dir}",
            "inference.num_servers=2",
            *overrides,
        ]
        ctx.log(f"soak: {' '.join(cmd[3:])}")
        return Job({"local": LaunchedRun(cmd, logs / f"{run_dir.name}.launcher.log")}, {"local": port})
    import secrets

    cluster = _cluster_file(logs / f"{run_dir.name}.cluster.yaml", net, run_dir, overrides)
    env = {name: secrets.token_hex(16) for name in SECRET_ENVS}  # the nodes' shared secrets, never argv
    ip = shutil.which("ip") or "ip"
    runs, ports = {}, {}
    for node in ("b", "a"):
        ports[node] = 9700 + len(ports)  # loopback inside the node's own namespace: no collision
        cmd = [ip, "netns", "exec", net[node].netns, *launch, "--status-port", str(ports[node])]
        cmd += ["--cluster", str(cluster), "--node", node]
        ctx.log(f"soak on host {node}: {' '.join(cmd[5:])}")
        node_env = net[node].env(**env, PYTHONUNBUFFERED="1")
        runs[node] = LaunchedRun(cmd, logs / f"{run_dir.name}.launcher-{node}.log", node_env)
    return Job({"a": runs["a"], "b": runs["b"]}, ports, net)


def _end_job(job: Job, run_s: float) -> int | None:
    """Wait for the run's end; over simulated hosts stop b's launcher (servers keep serving until asked)
    once a's has evaluated them after RL, so that a's Redis sees b's connections close."""
    if job.net is not None:
        job.main.wait_for(r"held-out accuracy after RL|no server could be evaluated", run_s + 900)
        b = job.runs["b"]
        if b.proc.poll() is None:
            b.proc.send_signal(signal.SIGTERM)
            try:
                b.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                b.proc.kill()
    try:
        return job.main.proc.wait(timeout=run_s + 900)
    except subprocess.TimeoutExpired:
        job.main.proc.kill()
        return None


def soak(
    ctx: BenchContext,
    model: Path,
    run_dir: Path,
    run_s: float,
    min_faults: int,
    seed: int,
    extra: tuple = (),
    hosts: bool = False,
) -> dict:
    """One soak run; its measurements (see the module docstring). Raises nothing for the run's sake:
    failures are in the result. hosts: over two simulated hosts (root), with link cuts among the faults."""
    from pipeline_rl.ledger import ledger_summary

    overrides = [f"model_path={model}", f"max_wall_s={run_s}", "trainer.max_steps=100000", f"seed={seed}"]
    overrides += [*FAULT_SETTINGS, *extra]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    ctx.log(
        f"soak: {min_faults} faults over {run_s:.0f}s, seed {seed}, {'two simulated hosts' if hosts else 'one host'}"
    )
    net_scope = contextlib.nullcontext()
    if hosts:
        from pipeline_rl.testing.simhosts import SimNet

        net_scope = SimNet(["a", "b"])
    with net_scope as net:
        job = _start_job(ctx, net, overrides, run_dir)
        node_dir = run_dir / "nodes" / "a" if net is not None else run_dir
        rng = random.Random(seed + 1)
        ready = job.main.wait_for(r"started actor0 \(pid \d+\)", 600)
        started_at = time.time() - job.main.elapsed()
        # Faults from now on, the last one a fifth of the run before its end: time to recover from it.
        up_s = job.main.elapsed()
        faults = schedule(seed, max(30.0, 0.8 * run_s - up_s), min_faults, link_cuts=net is not None)
        for fault in faults:
            fault.at_s += up_s
        config = json.loads((node_dir / "config.json").read_text()) if ready else {}
        counts = {
            "actor": config.get("actor", {}).get("num_actors", 1),
            "preprocessor": config.get("num_preprocessors", 1),
            "server": config.get("inference", {}).get("num_servers", 1),
        }
        job.server_urls = config.get("inference", {}).get("urls", [])
        for fault in faults if ready else []:
            while job.main.elapsed() < fault.at_s and job.main.proc.poll() is None:
                time.sleep(0.2)
            if job.main.proc.poll() is not None:
                fault.error = "the run had ended"
                continue
            fire(job, fault, rng, counts)
            ctx.log(
                f"soak: {fault.action} {fault.target} at {fault.fired_s:.0f}s: {fault.error or 'recovered'}"
            )
        restarts = job.restarts()
        code = _end_job(job, run_s)
        time.sleep(0.5)  # the reader threads' last lines
    summary_path = node_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    finals = node_dir / "servers_final.json"
    versions = [s.get("weight_version") for s in json.loads(finals.read_text())] if finals.exists() else []
    ledger = ledger_summary(run_dir)
    steps = summary.get("steps")
    return {
        "seed": seed,
        "run_s": run_s,
        "hosts": "a (Redis, trainer, preprocessor, actor), b (2 servers)" if hosts else "one",
        "exit_code": code,
        "steps": steps,
        "server_versions": versions,
        "servers_on_final": bool(versions) and all(v == steps for v in versions),
        "restarts": restarts,
        "lost": None if ledger.lost is None else len(ledger.lost),
        "lost_ids": (ledger.lost or [])[:20],
        "trained_twice": len(ledger.duplicates_trained),
        "abandoned": len(ledger.abandoned),
        "located": ledger.located_total,
        "generated": ledger.generated,
        "trained": ledger.trained,
        "ledger": ledger.lines(),
        "faults": [asdict(f) for f in faults],
        "started_at": started_at,  # epoch seconds of the launcher's start: fault times count from it
        "throughput": throughput(run_dir, started_at, 30.0 if run_s > 300 else 10.0),
        "log_tail": "".join(f"--- launcher {node}:\n{run.output[-3000:]}" for node, run in job.runs.items()),
    }


def _free_port() -> int:
    from inference_shim.procs import free_port

    return free_port()


def verdict(result: dict) -> list[str]:
    """What did not hold (empty: the soak passed)."""
    problems = []
    if result["exit_code"] != 0:
        problems.append(f"the launcher exited {result['exit_code']}")
    if not result["servers_on_final"]:
        problems.append(f"servers on {result['server_versions']}, the run ended at step {result['steps']}")
    if result["lost"] != 0:
        problems.append(f"lost {result['lost']} (not established: None): {result['lost_ids']}")
    if result["trained_twice"]:
        problems.append(f"{result['trained_twice']} samples trained twice")
    failed = [f"{f['action']} {f['target']}: {f['error']}" for f in result["faults"] if f["error"]]
    problems += failed
    roles = {f["role"] for f in result["faults"] if f["action"] == "kill" and not f["error"]}
    by_role = {"actor": "actors", "preprocessor": "preprocessors", "server": "servers", "trainer": "trainer"}
    for role in roles:
        key = by_role.get(role, role)
        if not result["restarts"].get(key):
            problems.append(f"no restart of the {key} counted")
    return problems


def run(ctx: BenchContext) -> dict:
    size = "quick" if ctx.quick else "full"
    run_s = float(ctx.options.get("run_s") or RUN_S[size])
    seed = first_seed(ctx)
    hosts = _over_hosts(ctx)
    # The full size's density (20 in 30 min), never fewer than one of each kind of the first round.
    first_round = len(KILLS) + (len(LINK_CUTS) if hosts else 0)
    min_faults = max(MIN_FAULTS["quick"], first_round, round(MIN_FAULTS["full"] * run_s / RUN_S["full"]))
    out = ctx.out_dir / NAME / f"seed{seed}-{time.strftime('%H%M%S')}"
    from pipeline_rl.demo.main import RECIPES, prepare_model

    recipe = RECIPES["arith"]  # the demo's sizes either way
    extra = tuple(o for o in recipe.overrides if not o.startswith(("max_wall_s=", "trainer.max_steps=")))
    if ctx.quick:  # an untrained tiny model on the torch engine: its groups are all-equal, keep them
        from pipeline_rl.demo.tiny_model import build_tiny_model

        model = build_tiny_model(ctx.out_dir / "models" / "tiny")
        extra += ("inference.backend=torch", "preprocess.drop_all_equal_groups=false", "eval.num_problems=10")
    else:
        model = prepare_model(recipe)
    result = soak(ctx, model, out / "run", run_s, min_faults, seed, extra, hosts=hosts)
    ctx.save_json(f"{NAME}-{size}", result)
    return publish_soak(ctx, result)


def _over_hosts(ctx: BenchContext) -> bool:
    """--hosts 1: over simulated hosts (refused with the reason where they cannot run); --hosts 0: on one
    host; unset: the full soak over simulated hosts where root allows, the quick one on one host."""
    from pipeline_rl.testing.simhosts import available

    asked = ctx.options.get("hosts")
    ok, why = available()
    if asked is None:
        return ok and not ctx.quick
    if asked[0] and not ok:
        raise SystemExit(
            f"soak --hosts 1: simulated hosts cannot run here ({why}); --hosts 0 runs on one host"
        )
    return bool(asked[0])


def publish_soak(ctx: BenchContext, result: dict) -> dict:
    problems = verdict(result)
    faults = result["faults"]
    fault_rows = [
        [f"{f['fired_s']:.0f}", f"{f['action']} {f['target'] or f['role']}", str(f["pid"] or "-"),
         "-" if f["recovered_s"] is None else f"{f['recovered_s'] - f['fired_s']:.1f}", f["error"] or "ok"]
        for f in faults
    ]  # fmt: skip
    restarts = result["restarts"]
    summary_rows = [[
        f"{result['run_s']:.0f}", str(len([f for f in faults if not f["error"]])), str(result["steps"]),
        ", ".join(f"{k} {v}" for k, v in sorted(restarts.items())) or "-",
        str(result["lost"]), str(result["trained_twice"]), str(result["abandoned"]), str(result["located"]),
        "yes" if result["servers_on_final"] else f"no: {result['server_versions']}",
    ]]  # fmt: skip
    image = plot(
        ctx.img_dir / f"{NAME}{'-quick' if ctx.quick else ''}.png",
        [tuple(p) for p in result["throughput"]],
        [_fault(f) for f in faults],
        f"trained samples/s over a {result['run_s']:.0f}s run, faults marked (seed {result['seed']})",
    )
    tables = [
        markdown_table(
            ["run s", "faults", "steps", "restarts by role", "lost", "trained twice", "abandoned", "located",
             "servers on the final version"],
            summary_rows,
        ),
        markdown_table(["at s", "fault", "pid", "recovered after s", "result"], fault_rows),
    ]  # fmt: skip
    goal = goal_line(
        "a run under faults from every role finishes with nothing lost and nothing trained twice",
        not problems,
        "held"
        if not problems
        else "; ".join(problems)[:600] + f" (seed {result['seed']}; log in the raw result)",
    )
    intro = (
        f"One launched run of {result['run_s']:.0f} s under {len(faults)} seeded faults (seed {result['seed']}), "
        "every role in turn: SIGKILL of an actor, a preprocessor, a server, the trainer and Redis, SIGSTOP of "
        "an actor, a preprocessor or a server for 2-6 s"
        + (
            ", and the servers' host's link cut for 4-10 s (two simulated hosts: a runs Redis, the trainer, "
            "the preprocessor and the actor, b the two servers)"
            if result.get("hosts", "one") != "one"
            else ", on one host"
        )
        + ". Lost and trained-twice come from the sample ledger's positive accounting (docs/trainer.md, Ledger)."
    )
    out = section(ctx, "Soak: a run under random faults", intro, tables, [goal], images=[image])
    out["raw"] = {k: v for k, v in result.items() if k not in ("log_tail",)}
    publish(ctx, NAME, out)
    return out


def _fault(data: dict) -> Fault:
    return Fault(**data)
