"""A server added to a running job and one removed from it, through `pipeline-rl fleet` (the launcher's
POST /servers). Real launcher, Redis, gloo, tiny model; the servers run the torch engine (the same
contract and membership routes, seconds to start): what is tested is the launcher's and the trainer's
handling of a changing fleet, not an engine.

What must hold: the added server (started by hand with --await-weights and the run's token) is admitted
to the weight group at a step boundary, gets the current weights and generation from the actors; the
removed server (the launcher's own) leaves the group and is stopped, not restarted; the run finishes
all its steps with a balanced ledger, and the added server ends on the final checkpoint's weights.

    .venv/bin/python -m pytest -q tests/integration/test_fleet_change.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from support.launching import (
    REPO,
    assert_servers_on_the_final_weights,
    finish,
    read_until,
    sessions_alive,
    start_run,
    started_pids,
    trainer_log,
    wait_version,
)

from inference_shim.procs import free_port, serve_argv, start_child, stop_process_tree, wait_healthy
from pipeline_rl.ledger import ledger_summary

STEPS = 100  # the change is made by about version 30: the rest is margin for a slower machine


def _fleet(run_dir, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipeline_rl.cli", "fleet", *args, "--run-dir", str(run_dir)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)


def _generated_tokens(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("shim_generated_tokens_total "):
            return float(line.split()[1])
    return 0.0


@pytest.mark.slow
def test_a_server_added_to_and_one_removed_from_a_running_job(launch_model, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    # The added server starts first, so it is up once the launcher's run is underway.
    token = "fleet-test-token"
    monkeypatch.setenv("PIPELINE_RL_TOKEN", token)  # the launcher's run token (never in argv)
    extra_port = free_port()
    url = f"http://127.0.0.1:{extra_port}"
    argv = serve_argv(
        launch_model, extra_port, backend="torch", extra=["--await-weights", "--max-model-len", "96"]
    )
    extra = start_child(argv, env={**os.environ, "PIPELINE_RL_TOKEN": token}, log_path=tmp_path / "extra.log")
    try:
        wait_healthy(url, 300, extra, path="/capabilities")
        proc, port = start_run(
            launch_model,
            run_dir,
            f"trainer.max_steps={STEPS}",
            "inference.num_servers=1",
            "inference=torch",
        )
        output = read_until(proc, r"started actor0 \(pid \d+\)", timeout_s=300)
        wait_version(proc, port, 2)
        refused = _fleet(run_dir, "add", "http://127.0.0.1:1")
        assert refused.returncode != 0 and "unreachable" in refused.stdout, refused
        added = _fleet(run_dir, "add", url)
        assert added.returncode == 0 and url in added.stdout, added
        deadline = time.monotonic() + 120
        while "answer again: the weight group forms again" not in trainer_log(run_dir):
            assert time.monotonic() < deadline, trainer_log(run_dir)[-3000:]
            time.sleep(0.5)
        while _generated_tokens(url) == 0:  # the actors found it (it serves recent weights)
            assert time.monotonic() < deadline, "the actor never used the added server"
            time.sleep(0.5)
        server0 = json.loads(_fleet(run_dir, "list").stdout)[0]
        removed = _fleet(run_dir, "remove", server0)
        assert removed.returncode == 0 and removed.stdout.count("http://") == 1, removed
        last = _fleet(run_dir, "remove", url)
        assert last.returncode != 0 and "last_server" in last.stdout, last
        output = finish(proc, output, timeout_s=400)
    finally:
        stop_process_tree(extra, grace_s=10)
    assert proc.returncode == 0, output[-5000:]
    assert "stopped server0: removed from the job" in output
    assert "restarted server0" not in output
    assert not sessions_alive(started_pids(output)), "processes left behind"
    ledger = ledger_summary(run_dir)
    assert ledger.balanced and ledger.lost == [] and not ledger.duplicates_trained, "\n".join(ledger.lines())
    states = json.loads((run_dir / "servers_final.json").read_text())
    assert [s["url"] for s in states] == [url], states
    assert_servers_on_the_final_weights(run_dir, STEPS, servers=1)
