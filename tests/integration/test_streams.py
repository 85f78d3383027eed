"""Streams on the Redis backend, against a real redis-server: the cases every backend passes
(tests/support/stream_cases.py), and what only Redis has: connection loss and the private server's password.

    .venv/bin/python -m pytest -q tests/integration/test_streams.py
"""

from __future__ import annotations

import threading
import time
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

from pipeline_rl.streams import (
    ROLLOUTS,
    RedisServer,
    StreamsConfig,
    StreamsError,
    StreamsUnavailable,
    make_reader,
    make_writer,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.slow]


@pytest.fixture
def cfg(redis_server: RedisServer) -> StreamsConfig:
    """A fresh, isolated streams config on the session's Redis (a unique run_name)."""
    common = dict(run_name=f"t{uuid.uuid4().hex[:10]}", trim_every=0, claim_every_s=0.0, poll_interval_s=0.01)
    return StreamsConfig(backend="redis", redis_url=redis_server.url, **common)


def test_redis_connection_loss_is_retried_then_reported(tmp_path: Path) -> None:
    """Redis only: the files backend has no connection to lose."""
    server = RedisServer(data_dir=tmp_path / "redis", persist=True).start()  # private: we stop it
    try:
        cfg = StreamsConfig(redis_url=server.url, run_name="conn", retry_deadline_s=1.0, op_timeout_s=5.0)
        message = sample_messages(1)[0]
        make_writer(cfg, ROLLOUTS).write(message)
        reader = make_reader(cfg, ROLLOUTS, group="prep", consumer="p0")
        patient = make_reader(
            cfg.model_copy(update={"retry_deadline_s": 15.0}), ROLLOUTS, group="prep", consumer="p0"
        )
        server.stop()

        start = time.monotonic()
        with pytest.raises(StreamsUnavailable, match="redis-server is running") as err:
            reader.read(count=10, block_s=0.1)
        assert time.monotonic() - start < 3.0
        assert server.safe_url in str(err.value) and "retry_deadline_s" in str(err.value)
        assert server.password not in str(err.value), "a message must never carry the password"

        # The server comes back within the deadline: the same call just succeeds. The read runs in a
        # worker thread because the server must be (re)started from this long-lived thread.
        result: list[object] = []
        worker = threading.Thread(target=lambda: result.append(patient.read(count=10, block_s=0.1)))
        worker.start()
        time.sleep(0.5)
        assert worker.is_alive()  # still retrying
        server.start()
        worker.join(timeout=20)
        assert not worker.is_alive()
        assert [e.message for e in result[0]] == [message]  # persisted across the restart
    finally:
        server.cleanup()


def test_the_launchers_monitor_gives_up_on_a_killed_redis_within_seconds(tmp_path: Path, tiny_model) -> None:
    """kill -9 of Redis under the launcher's reads: they raise within the monitor's short retry, not the
    children's 30 s, so the launcher's supervision loop (which restarts Redis) is not held up; once
    Redis is back the next poll reads on."""
    import os
    import signal

    from pipeline_rl.config import RunConfig
    from pipeline_rl.launch.monitor import MONITOR_RETRY_S, RunMonitor
    from pipeline_rl.messages import StatsRecord
    from pipeline_rl.streams import STATS

    server = RedisServer(data_dir=tmp_path / "redis", persist=True).start()  # private: we kill it
    try:
        streams = StreamsConfig(redis_url=server.url, run_name="monitor", retry_deadline_s=30.0)
        cfg = RunConfig(model_path=str(tiny_model), run_dir=str(tmp_path / "run"), streams=streams)
        monitor = RunMonitor(cfg, tmp_path)
        writer = make_writer(streams, STATS)
        writer.write(StatsRecord(source="trainer", values={"step": 1}))
        monitor.poll_streams()
        assert monitor.latest["trainer"]["step"] == 1
        os.kill(server.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while server.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.running, "redis-server outlived SIGKILL by 10 s"
        start = time.monotonic()
        with pytest.raises(StreamsUnavailable):
            monitor.poll_streams()
        assert time.monotonic() - start < MONITOR_RETRY_S + 5.0, (
            "the monitor retried for the children's deadline"
        )
        server.start()  # same port, its append-only file replayed
        writer.write(StatsRecord(source="trainer", values={"step": 2}))
        monitor.poll_streams()
        assert monitor.latest["trainer"]["step"] == 2
        monitor.close()
    finally:
        server.cleanup()


def test_private_redis_requires_its_password(redis_server: RedisServer) -> None:
    """The private server refuses a client without the password (any local user can reach loopback) and
    a client with a wrong one fails at once, naming the problem, instead of retrying for the deadline."""
    import socket

    import redis

    with socket.create_connection((redis_server.host, redis_server.port), timeout=5) as raw:
        raw.sendall(b"PING\r\n")
        assert raw.recv(200).startswith(b"-NOAUTH")
    assert redis.Redis.from_url(redis_server.url).ping()
    assert redis_server.password not in redis_server.safe_url

    wrong = redis_server.url.replace(redis_server.password, "wrong")
    cfg = StreamsConfig(redis_url=wrong, run_name="auth", retry_deadline_s=10.0)
    start = time.monotonic()
    with pytest.raises(StreamsError, match="refused our credentials") as err:
        make_writer(cfg, ROLLOUTS).write(sample_messages(1)[0])
    assert time.monotonic() - start < 3.0
    assert "wrong" not in str(err.value)
