"""The preprocessor process on a real redis-server: consumer-group sharing (every group exactly once),
packages that agree across partitions, dynamic sampling and progress, crash recovery, the CLI entry.

Groups are synthetic RolloutGroups written by the test (the actor's output format); everything from the
`rollouts` topic to the `training_data/<rank>` partitions is the real code.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from support.training import packages_by_batch, read_all

from inference_shim.faults import fired
from inference_shim.openai_protocol import VersionSpan
from pipeline_rl.config import RunConfig
from pipeline_rl.launch.locations import snapshot_locations
from pipeline_rl.ledger import LedgerWriter, ledger_dir, ledger_summary, read_records
from pipeline_rl.messages import (
    DeadLetter,
    PreprocessorProgress,
    RolloutGroup,
    Sample,
    StatsRecord,
    TrainingPackage,
)
from pipeline_rl.preprocess import main as preprocess
from pipeline_rl.preprocess.main import GROUP, Preprocessor
from pipeline_rl.preprocess.ops import is_padding
from pipeline_rl.streams import (
    DEAD_LETTER,
    ROLLOUTS,
    STATS,
    TRAINER_EVENTS,
    StreamsConfig,
    make_writer,
)

ATTEMPTS = 4


def make_cfg(
    redis_url: str, tmp_path: Path, *, ranks: int = 2, batch_size: int = 8, **preprocess
) -> RunConfig:
    streams = StreamsConfig(backend="redis", redis_url=redis_url, run_name=f"t{uuid.uuid4().hex[:10]}")
    return RunConfig(
        run_dir=str(tmp_path / "run"),
        model_path=str(tmp_path / "no-model"),
        num_preprocessors=3,
        streams=streams,
        actor={"attempts": ATTEMPTS, "max_tokens": 8},
        inference={"max_model_len": 32},
        preprocess={"seq_length": 48, **preprocess},
        trainer={"num_processes": ranks, "batch_size": batch_size},
    )


def make_group(index: int, rng: random.Random, rewards: list[float] | None = None) -> RolloutGroup:
    group_id = f"0:{index}"
    rewards = rewards or [float(rng.random() < 0.5) for _ in range(ATTEMPTS - 1)] + [0.5]
    samples = []
    for i, reward in enumerate(rewards):
        completion = [rng.randrange(4, 90) for _ in range(rng.randint(2, 8))]
        samples.append(
            Sample(
                sample_id=f"{group_id}/{i}",
                prompt_token_ids=[1] + [rng.randrange(4, 90) for _ in range(rng.randint(3, 12))],
                completion_token_ids=completion,
                completion_logprobs=[-rng.random() for _ in completion],
                version_spans=[VersionSpan(version=index % 3, start=0, end=len(completion))],
                finish_reason="length",
                reward=reward,
            )
        )
    return RolloutGroup(group_id=group_id, task="t", prompt_index=index, actor_id=0, samples=samples)


def trained_sample_ids(batch: dict[int, TrainingPackage]) -> list[str]:
    return [s.sample_id for p in batch.values() for mb in p.micro_batches for s in mb if not is_padding(s)]


def check_complete_batches(cfg: RunConfig, batches: dict[str, dict[int, TrainingPackage]]) -> None:
    """Every batch is on every rank with the same header and the same number of micro-batches."""
    for batch_id, by_rank in batches.items():
        assert sorted(by_rank) == list(range(cfg.trainer.num_processes)), batch_id
        counts = {len(p.micro_batches) for p in by_rank.values()}
        assert len(counts) == 1, f"{batch_id}: unequal micro-batch counts {counts}"
        headers = {
            (p.batch_samples, p.batch_tokens, p.batch_groups, tuple(p.group_ids)) for p in by_rank.values()
        }
        assert len(headers) == 1
        samples = [s for p in by_rank.values() for mb in p.micro_batches for s in mb if not is_padding(s)]
        assert len(samples) == by_rank[0].batch_samples >= cfg.trainer.batch_size
        assert sum(sum(s.labels_mask) for s in samples) == by_rank[0].batch_tokens
        assert sorted({s.group_id for s in samples}) == sorted(by_rank[0].group_ids)
        for p in by_rank.values():
            for mb in p.micro_batches:
                assert sum(len(s.input_ids) for s in mb) <= cfg.preprocess.seq_length


def test_preprocessors_in_a_group_handle_every_group_exactly_once(redis_server, tmp_path):
    cfg = make_cfg(redis_server.url, tmp_path)
    rng = random.Random(0)
    groups = [make_group(i, rng) for i in range(24)]
    make_writer(cfg.streams, ROLLOUTS).write_many(groups)
    preps = [Preprocessor(cfg, i) for i in range(3)]
    deadline = time.monotonic() + 30
    while make_writer(cfg.streams, ROLLOUTS).backlog(GROUP) and time.monotonic() < deadline:
        for prep in preps:  # interleaved, like three processes taking turns
            prep.poll(block_s=0.0)

    batches = packages_by_batch(cfg)
    check_complete_batches(cfg, batches)
    assert len(batches) == 24 * ATTEMPTS // cfg.trainer.batch_size
    assert {b.split(":")[0] for b in batches} == {"prep0", "prep1", "prep2"}  # the work was shared
    ids = [i for batch in batches.values() for i in trained_sample_ids(batch)]
    assert Counter(ids) == Counter(s.sample_id for g in groups for s in g.samples)  # each exactly once
    assert sum(p.totals.groups_in for p in preps) == 24
    assert make_writer(cfg.streams, ROLLOUTS).backlog(GROUP) == 0  # everything acked


def _micro_batches_holding_each_group(cfg: RunConfig) -> dict[str, int]:
    holding: Counter[str] = Counter()
    for batch in packages_by_batch(cfg).values():
        for package in batch.values():
            for mb in package.micro_batches:
                holding.update({s.group_id for s in mb if not is_padding(s)})
    return dict(holding)


def test_shared_prefix_layout_gets_each_group_whole_in_one_micro_batch(redis_server, tmp_path):
    # The shared_prefix layout shares a prompt only within a micro-batch (docs/trainer.md, "Micro-batch layout").
    rng = random.Random(2)
    groups = [make_group(i, rng) for i in range(16)]
    holding = {}
    for layout in ("shared_prefix", "padded"):
        cfg = make_cfg(redis_server.url, tmp_path / layout, batch_size=16, seq_length=96)
        cfg.trainer.micro_batch_layout = layout
        make_writer(cfg.streams, ROLLOUTS).write_many(groups)
        prep = Preprocessor(cfg, 0)
        for _ in range(10):
            prep.poll(block_s=0.0)
        check_complete_batches(cfg, packages_by_batch(cfg))
        holding[layout] = _micro_batches_holding_each_group(cfg)
    assert holding["shared_prefix"] == {g.group_id: 1 for g in groups}
    # Packed by sample length alone (the other layouts), these groups are scattered.
    assert max(holding["padded"].values()) > 1, holding["padded"]


def test_dynamic_sampling_drops_equal_reward_groups_and_reports_them(redis_server, tmp_path):
    cfg = make_cfg(redis_server.url, tmp_path, ranks=1, drop_all_equal_groups=True)
    rng = random.Random(1)
    groups = [make_group(i, rng, rewards=[1.0] * ATTEMPTS if i % 2 else None) for i in range(8)]
    make_writer(cfg.streams, ROLLOUTS).write_many(groups)
    prep = Preprocessor(cfg, 0)
    for _ in range(10):
        prep.poll(block_s=0.0)
    prep.publish(force=True)  # what run() does on exit; while running, drops go out at once

    batches = packages_by_batch(cfg)
    check_complete_batches(cfg, batches)
    kept = {g.group_id for g in groups[::2]}
    assert {gid for b in batches.values() for gid in b[0].group_ids} == kept
    progress = [m for m in read_all(cfg, TRAINER_EVENTS) if isinstance(m, PreprocessorProgress)]
    assert (progress[-1].groups_in, progress[-1].groups_dropped, progress[-1].samples_out) == (8, 4, 16)
    stats = [m for m in read_all(cfg, STATS) if isinstance(m, StatsRecord)]
    assert stats and stats[-1].source == "preprocessor0" and stats[-1].values["batches_out"] == 2
    assert make_writer(cfg.streams, ROLLOUTS).backlog(GROUP) == 0

    # A restarted preprocessor continues its totals (actors take the latest value per id).
    assert Preprocessor(cfg, 0).totals.groups_dropped == 4
    # The ledger names every dropped sample and why.
    assert ledger_summary(cfg.run_dir).dropped == {"filtered": 4 * ATTEMPTS}


def test_drops_are_published_at_once_for_actors_blocked_on_them(redis_server, tmp_path, monkeypatch):
    """A group dropped by dynamic sampling frees a place under the actors' lag limit: with max_lag 0 the
    actor cannot start its replacement before it hears of the drop, so every drop goes out on the poll
    that made it, not after the 1 s rate limit of the other progress."""
    cfg = make_cfg(redis_server.url, tmp_path, ranks=1, drop_all_equal_groups=True)
    rng = random.Random(3)
    writer = make_writer(cfg.streams, ROLLOUTS)
    prep = Preprocessor(cfg, 0)
    # The rate limit could not let them out. Longer than the host has been up (time.monotonic() counts
    # from boot): the first publish of a new preprocessor must be due however long that is.
    monkeypatch.setattr(preprocess, "PROGRESS_EVERY_S", time.monotonic() + 3600.0)
    for i in range(3):
        writer.write(make_group(i, rng, rewards=[0.0] * ATTEMPTS))
        prep.poll(block_s=0.0)
        progress = [m for m in read_all(cfg, TRAINER_EVENTS) if isinstance(m, PreprocessorProgress)]
        assert progress and progress[-1].groups_dropped == i + 1, f"drop {i + 1} not published by its poll"
    # Stats rows stay rate-limited: the three polls above made one.
    stats = [m for m in read_all(cfg, STATS) if isinstance(m, StatsRecord)]
    assert len(stats) == 1


def test_crash_after_writing_before_ack_does_not_duplicate(redis_server, tmp_path):
    cfg = make_cfg(redis_server.url, tmp_path)
    rng = random.Random(2)
    groups = [make_group(i, rng) for i in range(4)]
    make_writer(cfg.streams, ROLLOUTS).write_many(groups[:2])
    crashing = Preprocessor(cfg, 0)

    def crash(ids):
        raise RuntimeError("killed between write and ack")

    crashing.reader.ack = crash
    with pytest.raises(RuntimeError, match="killed"):
        crashing.poll(block_s=0.0)
    assert len(packages_by_batch(cfg)) == 1  # the batch is out, its groups are still pending

    restarted = Preprocessor(cfg, 0)  # same index: gets its pending groups back first
    make_writer(cfg.streams, ROLLOUTS).write_many(groups[2:])
    for _ in range(5):
        restarted.poll(block_s=0.0)
    batches = packages_by_batch(cfg)
    check_complete_batches(cfg, batches)
    ids = [i for batch in batches.values() for i in trained_sample_ids(batch)]
    assert Counter(ids) == Counter(s.sample_id for g in groups for s in g.samples)
    assert make_writer(cfg.streams, ROLLOUTS).backlog(GROUP) == 0


def test_a_duplicate_entry_after_a_restart_is_dropped_and_counted_so_the_gate_balances(
    redis_server, tmp_path
):
    """A group's second entry on `rollouts` (a write retried after a lost reply) reaching a restarted
    preprocessor that still holds the first one pending: the first is acked as already written, the copy
    is dropped AND counted, so written = trained + dropped (the actors' gate arithmetic) holds."""
    cfg = make_cfg(redis_server.url, tmp_path)
    rng = random.Random(5)
    groups = [make_group(i, rng) for i in range(4)]
    rollouts = make_writer(cfg.streams, ROLLOUTS)
    rollouts.write_many(groups[:2])
    crashing = Preprocessor(cfg, 0)

    def crash(ids):
        raise RuntimeError("killed between write and ack")

    crashing.reader.ack = crash
    with pytest.raises(RuntimeError, match="killed"):
        crashing.poll(block_s=0.0)

    restarted = Preprocessor(cfg, 0)
    rollouts.write_many([groups[0], *groups[2:]])  # groups[0] again: a new entry, the same group
    for _ in range(5):
        restarted.poll(block_s=0.0)
    restarted.publish(force=True)

    batches = packages_by_batch(cfg)
    check_complete_batches(cfg, batches)
    ids = [i for batch in batches.values() for i in trained_sample_ids(batch)]
    assert Counter(ids) == Counter(s.sample_id for g in groups for s in g.samples)  # none twice
    progress = [m for m in read_all(cfg, TRAINER_EVENTS) if isinstance(m, PreprocessorProgress)][-1]
    trained_groups = sum(b[0].batch_groups for b in batches.values())
    assert progress.groups_dropped == 1
    assert rollouts.total_written() == 5 == trained_groups + progress.groups_dropped
    assert rollouts.backlog(GROUP) == 0
    records = [r for f in ledger_dir(cfg.run_dir).glob("prep0-*.jsonl") for r in read_records(f)[0]]
    assert [(r["reason"], r["group"], len(r["ids"])) for r in records] == [("duplicate", "0:0", ATTEMPTS)]


def test_crash_between_partitions_leaves_an_incomplete_batch_that_is_redone(redis_server, tmp_path):
    cfg = make_cfg(redis_server.url, tmp_path)
    rng = random.Random(3)
    groups = [make_group(i, rng) for i in range(2)]
    make_writer(cfg.streams, ROLLOUTS).write_many(groups)
    crashing = Preprocessor(cfg, 0)

    def crash(message):
        raise RuntimeError("killed between partitions")

    crashing.partitions[1].write = crash
    with pytest.raises(RuntimeError, match="between partitions"):
        crashing.poll(block_s=0.0)

    restarted = Preprocessor(cfg, 0)
    restarted.poll(block_s=0.0)
    batches = packages_by_batch(cfg)
    complete = {b: by_rank for b, by_rank in batches.items() if len(by_rank) == 2}
    assert len(batches) == 2 and len(complete) == 1  # the torn batch is only on rank 0: never trained
    check_complete_batches(cfg, complete)
    ids = [i for batch in complete.values() for i in trained_sample_ids(batch)]
    assert Counter(ids) == Counter(s.sample_id for g in groups for s in g.samples)


@pytest.mark.parametrize("backend", ["redis", "files"])
def test_every_sample_not_trained_is_located_and_a_deleted_entry_is_named_lost(
    backend, redis_server, tmp_path
):
    """Positive accounting (pipeline_rl/ledger.py) against a real Redis and the files backend: groups
    the preprocessor packed wait in training_data/0 (no trainer read them), a group written after its
    last poll waits undelivered in rollouts, and (Redis) a group deleted from rollouts between produce
    and consume is named LOST by id, not counted as in flight."""
    cfg = make_cfg(redis_server.url, tmp_path, ranks=1, batch_size=8)
    if backend == "files":
        files = {"backend": "files", "files_dir": str(tmp_path / "streams"), "redis_url": None}
        cfg = cfg.model_copy(update={"streams": cfg.streams.model_copy(update=files)})
    rng = random.Random(11)
    actor = LedgerWriter(cfg.run_dir, "actor0-accounting")
    actor.started()
    writer = make_writer(cfg.streams, ROLLOUTS)

    def produce(index: int) -> tuple[list[str], str]:
        group = make_group(index, rng)
        ids = [s.sample_id for s in group.samples]
        actor.generated(group.group_id, ids)  # as the actor does: the ledger line, then the entry
        return ids, writer.write(group)

    # Whole batches of two groups each: five with one deleted (Redis), four (files).
    produced = [produce(i) for i in range(5 if backend == "redis" else 4)]
    lost = []
    if backend == "redis":
        import redis

        lost, entry = produced[2]
        assert redis.Redis.from_url(redis_server.url).xdel(f"{cfg.streams.run_name}:{ROLLOUTS}", entry) == 1
    prep = Preprocessor(cfg, 0)
    for _ in range(4):  # one batch (two groups) a poll
        prep.poll(block_s=0.0)
    waiting, _ = produce(9)  # after the last poll: undelivered
    snapshot_locations(cfg, Path(cfg.run_dir))

    summary = ledger_summary(cfg.run_dir)
    packed = [i for k, (ids, _) in enumerate(produced) if k != 2 or backend == "files" for i in ids]
    assert summary.located == {
        f"{ROLLOUTS} (not acknowledged by the preprocessors)": len(waiting),
        "training_data/0 (after its start)": len(packed),
    }, "\n".join(summary.lines())
    assert summary.lost == sorted(lost) and summary.abandoned == [], "\n".join(summary.lines())
    assert summary.balanced == (not lost)
    if lost:
        assert f"LOST: {', '.join(sorted(lost))}" in "\n".join(summary.lines())


def test_wrong_message_kind_goes_to_dead_letter(redis_server, tmp_path):
    cfg = make_cfg(redis_server.url, tmp_path, ranks=1)
    make_writer(cfg.streams, ROLLOUTS).write(StatsRecord(source="stray", values={}))
    prep = Preprocessor(cfg, 0)
    prep.poll(block_s=0.0)
    dead = [m for m in read_all(cfg, DEAD_LETTER) if isinstance(m, DeadLetter)]
    assert len(dead) == 1 and "expected a rollout_group" in dead[0].error
    assert make_writer(cfg.streams, ROLLOUTS).backlog(GROUP) == 0


def test_a_malformed_group_is_dead_lettered_counted_and_in_the_ledger(redis_server, tmp_path):
    cfg = make_cfg(redis_server.url, tmp_path, ranks=1)
    group = make_group(0, random.Random(6))
    broken = group.samples[0].model_copy(update={"completion_logprobs": []})  # logprobs missing
    make_writer(cfg.streams, ROLLOUTS).write(
        group.model_copy(update={"samples": [broken, *group.samples[1:]]})
    )
    prep = Preprocessor(cfg, 0)
    prep.poll(block_s=0.0)
    assert (prep.totals.groups_in, prep.totals.groups_dropped) == (1, 1)
    assert ledger_summary(cfg.run_dir).dropped == {"malformed": ATTEMPTS}


def all_short(group: RolloutGroup) -> RolloutGroup:
    """The group with every completion cut to 2 tokens."""
    samples = [
        s.model_copy(
            update={
                "completion_token_ids": s.completion_token_ids[:2],
                "completion_logprobs": s.completion_logprobs[:2],
                "version_spans": [VersionSpan(version=s.version_spans[0].version, start=0, end=2)],
            }
        )
        for s in group.samples
    ]
    return group.model_copy(update={"samples": samples})


def with_stages(cfg: RunConfig, placement_of: dict | None = None, **stages: dict) -> RunConfig:
    """cfg with user stages chained between `rollouts` and the advantages stage, all inside it unless
    `placement_of` ({"stages": {...}}) places them."""
    placement_of = placement_of or {}
    graph = {
        "name": "user",
        "stages": {
            "generate": {"kind": "generate", "outputs": ["rollouts"]},
            "train": {"kind": "train_actor", "inputs": ["training_data"]},
        },
    }
    topic = "rollouts"
    for name, spec in stages.items():
        graph["stages"][name] = {**spec, "inputs": [topic], "outputs": [f"after_{name}"]}
        topic = f"after_{name}"
    graph["stages"]["advantages"] = {"kind": "advantages", "inputs": [topic], "outputs": ["training_data"]}
    placement = {"stages": {name: {"inside": "advantages"} for name in stages}, **placement_of}
    return RunConfig.model_validate({**cfg.model_dump(), "graph": graph, "placement": placement})


def test_user_stages_inside_the_preprocessor_drop_and_change_groups_and_the_ledger_names_them(
    redis_server, tmp_path
):
    """The issue's example: a filter added by config alone. Its drops are in the ledger with the stage's
    reason, a group it empties counts as dropped for the actors' gate, a map's rewards reach the
    advantages, and a stage that raises dead-letters its group and the run goes on."""
    base = make_cfg(redis_server.url, tmp_path, ranks=1, batch_size=4)
    cfg = with_stages(
        base,
        short={"kind": "filter", "fn": "support.stage_fns:short_answers", "options": {"min_tokens": 5}},
        double={"kind": "map", "fn": "support.stage_fns:double_rewards", "options": {"factor": 2.0}},
    )
    rng = random.Random(7)
    groups = [make_group(i, rng) for i in range(11)] + [all_short(make_group(11, rng))]
    short = {s.sample_id for g in groups for s in g.samples if len(s.completion_token_ids) < 5}
    emptied = [g.group_id for g in groups if all(s.sample_id in short for s in g.samples)]
    make_writer(cfg.streams, ROLLOUTS).write_many(groups)
    prep = Preprocessor(cfg, 0)
    for _ in range(20):
        prep.poll(block_s=0.0)
    assert 0 < len(short) < 48 and emptied
    ledger = ledger_summary(cfg.run_dir)
    assert ledger.dropped == {"short:too_short": len(short)}
    assert prep.totals.groups_dropped == len(emptied)
    trained = {s.sample_id: s for b in packages_by_batch(cfg).values() for p in b.values() for mb in p.micro_batches
               for s in mb if not is_padding(s)}  # fmt: skip
    assert trained and not set(trained) & short
    originals = {s.sample_id: s.reward for g in groups for s in g.samples}
    assert all(s.reward == 2.0 * originals[s.sample_id] for s in trained.values())

    cfg = with_stages(make_cfg(redis_server.url, tmp_path / "b", ranks=1), oops={"kind": "filter", "level": "group",
                      "fn": "support.stage_fns:broken"})  # fmt: skip
    make_writer(cfg.streams, ROLLOUTS).write(groups[0])
    prep = Preprocessor(cfg, 0)
    prep.poll(block_s=0.0)
    dead = [m for m in read_all(cfg, DEAD_LETTER) if isinstance(m, DeadLetter)]
    assert len(dead) == 1 and "stage oops" in dead[0].error and "a bug in the user's stage" in dead[0].error
    assert ledger_summary(cfg.run_dir).dropped == {"oops:error": ATTEMPTS}
    assert (prep.totals.groups_in, prep.totals.groups_dropped) == (1, 1)
    assert make_writer(cfg.streams, ROLLOUTS).backlog(GROUP) == 0


def test_cli_processes_share_the_stream_and_stop_on_sigterm(redis_server, tmp_path):
    cfg = make_cfg(redis_server.url, tmp_path)
    config_path = tmp_path / "config.json"
    config_path.write_text(cfg.model_dump_json())
    rng = random.Random(4)
    groups = [make_group(i, rng) for i in range(16)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logs = [tmp_path / f"prep{i}.log" for i in range(2)]
    argv = [sys.executable, "-m", "pipeline_rl.cli", "preprocess", "--config", str(config_path), "--index"]
    procs = [
        subprocess.Popen(argv + [str(i)], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
        for i, log in enumerate(logs)
    ]
    try:
        # Start-up and processing get a deadline each: two interpreters importing torch beside another
        # test's engine can take most of a minute to start, and that must not eat the processing time.
        deadline = time.monotonic() + 180
        while not all("reading rollouts" in log.read_text() for log in logs):  # both up (signals handled)
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [
                log.read_text() for log in logs
            ]
            time.sleep(0.1)
        writer = make_writer(cfg.streams, ROLLOUTS)
        for group in groups:  # trickle in, like actors
            writer.write(group)
            time.sleep(0.05)
        deadline = time.monotonic() + 60
        while sum(len(b) for b in packages_by_batch(cfg).values()) < 16 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=30)
    assert [proc.returncode for proc in procs] == [0, 0], [log.read_text() for log in logs]
    batches = packages_by_batch(cfg)
    check_complete_batches(cfg, batches)
    ids = [i for batch in batches.values() for i in trained_sample_ids(batch)]
    assert Counter(ids) == Counter(s.sample_id for g in groups for s in g.samples)


def test_a_stage_with_workers_of_its_own_passes_each_group_on_once_through_a_kill_9(redis_server, tmp_path):
    """Two workers of a filter stage (their own processes, the CLI the launcher starts) share `rollouts`;
    one is SIGKILLed (fault stage.written) after writing a group on and before acking it, and restarts
    with the same index, as the launcher restarts it. The restarted worker finds the group it wrote and
    acks it without writing it again, so two preprocessors downstream cannot both train it: every sample
    is trained exactly once or dropped with the stage's reason, and only the filter's drops count for
    the actors' gate."""
    cfg = with_stages(
        make_cfg(redis_server.url, tmp_path, ranks=1, batch_size=4),
        {"stages": {"short": {"replicas": 2}}},
        short={"kind": "filter", "fn": "support.stage_fns:short_answers", "options": {"min_tokens": 3}},
    )
    config_path = tmp_path / "config.json"
    config_path.write_text(cfg.model_dump_json())
    rng = random.Random(8)
    groups = [make_group(i, rng) for i in range(14)] + [all_short(make_group(i, rng)) for i in (14, 15)]
    short = {s.sample_id for g in groups for s in g.samples if len(s.completion_token_ids) < 3}
    faults = tmp_path / "faults"
    tests = str(Path(__file__).parents[1])  # support.stage_fns, as a user's package on PYTHONPATH
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PIPELINE_RL_FAULTS="stage.written@3",
        PIPELINE_RL_FAULTS_DIR=str(faults),
        PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
    )
    argv = [
        sys.executable,
        "-m",
        "pipeline_rl.cli",
        "stage",
        "--config",
        str(config_path),
        "--stage",
        "short",
        "--index",
    ]

    def start(i: int, boot: int) -> subprocess.Popen:
        log = open(tmp_path / f"short{i}-{boot}.log", "w")  # noqa: SIM115 - the process writes it
        return subprocess.Popen(argv + [str(i)], env=env, stdout=log, stderr=subprocess.STDOUT)

    procs = {0: start(0, 0), 1: start(1, 0)}
    make_writer(cfg.streams, ROLLOUTS).write_many(groups)
    preps = [Preprocessor(cfg, 0), Preprocessor(cfg, 1)]
    restarted = False
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            for i, proc in list(procs.items()):
                if proc.poll() is not None and not restarted:
                    assert proc.returncode == -signal.SIGKILL, proc.returncode
                    procs[i], restarted = start(i, 1), True
            for prep in preps:
                prep.poll(block_s=0.1)
            trained = [i for b in packages_by_batch(cfg).values() for i in trained_sample_ids(b)]
            # What a preprocessor holds waits for a batch to fill (the stream ends before the last one).
            held = [s.sample_id for p in preps for h in p.held for s in h.samples]
            if restarted and len(trained) + len(held) + len(short) >= len(groups) * ATTEMPTS:
                break
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            proc.wait(timeout=30)
    logs = "\n".join(p.read_text() for p in tmp_path.glob("short*.log"))
    assert fired(faults) == ["stage.written"] and restarted, logs
    assert [p.returncode for p in procs.values()] == [0, 0], logs
    assert trained and Counter(trained + held) == Counter(
        s.sample_id for g in groups for s in g.samples if s.sample_id not in short
    )
    ledger = ledger_summary(cfg.run_dir)
    assert ledger.dropped["short:too_short"] == len(short)
    assert "duplicate" not in ledger.dropped, ledger.dropped  # nothing was written twice
    assert "was written before a restart; acking it" in logs
    progress = {}
    for m in read_all(cfg, TRAINER_EVENTS):
        if isinstance(m, PreprocessorProgress):
            progress[m.preprocessor_id] = m.groups_dropped
    assert progress.get("short0", 0) + progress.get("short1", 0) == 2  # the two emptied groups
    assert sum(p.totals.groups_dropped for p in preps) == 0
    assert {"short0", "short1"} <= set(progress)  # both workers took part
    assert make_writer(cfg.streams, ROLLOUTS).backlog("short") == 0
    assert make_writer(cfg.streams, "after_short").backlog(GROUP) == sum(len(p.held) for p in preps)
