"""What every test shares: tests/ on sys.path (for `support`), the markers' rules, which test files
`make test` runs alone, a private redis-server per session, and the tiny models the tests build once.

Markers (docs/development.md): `slow` starts vLLM engines or whole runs and runs in `make test`; `long`
is left out of `make test` (`make test-long`); `serial` is set here, from SERIAL_FILES, never by hand;
`gpu` needs an NVIDIA GPU. Nothing under tests/unit may be slow, long or serial: those tests start no
server of any kind (checked at collection).

The Redis server is real (redis-server on a free 127.0.0.1 port, no persistence); tests that share it
isolate themselves with a unique StreamsConfig.run_name (key prefix). Under pytest-xdist each worker is
a session of its own, so each has its own Redis and builds its own models.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))  # `from support.servers import ...` from any test directory

from inference_shim.cli import START_METHOD_ENV  # noqa: E402
from pipeline_rl.streams import RedisServer  # noqa: E402 - after the path set-up, like every test import

# Every vLLM server the tests start (directly, through a launched run, an evaluation or a benchmark)
# forks its engine processes from the server's imports: ready in under half the time of spawn, which
# is most of what a test that starts one waits for. Decoding is slower forked (docs/engines.md,
# "Starting by fork"), which no test times. The spawn default stays covered where a test says
# `--start-method spawn` (test_minimal_trainer_example.py) and by the benchmarks run outside tests.
os.environ.setdefault(START_METHOD_ENV, "fork")

INTEGRATION = TESTS / "integration"
UNIT = TESTS / "unit"
# `make test` runs every other test two files at a time on the machine's two cores, each test slower by
# ~1.5x. These files run afterwards, alone: they time fault detection against a running workload (a
# killed, stopped or cut-off peer noticed within seconds), bound a latency under load or an elapsed time
# tightly, or shape links in network namespaces, and sharing the cores with another test would test the
# machine's load rather than the code. Elapsed-time bounds in the other files leave at least ~2.5x slack
# over the deadline they check.
SERIAL_FILES = frozenset(
    {
        "test_drain_swap.py",  # whether a client meets a drain depends on timing a loaded box changes
        "test_chaos.py",
        "test_fault_recovery.py",
        "test_fleet_change.py",
        "test_three_hosts.py",
        "test_ray_cluster.py",
        "test_multihost_push.py",
        "test_fanout.py",
        "test_overload.py",
        "test_weight_sender.py",
        "test_simhosts.py",
    }
)
_SERIAL_PATHS = frozenset(INTEGRATION / name for name in SERIAL_FILES)
_missing = sorted(path.name for path in _SERIAL_PATHS if not path.exists())
assert not _missing, f"SERIAL_FILES names files that do not exist (renamed?): {_missing}"


# The longest files of `make test`'s first phase, longest first: xdist hands files out in collection
# order (with --no-loadscope-reorder, which the Makefile passes: by default xdist reorders files by their
# number of tests), so starting with them keeps both workers busy to the end instead of leaving one idle
# while the other runs a long file last (the slowest tests are listed by every `make test`, `--durations`).
LONGEST_FIRST = (
    "test_architectures.py",
    "test_smoke.py",
    "test_soak.py",
    "test_launcher.py",
    "test_contract_suite.py",
    "test_actor.py",
    "test_openai_compat.py",
    "test_supervision.py",
    "test_trainer_dist.py",
    "test_minimal_trainer_example.py",
    "test_exposure.py",
)


def _longest_first(item: pytest.Item) -> int:
    return LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST else len(LONGEST_FIRST)


@pytest.hookimpl(tryfirst=True)  # before pytest's own `-m` selection reads the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_longest_first)  # stable: a file's tests keep their order
    misplaced = []
    for item in items:
        if item.path in _SERIAL_PATHS:
            item.add_marker(pytest.mark.serial)
        if UNIT in item.path.parents and any(
            item.get_closest_marker(name) for name in ("slow", "long", "serial")
        ):
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError(
            "tests/unit holds server-free tests only; move these to tests/integration: "
            + ", ".join(misplaced)
        )


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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The default tiny model (~0.3 MB Qwen2, character tokenizer, seed 0), built once per session."""
    from pipeline_rl.demo.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny")


@pytest.fixture(scope="session")
def launch_model(tmp_path_factory) -> Path:
    """The tiny model the launched runs train (seed 3), built once per session."""
    from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("launch-model") / "tiny", TinyModelSpec(seed=3))
