"""Where a run directory keeps the trainer's checkpoints and weight snapshots.

Torch-free, so that the launcher, the evaluation and the report read a run directory without importing
the trainer; the trainer's checkpoint module (pipeline_rl/trainer/checkpoint.py) writes what is laid out
here and verifies it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
SNAPSHOTS = "snapshots"
SNAPSHOT_INDEX = "index.jsonl"
_STEP_DIR = re.compile(r"step_(\d+)")


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every step_<N> directory (not .tmp) as (N, path), newest first; complete or not."""
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether a published checkpoint directory exists (verified only when the trainer loads it)."""
    return bool(step_dirs(checkpoints_root(run_dir)))


def read_snapshots(run_dir: str | Path) -> list[dict]:
    """The index rows of a run's weight snapshots, oldest first ([] when it saved none)."""
    index = Path(run_dir) / SNAPSHOTS / SNAPSHOT_INDEX
    if not index.exists():
        return []
    return [json.loads(line) for line in index.read_text().splitlines() if line.strip()]
