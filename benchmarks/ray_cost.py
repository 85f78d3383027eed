"""`python -m benchmarks ray-cost`: what placing a run on a one-node Ray cluster costs against the local launcher.

    python -m benchmarks ray-cost               # demo recipe, local vs Ray alternating, 3 runs each, 40 steps
    python -m benchmarks ray-cost --seeds 5     # five runs each
    python -m benchmarks ray-cost --quick       # tiny untrained model, one run each, 5 steps

One Ray cluster of one node is started on this machine (`ray start --head`, token authentication on,
its own --temp-dir, 2 logical CPUs, a capped object store, no dashboard UI) before the runs and stopped
after them; its start time is reported on its own. Each run is the demo recipe for a fixed number of
trainer steps, launched either by the local launcher (`pipeline-rl launch ...`) or through the cluster
(`pipeline-rl launch --ray ADDRESS ...`: the placement group, the cluster file, the node's launcher
under a Ray actor); the two alternate, the order rotating per seed. Reported for each: seconds from
starting the launch command to the trainer's first recorded step, and trained samples per second
(pipeline_vs_sync.measure_run, as the other launched benchmarks count it); the difference of the
medians with each side's spread. Ray's idle cost: the memory (RSS and PSS summed) and CPU (over
IDLE_WINDOW_S) of every process of the cluster while no job runs, once when it is fresh and once after
the runs; and the CPU Ray's processes and the Ray driver take during each run.

The cluster's processes are found by their session: `ray start` runs in a session of its own and its
daemons and workers stay in it, while the job's node launcher starts its children in new sessions, so
the job is never counted as Ray's. Stopping them signals exactly those processes (SIGTERM, then SIGKILL),
never `ray stop`, which would stop every Ray process on the machine.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import resource
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from benchmarks.common import (
    BenchContext,
    StealMeter,
    failures_note,
    goal_line,
    markdown_table,
    publish,
    run_interleaved,
    run_to_end,
    section,
    seeds_text,
)
from benchmarks.pipeline_vs_sync import launch_command, measure_run

NAME = "ray-cost"
VARIANTS = ("local", "ray")
LAUNCHERS = {"local": "local (`pipeline-rl launch`)", "ray": "Ray (`--ray ADDRESS`)"}
STEPS = {"full": 40, "quick": 5}
IDLE_WINDOW_S = {"full": 20.0, "quick": 5.0}
# After `ray start` returns, its agents are still importing: an idle window taken at once would count that.
SETTLE_S = 10.0
# A safety net only: the runs end at their step count, in about two minutes at the demo's sizes.
MAX_WALL_S = 900
CPUS = 2  # the cluster's logical CPUs: the demo's trainer rank and its one server take one slot each
OBJECT_STORE_BYTES = 100_000_000  # Ray's default is 30% of RAM; the launcher puts nothing in it
START_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0
POLL_S = 1.0
GOAL_PERCENT = 5.0
DRIVER = "the --ray driver"
WORKERS = "Ray workers (ray::IDLE, the job's actor and tasks)"
AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # Ray's own per-node daemons, not workers


def servers_needed(ctx: BenchContext) -> list:
    return []  # every run starts its own servers through the launcher


def node_address() -> str:
    """This machine's first non-loopback IPv4 address: the cluster file the Ray launcher writes refuses a
    loopback address (another host could not reach it), so the one-node cluster listens on this one."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    raise RuntimeError("ray-cost: this machine has no non-loopback IPv4 address for the Ray node")


def _label(proc: psutil.Process) -> str:
    """A process as the tables name it: raylet, gcs_server, ray::IDLE, dashboard.py, ray.util.client.server, ..."""
    cmd = proc.cmdline()
    if not cmd:
        return proc.name()
    if cmd[0].startswith("ray::"):
        title = cmd[0].split()[0]
        return title if title in AGENTS else WORKERS
    if "python" in Path(cmd[0]).name:
        if any(Path(a).name == "default_worker.py" for a in cmd[1:]):
            return WORKERS  # a worker before it names itself ray::IDLE or ray::<the actor's class>
        if "-m" in cmd[1:-1]:
            return cmd[cmd.index("-m") + 1]
        script = next((a for a in cmd[1:] if a.endswith(".py")), None)
        return Path(script).name if script else proc.name()
    return Path(cmd[0]).name


