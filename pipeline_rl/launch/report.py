"""End-of-run summary and plots from <run_dir>/stats.jsonl (written by pipeline_rl/launch/monitor.py).

    pipeline-rl report runs/20261122-120000        # plots, summary and the sample ledger of a run

Plots (PNG, in the run directory): reward vs wall time, reward vs samples, lag of trained tokens per step, throughput over time. The summary (summary.json) holds the run's headline figures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline_rl.ledger import ledger_summary


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "stats.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _series(rows: list[dict], source: str, key: str, x: str = "time") -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        if (
            row.get("type") == "stats"
            and row.get("source") == source
            and isinstance(row.get(key), int | float)
        ):
            if isinstance(row.get(x), int | float):
                xs.append(row[x])
                ys.append(row[key])
    return xs, ys


def make_plots(run_dir: Path, started_at: float) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(run_dir)
    written: list[Path] = []

    def save(fig, name: str) -> None:
        path = run_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    t, reward = _series(rows, "trainer", "reward")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([x - started_at for x in t], reward, marker=".", lw=1, label="reward of trained samples")
    # Held-out evaluations (greedy, before RL, every eval.every_s, after RL) on the same axis: the
    # reward of trained samples depends on which groups were kept, the held-out accuracy does not.
    evals = [r for r in rows if r.get("type") == "eval" and isinstance(r.get("accuracy"), int | float)]
    if evals:
        ax.plot(
            [max(0.0, r["time"] - started_at) for r in evals],
            [r["accuracy"] for r in evals],
            "s-",
            color="tab:green",
            lw=1.2,
            label="held-out accuracy",
        )
        ax.legend(fontsize=8)
    ax.set(xlabel="wall time (s)", ylabel="reward / accuracy", title="Reward and held-out accuracy")
    ax.grid(alpha=0.3)
    save(fig, "reward_vs_time.png")

    samples, reward_s = _series(rows, "trainer", "reward", x="samples_consumed")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(samples, reward_s, marker=".", lw=1)
    ax.set(xlabel="samples trained", ylabel="mean reward", title="Reward vs samples")
    ax.grid(alpha=0.3)
    save(fig, "reward_vs_samples.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, style in (("lag_max", "-"), ("lag_mean", "--"), ("lag_min", ":")):
        steps, values = _series(rows, "trainer", key, x="step")
        ax.plot(steps, values, style, lw=1.2, label=key.replace("_", " "))
    ax.set(xlabel="optimizer step", ylabel="versions behind", title="Lag of trained tokens per step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, "lag_per_step.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for source, key, label in [("trainer", "samples_per_s", "trainer samples/s")]:
        x, y = _series(rows, source, key)
        ax.plot([v - started_at for v in x], y, lw=1, label=label)
    actor_sources = sorted(
        {
            r["source"]
            for r in rows
            if r.get("type") == "stats" and str(r.get("source", "")).startswith("actor")
        }
    )
    for source in actor_sources:
        x, y = _series(rows, source, "samples_per_s")
        ax.plot([v - started_at for v in x], y, lw=1, label=f"{source} samples/s")
    ax.set(xlabel="wall time (s)", ylabel="samples/s", title="Throughput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, "throughput.png")
    return written


def summarize(run_dir: Path, started_at: float, extra: dict, shared_dir: Path | None = None) -> dict:
    """<run_dir>/summary.json from the node's stats; the ledger from `shared_dir` (a cluster node's run_dir
    is its own directory under the shared one, where every node's ledger files are)."""
    rows = _rows(run_dir)
    trainer = [r for r in rows if r.get("type") == "stats" and r.get("source") == "trainer"]
    versions = [r for r in rows if r.get("type") == "version"]
    lag_max = max((r.get("lag_max", 0) or 0 for r in trainer), default=None)
    mixed = sum(1 for r in trainer if (r.get("lag_max") or 0) > (r.get("lag_min") or 0))
    summary = {
        "run_dir": str(run_dir),
        "wall_s": round(max((r.get("time", started_at) for r in rows), default=started_at) - started_at, 1),
        "steps": max((r.get("version", 0) for r in versions), default=0),
        "samples_trained": max((r.get("samples_consumed", 0) for r in versions), default=0),
        "reward_first_steps": _mean([r.get("reward") for r in trainer[:5]]),
        "reward_last_steps": _mean([r.get("reward") for r in trainer[-5:]]),
        "lag_max": lag_max,
        "steps_with_mixed_versions": mixed,
        "ledger": _ledger(shared_dir or run_dir),
        "phase_times": phase_times(trainer),
        **extra,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# Trainer phases per step, in the order they happen (trainer_metrics.jsonl; docs/trainer.md "Metrics").
# wait_data_s includes reading and decoding the package; forward_backward_s = collate + forward +
# backward + batch_metrics (the per-micro-batch phases).
PHASES = (
    "wait_data_s",
    "collate_s",
    "forward_s",
    "backward_s",
    "batch_metrics_s",
    "optimizer_s",
    "step_metrics_s",
    "weight_push_s",
    "events_s",
    "checkpoint_s",
    "snapshot_s",
)


def phase_times(trainer_rows: list[dict]) -> dict:
    """Median seconds per step of each phase, and its share of the median step."""
    import statistics

    out = {}
    steps = [r["step_s"] for r in trainer_rows if isinstance(r.get("step_s"), int | float)]
    step_s = statistics.median(steps) if steps else None
    for name in PHASES:
        values = [r[name] for r in trainer_rows if isinstance(r.get(name), int | float)]
        if values:
            median = statistics.median(values)
            share = round(median / step_s, 3) if step_s else None
            out[name] = {"median_s": round(median, 5), "share_of_step": share}
    if step_s is not None:
        out["step_s"] = {"median_s": round(step_s, 5), "share_of_step": 1.0}
    return out


def phase_lines(phases: dict) -> list[str]:
    """The phase table `pipeline-rl report` prints."""
    lines = ["trainer phases per step (medians):"]
    for name, v in phases.items():
        share = "" if v["share_of_step"] is None else f"  {v['share_of_step']:6.1%}"
        lines.append(f"  {name:<16} {v['median_s'] * 1000:9.1f} ms{share}")
    return lines


def _mean(values) -> float | None:
    values = [v for v in values if isinstance(v, int | float)]
    return round(sum(values) / len(values), 4) if values else None


def _ledger(run_dir: Path) -> dict:
    ledger = ledger_summary(run_dir)
    return {
        "balanced": ledger.balanced,
        "generated": ledger.generated,
        "trained": ledger.trained,
        "dropped": ledger.dropped,
        "in_flight": len(ledger.in_flight),
        "duplicates_trained": ledger.duplicates_trained[:20],
        # None where no location snapshot was taken (not a clean stop): not established
        "located": ledger.located,
        "abandoned": len(ledger.abandoned),
        "lost": None if ledger.lost is None else len(ledger.lost),
        "lost_ids": (ledger.lost or [])[:20],
    }


def main(argv: list[str] | None = None) -> None:
    """`pipeline-rl report RUN_DIR`: re-make the plots, print the summary and the sample ledger."""
    parser = argparse.ArgumentParser(prog="pipeline-rl report", description=main.__doc__)
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    rows = _rows(args.run_dir)
    start = min((r.get("time", 0) for r in rows if r.get("time")), default=0)
    for path in make_plots(args.run_dir, start):
        print(path)
    summary_path = args.run_dir / "summary.json"
    if summary_path.exists():
        print(summary_path.read_text().strip())
    metrics = args.run_dir / "trainer_metrics.jsonl"
    if metrics.exists():
        steps = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        print("\n".join(phase_lines(phase_times(steps))))
    print("\n".join(ledger_summary(args.run_dir).lines()))


if __name__ == "__main__":
    main()
