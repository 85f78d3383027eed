"""How much the demo's supervised warm-up depends on chance (`python -m benchmarks warmup-seeds`).

A new user's `make demo` starts RL from the warm-up's model, and RL sharpens the arithmetic that model
learned. So the warm-up's held-out "sum right in any format" must be a property of the recipe, not of the
seed or of the CPU's rounding order (which differs between CPU kinds: docs/decisions.md, "The demo"). This
runs the recipe's warm-up (pipeline_rl/demo/warmup.py's warm_up, exactly what `make demo` runs) at several
seeds, and for arith the same with the weight decay off and 500 steps, side by side; one worker
process per core, each on one thread as the warm-up always is. A seed changes the data order and the
answer styles drawn; the initial weights are the recipe's base model in every run.

    python -m benchmarks warmup-seeds --seeds 3            # seeds 0-2 of each variant
    python -m benchmarks warmup-seeds --recipe remainder   # the long-answer recipe's warm-up
    python -m benchmarks warmup-seeds --warmup-steps 300   # every variant at 300 steps

A warm-up whose worker dies (OOM, kill -9) is reported failed as soon as it dies and the others go on
(benchmarks/tests/test_smoke.py kills one); one that runs past WARMUP_TIMEOUT_S is killed.
"""

from __future__ import annotations

import math
import multiprocessing
import tempfile
import time
from concurrent.futures import TimeoutError as FutureTimeout

from benchmarks.common import (
    BenchContext,
    failures_note,
    first_seed,
    fmt,
    goal_line,
    markdown_table,
    median,
    publish,
    section,
    seeds_text,
)
from pipeline_rl.tasks.pool import CallTimeout, TimeoutPool, WorkerDied

# What each variant changes in the recipe's warm-up. "without decay" is the arith demo's warm-up with
# its weight decay off and 500 steps instead of 600, kept as the comparison that shows what decay buys
# (docs/decisions.md, "The demo"); the other recipes run as they are.
VARIANTS = {"recipe": {}, "without decay": {"weight_decay": 0.0, "steps": 500}}
# --quick: a smoke test of the machinery, not of the recipe.
QUICK = {"steps": 3, "eval_problems": 8}
# The spread across seeds a new user can live with: a README range of ~15 points is still one story.
MAX_SPREAD_POINTS = 15
# One warm-up's limit, from when its worker starts it: 4-6x the slowest measured (remainder's ~16 min).
WARMUP_TIMEOUT_S = 3600


def servers_needed(ctx: BenchContext) -> list:
    return []


def _one_warmup(recipe_name: str, base_dir: str, changes: dict, seed: int) -> dict:
    """One warm-up in a worker process: the recipe's task from base_dir's model, its warm-up with `changes`."""
    from pipeline_rl.demo.main import RECIPES
    from pipeline_rl.demo.warmup import warm_up

    recipe = RECIPES[recipe_name]
    cfg = recipe.warmup.model_copy(update={**changes, "seed": seed})
    with tempfile.TemporaryDirectory() as out:
        result = warm_up(base_dir, out, recipe.task, cfg)
    return {
        "seed": seed,
        "number_accuracy": result["number_accuracy"],
        "accuracy": result["accuracy"],
        "seconds": result["seconds"],
        "final_loss": result["final_loss"],
        "steps": cfg.steps,
        "weight_decay": cfg.weight_decay,
    }


