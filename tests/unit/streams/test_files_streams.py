"""Streams on the files backend (JSONL under a directory, for a machine without Redis): the cases every
backend passes (tests/support/stream_cases.py), what only files have (a torn line), and config checks.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from support.stream_cases import (  # noqa: F401 - the cases, collected here for this backend
    sample_messages,
    test_killed_consumer_loses_and_duplicates_nothing,
    test_latest_and_backlog,
    test_malformed_entries_go_to_dead_letter,
    test_positional_resume_reads_exactly_the_rest,
    test_round_trip_across_processes,
    test_trimming_never_drops_unacked_entries,
)

from inference_shim.openai_protocol import VersionSpan
from pipeline_rl.streams import DEAD_LETTER, ROLLOUTS, StreamsConfig, make_reader, make_writer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def cfg(files_dir: Path) -> StreamsConfig:
    """A fresh streams config in its own directory."""
    common = dict(run_name=f"t{uuid.uuid4().hex[:10]}", trim_every=0, claim_every_s=0.0, poll_interval_s=0.01)
    return StreamsConfig(backend="files", files_dir=files_dir, **common)


def test_files_torn_line_is_dead_lettered(files_dir: Path) -> None:
    """Files only: a writer killed mid-line leaves a partial line; the next writer closes it."""
    cfg = StreamsConfig(backend="files", files_dir=files_dir, run_name="torn")
    writer = make_writer(cfg, ROLLOUTS)
    good = sample_messages(2)
    writer.write(good[0])
    segment = next((files_dir / "torn" / ROLLOUTS).glob("*.jsonl"))
    with open(segment, "ab") as f:
        f.write(b'{"kind":"stats","sou')  # no newline: a torn write
    reader = make_reader(cfg, ROLLOUTS)
    assert [e.message for e in reader.read(count=10, block_s=0)] == [good[0]]  # the partial line is invisible
    writer.write(good[1])
    assert [e.message for e in reader.read(count=10, block_s=0)] == [good[1]]
    dead = make_reader(cfg, DEAD_LETTER).read(count=10, block_s=0)
    assert [d.message.topic for d in dead] == [ROLLOUTS]


def test_config_and_names_are_checked(files_dir: Path) -> None:
    with pytest.raises(ValueError, match="files_dir"):
        StreamsConfig(backend="files")
    with pytest.raises(ValueError, match="redis_url is unset"):
        make_writer(StreamsConfig(), ROLLOUTS)
    cfg = StreamsConfig(backend="files", files_dir=files_dir)
    for bad in ["../escape", "/abs", "a//b", ".hidden", ""]:
        with pytest.raises(ValueError, match="invalid topic"):
            make_writer(cfg, bad)
    with pytest.raises(ValueError, match="consumer name"):
        make_reader(cfg, ROLLOUTS, group="prep")
    with pytest.raises(TypeError, match="pipeline_rl.messages"):
        make_writer(cfg, ROLLOUTS).write(VersionSpan(version=0, start=0, end=1))
