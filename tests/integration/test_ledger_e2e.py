"""The sample ledger and the train-time lag bound, on real components.

    .venv/bin/python -m pytest -q tests/integration/test_ledger_e2e.py     # ~3 min on 2 cores

1. Two trainer ranks (the real `accelerate launch` command) get a batch in which some samples are older
   than actor.max_lag at the step that trains them: they are dropped and counted (metrics, ledger), the
   rest is trained with the step's counts lowered exactly, and both ranks stay in lockstep.
2. A short run through every stage: a real actor (two lives of actor 0) on a real server (the torch
   engine: the same contract, seconds to start), two lives of preprocessor 0 (the first dies between
   writing a batch and acking it), a duplicate entry on `rollouts`, and the real trainer. At the end
   the ledger balances and no sample was trained twice.
"""

from __future__ import annotations

import asyncio

import pytest
from support.servers import running_servers
from support.training import (
    ATTEMPTS,
    make_groups,
    packages_by_batch,
    read_jsonl,
    run_config,
    run_trainer,
    with_versions,
)

from pipeline_rl.actor import run_actor
from pipeline_rl.ledger import TOO_STALE, ledger_dir, ledger_summary, read_records
from pipeline_rl.messages import RolloutGroup
from pipeline_rl.preprocess.main import GROUP, Preprocessor
from pipeline_rl.preprocess.ops import group_to_training_samples
from pipeline_rl.streams import ROLLOUTS, make_reader, make_writer

pytestmark = pytest.mark.slow


def _preprocess_all(cfg, prep: Preprocessor) -> None:
    for _ in range(20):
        if not make_writer(cfg.streams, ROLLOUTS).backlog(GROUP):
            break
        prep.poll(block_s=0.0)


def test_two_ranks_drop_samples_older_than_max_lag_and_train_the_rest(redis_server, tiny_model, tmp_path):
    cfg = run_config(tmp_path, redis_server.url, tiny_model, max_lag=0, num_processes=2, max_steps=2)
    first = make_groups(tiny_model, 2, seed=21, prefix="a")
    fresh, old = make_groups(tiny_model, 2, seed=22, prefix="b")
    # Step 2 trains with the weights of version 1: everything of version 0 is 1 > max_lag=0 behind.
    fresh = with_versions(fresh, [[(1, 0)], [(0, 2), (1, 0)], [(1, 0)], [(1, 0)]])  # b:0/1 starts at v0
    old = with_versions(old, [[(0, 0)]] * ATTEMPTS)
    make_writer(cfg.streams, ROLLOUTS).write_many([*first, fresh, old])
    _preprocess_all(cfg, Preprocessor(cfg, 0))
    assert len(packages_by_batch(cfg)) == 2

    code, output = run_trainer(cfg, tmp_path / "trainer.log")
    assert code == 0, output[-4000:]
    stale = {"b:0/1", *(f"b:1/{i}" for i in range(ATTEMPTS))}
    kept = [
        s for s in group_to_training_samples(fresh, cfg.preprocess) if s.sample_id not in stale
    ]  # what step 2 may train
    step1, step2 = read_jsonl(cfg.run_path / "trainer_metrics.jsonl")
    assert (step1["samples"], step1["too_stale"]) == (8, 0)
    assert (step2["samples"], step2["too_stale"]) == (len(kept), len(stale))
    assert step2["trained_tokens"] == sum(sum(s.labels_mask) for s in kept)  # the normalizer, exact
    assert step2["lag_max"] == 0  # the bound holds on every trained token
    records = read_records(ledger_dir(cfg.run_dir) / "trainer.jsonl")[0]
    dropped = [r for r in records if r["event"] == "dropped"]
    assert [(r["reason"], r["step"], sorted(r["ids"])) for r in dropped] == [(TOO_STALE, 2, sorted(stale))]
    trained = {r["step"]: sorted(r["ids"]) for r in records if r["event"] == "trained"}
    assert trained == {
        1: sorted(s.sample_id for g in first for s in g.samples),
        2: sorted(s.sample_id for s in kept),
    }


def test_a_run_through_actor_preprocessor_and_trainer_leaves_a_balanced_ledger(
    redis_server, tiny_model, tmp_path
):
    cfg = run_config(tmp_path, redis_server.url, tiny_model, max_steps=3)
    cfg.preprocess.seq_length = 512  # chat prompts of the arith task fit: every sample is trainable
    rollouts = make_writer(cfg.streams, ROLLOUTS)
    with running_servers(tiny_model, tmp_path / "server-logs", 1, backend="torch") as urls:
        actor_cfg = cfg.model_copy(update={"inference": cfg.inference.model_copy(update={"urls": urls})})
        for _ in range(2):  # actor 0, then actor 0 again after a "restart": prompts start at 0 again
            asyncio.run(run_actor(actor_cfg, 0, max_groups=3))
    groups: list[RolloutGroup] = [
        e.message for e in make_reader(cfg.streams, ROLLOUTS).read(count=100, block_s=0.0)
    ]
    assert len(groups) == 6 and len({g.group_id for g in groups}) == 6

    crashing = Preprocessor(cfg, 0)

    def crash(ids):
        raise RuntimeError("killed between write and ack")

    crashing.reader.ack = crash
    with pytest.raises(RuntimeError, match="killed"):
        crashing.poll(block_s=0.0)
    rollouts.write(groups[0])  # a second entry of one group (a write retried after a lost reply)
    restarted = Preprocessor(cfg, 0)
    _preprocess_all(cfg, restarted)
    restarted.publish(force=True)
    assert rollouts.backlog(GROUP) == 0 and len(packages_by_batch(cfg)) == 3

    code, output = run_trainer(cfg, tmp_path / "trainer.log")
    assert code == 0, output[-4000:]

    ledger = ledger_summary(cfg.run_dir)
    all_ids = sorted(s.sample_id for g in groups for s in g.samples)
    assert ledger.balanced, "\n".join(ledger.lines())
    assert ledger.duplicates_trained == [] and ledger.in_flight == []
    assert (ledger.generated, ledger.trained) == (len(all_ids), len(all_ids))
    assert ledger.dropped == {"duplicate": ATTEMPTS}  # the copy: dropped, counted, not trained
    # The actors' gate arithmetic: every entry written is consumed (trained, or dropped and counted).
    trained_groups = sum(b[0].batch_groups for b in packages_by_batch(cfg).values())
    assert rollouts.total_written() == trained_groups + restarted.totals.groups_dropped
