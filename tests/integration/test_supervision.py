"""The launcher's supervision, by causing the faults: kill -9 an actor and then the private Redis in one
run, kill an actor more often than its budget allows. Real launcher, real Redis, tiny model; the servers
run the torch engine (the same contract, seconds to start), since what is tested is the launcher's
restarts of the other roles (the servers' own faults, on vLLM-CPU: test_fault_recovery.py, test_chaos.py).

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

import psutil
import pytest
from support.launching import SMALL_RUN, finish, launch, read_until, sessions_alive, started_pids, status

from inference_shim.procs import free_port
from pipeline_rl.ledger import ledger_dir, ledger_summary

STEPS = 30
FAST_RESTARTS = ["supervision.actor.backoff_s=0.5", "supervision.redis.backoff_s=0.2"]


def _start_run(model: Path, run_dir: Path, *extra: str):
    port = free_port()
    args = [
        f"model_path={model}",
        f"run_dir={run_dir}",
        "inference=torch",
        *SMALL_RUN,
        *FAST_RESTARTS,
        *extra,
    ]
    return launch(["--status-port", str(port), *args]), port


def _wait_for_version(proc, port: int, at_least: int, timeout_s: float = 120) -> None:
    """Wait until the trainer has published `at_least` but is far from done (polling /status)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        version = status(port)["weight_version"]
        if version >= at_least:
            assert version < STEPS - 2, f"too late to fault mid-run (version {version})"
            return
        assert proc.poll() is None, "the launcher exited early"
        time.sleep(0.1)
    raise AssertionError(f"the trainer published no version {at_least} in {timeout_s:.0f}s")


def _redis_pid(launcher_pid: int) -> int:
    # redis-server rewrites its command line (to "redis-server host:port"): find it as the launcher's child.
    children = psutil.Process(launcher_pid).children()
    pids = [c.pid for c in children if c.name() == "redis-server"]
    assert len(pids) == 1, [(c.pid, c.name()) for c in children]
    return pids[0]


@pytest.mark.slow
def test_a_killed_actor_and_then_a_killed_redis_are_restarted_and_the_run_finishes(launch_model, tmp_path):
    run_dir = tmp_path / "run"
    proc, port = _start_run(launch_model, run_dir, f"trainer.max_steps={STEPS}")
    output = read_until(proc, r"started actor0 \(pid \d+\)", timeout_s=300)
    _wait_for_version(proc, port, 1)
    os.killpg(int(re.search(r"started actor0 \(pid (\d+)\)", output).group(1)), signal.SIGKILL)
    output += read_until(proc, r"restarted actor0 \(pid \d+\)", timeout_s=30)
    state = status(port)
    assert state["restarts"]["actors"] == 1 and state["restarts_per_process"] == {"actor0": 1}
    _wait_for_version(proc, port, state["weight_version"] + 1)  # the restarted actor's groups train
    os.kill(_redis_pid(proc.pid), signal.SIGKILL)
    output += read_until(proc, r"restarted redis on the same port", timeout_s=30)
    output = finish(proc, output, timeout_s=240)
    assert "actor0 exited with code -9 (SIGKILL): restarting it" in output
    assert "redis exited with code -9 (SIGKILL): restarting it" in output
    assert proc.returncode == 0, output[-4000:]
    assert not sessions_alive(started_pids(output)), "processes left behind"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == STEPS
    ledger = ledger_summary(run_dir)
    assert ledger.trained and not ledger.duplicates_trained, ledger.lines()
    # Two incarnations of actor0, each with its own ledger file (fresh sample ids).
    assert len(list(ledger_dir(run_dir).glob("actor0-*.jsonl"))) == 2


@pytest.mark.slow
def test_actor_that_keeps_dying_spends_its_budget_and_stops_the_run(launch_model, tmp_path):
    run_dir = tmp_path / "run"
    proc, _ = _start_run(launch_model, run_dir, "trainer.max_steps=1000", "supervision.actor.max_restarts=1")
    output = read_until(proc, r"started actor0 \(pid \d+\)", timeout_s=300)
    for pattern in (r"started actor0 \(pid (\d+)\)", r"restarted actor0 \(pid (\d+)\)"):
        time.sleep(2)
        os.killpg(int(re.findall(pattern, output)[-1]), signal.SIGKILL)
        if pattern.startswith("started"):
            output += read_until(proc, r"restarted actor0 \(pid \d+\)", timeout_s=30)
    started = time.monotonic()
    output = finish(proc, output, timeout_s=120)
    assert proc.returncode != 0
    assert "ERROR: actor0 (role actors) exited with code -9 (SIGKILL)" in output, output[-4000:]
    assert "supervision.actor.max_restarts=1" in output and "Last lines of logs/actor0.log" in output
    assert time.monotonic() - started < 60, "the stop after a spent budget takes seconds"
    # "restarted actor0 (pid N)" also matches: the incarnations are checked too.
    assert not sessions_alive(started_pids(output)), "processes left behind"