class OneNodeRay:
    """A Ray head node on this machine, its processes found and stopped by their session (module docstring)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token_path = workdir / "ray-token"
        self.token_path.unlink(missing_ok=True)
        self.token_path.touch(mode=0o600)  # readable by this user only before the token is in it
        self.token_path.write_text(secrets.token_hex(32))
        # Unix socket paths must stay under ~107 bytes: a short directory under /tmp, never the run's.
        self.temp_dir = Path(f"/tmp/prlray-bench-{os.getpid()}")
        self.host = node_address()
        self.port: int | None = None
        self.session: int | None = None
        self.start_s: float | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """The environment of every Ray client and node: token authentication, as on a real cluster."""
        return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)}

    def start(self) -> None:
        from inference_shim.procs import free_port, start_child

        ray = str(Path(sys.executable).with_name("ray"))
        self.port = free_port(self.host)
        argv = [ray, "start", "--head", "--node-ip-address", self.host, "--port", str(self.port)]
        argv += ["--temp-dir", str(self.temp_dir), "--num-cpus", str(CPUS)]
        argv += ["--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats"]
        argv += ["--include-dashboard", "false"]
        # Ray's fixed default ports (the headless dashboard's 8265, the agent's 52365, the client
        # server's 10001) would collide with another cluster on this machine: free ones instead, and
        # workers on random ports (0), since free_port draws inside Ray's default worker range.
        for flag in ("--dashboard-port", "--dashboard-agent-listen-port", "--ray-client-server-port"):
            argv += [flag, str(free_port(self.host))]
        argv += ["--min-worker-port", "0", "--max-worker-port", "0"]
        log = self.workdir / "ray-start.log"
        started = time.monotonic()
        # die_with_parent off: `ray start` exits once its daemons run; they must outlive it.
        proc = start_child(argv, env=self.env(), log_path=log, die_with_parent=False, append_log=False)
        self.session = proc.pid  # its own session (start_child): the daemons it forks stay in it
        try:
            code = proc.wait(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        self.start_s = time.monotonic() - started
        if code != 0:
            raise RuntimeError(f"`ray start` failed ({code}); see {log}:\n{log.read_text()[-2000:]}")

    def processes(self) -> list[psutil.Process]:
        """Every live process of this cluster (its session), the job's own (other sessions) not included."""
        if self.session is None:
            return []
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):  # gone meanwhile
                if os.getsid(proc.pid) == self.session and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
        return found

    def stop(self) -> None:
        """SIGTERM every process of the cluster, SIGKILL what is left after STOP_GRACE_S (gcs_server and
        the raylet ignore SIGTERM for longer than that), then remove its temp dir."""
        procs = self.processes()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(sig)
            _, procs = psutil.wait_procs(procs, timeout=STOP_GRACE_S)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> OneNodeRay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class CpuMeter:
    """CPU seconds of a changing set of processes over a window, polled every POLL_S: a process born in
    the window counts from its start, one gone keeps its last reading (so up to POLL_S of its CPU is missed).
    Used as `with CpuMeter(select) as meter: ...`; then meter.by_label() and meter.window_s."""

    def __init__(self, select: Callable[[], list[psutil.Process]]) -> None:
        self.select = select
        self.base: dict[tuple[int, float], float] = {}
        self.last: dict[tuple[int, float], float] = {}
        self.labels: dict[tuple[int, float], str] = {}
        self.rss: dict[tuple[int, float], int] = {}
        self.pss: dict[tuple[int, float], int] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.window_s = 0.0

    def poll(self) -> None:
        for proc in self.select():
            try:
                with proc.oneshot():
                    key = (proc.pid, proc.create_time())
                    times = proc.cpu_times()
                    if key not in self.base:
                        self.labels[key] = _label(proc)
                        self.base[key] = times.user + times.system if key[1] < self._started else 0.0
                    self.last[key] = times.user + times.system
                    self.rss[key] = proc.memory_info().rss
            except psutil.Error:
                continue

    def memory(self) -> None:
        """RSS and PSS of every selected process now (PSS shares each page among the processes mapping it,
        so the sum does not count Ray's shared libraries once per process)."""
        for proc in self.select():
            with contextlib.suppress(psutil.Error):
                key = (proc.pid, proc.create_time())
                info = proc.memory_full_info()
                self.rss[key], self.pss[key] = info.rss, getattr(info, "pss", 0)

    def _run(self) -> None:
        while not self._done.wait(POLL_S):
            self.poll()

    def __enter__(self) -> CpuMeter:
        self._started = time.time()
        self._t0 = time.monotonic()
        self.poll()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.poll()
        self.window_s = time.monotonic() - self._t0

    def by_label(self) -> dict[str, dict]:
        """label -> processes, CPU % of one core over the window, RSS and PSS MB (the last readings)."""
        out: dict[str, dict] = {}
        for key, label in self.labels.items():
            row = out.setdefault(label, {"processes": 0, "cpu_percent": 0.0, "rss_mb": 0.0, "pss_mb": 0.0})
            row["processes"] += 1
            row["cpu_percent"] += (self.last[key] - self.base[key]) / max(self.window_s, 1e-9) * 100
            row["rss_mb"] += self.rss.get(key, 0) / 1e6
            row["pss_mb"] += self.pss.get(key, 0) / 1e6
        return out


