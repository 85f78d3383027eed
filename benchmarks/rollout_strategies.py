"""`python -m benchmarks rollout-strategies`: the answers to "generation waits on its longest answers", on
one pipeline, where the long tail bites.

    python -m benchmarks rollout-strategies                       # long-tail task 3 seeds, demo 1 seed
    python -m benchmarks rollout-strategies --resume              # skip the runs a stopped one finished
    python -m benchmarks rollout-strategies --recipes longtail --seeds 1 --run-s 240
    python -m benchmarks rollout-strategies --quick               # tiny untrained model, 1 seed, 60 s runs

Strategies (STRATEGIES): pipelined with in-flight updates (KV kept, or recomputed), pipelined with
drain-then-swap servers (2 servers, staggered: no answer mixes versions), sync (each phase on every core,
the faster sync placement of pipeline-vs-sync), and sync with partial rollouts at two token caps per round
(PARTIAL_CAPS of the recipe's max_tokens: not divisors of it). Every run is a real `pipeline-rl launch`,
evaluated off its clock on the trainer's weight saves (benchmarks/pipeline_vs_sync.py: launch_command,
measure_run), the strategies rotating which goes first per seed. Reported per strategy (medians over seeds):
time to the recipe's fixed levels (pipeline_vs_sync.LEVELS), samples/s, engine and trainer idle fractions,
answer tokens written per second by sequences in flight, the lag of trained tokens, and the share of
trained tokens in answers that mixed weight versions. Goal: pipelined reaches the long-tail task's top level
>= 1.5x sooner than the best sync variant; judged against the overlap bound the sync runs' phases allow.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

from benchmarks.common import (
    BenchContext,
    failures_note,
    goal_line,
    markdown_table,
    publish,
    section,
    seeds_text,
)
from benchmarks.pipeline_vs_sync import (
    LEVELS,
    RUN_S,
    launch_command,
    launch_run,
    measure_run,
    median_of,
    median_time_to_target,
    plot_accuracy,
    spread_text,
    time_to_text,
)
from pipeline_rl.eval.snapshots import evaluate_run

LONG_TAIL = "longtail"
SEEDS = {LONG_TAIL: 3, "arith": 1}
# Seconds between the weight saves evaluated after a run: grading 100 long-tail answers of up to 352
# tokens takes ~10 s a save here, the demo's a second.
SNAPSHOT_EVERY_S = {LONG_TAIL: 20, "arith": 3}
# Token caps per round of the two partial-rollout variants, as shares of the recipe's actor.max_tokens.
PARTIAL_CAPS = (0.3, 0.12)
# Buckets of sequences in flight for the engine's throughput table.
IN_FLIGHT_BUCKETS = ((0, 0), (1, 8), (9, 32), (33, 128), (129, 10**9))


def strategies(max_tokens: int) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Name -> (pipeline_vs_sync variant, extra overrides)."""
    caps = sorted({max(1, round(max_tokens * share)) for share in PARTIAL_CAPS}, reverse=True)
    out = {
        "pipeline-keep": ("pipeline", ("inference.kv_after_update=keep",)),
        "pipeline-recompute": ("pipeline", ("inference.kv_after_update=recompute",)),
        "pipeline-drain": ("pipeline", ("inference.update_mode=drain", "inference.num_servers=2")),
        "sync": ("sync-colocated", ()),
    }
    for cap in caps:
        out[f"sync-partial-{cap}"] = ("sync-colocated", (f"actor.round_tokens={cap}",))
    return out


def recipe_max_tokens(recipe: str) -> int:
    from pipeline_rl.demo.main import RECIPES
    from pipeline_rl.launch.compose import compose

    return compose([*RECIPES[recipe].overrides, "model_path=unused"]).actor.max_tokens


