"""Trainer checkpoints: written durably and atomically, verified, found again on resume, pruned.

Layout of <run_dir>/checkpoints/step_<NNNNNNNN>/:
    model/                 Hugging Face weights (save_pretrained, float32) + tokenizer files from model_path:
                           loadable with from_pretrained, servable with `pipeline-rl serve --model`; or,
                           with trainer.lora, a peft adapter directory (adapter_config.json naming
                           model_path as its base, adapter_model.safetensors, float32) + tokenizer files:
                           loadable with PeftModel.from_pretrained, servable with vLLM's --lora-modules
    optimizer/             optimizer + LR schedule state, in the strategy's format (with trainer.lora: of
                           the adapter only)
    feed_rank<r>.json      rank r's stream position and the packages it had read but not trained yet
    trainer_state.json     step, weight version, consumption counters, world size, strategy, checksums
    manifest.json          written last: every other file's relative path and size in bytes
and <run_dir>/checkpoints/latest holds the name of the newest published checkpoint (for people and
tools; resume does not trust it, see below).

Ordering contract of save() (collective, every rank calls it after the same step):
  1. rank 0 creates step_N.tmp/ (a leftover from a crash is removed first); barrier
  2. every rank writes its parts into it (weights gathered bucket by bucket, rank 0 writes them)
  3. barrier; rank 0, in one pass over step_N.tmp/, fsyncs every file and directory and records the
     sizes, writes manifest.json (fsynced), fsyncs step_N.tmp/; renames it to step_N and fsyncs
     checkpoints/ (and the run directory, which holds checkpoints/); verifies step_N as resume would;
     rewrites `latest` (tmp file + fsync + rename + fsync of checkpoints/); prunes; every rank gets
     the outcome (Comm.on_main: a failure raises on all ranks)
  Only then may ranks commit their stream positions (trimming may drop what a checkpoint still needs
  otherwise). A crash or power loss at any point leaves every earlier published checkpoint intact.
  Every other rank fsyncs the tree before the barrier of step 3, so the files it wrote are durable
  also when it runs on another node over shared storage (where rank 0's fsync cannot flush another
  client's cache); on one machine rank 0's pass alone would do (one page cache).

Verified means: manifest.json parses, every file it lists exists with the recorded size (a truncated
or missing file fails), trainer_state.json parses, and every rank's feed_rank<r>.json parses. It costs
one stat per file and three small JSON reads; file contents are not hashed (that would read the whole
checkpoint back).

Pruning rule (prune(), after the new checkpoint is published AND verified, never before):
  - keep the newest trainer.keep_checkpoints verified checkpoints. keep_checkpoints is at least 2: the
    newest one has been verified but never loaded (the trainer does not reload what it just wrote), so a
    fault only a load reveals (bytes changed in place, sizes intact) must still leave a previous one on
    disk: such a load fails with the library's error, and moving the newest aside resumes from it;
  - delete every older step_* directory, verified or not, and every leftover step_*.tmp/;
  - delete any step_M newer than the one just published: this run resumed from an older checkpoint
    because step_M did not verify, so step_M belongs to an abandoned past and would otherwise shadow
    the new ones on the next resume;
  - a failed verification raises (nothing is pruned, `latest` keeps naming the previous checkpoint).

Resume (latest_checkpoint): step_* directories newest-first by step number; each that does not verify
is skipped with a warning naming it and why; the first that verifies is returned and everything the
trainer restores (weights, optimizer, step, version, each rank's stream position) is read from that
one directory. If directories exist but none verifies, CheckpointError lists each with its reason.

Cadence (checkpoint_due): after a step, a checkpoint is due every trainer.checkpoint_every steps or
when trainer.checkpoint_every_s seconds have passed since the last checkpoint (or since start),
whichever comes first; 0 turns either off. A final checkpoint is always written at shutdown.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from inference_shim.faults import fault_point
from pipeline_rl.progress import Progress
from pipeline_rl.run_dir import (  # noqa: F401 - has_checkpoint, read_snapshots: the layout's readers
    SNAPSHOT_INDEX,
    SNAPSHOTS,
    checkpoints_root,
    has_checkpoint,
    read_snapshots,
    step_dirs,
)
from pipeline_rl.trainer.dist import Comm
from pipeline_rl.trainer.strategies import Strategy

log = logging.getLogger("pipeline_rl.trainer")

WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
MODEL_CONFIG_FILES = ("config.json", "generation_config.json")
MANIFEST = "manifest.json"
STATE = "trainer_state.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete or unreadable (the message says which file and why)."""


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


