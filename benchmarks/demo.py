"""Benchmark `demo`: what a new user sees from `make demo`, recorded run by run.

    python -m benchmarks demo                   # a fresh clone of this checkout runs `make demo` (~20-30 min)
    python -m benchmarks demo --record RUN_DIR  # record a demo run made elsewhere (its run directory)

A fresh clone runs `make demo` exactly as README.md tells a new user (setup included, the warm-up built
anew). Every run is added to the results file's table (earlier runs stay: the range a new user should
expect is over all of them), and the goal line states the range of the held-out accuracy at the end.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common import (
    REPO_ROOT,
    BenchContext,
    cpu_of_this_machine,
    goal_line,
    markdown_table,
    publish,
    section,
)

NAME = "demo"
HEADERS = [
    "date",
    "CPU",
    "how",
    "warm-up: sum right / graded",
    "before RL",
    "~1 min",
    "end",
    "weight versions",
    "batches mixing 2 versions",
    "`pipeline-rl eval`: warm-up / RL checkpoint",
]
CLONE_TIMEOUT_S = 3600


def servers_needed(ctx: BenchContext) -> list:
    return []  # the demo starts its own


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def rescore(repo: Path, run_dir: Path, warmup: Path, log: Path) -> str:
    """`pipeline-rl eval` on the warm-up checkpoint and on the run's RL checkpoint, as a user would run it
    after the demo: "a / b" accuracies, to set beside the run's own first and last evaluations."""
    out = run_dir / "rescore.json"
    with log.open("a") as sink:
        subprocess.run(
            [str(repo / ".venv" / "bin" / "pipeline-rl"), "eval", str(warmup), str(run_dir), "--out", str(out)],
            cwd=repo, stdout=sink, stderr=subprocess.STDOUT, check=True, timeout=900,
        )  # fmt: skip
    before, after = json.loads(out.read_text())["results"]
    return f"{_pct(before['accuracy'])} / {_pct(after['accuracy'])}"


def demo_row(run_dir: Path, warmup_json: Path, how: str, date: str, rescored: str = "-") -> list[str]:
    """One table row from a finished demo run directory and its warm-up's warmup.json."""
    summary = json.loads((run_dir / "summary.json").read_text())
    warm = json.loads(warmup_json.read_text())
    rows = [json.loads(line) for line in (run_dir / "stats.jsonl").read_text().splitlines() if line.strip()]
    evals = sorted((r for r in rows if r.get("type") == "eval"), key=lambda r: r["time"])
    first_minute = next((r["accuracy"] for r in evals[1:] if r["time"] - evals[0]["time"] >= 50), None)
    versions = summary.get("final_weight_version")
    return [
        date,
        cpu_of_this_machine(),
        how,
        f"{_pct(warm.get('number_accuracy'))} / {_pct(warm.get('accuracy'))}",
        _pct(summary.get("accuracy_before")),
        _pct(first_minute),
        _pct(summary.get("accuracy_after")),
        str(versions),
        f"{summary.get('steps_with_mixed_versions')} of {summary.get('steps')}",
        rescored,
    ]


def _fresh_clone_run(ctx: BenchContext) -> list[str]:
    work = Path(tempfile.mkdtemp(prefix="demo-clone-"))
    clone = work / "pipeline-rl"
    try:
        subprocess.run(["git", "clone", "--quiet", str(REPO_ROOT), str(clone)], check=True, timeout=300)
        date = time.strftime("%Y-%m-%d %H:%M")
        log = ctx.out_dir / "demo-clone.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        ctx.log(f"make demo in a fresh clone ({clone}); output in {log}")
        with log.open("w") as out:
            subprocess.run(
                ["make", "demo"],
                cwd=clone,
                stdout=out,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=CLONE_TIMEOUT_S,
            )
        run_dir = max((clone / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
        warmup = clone / "artifacts" / "tiny-arith"
        rescored = rescore(clone, run_dir, warmup, log)
        return demo_row(run_dir, warmup / "warmup.json", "fresh clone", date, rescored)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(ctx: BenchContext) -> dict:
    record = ctx.options.get("record")
    if record:
        run_dir = Path(record)
        date = time.strftime("%Y-%m-%d %H:%M", time.localtime((run_dir / "summary.json").stat().st_mtime))
        warmup = REPO_ROOT / "artifacts" / "tiny-arith"
        rescored = rescore(REPO_ROOT, run_dir, warmup, ctx.out_dir / "demo-rescore.log")
        row = demo_row(run_dir, warmup / "warmup.json", "recorded", date, rescored)
    else:
        row = _fresh_clone_run(ctx)
    previous = ctx.results_dir / f"{NAME}.json"
    rows = json.loads(previous.read_text())["tables"][0]["rows"] if previous.exists() else []
    rows = [r + ["-"] * (len(HEADERS) - len(r)) for r in rows]  # runs recorded before a column existed
    rows.append(row)
    ends = [float(r[6].rstrip("%")) for r in rows if r[6] != "-"]
    befores = [float(r[4].rstrip("%")) for r in rows if r[4] != "-"]
    firsts = [float(r[5].rstrip("%")) for r in rows if r[5] != "-"]
    goal = goal_line(
        "`make demo`: RL lifts held-out accuracy from the warm-up's start within its 10 minutes",
        bool(ends) and min(ends) > max(befores, default=0.0) + 50,
        f"over {len(rows)} runs: {min(befores):.1f}-{max(befores):.1f}% before RL, "
        f"{min(firsts):.1f}-{max(firsts):.1f}% after the first minute, {min(ends):.1f}-{max(ends):.1f}% at the end.",
    )
    intro = (
        "`make demo` on a 2-core box: the tiny model built and warmed up (600 supervised steps on `arith`), then "
        "10 minutes of pipelined GRPO with one vLLM-CPU server, Redis, the preprocessor, the actor and a DDP "
        "trainer. Held-out accuracy is greedy, on 200 problems, every minute. Each row is one run: a fresh "
        "clone running `make demo` as the README says, or a run directory recorded with `--record`."
    )
    rescored = [r for r in rows if r[-1] != "-"]
    agree = goal_line(
        "`pipeline-rl eval` on the warm-up and on the RL checkpoint gives what the demo's own evaluations printed",
        bool(rescored) and all(r[-1] == f"{r[4]} / {r[6]}" for r in rescored),
        f"{sum(r[-1] == f'{r[4]} / {r[6]}' for r in rescored)} of {len(rescored)} rescored runs agree exactly",
    )
    result = section(ctx, "The CPU demo (`make demo`)", intro, [markdown_table(HEADERS, rows)], [goal, agree])
    publish(ctx, NAME, result)
    return result