def measure_strategy_run(run_dir: Path, levels: tuple[float, ...]) -> dict:
    """measure_run's figures, and what this bench adds: throughput by sequences in flight, lag, mixed tokens."""
    out = measure_run(run_dir, levels)
    rows = [json.loads(line) for line in (run_dir / "stats.jsonl").read_text().splitlines() if line.strip()]
    actors = [r for r in rows if r.get("type") == "stats" and str(r.get("source", "")).startswith("actor")]
    trainer = [r for r in rows if r.get("type") == "stats" and r.get("source") == "trainer"]
    by_bucket: dict[str, list[float]] = {}
    for r in actors:
        n = r.get("sequences_in_flight")
        if n is None or r.get("tokens_per_s") is None:
            continue
        low, high = next(b for b in IN_FLIGHT_BUCKETS if b[0] <= n <= b[1])
        by_bucket.setdefault(f"{low}-{high}" if high < 10**9 else f"{low}+", []).append(r["tokens_per_s"])
    out["tokens_per_s_by_in_flight"] = {k: (statistics.median(v), len(v)) for k, v in by_bucket.items()}
    trained = sum(r.get("trained_tokens", 0) for r in trainer)
    out["mixed_token_share"] = (
        sum(r.get("mixed_version_tokens", 0) for r in trainer) / trained if trained else None
    )
    lag_max = [r["lag_max"] for r in trainer if r.get("lag_max") is not None]
    out["lag_max"] = max(lag_max) if lag_max else None
    out["lag_p90_of_steps"] = sorted(lag_max)[int(0.9 * (len(lag_max) - 1))] if lag_max else None
    return out


def _load_previous(ctx: BenchContext, name: str) -> dict:
    path = ctx.out_dir / f"{name}.json"
    if not ctx.options.get("resume") or not path.exists():
        return {"runs": {}, "failures": []}
    return json.loads(path.read_text())


def run(ctx: BenchContext) -> dict:
    recipes = ctx.options.get("recipes") or ([LONG_TAIL] if ctx.quick else list(SEEDS))
    wall_s = ctx.options.get("run_s") or RUN_S["quick" if ctx.quick else "full"]
    name = "rollout_strategies"
    done = _load_previous(ctx, name)  # {"runs": {"recipe/strategy/seed": measured}, "failures": [...]}
    for recipe in recipes:
        if ctx.quick:
            from pipeline_rl.demo.tiny_model import build_tiny_model

            model = build_tiny_model(ctx.out_dir / "models" / "tiny")
        else:
            from pipeline_rl.demo.main import RECIPES, prepare_model

            model = prepare_model(RECIPES[recipe])
        plan = strategies(recipe_max_tokens(recipe))
        seeds = ctx.options.get("seeds") or (1 if ctx.quick else SEEDS.get(recipe, 1))
        for i in range(seeds):
            names = list(plan)
            for strategy in names[i % len(names) :] + names[: i % len(names)]:
                key = f"{recipe}/{strategy}/{i}"
                if key in done["runs"]:
                    continue
                variant, extra = plan[strategy]
                run_dir = ctx.out_dir / name / f"{recipe}-{strategy}{i}-{time.strftime('%H%M%S')}"
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                quick = ("preprocess.drop_all_equal_groups=false",) if ctx.quick else ()
                cmd = launch_command(
                    ctx,
                    variant,
                    model,
                    run_dir,
                    wall_s,
                    seed=i,
                    extra=(*extra, *quick),
                    recipe=recipe,
                    snapshot_every_s=SNAPSHOT_EVERY_S.get(recipe, 3),
                )
                try:
                    launch_run(ctx, strategy, run_dir, wall_s, cmd)
                    evaluate_run(run_dir)
                    done["runs"][key] = {**measure_strategy_run(run_dir, LEVELS[recipe]), "run_s": wall_s}
                except Exception as exc:  # one failed run is recorded; the others go on
                    done["failures"].append(f"{key}: {exc}")
                    ctx.log(f"{key} FAILED (the others go on): {exc}")
                ctx.save_json(name, done)
        results = {s: [v for k, v in done["runs"].items() if k.startswith(f"{recipe}/{s}/")] for s in plan}
        run_s = sorted({r.get("run_s", wall_s) for runs in results.values() for r in runs}) or [wall_s]
        failures = [f for f in done["failures"] if f.startswith(f"{recipe}/")]
        section_ = _section(ctx, recipe, results, seeds, "/".join(map(str, run_s)), failures)
        publish(ctx, f"rollout-strategies-{recipe}", section_)
    return done


