"""`python -m benchmarks soak`: one launched run under random faults from every role, for a fixed time.

    python -m benchmarks soak                       # demo recipe, 30 min, >= 20 faults, seed 0
    python -m benchmarks soak --run-s 600 --first-seed 3   # 10 minutes (>= 7 faults), seed 3
    python -m benchmarks soak --quick               # tiny model on the torch engine, 170 s, >= 5 faults

The driver draws a seeded schedule of faults spread over the run, every role in turn before any twice:
SIGKILL of an actor, a preprocessor, a server, the trainer and the run's Redis; SIGSTOP of an actor, a
preprocessor or a server for a few seconds, then SIGCONT. Each fault is logged (time, kind, target,
pid); after a kill the driver waits for the launcher's "restarted <name>" before the next one. The run
ends at max_wall_s (the trainer checkpoints and stops). What must hold: the launcher exits 0; every
server serves the last version; the sample ledger's positive accounting establishes lost = 0 and no
sample trained twice (pipeline_rl/ledger.py); every role restarted. Reported: steps, restarts per
role, lost / abandoned / located, trained samples per second in windows over the run with each fault
marked on the plot. A simulated host's link cut (ip netns) is not among the faults: it needs a run
over several simulated hosts (tests/integration/test_multihost_push.py covers a cut mid-push).
"""

from __future__ import annotations

import json
import os
import random
import re
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


def schedule(seed: int, span_s: float, min_faults: int) -> list[Fault]:
    """`min_faults` faults spread over `span_s` seconds (from the moment the run is up), each round every
    kind once (kills of all five roles first, shuffled; then the stops, shuffled)."""
    rng = random.Random(seed)
    kinds: list[tuple[str, str]] = []
    while len(kinds) < min_faults:
        kills, stops = list(KILLS), list(STOPS)
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

    def __init__(self, cmd: list[str], log_path: Path) -> None:
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
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


def _target(run: LaunchedRun, fault: Fault, rng: random.Random, counts: dict[str, int]) -> None:
    if fault.role == "redis":
        fault.target, fault.pid = "redis", run.redis_pid() or 0
        return
    name = "trainer" if fault.role == "trainer" else f"{fault.role}{rng.randrange(counts[fault.role])}"
    fault.target, fault.pid = name, run.pid_of(name) or 0


def fire(run: LaunchedRun, fault: Fault, rng: random.Random, counts: dict[str, int]) -> None:
    """Send the fault and wait until the run recovered from it (bounded)."""
    _target(run, fault, rng, counts)
    if not fault.pid:
        fault.error = f"no pid for {fault.target}"
        return
    mark = len(run.lines)
    fault.fired_s = run.elapsed()
    try:
        if fault.action == "kill":
            # A process group (the server's engine, the trainer's ranks) dies whole; Redis is one process.
            (
                psutil.Process(fault.pid).kill()
                if fault.role == "redis"
                else _killpg(fault.pid, signal.SIGKILL)
            )
            if run.wait_for(rf"restarted {fault.target}\b", RESTART_WAIT_S, after=mark):
                fault.recovered_s = run.elapsed()
            else:
                fault.error = f"{fault.target} was not restarted within {RESTART_WAIT_S:.0f}s"
        else:
            _killpg(fault.pid, signal.SIGSTOP)
            try:
                time.sleep(rng.uniform(*STOP_S))
            finally:
                _killpg(fault.pid, signal.SIGCONT)
            fault.recovered_s = run.elapsed()
    except (ProcessLookupError, psutil.Error) as e:
        fault.error = f"{type(e).__name__}: {e}"


def _killpg(pid: int, sig: int) -> None:
    os.killpg(pid, sig)


def throughput(run_dir: Path, started_at: float, window_s: float) -> list[tuple[float, float]]:
    """(window start from the run's start, trained samples per second in it) over the run."""
    path = run_dir / "trainer_metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    points = [
        (r["time"] - started_at, r.get("samples_consumed", r.get("samples", 0))) for r in rows if "time" in r
    ]
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
    colors = {"kill": "#d62728", "stop": "#ff7f0e"}
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


