"""`python -m benchmarks lag`: how stale may a pipelined sample be? max_lag x KV policy.

    python -m benchmarks lag                          # demo model, max_lag 0,1,2,4,8 x recompute/keep, 1 seed, 100 s
    python -m benchmarks lag --lags 0,2,8 --seeds 2   # fewer lags, two seeds
    python -m benchmarks lag --kv-after-update recompute --seeds 3   # one KV policy, three seeds
    python -m benchmarks lag --quick                  # tiny untrained model, lags 0 and 2, recompute, 30 s (smoke test)
    python -m benchmarks lag --recipe longtail --lags 0,2,4,8 --seeds 3 --kv-after-update keep \
        --override algo.name=decoupled --override algo.lag_correction=decay --override algo.lag_decay=0.9 \
        --tag decoupled-decay                         # learning per sample under lag with the corrections

Every run is a pipelined `pipeline-rl launch` of the demo recipe (or `--recipe`) (pipeline_vs_sync.launch_command) with
`actor.max_lag=L` and `inference.kv_after_update=K`; only those two change. The buffer is raised to
what the lag allows (`actor.max_buffered_groups` = groups per step x (L+1), at least the recipe's), so
the lag, not the buffer, is what binds. max_lag 0 is pipelined in name only: the actor may not start a
group for the next version before the trainer has stepped, so engine and trainer take turns.
`recompute` drops a sequence's KV cache after an update (its next tokens see the new weights through a
fresh prefill); `keep` continues on the old cache. Reported per (L, K): seconds AND samples trained
until held-out accuracy first reaches the target levels (learning per second and per sample), final
accuracy, samples/s, the median over steps of the trained tokens' mean lag, and samples dropped as too
stale.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from benchmarks.common import (
    BenchContext,
    failures_note,
    goal_line,
    markdown_table,
    publish,
    run_interleaved,
    section,
    seeds_text,
)
from benchmarks.pipeline_vs_sync import (
    EVAL_EVERY_S,
    LEVELS,
    launch_command,
    launch_run,
    measure_run,
    median_of,
    plot_accuracy,
    time_to_text,
)
from pipeline_rl.eval.snapshots import evaluate_run

LAGS = (0, 1, 2, 4, 8)
KV_POLICIES = ("recompute", "keep")
RUN_S = {"full": 100, "quick": 30}


def servers_needed(ctx: BenchContext) -> list:
    return []  # every run starts its own servers through the launcher


def lag_overrides(recipe_overrides: list[str], lag: int, kv: str) -> tuple[str, ...]:
    """The launch overrides of one (max_lag, KV policy) run: the buffer sized so the lag binds."""
    from pipeline_rl.launch.compose import compose

    cfg = compose(
        ["model_path=unused", *recipe_overrides]
    )  # the recipe's typed config, as the launcher sees it
    groups_per_step = cfg.trainer.batch_size // cfg.actor.attempts
    buffered = max(cfg.actor.max_buffered_groups, groups_per_step * (lag + 1))
    return (
        f"actor.max_lag={lag}",
        f"actor.max_buffered_groups={buffered}",
        f"inference.kv_after_update={kv}",
    )


def run(ctx: BenchContext) -> dict:
    from pipeline_rl.demo.main import RECIPES

    recipe = ctx.options.get("recipe", "arith")
    if ctx.quick:
        from pipeline_rl.demo.tiny_model import build_tiny_model

        model = build_tiny_model(ctx.out_dir / "models" / "tiny")
    else:
        from pipeline_rl.demo.main import prepare_model

        model = prepare_model(RECIPES[recipe])
    lags = ctx.options.get("lags") or ([0, 2] if ctx.quick else list(LAGS))
    # --kv-after-update names the one policy to run (the lags under it only); default both.
    chosen = ctx.options.get("kv_after_update")
    policies = [chosen] if chosen else ["recompute"] if ctx.quick else list(KV_POLICIES)
    wall_s = ctx.options.get("run_s") or RUN_S["quick" if ctx.quick else "full"]
    seeds = ctx.options.get("seeds") or 1
    configs = {f"lag{lag}-{kv}": (lag, kv) for kv in policies for lag in lags}

    def one_run(name: str, i: int) -> dict:
        lag, kv = configs[name]
        run_dir = ctx.out_dir / "lag" / f"{name}-{i}-{time.strftime('%H%M%S')}"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        extra = lag_overrides(RECIPES[recipe].overrides, lag, kv)
        if ctx.quick:  # an untrained model's groups are all-equal: keep them, so steps happen
            extra += ("preprocess.drop_all_equal_groups=false",)
        cmd = launch_command(ctx, "pipeline", model, run_dir, wall_s, seed=i, extra=extra, recipe=recipe)
        launch_run(ctx, "pipeline", run_dir, wall_s, cmd)
        evaluate_run(run_dir)
        return measure_run(run_dir, LEVELS[recipe])

    name = result_name(recipe, ctx.options.get("tag"))
    results, failures = run_interleaved(ctx, list(configs), seeds, one_run, name)
    return publish_lag(ctx, results, configs, seeds, wall_s, failures, recipe=recipe, name=name)


def result_name(recipe: str, tag: str | None) -> str:
    """lag, lag-<recipe>, lag-<recipe>-<tag>: one results file per study."""
    return "-".join(["lag", *([recipe] if recipe != "arith" else []), *([tag] if tag else [])])


def publish_lag(
    ctx: BenchContext,
    results: dict[str, list[dict]],
    configs: dict[str, tuple[int, str]],
    seeds: int,
    wall_s: int,
    failures: Sequence[str] = (),
    recipe: str = "arith",
    name: str = "lag",
) -> dict:
    levels = [f"{level:.0%}" for level in LEVELS[recipe]]
    target = f"{LEVELS[recipe][-1]:.0%}"

    def med(setting: str, key: str):
        return median_of(results[setting], key)

    rows = []
    for setting, (lag, kv) in configs.items():
        samples = med(setting, "samples_to_target")
        rows.append(
            [
                lag,
                kv,
                *(time_to_text(results[setting], level) for level in levels),
                f"{samples:.0f}" if samples is not None else "not reached",
                f"{med(setting, 'accuracy_after'):.1%}"
                if med(setting, "accuracy_after") is not None
                else "-",
                med(setting, "samples_per_s"),
                med(setting, "lag_mean"),
                med(setting, "too_stale"),
            ]
        )
    table = markdown_table(
        [
            "max_lag",
            "KV after update",
            *(f"s to {level}" for level in levels),
            f"samples to {target}",
            "final acc.",
            "samples/s",
            "mean lag",
            "too stale",
        ],
        rows,
    )
    # What the study is for: does allowing lag cost learning per sample, and does it buy time?
    by_lag = {configs[n][0]: n for n in configs if configs[n][1] == "recompute"}
    by_lag = by_lag or {configs[n][0]: n for n in configs}  # one policy run: its own
    goals = []
    if 0 in by_lag and 4 in by_lag:
        s0, s4 = med(by_lag[0], "samples_to_target"), med(by_lag[4], "samples_to_target")
        goal = f"at max_lag 4, samples to {target} within 1.1x of max_lag 0"
        if s0 is None or s4 is None:
            goals.append(
                goal_line(goal, None, f"max_lag 0: {s0}, max_lag 4: {s4} samples (None: not reached).")
            )
        else:
            goals.append(goal_line(goal, s4 <= 1.1 * s0, f"{s4:.0f} / {s0:.0f} = {s4 / s0:.2f}x."))
    if 0 in by_lag and len(by_lag) > 1:
        t0 = med(by_lag[0], "time_to_target_s")
        best = min(
            (n for lag, n in by_lag.items() if lag > 0 and med(n, "time_to_target_s") is not None),
            key=lambda n: med(n, "time_to_target_s"),
            default=None,
        )
        sooner = f"some max_lag > 0 reaches {target} sooner than max_lag 0 (recompute)"
        if best is None:
            goals.append(
                goal_line(sooner, None if t0 is None else False, f"no max_lag > 0 reached {target}.")
            )
        elif t0 is None:
            goals.append(
                goal_line(
                    sooner, True, f"{best} did ({med(best, 'time_to_target_s'):.0f} s); max_lag 0 did not."
                )
            )
        else:
            tb = med(best, "time_to_target_s")
            goals.append(goal_line(sooner, tb < t0, f"{best} {tb:.0f} s vs lag0-recompute {t0:.0f} s."))
    intro = (
        f"Pipelined runs of the `{recipe}` recipe on its warmed-up model, {seeds_text(ctx, seeds)} per setting, "
        f"{wall_s} s each, the settings rotating; only `actor.max_lag` and `inference.kv_after_update` "
        "change (and the buffer, sized to the lag: benchmarks/lag.py). Seconds from the run's first "
        f"step, and samples trained into the evaluated weights, until greedy held-out accuracy (100 "
        f"problems, graded after the run on the weights the trainer saved every {EVAL_EVERY_S} s) first "
        "reaches each level; mean lag = median over steps of the "
        "trained tokens' mean versions behind; too stale = samples the trainer dropped for exceeding max_lag."
        + failures_note(failures)
    )
    images = [
        plot_accuracy(ctx, results, f"{name}-seconds"),
        plot_accuracy(ctx, results, f"{name}-samples", curve="curve_samples", xlabel="samples trained"),
    ]
    overrides = " ".join(ctx.options.get("overrides", ()))
    title = "Lag study: max_lag and the KV policy" + (
        f" ({recipe}{', ' + overrides if overrides else ''})" if name != "lag" else ""
    )
    publish(ctx, name, section(ctx, title, intro, [table], goals, [i for i in images if i]))
    return results