def _section(
    ctx: BenchContext, recipe: str, results: dict[str, list[dict]], seeds: int, wall_s: int, failures
):
    levels = [f"{level:.0%}" for level in LEVELS[recipe]]
    target = LEVELS[recipe][-1]

    def med(s: str, key: str):
        return median_of(results[s], key)

    def pct(v):
        return f"{v:.1%}" if v is not None else "-"

    rows = [
        [
            s,
            len(runs),
            *(time_to_text(runs, level) for level in levels),
            spread_text(runs, "samples_per_s", 1),
            spread_text(runs, "samples_to_target"),
            pct(med(s, "engine_idle")),
            pct(med(s, "engine_one_request")),
            pct(med(s, "trainer_idle")),
            med(s, "lag_mean"),
            med(s, "lag_max"),
            pct(med(s, "mixed_token_share")),
        ]
        for s, runs in results.items()
    ]
    table = markdown_table(
        [
            "strategy",
            "runs",
            *(f"s to {level}" for level in levels),
            "samples/s",
            f"samples to {target:.0%}",
            "engine idle",
            "engine at 1 request",
            "trainer idle",
            "lag mean",
            "lag max",
            "tokens in mixed-version answers",
        ],
        rows,
    )
    buckets = sorted(
        {b for runs in results.values() for r in runs for b in r["tokens_per_s_by_in_flight"]},
        key=lambda b: int(b.split("-")[0].rstrip("+")),
    )
    throughput = markdown_table(
        ["strategy", *(f"{b} in flight" for b in buckets)],
        [
            [
                s,
                *(
                    _median_or_dash(
                        [
                            r["tokens_per_s_by_in_flight"][b][0]
                            for r in runs
                            if b in r["tokens_per_s_by_in_flight"]
                        ]
                    )
                    for b in buckets
                ),
            ]
            for s, runs in results.items()
        ],
    )
    notes = [_goal(results, target, recipe)] if recipe == LONG_TAIL else []
    intro = (
        f"The `{recipe}` recipe, {seeds_text(ctx, seeds)} per strategy, runs of {wall_s} s, the strategies "
        "rotating; medians over seeds (min-max). Second table: answer tokens the actor wrote per second, "
        "median over its 1 s records, by the sequences it had in flight then." + failures_note(failures)
    )
    images = [plot_accuracy(ctx, results, f"rollout-strategies-{recipe}")]
    return section(
        ctx, f"Rollout strategies ({recipe})", intro, [table, throughput], notes, [i for i in images if i]
    )


def _median_or_dash(values: list[float]) -> str:
    return f"{statistics.median(values):.0f}" if values else "-"


def _goal(results: dict[str, list[dict]], target: float, recipe: str) -> str:
    name = f"pipelined reaches {target:.0%} on `{recipe}` ≥ 1.5× sooner than the best sync variant"
    sync = {s: median_time_to_target(runs) for s, runs in results.items() if s.startswith("sync")}
    pipe = {s: median_time_to_target(runs) for s, runs in results.items() if s.startswith("pipeline")}
    reached_sync = {s: t for s, t in sync.items() if t is not None}
    reached_pipe = {s: t for s, t in pipe.items() if t is not None}
    bound = _overlap_bound(results)
    bound_text = (
        f"; overlap bound {bound:.2f}× (sync's generation + training / the slower phase)" if bound else ""
    )
    if not reached_pipe:
        return goal_line(name, None, f"no pipelined strategy reached {target:.0%}{bound_text}.")
    best_pipe = min(reached_pipe, key=reached_pipe.get)
    if not reached_sync:
        return goal_line(
            name, True, f"{best_pipe} reached it in {reached_pipe[best_pipe]:.0f} s; no sync variant did."
        )
    best_sync = min(reached_sync, key=reached_sync.get)
    speedup = reached_sync[best_sync] / reached_pipe[best_pipe]
    met = speedup >= 1.5
    detail = f"{speedup:.2f}× ({best_sync} {reached_sync[best_sync]:.0f} s / {best_pipe} {reached_pipe[best_pipe]:.0f} s){bound_text}"
    if not met and bound is not None and bound < 1.5:
        detail += f". Missed, bound {bound:.2f}"
    return goal_line(name, met, detail + ".")


def _overlap_bound(results: dict[str, list[dict]]) -> float | None:
    """(generation + training) / max(generation, training) of the sync runs' median step: what running
    the phases side by side can give at most."""
    gen, train = (
        median_of(results.get("sync", []), "wait_step_s"),
        median_of(results.get("sync", []), "train_step_s"),
    )
    if gen is None or train is None or max(gen, train) <= 0 or math.isnan(gen + train):
        return None
    return (gen + train) / max(gen, train)


def servers_needed(ctx: BenchContext) -> list:
    return []  # every run starts its own servers through the launcher