def soak(
    ctx: BenchContext, model: Path, run_dir: Path, run_s: float, min_faults: int, seed: int, extra: tuple = ()
) -> dict:
    """One soak run; its measurements (see the module docstring). Raises nothing for the run's sake:
    failures are in the result."""
    from pipeline_rl.ledger import ledger_summary

    status_port = _free_port()
    cmd = [sys.executable, "-m", "pipeline_rl.cli", "launch", "--status-port", str(status_port)]
    cmd += ["--progress-every", "5", f"model_path={model}", f"run_dir={run_dir}", f"max_wall_s={run_s}"]
    cmd += ["trainer.max_steps=100000", "inference.num_servers=2", f"seed={seed}", *FAULT_SETTINGS, *extra]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    ctx.log(f"soak: {min_faults} faults over {run_s:.0f}s, seed {seed}: {' '.join(cmd[3:])}")
    run = LaunchedRun(cmd, run_dir.parent / f"{run_dir.name}.launcher.log")
    rng = random.Random(seed + 1)
    ready = run.wait_for(r"started actor0 \(pid \d+\)", 600)
    started_at = time.time() - run.elapsed()
    # Faults from now on, the last one a fifth of the run before its end: time to recover from it.
    up_s = run.elapsed()
    faults = schedule(seed, max(30.0, 0.8 * run_s - up_s), min_faults)
    for fault in faults:
        fault.at_s += up_s
    config = json.loads((run_dir / "config.json").read_text()) if ready else {}
    counts = {
        "actor": config.get("actor", {}).get("num_actors", 1),
        "preprocessor": config.get("num_preprocessors", 1),
        "server": config.get("inference", {}).get("num_servers", 1),
    }
    restarts: dict = {}
    for fault in faults if ready else []:
        while run.elapsed() < fault.at_s and run.proc.poll() is None:
            time.sleep(0.2)
        if run.proc.poll() is not None:
            fault.error = "the run had ended"
            continue
        fire(run, fault, rng, counts)
        ctx.log(f"soak: {fault.action} {fault.target} at {fault.fired_s:.0f}s: {fault.error or 'recovered'}")
    try:
        restarts = httpx.get(f"http://127.0.0.1:{status_port}/status", timeout=10).json()["restarts"]
    except (httpx.HTTPError, ValueError, KeyError):
        restarts = {}
    try:
        code = run.proc.wait(timeout=run_s + 900)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        code = None
    time.sleep(0.5)  # the reader thread's last lines
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    finals = run_dir / "servers_final.json"
    versions = [s.get("weight_version") for s in json.loads(finals.read_text())] if finals.exists() else []
    ledger = ledger_summary(run_dir)
    steps = summary.get("steps")
    return {
        "seed": seed,
        "run_s": run_s,
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
        "throughput": throughput(run_dir, started_at, 30.0 if run_s > 300 else 10.0),
        "log_tail": run.output[-3000:],
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
    # The full size's density (20 in 30 min), never fewer than the short version's 5.
    min_faults = max(MIN_FAULTS["quick"], round(MIN_FAULTS["full"] * run_s / RUN_S["full"]))
    seed = first_seed(ctx)
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
    result = soak(ctx, model, out / "run", run_s, min_faults, seed, extra)
    ctx.save_json(f"{NAME}-{size}", result)
    return publish_soak(ctx, result)


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
        "an actor, a preprocessor or a server for 2-6 s. Lost and trained-twice come from the sample ledger's "
        "positive accounting (docs/trainer.md, Ledger)."
    )
    out = section(ctx, "Soak: a run under random faults", intro, tables, [goal], images=[image])
    out["raw"] = {k: v for k, v in result.items() if k not in ("log_tail",)}
    publish(ctx, NAME, out)
    return out


def _fault(data: dict) -> Fault:
    return Fault(**data)