def checkpoint_due(step: int, seconds_since_last: float, every_steps: int, every_s: float) -> bool:
    """Whether to checkpoint after `step` (pure: the loop passes its clock). 0 turns a cadence off."""
    by_steps = every_steps > 0 and step % every_steps == 0
    by_time = every_s > 0 and seconds_since_last >= every_s
    return by_steps or by_time


def verify(path: Path) -> TrainerState:
    """The checkpoint's TrainerState if it is complete (see the module docstring), else CheckpointError."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not an object")
    except FileNotFoundError:
        raise CheckpointError(f"no {MANIFEST} (the write did not finish)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{MANIFEST} unreadable: {type(e).__name__}: {e}") from None
    for rel, size in files.items():
        try:
            actual = (path / rel).stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{rel} is missing") from None
        if actual != size:
            raise CheckpointError(f"{rel} has {actual} bytes, the manifest recorded {size} (truncated?)")
    try:
        state = read_state(path)
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{STATE} unreadable: {type(e).__name__}: {e}") from None
    if manifest.get("step") != state.step:
        raise CheckpointError(f"{STATE} says step {state.step}, the manifest step {manifest.get('step')}")
    for rank in range(state.world_size):
        name = f"feed_rank{rank}.json"
        if name not in files:
            raise CheckpointError(f"{name} is not in the manifest")
        try:
            read_feed_state(path, rank)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{name} unreadable: {type(e).__name__}: {e}") from None
    return state


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint to resume from: the newest that verifies, skipping (and logging) those that do not.

    None if there is no step_* directory at all; CheckpointError listing each one tried if none verifies.
    """
    tried: list[str] = []
    for _, path in step_dirs(checkpoints_root(run_dir)):
        try:
            verify(path)
        except CheckpointError as e:
            log.warning("checkpoint %s skipped: %s; trying the next older one", path, e)
            tried.append(f"{path.name}: {e}")
            continue
        if tried:
            log.warning("resuming from %s, older than the %d skipped checkpoint(s)", path.name, len(tried))
        return path
    if tried:
        root = checkpoints_root(run_dir)
        raise CheckpointError(
            f"no checkpoint in {root} verifies; tried newest first: " + "; ".join(tried) + ". "
            "Restore the files named (e.g. from a backup), or move the checkpoints directory aside and "
            "start again without trainer.resume (training restarts at step 0)."
        )
    return None


def read_state(path: Path) -> TrainerState:
    return TrainerState(**json.loads((path / STATE).read_text()))


def read_feed_state(path: Path, rank: int) -> dict:
    return json.loads((path / f"feed_rank{rank}.json").read_text())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(top: Path) -> dict[str, int]:
    """fsync every file and directory under `top` (children before parents); returns file sizes."""
    sizes: dict[str, int] = {}
    for dirpath, _dirs, names in os.walk(top, topdown=False):
        for name in names:
            path = Path(dirpath, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                sizes[path.relative_to(top).as_posix()] = os.fstat(fd).st_size
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))
    return sizes


