"""The CPU each experiment tracker costs a run: a run's own stats.jsonl replayed, at the pace it was
written, through the tracking hub with one tracker at a time (and with none, the replay's own cost).

    .venv/bin/python benchmarks/diag/tracker_cpu.py RUN_DIR/stats.jsonl              # first 60 s of rows
    .venv/bin/python benchmarks/diag/tracker_cpu.py RUN_DIR/stats.jsonl --seconds 120 --trackers mlflow

RUN_DIR is any run directory, e.g. one of `python -m benchmarks tracking-cost`'s runs under
artifacts/bench/tracking-cost/. Printed per tracker: CPU seconds of this process and its children (W&B's
service is one) to open it, and per second of the run while rows flow, as a share of one core. The
end-to-end cost on samples per second is the tracking-cost benchmark's; this says which tracker it is.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import psutil

from pipeline_rl.config import RunConfig, load_run_config
from pipeline_rl.tracking.config import TrackingConfig
from pipeline_rl.tracking.hub import Trackers

TRACKERS = ("none", "tensorboard", "wandb", "mlflow")


def _cpu_s() -> float:
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def replay(run_cfg: RunConfig, rows: list[dict], tracker: str) -> tuple[float, float]:
    """(CPU s to open, CPU s while the rows flowed) for one tracker, started as the launcher starts them."""
    root = Path(tempfile.mkdtemp(prefix="tracker-cpu-"))
    tracking = TrackingConfig(wandb_mode="offline", **({} if tracker == "none" else {tracker: True}))
    before = _cpu_s()
    hub = Trackers.start(run_cfg.model_copy(update={"tracking": tracking}), root, resumed=False)
    time.sleep(5)  # the trackers open on the hub's own thread
    opened = _cpu_s()
    first, started, i = rows[0]["time"], time.monotonic(), 0
    while i < len(rows):
        due = first + (time.monotonic() - started)
        j = i
        while j < len(rows) and rows[j]["time"] <= due:
            j += 1
        if hub is not None and j > i:
            hub.rows(rows[i:j])
        i = j
        time.sleep(0.02)
    time.sleep(tracking.flush_every_s + 1)
    flowed = _cpu_s()
    if hub is not None:
        hub.finish({}, [])
    return opened - before, flowed - opened


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stats", type=Path)
    p.add_argument("--seconds", type=float, default=60.0, help="replay this much of the run")
    p.add_argument("--trackers", default=",".join(TRACKERS))
    args = p.parse_args()
    run_cfg = load_run_config(args.stats.parent / "config.json")
    rows = [json.loads(line) for line in args.stats.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("time") and r["time"] - rows[0]["time"] < args.seconds]
    span = rows[-1]["time"] - rows[0]["time"]
    print(f"{len(rows)} rows over {span:.0f} s of {args.stats}")
    print("| tracker | CPU s to open | CPU s while rows flow | share of one core |")
    print("|---|---|---|---|")
    for tracker in args.trackers.split(","):
        opening, flowing = replay(run_cfg, rows, tracker)
        print(f"| {tracker} | {opening:.2f} | {flowing:.2f} | {100 * flowing / span:.2f}% |", flush=True)


if __name__ == "__main__":
    main()