def measure_idle(cluster: OneNodeRay, window_s: float) -> dict:
    """Ray's processes with no job: their count, memory and CPU over window_s, per process kind."""
    with CpuMeter(cluster.processes) as meter:
        time.sleep(window_s)
    meter.memory()
    kinds = meter.by_label()
    return {
        "window_s": meter.window_s,
        "processes": sum(k["processes"] for k in kinds.values()),
        "cpu_percent": sum(k["cpu_percent"] for k in kinds.values()),
        "rss_mb": sum(k["rss_mb"] for k in kinds.values()),
        "pss_mb": sum(k["pss_mb"] for k in kinds.values()),
        "kinds": kinds,
    }


def first_step_time(stats_dir: Path) -> float:
    """Wall time (time.time()) of the trainer's first recorded step in <stats_dir>/stats.jsonl."""
    import json

    for line in (stats_dir / "stats.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if row.get("type") == "stats" and row.get("source") == "trainer":
                return row["time"]
    raise RuntimeError(f"no trainer step recorded in {stats_dir / 'stats.jsonl'}")


def stats_dir_of(run_dir: Path) -> Path:
    """Where a run's stats.jsonl is: the run directory (local), the control node's directory (Ray)."""
    if (run_dir / "stats.jsonl").exists():
        return run_dir
    found = sorted((run_dir / "nodes").glob("*/stats.jsonl"))
    if len(found) != 1:
        raise RuntimeError(f"expected one stats.jsonl in {run_dir}, found {[str(p) for p in found]}")
    return found[0].parent


FIGURES = (
    "launch_to_first_step_s",
    "launch_to_launcher_s",
    "launcher_to_first_step_s",
    "samples_per_s",
    "ray_cpu_percent",
    "driver_cpu_percent",
)


def summarize(results: dict[str, list[dict]]) -> dict:
    """Per variant and figure: each run, median, min, max; Ray's median minus local's, in units and %."""
    out: dict = {}
    for key in FIGURES:
        per = {}
        for name in VARIANTS:
            values = [r[key] for r in results.get(name, []) if r.get(key) is not None]
            per[name] = {
                "runs": values,
                "median": statistics.median(values) if values else None,
                "min": min(values) if values else None,
                "max": max(values) if values else None,
            }
        local, ray = per["local"]["median"], per["ray"]["median"]
        both = local is not None and ray is not None
        per["difference"] = ray - local if both else None
        per["difference_percent"] = (ray - local) / local * 100 if both and local else None
        out[key] = per
    return out


def run(ctx: BenchContext) -> dict:
    try:
        import ray  # noqa: F401 - only to refuse early, with the fix
    except ImportError:
        raise RuntimeError("ray-cost needs Ray: pip install 'pipeline-rl[ray]'") from None
    from pipeline_rl.demo.main import RECIPES

    if ctx.quick:
        from pipeline_rl.demo.tiny_model import build_tiny_model

        model = build_tiny_model(ctx.out_dir / "models" / "tiny")
    else:
        from pipeline_rl.demo.main import prepare_model

        model = prepare_model(RECIPES["arith"])
    size = "quick" if ctx.quick else "full"
    steps = STEPS[size]
    seeds = ctx.options.get("seeds") or (1 if ctx.quick else 3)
    steal = StealMeter()
    stamp = time.strftime("%H%M%S")
    with OneNodeRay(ctx.out_dir / "ray-cost" / f"cluster-{stamp}") as cluster:
        cluster.start()
        ctx.log(f"Ray head {cluster.address} started in {cluster.start_s:.1f} s; temp dir {cluster.temp_dir}")
        time.sleep(SETTLE_S)
        idle = {"fresh": measure_idle(cluster, IDLE_WINDOW_S[size])}
        ctx.log(f"Ray idle (fresh): { {k: v for k, v in idle['fresh'].items() if k != 'kinds'} }")

        def one_run(name: str, i: int) -> dict:
            return measure_one(ctx, cluster, name, model, steps, seed=i)

        results, failures = run_interleaved(ctx, list(VARIANTS), seeds, one_run, "ray_cost")
        idle["after the runs"] = measure_idle(cluster, IDLE_WINDOW_S[size])
        start_s = cluster.start_s
        address = cluster.address
    return publish_cost(ctx, results, idle, start_s, address, seeds, steps, failures, steal.percent())


def measure_one(
    ctx: BenchContext, cluster: OneNodeRay, name: str, model: Path, steps: int, seed: int
) -> dict:
    """One run of `steps` trainer steps by launcher `name` ("local" or "ray"), to its end: what
    measure_run reads from its stats, the launch-to-first-step split at the (node) launcher's start, and
    the CPU of Ray's processes and of the `--ray` driver over the run."""
    run_dir = ctx.out_dir / "ray-cost" / f"{name}-{seed}-{time.strftime('%H%M%S')}"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    extra = (f"trainer.max_steps={steps}",)
    if ctx.quick:  # an untrained model's groups are all-equal: keep them, so steps happen
        extra += ("preprocess.drop_all_equal_groups=false",)
    cmd = launch_command(
        ctx, "pipeline", model, run_dir, MAX_WALL_S, seed=seed, extra=extra, snapshot_every_s=0
    )
    env = None
    if name == "ray":  # `pipeline-rl launch --ray ADDRESS <the same overrides>`
        cmd = [*cmd[:4], "--ray", cluster.address, *cmd[4:]]
        env = cluster.env()
    ctx.log(f"{name}: {' '.join(cmd[3:])}")
    log_path = run_dir.parent / f"{run_dir.name}.log"
    # The launch command is this process's only child while it runs, and reaped by run_to_end: its CPU
    # is exactly the growth of RUSAGE_CHILDREN. For `--ray` that is the driver alone (the job runs under
    # Ray's worker); for the local launcher, the whole job, which is not Ray's, so not reported.
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    launched = time.time()
    with CpuMeter(cluster.processes) as meter:
        code = run_to_end(cmd, log_path, timeout_s=MAX_WALL_S + 600, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        raise RuntimeError(f"{name} run failed (exit {code}); see {log_path}")
    stats_dir = stats_dir_of(run_dir)
    measured = measure_run(stats_dir)
    first_step = first_step_time(stats_dir)
    # The (node) launcher writes config.json first thing, the same code on both sides: before it is
    # the placement (for Ray: the driver, the placement group, the actor), after it the run's own start.
    launcher_started = (stats_dir / "config.json").stat().st_mtime
    measured["launch_to_first_step_s"] = first_step - launched
    measured["launch_to_launcher_s"] = launcher_started - launched
    measured["launcher_to_first_step_s"] = first_step - launcher_started
    kinds = meter.by_label()
    measured["ray_cpu_percent"] = sum(v["cpu_percent"] for v in kinds.values())
    measured["cpu_by_process"] = {k: round(v["cpu_percent"], 2) for k, v in kinds.items()}
    if name == "ray":
        driver_s = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        measured["driver_cpu_percent"] = driver_s / meter.window_s * 100
        measured["cpu_by_process"][DRIVER] = round(measured["driver_cpu_percent"], 2)
    return measured


def _spread(s: dict, digits: int) -> str:
    if s["median"] is None:
        return "-"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def _width(s: dict) -> float:
    """A figure's spread (max - min) in % of its median."""
    return (s["max"] - s["min"]) / s["median"] * 100 if s["median"] else float("nan")


def _difference(s: dict, digits: int, unit: str = "") -> str:
    if s["difference"] is None:
        return "-"
    return f"{s['difference']:+.{digits}f}{unit} ({s['difference_percent']:+.1f}%)"


def publish_cost(
    ctx: BenchContext,
    results: dict[str, list[dict]],
    idle: dict[str, dict],
    start_s: float,
    address: str,
    seeds: int,
    steps: int,
    failures=(),
    steal_percent: float | None = None,
) -> dict:
    summary = summarize(results)
    first, sps = summary["launch_to_first_step_s"], summary["samples_per_s"]
    rows = []
    for name in VARIANTS:
        rows.append(
            [
                LAUNCHERS[name],
                str(len(sps[name]["runs"])),
                ", ".join(f"{v:.1f}" for v in first[name]["runs"]) or "-",
                _spread(first[name], 1),
                ", ".join(f"{v:.1f}" for v in sps[name]["runs"]) or "-",
                _spread(sps[name], 1),
            ]
        )
    rows.append(["Ray - local (medians)", "", "", _difference(first, 1, " s"), "", _difference(sps, 2)])
    table = markdown_table(
        [
            "launcher",
            "runs",
            "launch to first step, s (each run)",
            "median (min-max)",
            "samples/s (each run)",
            "median (min-max)",
        ],
        rows,
    )
    split_rows = [
        [LAUNCHERS[name], _spread(summary["launch_to_launcher_s"][name], 1),
         _spread(summary["launcher_to_first_step_s"][name], 1)]
        for name in VARIANTS
    ]  # fmt: skip
    split_rows.append(
        ["Ray - local (medians)", _difference(summary["launch_to_launcher_s"], 1, " s"),
         _difference(summary["launcher_to_first_step_s"], 1, " s")]
    )  # fmt: skip
    split_table = markdown_table(
        ["launcher", "launch to the (node) launcher's start, s", "the launcher's start to first step, s"],
        split_rows,
    )
    node = address.split(":")[0]
    idle_rows = [
        [f"{node} (head), {when}", str(m["processes"]), f"{m['rss_mb']:.0f}", f"{m['pss_mb']:.0f}",
         f"{m['cpu_percent']:.1f}"]
        for when, m in idle.items()
    ]  # fmt: skip
    idle_table = markdown_table(
        ["node, Ray idle (no job)", "processes", "RSS MB (sum)", "PSS MB (sum)", "CPU % of one core"],
        idle_rows,
    )
    fresh = idle["fresh"]
    kinds_table = markdown_table(
        ["Ray process", "processes", "RSS MB, idle", "PSS MB, idle", "CPU %: idle", "local runs", "Ray runs"],
        _process_rows(fresh["kinds"], results),
    )
    ray_cpu = summary["ray_cpu_percent"]
    driver_cpu = summary["driver_cpu_percent"]
    diff = sps["difference_percent"]
    detail = "not measured"
    if diff is not None:
        local, ray = sps["local"], sps["ray"]
        detail = (
            f"Ray's median is {diff:+.1f}% against local ({ray['median']:.1f} vs {local['median']:.1f} "
            f"samples/s; the runs spread over {_width(local):.1f}% of their median locally, "
            f"{_width(ray):.1f}% on Ray)."
        )
    goal = goal_line(
        f"a demo-sized run on a one-node Ray cluster trains within {GOAL_PERCENT:.0f}% of the local "
        "launcher's samples/s",
        None if diff is None else diff >= -GOAL_PERCENT,
        detail,
    )
    notes: list[str] = []
    ray_a, ray_b, drv = ray_cpu["ray"]["median"], ray_cpu["local"]["median"], driver_cpu["ray"]["median"]
    if None not in (ray_a, ray_b, drv):
        cores = os.cpu_count() or 1
        extra = ray_a - ray_b + drv
        notes.append(
            f"- **What Ray takes from a run:** during the Ray runs Ray's processes used a median {ray_a:.1f}% "
            f"of one core ({ray_b:.1f}% during the local runs: the cluster is up for both) and the `--ray` "
            f"driver {drv:.1f}%: {extra:.1f}% of one core more than a local run, {extra / cores:.1f}% of "
            f"this machine's {cores} cores, taken from the run's processes. That bounds what the "
            "placement can cost samples/s (the node's launcher and the processes it starts are the local "
            "launcher's, with the same cores); a larger difference is the runs' own spread."
        )
    intro = (
        f"The demo recipe (the warmed-up demo model and its sizes) for {steps} trainer steps, pipelined, "
        f"launched by the local launcher and through a one-node Ray cluster (`pipeline-rl launch --ray "
        f"ADDRESS`), alternating; {seeds_text(ctx, seeds)}. Launch to first step: from starting the "
        "launch command to the trainer's first step in stats.jsonl; samples/s: trained samples over the "
        "run's stats (pipeline_vs_sync.measure_run). The cluster (Ray "
        f"{_ray_version()}, token authentication, 2 logical CPUs, a 100 MB object store, no dashboard UI) "
        f"was started once, in {start_s:.1f} s (`ray start --head`, not counted in any run), and stays up "
        "during the local runs too, so its idle cost falls on both sides and the difference is the "
        "placement path: the driver, the placement group, the node's launcher under a Ray actor. It "
        f"listens on this machine's own address ({address.split(':')[0]}): the cluster file the Ray "
        "launcher writes refuses a loopback address. The second table splits launch to first step where "
        "the (node) launcher writes the run's config.json: before it, the placement (for Ray: the driver "
        "connecting, the placement group, the actor's worker); after it, the run's own start, the same "
        "code on both sides. Ray's idle cost: every process of the cluster with no job, once fresh "
        f"({SETTLE_S:.0f} s after `ray start` returned) and once after the runs, memory summed (RSS; PSS shares each page "
        f"among the processes mapping it), CPU over {fresh['window_s']:.0f} s; the last table gives each "
        "kind of Ray process, and its CPU during the runs." + failures_note(failures)
    )
    title = "Ray placement: its cost against the local launcher"
    tables = [table, split_table, idle_table, kinds_table]
    result = section(ctx, title, intro, tables, [goal, *notes], steal_percent=steal_percent)
    result["raw"] = {"summary": summary, "idle": idle, "ray_start_s": start_s, "steps": steps}
    publish(ctx, NAME, result)
    return result


def _process_rows(kinds: dict[str, dict], results: dict[str, list[dict]]) -> list[list[str]]:
    """Per kind of Ray process (the driver last): its idle memory and CPU, and its median CPU during the
    runs of each launcher (a kind absent from a run, such as the job's worker in a local run, counts 0)."""

    def during(label: str, name: str) -> str:
        if label == DRIVER and name == "local":
            return "-"
        runs = results.get(name, [])
        values = [r.get("cpu_by_process", {}).get(label, 0.0) for r in runs]
        return f"{statistics.median(values):.1f}" if values else "-"

    labels = list(dict.fromkeys([*sorted(kinds, key=lambda k: -kinds[k]["rss_mb"]), *(
        label for runs in results.values() for r in runs for label in r.get("cpu_by_process", {})
    )]))  # fmt: skip
    labels.sort(key=lambda label: label == DRIVER)
    rows = []
    for label in labels:
        idle = ["0", "-", "-", "-"]
        if label in kinds:
            k = kinds[label]
            idle = [
                str(k["processes"]),
                f"{k['rss_mb']:.0f}",
                f"{k['pss_mb']:.0f}",
                f"{k['cpu_percent']:.1f}",
            ]
        rows.append([label, *idle, during(label, "local"), during(label, "ray")])
    return rows


def _ray_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return "?"
