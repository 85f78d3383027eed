"""The stream tests every backend must pass (the Redis backend against a real redis-server in
tests/integration/test_streams.py, the files backend in tests/unit/streams/test_files_streams.py):
each test module imports these cases and gives them its own `cfg` fixture.

Child processes are real (multiprocessing spawn) and are SIGKILLed where a test needs a consumer to die
between read and ack; they are defined here, at top level, so that spawn can import them.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time

import pytest
from pydantic import BaseModel

from inference_shim.openai_protocol import VersionSpan
from pipeline_rl.messages import (
    DeadLetter,
    RolloutGroup,
    Sample,
    StatsRecord,
    TrainingSample,
    WeightVersionEvent,
)
from pipeline_rl.streams import (
    DEAD_LETTER,
    ROLLOUTS,
    TRAINER_EVENTS,
    Entry,
    GroupReader,
    StreamsConfig,
    make_reader,
    make_writer,
    training_partition,
)

_SPAWN = mp.get_context("spawn")


def sample_messages(n: int) -> list[BaseModel]:
    """n deterministic messages cycling through four kinds (fixed timestamps, so == compares exactly)."""
    out: list[BaseModel] = []
    for i in range(n):
        if i % 4 == 0:
            sample = Sample(
                sample_id=f"a0:{i}/0",
                prompt_token_ids=[1, 2, 3],
                completion_token_ids=[4, 5],
                completion_logprobs=[-0.25, -1.5],
                version_spans=[VersionSpan(version=i, start=0, end=2)],
                finish_reason="stop",
                reward=0.5 + i,
                completion_text="42 ✓\nline two",
            )
            out.append(
                RolloutGroup(
                    group_id=f"a0:{i}",
                    task="arith",
                    prompt_index=i,
                    actor_id=0,
                    samples=[sample],
                    metadata={"nested": {"x": [1, 2.5, None]}},
                    created_at=1000.0 + i,
                )
            )
        elif i % 4 == 1:
            out.append(
                TrainingSample(
                    sample_id=f"s{i}",
                    group_id=f"g{i}",
                    input_ids=[1, 2, 3, 4],
                    labels_mask=[0, 0, 1, 1],
                    advantages=[0.0, 0.0, 0.1, 0.1],
                    old_logprobs=[0.0, 0.0, -0.3, -0.7],
                    token_versions=[-1, -1, i, i],
                    reward=1.0,
                    created_at=2000.0 + i,
                )
            )
        elif i % 4 == 2:
            out.append(WeightVersionEvent(version=i, step=i, samples_consumed=10 * i, time=3000.0 + i))
        else:
            out.append(
                StatsRecord(source="test", values={"i": i, "f": i / 3, "s": "x", "n": None}, time=4000.0 + i)
            )
    return out


def drain(reader, count: int = 100, block_s: float = 0.2) -> list[Entry]:
    """Read until a read comes back empty."""
    got: list[Entry] = []
    while batch := reader.read(count=count, block_s=block_s):
        got.extend(batch)
    return got


# -- child processes (top level so that spawn can import them) ----------------------------------------


def _child_write(cfg_json: str, topic: str, n: int) -> None:
    cfg = StreamsConfig.model_validate_json(cfg_json)
    writer = make_writer(cfg, topic)
    messages = sample_messages(n)
    writer.write_many(messages[: n // 2])  # one pipelined batch ...
    for message in messages[n // 2 :]:  # ... and single writes
        writer.write(message)


def _child_read_then_hang(cfg_json: str, topic: str, consumer: str, count: int, out: mp.Queue) -> None:
    cfg = StreamsConfig.model_validate_json(cfg_json)
    reader = make_reader(cfg, topic, group="prep", consumer=consumer, claim_idle_s=None)
    out.put([e.id for e in reader.read(count=count, block_s=5.0)])
    time.sleep(120)  # "processing": the test SIGKILLs us before any ack


def _read_in_child_then_kill(cfg: StreamsConfig, topic: str, consumer: str, count: int) -> list[str]:
    queue = _SPAWN.Queue()
    proc = _SPAWN.Process(
        target=_child_read_then_hang, args=(cfg.model_dump_json(), topic, consumer, count, queue)
    )
    proc.start()
    try:
        ids = queue.get(timeout=30)
    finally:
        proc.kill()  # SIGKILL: no cleanup, no ack
        proc.join(timeout=10)
    assert proc.exitcode == -9
    return ids


# -- 1 -----------------------------------------------------------------------------------------------


def test_round_trip_across_processes(cfg: StreamsConfig) -> None:
    n = 12
    proc = _SPAWN.Process(target=_child_write, args=(cfg.model_dump_json(), ROLLOUTS, n))
    proc.start()
    proc.join(timeout=30)
    assert proc.exitcode == 0

    expected = sample_messages(n)
    positional = drain(make_reader(cfg, ROLLOUTS))
    assert [e.message for e in positional] == expected
    assert [type(e.message) for e in positional] == [type(m) for m in expected]
    assert positional[0].message.samples[0].version_spans[0] == VersionSpan(version=0, start=0, end=2)
    # Ids sort in write order on both backends.
    assert len({e.id for e in positional}) == n

    grouped = drain(make_reader(cfg, ROLLOUTS, group="prep", consumer="p0"))
    assert [e.message for e in grouped] == expected
    assert [e.id for e in grouped] == [e.id for e in positional]


# -- 2 -----------------------------------------------------------------------------------------------


def test_killed_consumer_loses_and_duplicates_nothing(cfg: StreamsConfig) -> None:
    writer = make_writer(cfg, ROLLOUTS)
    ids = writer.write_many(sample_messages(24))
    processed: list[str] = []
    acked = 0

    def process_and_ack(reader: GroupReader, batch: list[Entry]) -> None:
        nonlocal acked
        processed.extend(e.id for e in batch)
        acked += reader.ack([e.id for e in batch])

    # Consumer c1 dies holding 5 entries; restarted under the same name it gets exactly those first.
    held_by_dead_c1 = _read_in_child_then_kill(cfg, ROLLOUTS, "c1", 5)
    assert held_by_dead_c1 == ids[:5]
    c1 = make_reader(cfg, ROLLOUTS, group="prep", consumer="c1", claim_idle_s=None)
    assert c1.pending() == {"c1": 5}
    first = c1.read(count=100, block_s=0)
    assert [e.id for e in first] == held_by_dead_c1
    process_and_ack(c1, first)
    process_and_ack(c1, c1.read(count=6, block_s=1.0))

    # Consumer c2 dies holding 4 and never comes back; c3 claims them once idle, then reads the rest.
    held_by_dead_c2 = _read_in_child_then_kill(cfg, ROLLOUTS, "c2", 4)
    assert held_by_dead_c2 == ids[11:15]
    c3 = make_reader(cfg, ROLLOUTS, group="prep", consumer="c3", claim_idle_s=0.3)
    time.sleep(0.4)
    claimed = c3.read(count=10, block_s=1.0)
    assert [e.id for e in claimed] == held_by_dead_c2
    process_and_ack(c3, claimed)
    while batch := c3.read(count=4, block_s=0.2):
        process_and_ack(c3, batch)

    assert sorted(processed) == sorted(ids) and len(processed) == len(set(processed)) == 24
    assert acked == 24
    assert c3.pending() == {}
    assert c3.backlog("prep") == 0


# -- 3 -----------------------------------------------------------------------------------------------


def test_positional_resume_reads_exactly_the_rest(cfg: StreamsConfig) -> None:
    topic = training_partition(0)
    messages = sample_messages(13)
    writer = make_writer(cfg, topic)
    writer.write_many(messages[:10])

    reader = make_reader(cfg, topic)
    assert [e.message for e in reader.read(count=4, block_s=0)] == messages[:4]
    saved = reader.position  # what the trainer checkpoints

    resumed = make_reader(cfg, topic, start_after=saved)
    assert [e.message for e in drain(resumed, count=3)] == messages[4:10]
    writer.write_many(messages[10:])
    assert [e.message for e in resumed.read(count=100, block_s=1.0)] == messages[10:]
    assert resumed.read(count=100, block_s=0) == []

    again = make_reader(cfg, topic, start_after=resumed.position)
    assert again.read(count=100, block_s=0.1) == []
    # The other partition is separate.
    assert make_reader(cfg, training_partition(1)).read(count=10, block_s=0) == []


# -- 4 -----------------------------------------------------------------------------------------------


def test_malformed_entries_go_to_dead_letter(cfg: StreamsConfig, caplog: pytest.LogCaptureFixture) -> None:
    good = sample_messages(2)
    writer = make_writer(cfg, ROLLOUTS)
    ids = [writer.write(good[0])]
    bad_ids = [
        writer.write_raw(b"\xc1\xff not any encoding"),  # bad bytes
        writer.write_raw({"kind": "mystery", "x": 1}),  # unknown kind
        writer.write_raw({"kind": "stats", "source": 5}),  # known kind, fails validation
    ]
    ids.append(writer.write(good[1]))

    with caplog.at_level(logging.WARNING, logger="pipeline_rl.streams"):
        reader = make_reader(cfg, ROLLOUTS, group="prep", consumer="p0")
        got = drain(reader, count=10, block_s=0.1)
    assert [e.message for e in got] == good and [e.id for e in got] == ids
    # The malformed entries were acked (after being dead-lettered); the good ones wait for our ack.
    assert reader.pending() == {"p0": 2}
    reader.ack(ids)
    assert reader.backlog("prep") == 0

    dead = drain(make_reader(cfg, DEAD_LETTER), block_s=0)
    assert all(isinstance(d.message, DeadLetter) for d in dead)
    assert [(d.message.topic, d.message.stream_id) for d in dead] == [(ROLLOUTS, i) for i in bad_ids]
    assert "mystery" in dead[1].message.raw and "ValidationError" in dead[2].message.error
    for bad in bad_ids:
        assert any(bad in r.getMessage() and repr(ROLLOUTS) in r.getMessage() for r in caplog.records)

    # A positional reader skips them the same way and its position moves past them.
    topic = training_partition(0)
    pw = make_writer(cfg, topic)
    pw.write_raw({"kind": "mystery"})
    last = pw.write(good[0])
    positional = make_reader(cfg, topic)
    assert [e.message for e in positional.read(count=10, block_s=0)] == [good[0]]
    assert positional.position == last
    assert [d.message.topic for d in drain(make_reader(cfg, DEAD_LETTER), block_s=0)][-1] == topic


# -- 5 -----------------------------------------------------------------------------------------------


def test_trimming_never_drops_unacked_entries(cfg: StreamsConfig) -> None:
    # One segment per write on the files backend, so its segment-granular trimming is exact here.
    cfg = cfg.model_copy(update={"trim_keep_last": 0, "segment_bytes": 1})
    writer = make_writer(cfg, ROLLOUTS)
    messages = sample_messages(30)
    ids = [writer.write(m) for m in messages]
    assert writer.trim() == 0  # no consumer group: nothing is known to be consumed

    g1 = make_reader(cfg, ROLLOUTS, group="g1", consumer="a", claim_idle_s=None)
    g2 = make_reader(cfg, ROLLOUTS, group="g2", consumer="b", claim_idle_s=None)
    assert writer.trim() == 0  # new groups start before the first entry

    batch = g1.read(count=10, block_s=0)
    g1.ack([e.id for e in batch[:5]])  # entries 5..9 stay pending in g1
    g2.ack([e.id for e in drain(g2)])  # g2 is done with everything
    assert writer.trim() == 5
    assert writer.length() == 25

    # Everything g1 has not acked is still there: a restarted g1 consumer gets 5..9, then 10..29.
    g1 = make_reader(cfg, ROLLOUTS, group="g1", consumer="a", claim_idle_s=None)
    rest = drain(g1)
    assert [e.id for e in rest] == ids[5:] and [e.message for e in rest] == messages[5:]
    assert writer.trim() == 0  # delivered but not acked: kept
    g1.ack([e.id for e in rest])

    # A positional reader's committed position holds trimming back too.
    trainer = make_reader(cfg, ROLLOUTS)
    assert [e.id for e in trainer.read(count=15, block_s=0)] == ids[5:20]  # 0..4 are gone
    trainer.commit("trainer0")
    assert writer.backlog("trainer0") == 10
    keep3 = make_writer(cfg.model_copy(update={"trim_keep_last": 3}), ROLLOUTS)
    assert keep3.trim() == 15 and keep3.length() == 10
    trainer.read(count=100, block_s=0)
    trainer.commit("trainer0")
    assert keep3.trim() == 7 and keep3.length() == 3  # the newest trim_keep_last entries always stay
    assert keep3.latest().message == messages[-1]


# -- 6 -----------------------------------------------------------------------------------------------


# -- more --------------------------------------------------------------------------------------------


def test_latest_and_backlog(cfg: StreamsConfig) -> None:
    events = make_reader(cfg, TRAINER_EVENTS)
    assert events.latest() is None
    make_writer(cfg, TRAINER_EVENTS).write_many(
        [WeightVersionEvent(version=v, step=v, samples_consumed=v) for v in range(5)]
    )
    assert events.latest().message.version == 4

    writer = make_writer(cfg, ROLLOUTS)
    writer.write_many(sample_messages(6))
    assert writer.backlog("prep") == 6  # the group does not exist yet: everything is unread
    reader = make_reader(cfg, ROLLOUTS, group="prep", consumer="p0")
    batch = reader.read(count=4, block_s=0)
    assert writer.backlog("prep") == 6  # 4 delivered but unacked + 2 undelivered
    reader.ack([e.id for e in batch])
    assert writer.backlog("prep") == 2
    reader.ack([e.id for e in reader.read(count=10, block_s=0)])
    assert writer.backlog("prep") == 0 and writer.length() == 6
