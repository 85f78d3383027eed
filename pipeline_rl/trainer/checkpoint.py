"""Trainer checkpoints: written atomically, found again on resume, pruned.

Layout of <run_dir>/checkpoints/step_<NNNNNNNN>/:
    model/                 Hugging Face weights (save_pretrained, float32) + tokenizer files from model_path:
                           loadable with from_pretrained, servable with `pipeline-rl serve --model`
    optimizer/             optimizer + LR schedule state, in the strategy's format
    feed_rank<r>.json      rank r's stream position and the packages it had read but not trained yet
    trainer_state.json     step, weight version, consumption counters, world size, strategy, checksums
and <run_dir>/checkpoints/latest holds the name of the newest complete checkpoint.

Ordering contract of save() (collective, every rank calls it after the same step):
  1. rank 0 creates step_N.tmp/ (a leftover from a crash is removed first); barrier
  2. every rank writes its parts into it (weights gathered bucket by bucket, rank 0 writes them)
  3. barrier; rank 0 renames step_N.tmp -> step_N, then rewrites `latest` (tmp file + rename), then
     deletes checkpoints beyond trainer.keep_checkpoints; barrier
  Only then may ranks commit their stream positions (trimming may drop what a checkpoint still needs
  otherwise). A crash at any point leaves the previous `latest` intact.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline_rl.trainer.dist import Comm
from pipeline_rl.trainer.strategy import Strategy

WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


@dataclass
class TrainerState:
    """What a resumed trainer needs besides weights and optimizer (trainer_state.json)."""

    step: int = 0
    version: int = 0
    samples_consumed: int = 0
    groups_consumed: int = 0
    tokens_consumed: int = 0
    world_size: int = 1
    strategy: str = "ddp"
    replica_checksums: list[str | None] = field(default_factory=list)


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    root = checkpoints_root(run_dir)
    pointer = root / "latest"
    if pointer.is_file():
        path = root / pointer.read_text().strip()
        if (path / "trainer_state.json").is_file():
            return path
    # `latest` missing (crash right after a rename): the newest complete directory is as good.
    complete = sorted(
        p for p in root.glob("step_*") if p.suffix != ".tmp" and (p / "trainer_state.json").is_file()
    )
    return complete[-1] if complete else None


def read_state(path: Path) -> TrainerState:
    return TrainerState(**json.loads((path / "trainer_state.json").read_text()))


def read_feed_state(path: Path, rank: int) -> dict:
    return json.loads((path / f"feed_rank{rank}.json").read_text())


def _write_text(path: Path, text: str) -> None:
    """Atomically: a reader sees the old file or the whole new one, never a torn one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_json(path: Path, data: object) -> None:
    _write_text(path, json.dumps(data))


def copy_tokenizer_files(model_path: str | Path, out: Path) -> None:
    """Everything in model_path that is not weights or config.json (tokenizer, chat template, ...)."""
    for src in Path(model_path).iterdir():
        if src.is_file() and not src.name.endswith(WEIGHT_FILES) and not (out / src.name).exists():
            shutil.copy2(src, out / src.name)


def save(
    run_dir: str | Path,
    state: TrainerState,
    strategy: Strategy,
    feed_state: dict,
    comm: Comm,
    *,
    model_path: str | Path,
    bucket_bytes: int,
    keep: int,
) -> Path:
    """Write checkpoint step_<state.step> (collective; see the module docstring for the order)."""
    root = checkpoints_root(run_dir)
    final = root / f"step_{state.step:08d}"
    tmp = root / f"step_{state.step:08d}.tmp"
    if comm.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    comm.barrier()

    weights = strategy.full_state_dict(bucket_bytes)  # collective; rank 0 only gets the dict
    if comm.is_main:
        strategy.module.save_pretrained(tmp / "model", state_dict=weights, safe_serialization=True)
        copy_tokenizer_files(model_path, tmp / "model")
    strategy.save_optimizer(tmp / "optimizer")
    _write_json(tmp / f"feed_rank{comm.rank}.json", feed_state)
    state.replica_checksums = comm.all_gather_object(strategy.replica_checksum())
    if comm.is_main:
        _write_json(tmp / "trainer_state.json", asdict(state))
    comm.barrier()

    if comm.is_main:
        shutil.rmtree(final, ignore_errors=True)  # a checkpoint of the same step from a previous life
        os.replace(tmp, final)
        _write_text(root / "latest", final.name)
        _prune(root, keep)
    comm.barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    complete = sorted(p for p in root.glob("step_*") if p.suffix != ".tmp")
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop lines of steps after `last_step` (a resumed run redoes them). Atomic rewrite."""
    if not path.is_file():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line and json.loads(line).get("step", 0) <= last_step
    ]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