def _write_text(path: Path, text: str) -> None:
    """Atomically and durably: a reader sees the old file or the whole new one, also after power loss."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def copy_tokenizer_files(model_path: str | Path, out: Path, skip: tuple[str, ...] = ()) -> None:
    """Everything in model_path that is not weights, not in `skip` and not in `out` yet (tokenizer, chat
    template, ...; config.json is already there after save_pretrained)."""
    for src in Path(model_path).iterdir():
        if (
            src.is_file()
            and not src.name.endswith(WEIGHT_FILES)
            and src.name not in skip
            and not (out / src.name).exists()
        ):
            shutil.copy2(src, out / src.name)


def write_weights(
    strategy: Strategy, weights: dict[str, torch.Tensor], out_dir: Path, model_path: str | Path
) -> None:
    """The weights `full_state_dict` gathered as a loadable directory plus model_path's tokenizer files:
    the full Hugging Face model, or with trainer.lora the peft adapter (rank 0 calls it)."""
    if strategy.cfg.trainer.lora is None:
        strategy.module.save_pretrained(out_dir, state_dict=weights, safe_serialization=True)
        copy_tokenizer_files(model_path, out_dir)
        return
    from pipeline_rl.trainer import lora

    # An absolute base path: the adapter directory is then loadable from anywhere (transformers, export).
    lora.save_adapter(strategy.module, weights, out_dir, Path(model_path).resolve())
    # The base model's config files stay out: with them the directory would pass for a full model.
    copy_tokenizer_files(model_path, out_dir, skip=MODEL_CONFIG_FILES)


def save_snapshot(
    run_dir: str | Path,
    version: int,
    strategy: Strategy,
    comm: Comm,
    *,
    model_path: str | Path,
    bucket_bytes: int,
) -> Path:
    """Weights of `version` as a loadable model directory, run_dir/snapshots/v<version>, and a line
    {"version", "time"} in snapshots/index.jsonl (collective; rank 0 writes). Not a checkpoint: no
    optimizer or stream position, nothing resumes from it; it is for evaluating weights after the run
    (trainer.snapshot_every_s), off the run's clock."""
    root = Path(run_dir) / SNAPSHOTS
    weights = strategy.full_state_dict(bucket_bytes)  # collective; rank 0 only gets the dict
    final = root / f"v{version:08d}"
    if comm.is_main:
        tmp = root / f"v{version:08d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        write_weights(strategy, weights, tmp, model_path)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with (root / SNAPSHOT_INDEX).open("a") as f:
            f.write(json.dumps({"version": version, "time": time.time(), "path": final.name}) + "\n")
    return final


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

    # A bar when the trainer runs on a terminal (by hand); nothing in a log, which gets its own line.
    bar = Progress(f"checkpoint {final.name}", 4, unit="part", quiet=True, enabled=comm.is_main)
    # Plain writes: the single fsync pass below makes them durable before anything is published.
    weights = strategy.full_state_dict(bucket_bytes)  # collective; rank 0 only gets the dict
    bar.advance(note="weights gathered")
    if comm.is_main:
        write_weights(strategy, weights, tmp / "model", model_path)
    bar.advance(note="model written")
    strategy.save_optimizer(tmp / "optimizer")
    bar.advance(note="optimizer written")
    (tmp / f"feed_rank{comm.rank}.json").write_text(json.dumps(feed_state))
    state.replica_checksums = comm.all_gather_object(strategy.replica_checksum())
    if comm.is_main:
        (tmp / STATE).write_text(json.dumps(asdict(state)))
    else:
        # Ranks on other nodes (shared storage): only the writer's own fsync flushes its client-side
        # cache; rank 0's pass below cannot. On one machine this re-syncs clean pages: cheap.
        _sync_tree(tmp)
    comm.barrier()

    def publish() -> None:
        _publish(root, tmp, final, state.step)
        _write_text(root / "latest", final.name)
        prune(root, keep, newest=final)

    # Rank 0 publishes; every rank waits for it and learns the outcome, so a checkpoint that fails
    # verification stops all ranks at this point instead of leaving them in the next collective.
    comm.on_main(publish, f"publishing checkpoint {final.name}")
    bar.advance(note="published")
    bar.close()
    return final


def _publish(root: Path, tmp: Path, final: Path, step: int) -> None:
    """fsync tmp's tree, add the manifest, rename tmp -> final durably, verify final (rank 0)."""
    fault_point("checkpoint.write")  # chaos tests: die with the files written, nothing published
    sizes = _sync_tree(tmp)
    with open(tmp / MANIFEST, "w") as f:
        json.dump({"step": step, "files": sizes}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)  # a checkpoint of the same step from an abandoned past
    os.replace(tmp, final)
    _fsync_dir(root)
    _fsync_dir(root.parent)  # checkpoints/ itself is new at the first save
    try:
        verify(final)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {final} failed verification right after writing: {e}") from None


def prune(root: Path, keep: int, newest: Path) -> None:
    """Apply the pruning rule of the module docstring after `newest` was published and verified."""
    keep = max(keep, 2)
    newest_step = verify(newest).step
    kept = 0
    for step, path in step_dirs(root):
        if step > newest_step:
            log.warning("deleting %s: newer than %s but from an abandoned past", path, newest.name)
        elif kept < keep:
            try:
                verify(path)
                kept += 1
                continue
            except CheckpointError:
                continue  # an unverifiable one inside the kept window stays until the window passes it
        shutil.rmtree(path, ignore_errors=True)
    for leftover in root.glob("step_*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)


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
