"""Shared pytest fixtures: a private redis-server for the whole session, scratch directories; and which
test files `make test` runs alone.

The Redis server is real (redis-server on a free 127.0.0.1 port, no persistence); tests that share it
isolate themselves with a unique StreamsConfig.run_name (key prefix). Under pytest-xdist each worker is
a session of its own, so each has its own Redis.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline_rl.streams import RedisServer

# `make test` runs every other test two files at a time on the machine's two cores, each test slower by
# ~1.5x (seen: 36% idle cores serially; 1.35x the throughput in parallel). These files run afterwards,
# alone: they time fault detection against a running workload (a killed, stopped or cut-off peer
# noticed within seconds), bound a latency under load or an elapsed time tightly, or shape links in
# network namespaces, and sharing the cores with another test would test the machine's load rather than
# the code. Elapsed-time bounds in the other files leave at least ~2.5x slack over the deadline they check.
SERIAL_FILES = frozenset(
    {
        "test_chaos.py",
        "test_fault_recovery.py",
        "test_fleet_change.py",
        "test_three_hosts.py",
        "test_multihost_push.py",
        "test_fanout.py",
        "test_overload.py",
        "test_weight_sender.py",
        "test_simhosts.py",
    }
)
# By full path: the hook below sees the whole session's items, tests/unit's included.
_SERIAL_PATHS = frozenset(Path(__file__).parent / name for name in SERIAL_FILES)
_missing = sorted(path.name for path in _SERIAL_PATHS if not path.exists())
assert not _missing, f"SERIAL_FILES names files that do not exist (renamed?): {_missing}"


@pytest.hookimpl(tryfirst=True)  # before pytest's own `-m` selection reads the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path in _SERIAL_PATHS:
            item.add_marker(pytest.mark.serial)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One private redis-server for the session; stopped (SHUTDOWN NOSAVE) and its temp dir removed at the end."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def files_dir(tmp_path: Path) -> Path:
    """An empty directory for the files backend of the streams."""
    path = tmp_path / "streams"
    path.mkdir()
    return path
