"""Crash and resume: a 2-rank DDP trainer is SIGKILLed after a checkpoint, restarted with
trainer.resume=true, and the run ends exactly as if nothing had happened: every step and every sample
trained once, versions continuing, the weight receiver brought back to the checkpoint's weights first.

Real parts: redis-server, two preprocessors (in this process, taking turns, so their batches interleave
in both partitions), the `accelerate launch` trainer command, a real gloo weight group. The receiver is
the CaptureServer (tests/support/capture.py, no engine): it outlives the killed trainer like a real server would and keeps the
history of versions it applied.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import psutil
import pytest
from support.capture import CaptureServer
from support.training import (
    make_groups,
    read_jsonl,
    run_config,
    run_trainer,
    start_trainer,
    stop_trainer,
)

from pipeline_rl.ledger import ledger_summary
from pipeline_rl.messages import WeightVersionEvent
from pipeline_rl.preprocess.main import Preprocessor
from pipeline_rl.streams import ROLLOUTS, TRAINER_EVENTS, make_reader, make_writer, training_partition
from pipeline_rl.trainer import checkpoint
from pipeline_rl.trainer.feed import commit_name

pytestmark = pytest.mark.slow

STEPS = 6


def _feed(cfg, preps, groups) -> None:
    """Actors' output in, packages out: the two preprocessors take turns until the groups are consumed."""
    make_writer(cfg.streams, ROLLOUTS).write_many(groups)
    deadline = time.monotonic() + 30
    while make_writer(cfg.streams, ROLLOUTS).backlog("preprocess") and time.monotonic() < deadline:
        for prep in preps:
            prep.poll(block_s=0.0)


def _wait_for(predicate, what: str, proc, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"trainer exited with {proc.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_sigkill_after_checkpoint_then_resume_trains_every_sample_exactly_once(
    redis_server, tiny_model, tmp_path
):
    groups = make_groups(tiny_model, 2 * STEPS, seed=7)
    with CaptureServer(tiny_model) as capture:
        cfg = run_config(
            tmp_path, redis_server.url, tiny_model, num_processes=2, max_steps=STEPS, checkpoint_every=2
        )
        cfg.inference.urls = [capture.url]
        preps = [Preprocessor(cfg, 0), Preprocessor(cfg, 1)]
        _feed(
            cfg, preps, groups[:6]
        )  # three batches: the checkpoint at step 2 holds the third unread-by-training

        log_path = tmp_path / "trainer1.log"
        proc = start_trainer(cfg, log_path)
        try:
            metrics_path = cfg.run_path / "trainer_metrics.jsonl"
            _wait_for(lambda: metrics_path.exists() and len(read_jsonl(metrics_path)) == 3, "step 3", proc)
            capture.wait_for_version(3, timeout_s=30)
            ranks = psutil.Process(proc.pid).children(recursive=True)
            assert len([r for r in ranks if "train:rank" in " ".join(r.cmdline())]) == 2  # setproctitle
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher: no chance to checkpoint step 3
            proc.wait(timeout=30)
            # The ranks live in their own sessions (torchrun); they notice their launcher died and die too.
            gone, alive = psutil.wait_procs(ranks, timeout=15)
            assert not alive, f"orphaned trainer processes survived the launcher: {alive}"
        finally:
            stop_trainer(proc)
        ckpt = checkpoint.latest_checkpoint(cfg.run_dir)
        assert checkpoint.read_state(ckpt).step == 2
        buffered = [checkpoint.read_feed_state(ckpt, r)["buffered"] for r in (0, 1)]
        assert all(len(b) == 1 for b in buffered), "the third batch was read before the checkpoint"

        _feed(cfg, preps, groups[6:])
        cfg.trainer.resume = True
        code, output = run_trainer(cfg, tmp_path / "trainer2.log")
        assert code == 0, output[-4000:]
        assert "resuming from" in output and f"step_{2:08d}" in output
        history = [(h["version"], h["restore"]) for h in capture.history]

    # Steps and versions continue from the checkpoint; the redone step 3 replaced the lost one.
    metrics = read_jsonl(cfg.run_path / "trainer_metrics.jsonl")
    assert [(m["step"], m["version"]) for m in metrics] == [(s, s) for s in range(1, STEPS + 1)]
    assert history == [
        (1, False),
        (2, False),
        (3, False),
        (2, True),
        *[(v, False) for v in range(3, STEPS + 1)],
    ]
    events = [e.message for e in make_reader(cfg.streams, TRAINER_EVENTS).read(count=1000, block_s=0.0)]
    versions = [m.version for m in events if isinstance(m, WeightVersionEvent)]
    assert versions == [1, 2, 3, 2, *range(3, STEPS + 1)]  # the restore is announced (actors rewind)

    # Every sample trained exactly once over both lives: no gap, no duplicate.
    trained = [i for line in read_jsonl(cfg.run_path / "trained_samples.jsonl") for i in line["sample_ids"]]
    assert Counter(trained) == Counter(s.sample_id for g in groups for s in g.samples)
    # The ledger says the same: step 3 of the first life was voided by the resume, not counted twice.
    ledger = ledger_summary(cfg.run_dir)
    assert (ledger.trained, ledger.duplicates_trained) == (8 * STEPS, [])
    state = checkpoint.read_state(checkpoint.latest_checkpoint(cfg.run_dir))
    assert (state.step, state.version, state.samples_consumed, state.groups_consumed) == (
        STEPS,
        STEPS,
        8 * STEPS,
        2 * STEPS,
    )
    # After the final checkpoint both ranks committed their positions: nothing of theirs is pending.
    for rank in (0, 1):
        assert make_writer(cfg.streams, training_partition(rank)).backlog(commit_name(rank)) == 0
