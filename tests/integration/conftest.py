"""Shared pytest fixtures: a private redis-server for the whole session, scratch directories.

The Redis server is real (redis-server on a free 127.0.0.1 port, no persistence); tests that share it
isolate themselves with a unique StreamsConfig.run_name (key prefix).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline_rl.streams import RedisServer


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
