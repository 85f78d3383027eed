"""Typed message streams between the pipeline's processes, on Redis or on plain files.

    from pipeline_rl.streams import StreamsConfig, make_writer, make_reader, training_partition

    cfg = StreamsConfig(backend="redis", redis_url=url, run_name="exp1")     # or backend="files"
    make_writer(cfg, "rollouts").write(rollout_group)

    # competing consumers (preprocessors): read, process, ack
    reader = make_reader(cfg, "rollouts", group="preprocess", consumer="prep0")
    batch = reader.read(count=32, block_s=1.0)
    ...; reader.ack([e.id for e in batch])

    # one consumer with its own position (trainer rank r): checkpoint reader.position, resume with it
    reader = make_reader(cfg, training_partition(r), start_after=saved_position)

    make_reader(cfg, "trainer_events").latest()          # newest message (actors: weight version)
    make_writer(cfg, "rollouts").backlog("preprocess")   # unacked entries (actors: backpressure)
    make_writer(cfg, "rollouts").total_written()         # entries ever written by anyone (actors)

Semantics, the ack and trimming rules and the files backend's limits: docs/streams.md.
"""

from __future__ import annotations

from typing import Literal, overload

from pipeline_rl.streams.base import (
    Entry,
    GroupReader,
    PositionalReader,
    StreamsError,
    StreamsUnavailable,
    TopicStore,
    Writer,
)
from pipeline_rl.streams.config import (
    CARRIED,
    CARRY_GROUP,
    DEAD_LETTER,
    ROLLOUTS,
    STATS,
    TRAINER_EVENTS,
    TRAINING_DATA,
    StreamsConfig,
    training_partition,
)
from pipeline_rl.streams.redis_server import RedisServer

__all__ = [
    "CARRIED",
    "CARRY_GROUP",
    "DEAD_LETTER",
    "ROLLOUTS",
    "STATS",
    "TRAINER_EVENTS",
    "TRAINING_DATA",
    "Entry",
    "GroupReader",
    "PositionalReader",
    "RedisServer",
    "StreamsConfig",
    "StreamsError",
    "StreamsUnavailable",
    "Writer",
    "make_reader",
    "make_writer",
    "open_store",
    "training_partition",
]


def open_store(cfg: StreamsConfig, topic: str) -> TopicStore:
    """The backend's raw store for `topic` (readers and writers are built on it)."""
    if cfg.backend == "redis":
        from pipeline_rl.streams.redis_backend import RedisTopicStore

        return RedisTopicStore(cfg, topic)
    from pipeline_rl.streams.files_backend import FilesTopicStore

    return FilesTopicStore(cfg, topic)


def make_writer(cfg: StreamsConfig, topic: str) -> Writer:
    """A writer of typed messages to `topic`; it trims the topic every `cfg.trim_every` writes."""
    return Writer(open_store(cfg, topic), trim_keep_last=cfg.trim_keep_last, trim_every=cfg.trim_every)


@overload
def make_reader(
    cfg: StreamsConfig,
    topic: str,
    *,
    group: str,
    consumer: str,
    claim_idle_s: float | None | Literal["config"] = ...,
) -> GroupReader: ...


@overload
def make_reader(
    cfg: StreamsConfig, topic: str, *, group: None = None, start_after: str | None = None
) -> PositionalReader: ...


def make_reader(
    cfg: StreamsConfig,
    topic: str,
    *,
    group: str | None = None,
    consumer: str | None = None,
    start_after: str | None = None,
    claim_idle_s: float | None | Literal["config"] = "config",
) -> GroupReader | PositionalReader:
    """A reader of `topic`: a consumer-group reader if `group` is given, else a positional one.

    group/consumer: competing consumers; `consumer` must be stable across restarts of the same worker.
    claim_idle_s: take over others' entries unacked this long ('config': cfg.claim_idle_s; None: never).
    start_after: positional only; a `position` saved earlier (None = from the oldest retained entry).
    """
    store = open_store(cfg, topic)
    if group is None:
        if consumer is not None:
            raise ValueError("consumer= needs group=: a positional reader has no consumer name")
        return PositionalReader(store, start_after=start_after, trim_keep_last=cfg.trim_keep_last)
    if consumer is None:
        raise ValueError(f"reading {topic!r} in group {group!r} needs a stable consumer name, e.g. 'prep0'")
    if start_after is not None:
        raise ValueError("start_after= is for positional readers; a group tracks its own position")
    return GroupReader(
        store,
        group,
        consumer,
        claim_idle_s=cfg.claim_idle_s if claim_idle_s == "config" else claim_idle_s,
        claim_every_s=cfg.claim_every_s,
        trim_keep_last=cfg.trim_keep_last,
    )
