"""Benchmark 3, `pipeline-rl bench pipeline-vs-sync`: the demo task pipelined vs `mode=sync` on one machine.

    pipeline-rl bench pipeline-vs-sync                 # demo model, 3 seeds per mode, 300 s each
    pipeline-rl bench pipeline-vs-sync --seeds 1 --run-s 180   # shorter: one seed, 3-minute runs
    pipeline-rl bench pipeline-vs-sync --quick         # tiny untrained model, 1 seed, 60 s runs (smoke test)

Each run is a real `pipeline-rl launch` (vLLM-CPU server, Redis, gloo pushes) with periodic held-out
evaluation; seed i sets the run's `seed`, `actor.seed` and `trainer.seed` to i, and the two modes
alternate which goes first. Reported per mode (medians over seeds, with min-max): wall time until held-out accuracy first reaches the
target levels (THRESHOLDS; the goal at TARGET), final accuracy, samples/s trained, and the idle
fractions of the trainer (waiting for data / step time) and of the engine (share of the actor's
1-second snapshots with no request in flight).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pipeline_rl.bench.common import (
    REPO_ROOT,
    BenchContext,
    goal_line,
    markdown_table,
    publish,
    rotate,
    section,
)

# Held-out accuracies whose first crossing is timed; the goal is judged at TARGET (the demo holds ~95%
# after two minutes, so 90% takes a few dozen steps; 50% is crossed within the first evaluations).
THRESHOLDS = (0.5, 0.8, 0.9)
TARGET = 0.9
EVAL_EVERY_S = 10
RUN_S = {"full": 300, "quick": 60}


def servers_needed(ctx: BenchContext) -> list:
    return []  # every run starts its own servers through the launcher


def _launch(ctx: BenchContext, mode: str, model: Path, run_dir: Path, wall_s: int, seed: int) -> None:
    from pipeline_rl.launch.demo import DEMO_OVERRIDES

    overrides = [o for o in DEMO_OVERRIDES if not o.startswith("max_wall_s=")]
    cmd = [sys.executable, "-m", "pipeline_rl.cli", "launch", f"model_path={model}", f"run_dir={run_dir}"]
    cmd += [
        *overrides,
        f"mode={mode}",
        f"max_wall_s={wall_s}",
        f"seed={seed}",
        f"actor.seed={seed}",
        f"trainer.seed={seed}",
        f"eval.every_s={EVAL_EVERY_S}",
        "eval.num_problems=100",
    ]
    cmd += ["actor.stats_interval_s=1"]
    ctx.log(f"{mode}: {' '.join(cmd[3:])}")
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        result = subprocess.run(
            cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=wall_s + 600
        )
    if result.returncode != 0:
        raise RuntimeError(
            f"{mode} run failed (exit {result.returncode}); see {run_dir.parent / run_dir.name}.log"
        )


def _measure(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "stats.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    trainer = [r for r in rows if r.get("type") == "stats" and r.get("source") == "trainer"]
    actors = [r for r in rows if r.get("type") == "stats" and str(r.get("source", "")).startswith("actor")]
    evals = sorted((r for r in rows if r.get("type") == "eval"), key=lambda r: r["time"])
    start = min(r["time"] for r in rows if r.get("type") == "stats")
    before = summary.get("accuracy_before")
    reached = {
        level: next((r["time"] - start for r in evals if r["accuracy"] >= level), None)
        for level in THRESHOLDS
    }
    step_s = sum(r.get("step_s", 0.0) for r in trainer)
    wait_s = sum(r.get("wait_data_s", 0.0) for r in trainer)
    snapshots = [r.get("in_flight_server0") for r in actors if r.get("in_flight_server0") is not None]
    last = trainer[-1] if trainer else {}
    wall = (last.get("time", start) - start) or 1.0
    return {
        "accuracy_before": before,
        "accuracy_after": summary.get("accuracy_after"),
        "time_to_target_s": reached[TARGET],
        "time_to_s": {f"{level:.0%}": t for level, t in reached.items()},
        "steps": summary.get("steps"),
        "samples_per_s": last.get("samples_consumed", 0) / wall,
        "trainer_idle": wait_s / step_s if step_s else None,
        "engine_idle": sum(1 for s in snapshots if s == 0) / len(snapshots) if snapshots else None,
    }


def run(ctx: BenchContext) -> dict:
    if ctx.quick:
        from pipeline_rl.tiny_model import build_tiny_model

        model = build_tiny_model(ctx.out_dir / "models" / "tiny")
    else:
        from pipeline_rl.launch.demo import prepare_model

        model = prepare_model()
    wall_s = ctx.options.get("run_s") or RUN_S["quick" if ctx.quick else "full"]
    # Seeds instead of the 5-repeat default of the others: each run is a whole RL run, minutes long.
    runs = ctx.options.get("seeds") or (1 if ctx.quick else 3)
    results: dict[str, list[dict]] = {"pipeline": [], "sync": []}
    for i in range(runs):
        for mode in rotate(("pipeline", "sync"), i):
            run_dir = ctx.out_dir / "pipeline_vs_sync" / f"{mode}{i}-{time.strftime('%H%M%S')}"
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            _launch(ctx, mode, model, run_dir, wall_s, seed=i)
            measured = _measure(run_dir)
            results[mode].append(measured)
            ctx.log(f"{mode} run {i}: {measured}")
    ctx.save_json("pipeline_vs_sync", results)

    def med(mode: str, key: str):
        values = [r[key] for r in results[mode] if r[key] is not None]
        return statistics.median(values) if values else None

    def time_to(mode: str, level: str) -> str:
        values = [r["time_to_s"][level] for r in results[mode] if r["time_to_s"][level] is not None]
        if not values:
            return "not reached"
        missed = len(results[mode]) - len(values)
        spread = f" ({min(values):.0f}-{max(values):.0f})" if len(values) > 1 else ""
        return f"{statistics.median(values):.0f}{spread}" + (f", {missed} not reached" if missed else "")

    levels = [f"{level:.0%}" for level in THRESHOLDS]
    rows = []
    for mode in ("pipeline", "sync"):
        rows.append(
            [
                mode,
                *(time_to(mode, level) for level in levels),
                f"{med(mode, 'accuracy_before'):.1%}",
                f"{med(mode, 'accuracy_after'):.1%}",
                med(mode, "steps"),
                med(mode, "samples_per_s"),
                med(mode, "trainer_idle"),
                med(mode, "engine_idle"),
            ]
        )
    table = markdown_table(
        [
            "mode",
            *(f"s to {level}" for level in levels),
            "acc. before",
            "acc. after",
            "steps",
            "samples/s",
            "trainer idle",
            "engine idle",
        ],
        rows,
    )
    t_pipe, t_sync = med("pipeline", "time_to_target_s"), med("sync", "time_to_target_s")
    if t_pipe is not None and t_sync is not None:
        speedup = t_sync / t_pipe
        goal = goal_line(
            f"pipelined reaches {TARGET:.0%} held-out accuracy ≥ 1.5× faster than sync",
            speedup >= 1.5,
            f"{speedup:.2f}× (sync {t_sync:.0f} s / pipelined {t_pipe:.0f} s).",
        )
    elif t_pipe is not None:
        goal = goal_line(
            f"pipelined reaches {TARGET:.0%} held-out accuracy ≥ 1.5× faster than sync",
            True,
            f"pipelined reached it in {t_pipe:.0f} s; sync did not within {wall_s} s.",
        )
    else:
        goal = goal_line(
            f"pipelined reaches {TARGET:.0%} held-out accuracy ≥ 1.5× faster than sync",
            None,
            f"neither mode reached {TARGET:.0%} within {wall_s} s in this run.",
        )
    sps_ratio = (med("pipeline", "samples_per_s") or 0) / (med("sync", "samples_per_s") or 1)
    intro = (
        f"The demo task (`pipeline_rl/launch/demo.py` settings), {runs} seed(s) per mode, runs of {wall_s} s, "
        "the modes alternating; medians over seeds (min-max in brackets) of the "
        f"seconds until held-out accuracy (greedy, 100 problems, evaluated every {EVAL_EVERY_S} s) first "
        f"reaches each level; the goal is judged at {TARGET:.0%}. Pipelined trains {sps_ratio:.2f}× the samples/s of sync. Idle fractions: "
        "trainer = waiting for data / step time; engine = share of 1 s snapshots with nothing in flight."
    )
    publish(ctx, "pipeline-vs-sync", section(ctx, "3. Pipelined vs synchronous RL", intro, [table], [goal]))
    return results