def run(ctx: BenchContext) -> dict:
    from pipeline_rl.demo.main import RECIPES, build_tiny_model

    recipe_name = ctx.options.get("recipe") or "arith"
    recipe = RECIPES[recipe_name]
    seeds = ctx.options.get("seeds") or (2 if ctx.quick else 3)
    first = first_seed(ctx)
    # The recipe's base model, built (seeded: the same weights as `make demo` builds) beside the results,
    # so a demo reading artifacts/ is never disturbed.
    base = build_tiny_model(ctx.out_dir / f"warmup-seeds-{recipe.base_dir}", recipe.model)
    variants = VARIANTS if recipe_name == "arith" else {"recipe": {}}
    steps = {"steps": ctx.options["warmup_steps"]} if "warmup_steps" in ctx.options else {}  # 0 counts
    jobs = [
        (name, {**changes, **(QUICK if ctx.quick else {}), **steps}, seed)
        for seed in range(first, first + seeds)
        for name, changes in variants.items()
    ]
    for _, changes, _ in jobs:  # a bad --warmup-steps fails here, with pydantic's message, not in a worker
        type(recipe.warmup).model_validate({**recipe.warmup.model_dump(), **changes})
    workers = min(len(jobs), multiprocessing.cpu_count())
    ctx.log(f"{len(jobs)} warm-ups of {recipe_name}, {workers} at a time, one thread each")
    results: dict[str, list[dict]] = {name: [] for name in variants}
    failures: list[str] = []
    started = time.monotonic()
    # Each warm-up has its hour from when it starts (a worker that hangs is killed then, one that dies
    # fails its warm-up at once, the others go on); the whole bench has the hours of its rounds, plus
    # one for worker starts and the replacement of a dead worker.
    deadline = time.monotonic() + WARMUP_TIMEOUT_S * (math.ceil(len(jobs) / workers) + 1)
    # Spawned workers (tasks/pool.py): no torch state (threads, RNG) leaks in from this process, and every
    # warm-up seeds its own RNGs and threads. Leaving the `with` kills the workers: on an error, Ctrl-C
    # or the bench's SIGTERM none runs on.
    with TimeoutPool(workers, preload=("pipeline_rl.demo.warmup",), name="warmup") as pool:
        pending = [
            (
                name,
                seed,
                pool.submit(_one_warmup, recipe_name, str(base), changes, seed, timeout_s=WARMUP_TIMEOUT_S),
            )
            for name, changes, seed in jobs
        ]
        for name, seed, future in pending:
            try:
                measured = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except (FutureTimeout, CallTimeout) as exc:
                failures.append(
                    f"{name} seed {seed}: not finished in time ({str(exc) or 'the bench deadline'})"
                )
                ctx.log(f"{name} seed {seed} FAILED: not finished in time (the others go on)")
            except WorkerDied as exc:
                failures.append(f"{name} seed {seed}: its worker process died ({exc})")
                ctx.log(f"{name} seed {seed} FAILED: its worker process died, {exc} (the others go on)")
            except Exception as exc:  # one failed warm-up is recorded; the others still count
                failures.append(f"{name} seed {seed}: {exc}")
                ctx.log(f"{name} seed {seed} FAILED (the others go on): {exc}")
            else:
                results[name].append(measured)
                ctx.log(f"{name} seed {seed}: sum right {measured['number_accuracy']:.1%}")
            # Saved after every warm-up: a run stopped halfway keeps what it measured.
            ctx.save_json("warmup_seeds", {"recipe": recipe_name, "runs": results, "failures": failures})

    rows = []
    for name, runs in results.items():
        runs.sort(key=lambda r: r["seed"])
        numbers = [r["number_accuracy"] for r in runs]
        rows.append(
            [
                name,
                f"{runs[0]['steps']} / {runs[0]['weight_decay']}" if runs else "-",
                ", ".join(f"{r['seed']}: {r['number_accuracy']:.1%}" for r in runs) or "-",
                f"{min(numbers):.1%}-{max(numbers):.1%}" if numbers else "-",
                f"{median(numbers):.1%}" if numbers else "-",
                fmt(median([r["seconds"] for r in runs])) if runs else "-",
            ]
        )
    table = markdown_table(
        [
            "variant",
            "steps / weight decay",
            "sum right in any format, per seed",
            "range",
            "median",
            "seconds (median)",
        ],
        rows,
    )
    recipe_numbers = [r["number_accuracy"] for r in results["recipe"]]
    spread_points = round(100 * (max(recipe_numbers) - min(recipe_numbers)), 1) if recipe_numbers else None
    goal = goal_line(
        f"the recipe's warm-up lands within {MAX_SPREAD_POINTS} points across seeds",
        None if len(recipe_numbers) < 2 else spread_points <= MAX_SPREAD_POINTS,
        f"Spread {spread_points} points." if len(recipe_numbers) >= 2 else "Fewer than two seeds finished.",
    )
    intro = (
        f"The {recipe_name} recipe's supervised warm-up (what `make demo` runs first), {seeds_text(ctx, seeds)} per "
        f"variant, {workers} at a time on one thread each, {time.monotonic() - started:.0f} s in all. 'Sum right "
        "in any format' grades the last integer of each greedy held-out answer: the arithmetic RL can sharpen."
        + failures_note(failures)
    )
    publish(ctx, "warmup-seeds", section(ctx, "Warm-up across seeds", intro, [table], [goal]))
    return {"runs": results, "failures": failures}
