"""Trainer checkpoints under real faults: durable publishing (fsync order seen by strace), verification,
resume falling back past a truncated / missing / corrupt newest checkpoint, pruning that keeps a fallback,
and the step/time cadence. Single rank, in-process, a tiny real model on CPU (no server, no torch.distributed);
one test runs a checkpoint write in a child process under strace.

    .venv/bin/python -m pytest -q tests/unit/test_checkpoint.py      # ~30 s on 2 cores
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pydantic
import pytest
import torch

from pipeline_rl.config import RunConfig, TrainerConfig
from pipeline_rl.demo.tiny_model import build_tiny_model
from pipeline_rl.trainer import checkpoint, loop
from pipeline_rl.trainer.checkpoint import CheckpointError, checkpoint_due
from pipeline_rl.trainer.dist import Comm
from pipeline_rl.trainer.strategies.ddp import DDPStrategy

COMM = Comm(rank=0, world=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def _cfg(tmp_path: Path, model: Path, **trainer) -> RunConfig:
    return RunConfig(
        run_dir=str(tmp_path / "run"), model_path=str(model), trainer={"resume": True, **trainer}
    )


def _save(cfg: RunConfig, strategy: DDPStrategy, step: int, keep: int = 2, world_size: int = 1) -> Path:
    """Shift every weight by a step-specific amount (so checkpoints differ), then save step `step`."""
    with torch.no_grad():
        for p in strategy.module.parameters():
            p.add_(0.01 * step)
    state = checkpoint.TrainerState(step=step, version=step, samples_consumed=8 * step, world_size=world_size)
    return checkpoint.save(
        cfg.run_dir,
        state,
        strategy,
        {"position": f"p{step}"},
        COMM,
        model_path=cfg.model_path,
        bucket_bytes=1 << 20,
        keep=keep,
    )


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _steps(cfg: RunConfig) -> list[str]:
    return sorted(p.name for p in checkpoint.checkpoints_root(cfg.run_dir).iterdir() if p.name != "latest")


# ------------------------------------------------------------------------------ publishing, manifest
def test_published_checkpoint_has_a_manifest_of_every_file_and_verifies(tiny_model, tmp_path):
    cfg = _cfg(tmp_path, tiny_model)
    final = _save(cfg, DDPStrategy(cfg, COMM, tiny_model), 1)
    manifest = json.loads((final / "manifest.json").read_text())
    on_disk = {
        p.relative_to(final).as_posix(): p.stat().st_size
        for p in final.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }
    assert manifest == {"step": 1, "files": on_disk}
    assert {
        "model/model.safetensors",
        "optimizer/optimizer.pt",
        "feed_rank0.json",
        "trainer_state.json",
    } <= set(on_disk)
    assert checkpoint.verify(final).step == 1
    root = checkpoint.checkpoints_root(cfg.run_dir)
    assert (root / "latest").read_text() == final.name and _steps(cfg) == ["step_00000001"]


def test_writes_are_fsynced_before_the_rename_that_publishes_them(tiny_model, tmp_path):
    """strace (no mock of os.fsync) records each fsync and rename of a real save() in a child process."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    run_dir = tmp_path / "run"
    script = textwrap.dedent(f"""
        import torch
        from pipeline_rl.config import RunConfig
        from pipeline_rl.trainer import checkpoint
        from pipeline_rl.trainer.dist import Comm
        from pipeline_rl.trainer.strategies.ddp import DDPStrategy
        cfg = RunConfig(run_dir={str(run_dir)!r}, model_path={str(tiny_model)!r})
        comm = Comm(rank=0, world=1, local_rank=0, device=torch.device("cpu"))
        checkpoint.save(cfg.run_dir, checkpoint.TrainerState(step=7), DDPStrategy(cfg, comm, cfg.model_path),
                        {{"position": "p"}}, comm, model_path=cfg.model_path, bucket_bytes=1 << 20, keep=2)
    """)
    trace = tmp_path / "strace.txt"
    # --seccomp-bpf stops the child only at the traced calls (the default stops it at every one: ~1.5x slower).
    syscalls = "trace=fsync,rename,renameat,renameat2"
    argv = ["strace", "-f", "-qq", "--seccomp-bpf", "-y", "-o", str(trace), "-e", syscalls]
    done = subprocess.run([*argv, sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and "ptrace" in done.stderr:
        pytest.skip(f"strace cannot trace here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr[-2000:]

    root = (run_dir / "checkpoints").resolve()
    tmp, final = root / "step_00000007.tmp", root / "step_00000007"
    events: list[tuple[str, str]] = []  # ("fsync", path) / ("rename", "src -> dst"), in syscall order
    for line in trace.read_text().splitlines():
        if m := re.search(r"fsync\(\d+<([^>]*)>\) = 0", line):
            events.append(("fsync", m.group(1)))
        elif m := re.search(r"rename\w*\((?:[^,]*, )?\"([^\"]+)\", (?:[^,]*, )?\"([^\"]+)\"", line):
            events.append(("rename", f"{m.group(1)} -> {m.group(2)}"))
    publish = events.index(("rename", f"{tmp} -> {final}"))
    before = {p for kind, p in events[:publish] if kind == "fsync"}
    files = [p for p in final.rglob("*") if p.is_file()]
    dirs = [p for p in final.rglob("*") if p.is_dir()]
    assert files and all(str(tmp / p.relative_to(final)) in before for p in files), "a file not fsynced"
    assert all(str(tmp / p.relative_to(final)) in before for p in dirs), "a directory not fsynced"
    assert str(tmp) in before, "the checkpoint directory itself not fsynced before the rename"
    after = events[publish + 1 :]
    latest_rename = after.index(("rename", f"{root / 'latest.tmp'} -> {root / 'latest'}"))
    assert ("fsync", str(root)) in after[:latest_rename], "checkpoints/ not fsynced after the rename"
    # `latest`: its content fsynced before its rename, checkpoints/ fsynced after that rename.
    assert ("fsync", str(root / "latest.tmp")) in after[:latest_rename]
    assert ("fsync", str(root)) in after[latest_rename + 1 :]


# ----------------------------------------------------------------------------- faults and fallback
def _truncate_weights(ckpt: Path) -> None:
    path = ckpt / "model" / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _corrupt_state_same_size(ckpt: Path) -> None:
    path = ckpt / "trainer_state.json"
    path.write_bytes(b"#" * path.stat().st_size)  # sizes still match: only the parse catches it


FAULTS = {
    "truncated weights": (_truncate_weights, "model/model.safetensors has"),
    "missing optimizer": (
        lambda c: (c / "optimizer" / "optimizer.pt").unlink(),
        "optimizer/optimizer.pt is missing",
    ),
    "missing feed": (lambda c: (c / "feed_rank0.json").unlink(), "feed_rank0.json is missing"),
    "corrupt trainer_state": (_corrupt_state_same_size, "trainer_state.json unreadable"),
    "corrupt manifest": (lambda c: (c / "manifest.json").write_text("{not json"), "manifest.json unreadable"),
    "no manifest (unfinished)": (lambda c: (c / "manifest.json").unlink(), "no manifest.json"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_resume_skips_a_faulty_newest_checkpoint_and_loads_the_previous(fault, tiny_model, tmp_path, caplog):
    cfg = _cfg(tmp_path, tiny_model)
    strategy = DDPStrategy(cfg, COMM, tiny_model)
    _save(cfg, strategy, 1)
    at_step_1 = _weights(strategy.module)
    newest = _save(cfg, strategy, 2)
    damage, reason = FAULTS[fault]
    damage(newest)

    with caplog.at_level(logging.WARNING, logger="pipeline_rl.trainer"):
        ckpt, state = loop._resume_point(cfg, COMM)  # what Trainer.start restores from
    assert ckpt.name == "step_00000001"
    assert (state.step, state.version, state.samples_consumed) == (1, 1, 8)
    assert checkpoint.read_feed_state(ckpt, 0) == {"position": "p1"}  # the stream position of step 1 too
    skipped = [r.getMessage() for r in caplog.records if " skipped: " in r.getMessage()]
    assert len(skipped) == 1 and "step_00000002" in skipped[0] and reason in skipped[0], skipped

    restored = DDPStrategy(cfg, COMM, ckpt / "model")  # and it really loads: weights of step 1
    restored.load_optimizer(ckpt / "optimizer")
    assert all(torch.equal(at_step_1[k], v) for k, v in restored.module.state_dict().items())


def test_resume_raises_listing_every_checkpoint_tried_when_none_verifies(tiny_model, tmp_path):
    cfg = _cfg(tmp_path, tiny_model)
    strategy = DDPStrategy(cfg, COMM, tiny_model)
    first, second = _save(cfg, strategy, 1), _save(cfg, strategy, 2)
    _truncate_weights(second)
    (first / "feed_rank0.json").unlink()
    with pytest.raises(CheckpointError) as raised:
        loop._resume_point(cfg, COMM)
    message = str(raised.value)
    assert "step_00000002: model/model.safetensors has" in message
    assert "step_00000001: feed_rank0.json is missing" in message
    assert "move the checkpoints directory aside" in message


def test_no_checkpoint_at_all_starts_fresh(tiny_model, tmp_path):
    cfg = _cfg(tmp_path, tiny_model)
    assert checkpoint.latest_checkpoint(cfg.run_dir) is None
    (checkpoint.checkpoints_root(cfg.run_dir) / "step_00000003.tmp").mkdir(parents=True)  # never published
    ckpt, state = loop._resume_point(cfg, COMM)
    assert ckpt is None and state.step == 0


# ------------------------------------------------------------------------------------------ pruning
def test_pruning_keeps_the_newest_verified_two_even_when_asked_for_one(tiny_model, tmp_path):
    cfg = _cfg(tmp_path, tiny_model)
    strategy = DDPStrategy(cfg, COMM, tiny_model)
    for step in (1, 2, 3):
        _save(cfg, strategy, step, keep=1)
    assert _steps(cfg) == ["step_00000002", "step_00000003"]
    with pytest.raises(pydantic.ValidationError, match="keep_checkpoints"):
        TrainerConfig(keep_checkpoints=1)


def test_pruning_keeps_the_last_good_checkpoint_behind_a_corrupt_one(tiny_model, tmp_path):
    cfg = _cfg(tmp_path, tiny_model)
    strategy = DDPStrategy(cfg, COMM, tiny_model)
    _save(cfg, strategy, 1)
    _truncate_weights(_save(cfg, strategy, 2))
    _save(cfg, strategy, 3)  # verified: 3 and 1 (2 does not count), so 1 stays as the fallback
    assert _steps(cfg) == ["step_00000001", "step_00000002", "step_00000003"]
    _save(cfg, strategy, 4)  # verified: 4 and 3; everything older goes, corrupt or not
    assert _steps(cfg) == ["step_00000003", "step_00000004"]


def test_nothing_is_pruned_when_the_new_checkpoint_fails_verification(tiny_model, tmp_path):
    cfg = _cfg(tmp_path, tiny_model)
    strategy = DDPStrategy(cfg, COMM, tiny_model)
    _save(cfg, strategy, 1)
    _save(cfg, strategy, 2)
    # A state claiming 2 ranks from a 1-rank save: feed_rank1.json is never written, verification fails.
    with pytest.raises(CheckpointError, match="step_00000003 failed verification.*feed_rank1.json"):
        _save(cfg, strategy, 3, world_size=2)
    assert _steps(cfg) == ["step_00000001", "step_00000002", "step_00000003"]
    root = checkpoint.checkpoints_root(cfg.run_dir)
    assert (root / "latest").read_text() == "step_00000002"
    assert checkpoint.latest_checkpoint(cfg.run_dir).name == "step_00000002"


def test_after_a_fallback_the_abandoned_newer_checkpoints_and_leftovers_are_removed(tiny_model, tmp_path):
    cfg = _cfg(tmp_path, tiny_model)
    strategy = DDPStrategy(cfg, COMM, tiny_model)
    for step in (2, 3, 4):
        _save(cfg, strategy, step, keep=3)
    _truncate_weights(checkpoint.checkpoints_root(cfg.run_dir) / "step_00000004")
    (checkpoint.checkpoints_root(cfg.run_dir) / "step_00000003" / "manifest.json").unlink()
    (checkpoint.checkpoints_root(cfg.run_dir) / "step_00000009.tmp").mkdir()  # a crashed write
    ckpt, state = loop._resume_point(cfg, COMM)
    assert (ckpt.name, state.step) == ("step_00000002", 2)
    _save(cfg, strategy, 3, keep=3)  # the resumed run redoes step 3
    # step_4 (from the abandoned past) would shadow the new step_3 on the next resume: gone.
    assert _steps(cfg) == ["step_00000002", "step_00000003"]
    assert checkpoint.latest_checkpoint(cfg.run_dir).name == "step_00000003"


# ------------------------------------------------------------------------------------------ cadence
def test_checkpoint_due_by_steps_or_by_time_whichever_first():
    """A fake clock: steps take 70 s; the timer restarts at every checkpoint, whichever cadence made it."""

    def run(every_steps: int, every_s: float, steps: int = 17) -> list[int]:
        saved_at, saved = 0.0, []
        for step in range(1, steps + 1):
            now = 70.0 * step
            if checkpoint_due(step, now - saved_at, every_steps=every_steps, every_s=every_s):
                saved.append(step)
                saved_at = now
        return saved

    # 5: 350 s since start; 6: step cadence; 11: 350 s since step 6; 12: steps; 17: 350 s since 12.
    assert run(every_steps=6, every_s=300) == [5, 6, 11, 12, 17]
    assert run(every_steps=0, every_s=300) == [5, 10, 15]
    assert [s for s in range(1, 16) if checkpoint_due(s, 1e9, every_steps=4, every_s=0)] == [4, 8, 12]
    assert not any(checkpoint_due(s, 1e9, every_steps=0, every_s=0) for s in range(1, 16))
    assert checkpoint_due(1, 300.0, every_steps=0, every_s=300) and not checkpoint_due(1, 299.9, 0, 300)


def test_trainer_applies_the_time_cadence_from_its_config(tiny_model, tmp_path):
    cfg = _cfg(tmp_path, tiny_model, checkpoint_every=0, checkpoint_every_s=60)
    assert TrainerConfig().checkpoint_every_s == 300  # on by default: a crash costs minutes
    state = checkpoint.TrainerState(step=3)
    # Only cfg, comm, state and the clock matter to checkpoint_due; nothing else is built here.
    tr = loop.Trainer(cfg, COMM, state, None, None, None, None, None, None, saved_step=0, saved_at=0.0)
    tr.saved_at = time.monotonic() - 59
    assert not tr.checkpoint_due()
    tr.saved_at = time.monotonic() - 61
    assert tr.checkpoint_due()
