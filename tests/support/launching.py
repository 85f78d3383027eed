"""Launched runs in tests: the small-run overrides every launched test shares, starting `pipeline-rl
launch` as a child, reading its output, and the checks a finished run must pass (every server on the
final weights, the ledger balanced, no process left).

Every child of the launcher runs in its own process session; "no process left" is checked by scanning
/proc for any process still in one of those sessions (vLLM's EngineCore and workers included).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from inference_shim.procs import free_port
from support.servers import transformers_greedy

REPO = Path(__file__).resolve().parents[2]
# The sizes of every launched test run: a few tokens per answer, small batches, a short evaluation.
SMALL_RUN = [
    "inference.max_model_len=96",
    "inference.max_num_seqs=32",
    "actor.attempts=4",
    "actor.max_tokens=12",
    "actor.max_lag=2",
    "actor.max_buffered_groups=8",
    "trainer.batch_size=16",
    "eval.num_problems=20",
    "eval.max_tokens=12",
]
# Quick restarts and short push deadlines, for runs that cause faults.
FAST_FAULTS = [
    "supervision.server.backoff_s=0.5",
    "supervision.trainer.backoff_s=0.5",
    "trainer.push_timeout_s=20",
    "trainer.rejoin_check_s=1",
    "inference.num_servers=2",
]


def launch(args: list[str], **kwargs) -> subprocess.Popen:
    """`pipeline-rl launch ARGS` as a child whose output (stdout and stderr) the test reads."""
    cmd = [sys.executable, "-m", "pipeline_rl.cli", "launch", "--progress-every", "2", *args]
    return subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs
    )


def start_run(model: Path, run_dir: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    """A small launched run with quick fault handling and a status port of its own: (process, port)."""
    port = free_port()
    args = [f"model_path={model}", f"run_dir={run_dir}", *SMALL_RUN, *FAST_FAULTS, *extra]
    return launch(["--status-port", str(port), *args]), port


def sessions_alive(session_ids: set[int]) -> list[str]:
    """The pids of live processes in any of these sessions."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) in session_ids and fields[0] != "Z":
            alive.append(stat.parent.name)
    return alive


def started_pids(output: str) -> set[int]:
    return {int(pid) for pid in re.findall(r"started \S+ \(pid (\d+)\)", output)}


def pid_of(output: str, name: str) -> int:
    return int(re.findall(rf"(?:re)?started {name} \(pid (\d+)\)", output)[-1])


def read_until(proc: subprocess.Popen, pattern: str, timeout_s: float) -> str:
    """Read the launcher's output until a line matches `pattern` (or fail after timeout_s)."""
    seen = []
    deadline = time.monotonic() + timeout_s
    os.set_blocking(proc.stdout.fileno(), False)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            seen.append(line)
            if re.search(pattern, line):
                return "".join(seen)
        elif proc.poll() is not None:
            break
        else:
            time.sleep(0.1)
    raise AssertionError(
        f"no line matching {pattern!r} within {timeout_s}s; output:\n{''.join(seen)[-4000:]}"
    )


def finish(proc: subprocess.Popen, so_far: str, timeout_s: float) -> str:
    """The launcher's whole output once it exited (within timeout_s)."""
    os.set_blocking(proc.stdout.fileno(), True)
    rest, _ = proc.communicate(timeout=timeout_s)
    return so_far + rest


def status(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/status", timeout=5).json()


def wait_version(proc: subprocess.Popen, port: int, at_least: int, timeout_s: float = 300) -> None:
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


def trainer_log(run_dir: Path) -> str:
    return (run_dir / "logs" / "trainer.log").read_text()


def assert_servers_on_the_final_weights(run_dir: Path, steps: int, servers: int = 2) -> None:
    """Every server ended on version `steps`, and serves exactly the final checkpoint's weights."""
    from pipeline_rl.trainer.checkpoint import latest_checkpoint, read_state

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


def assert_clean_finish(
    proc: subprocess.Popen, output: str, run_dir: Path, steps: int, servers: int = 2
) -> None:
    """The run exited 0 after `steps` steps, left no process, balanced its ledger with every untrained
    sample located (positive accounting: lost = 0, established), served the final weights."""
    from pipeline_rl.ledger import ledger_summary

    assert proc.returncode == 0, output[-5000:]
    assert not sessions_alive(started_pids(output)), "processes left behind"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps
    ledger = ledger_summary(run_dir)
    assert ledger.trained and not ledger.duplicates_trained, "\n".join(ledger.lines())
    assert ledger.balanced, "\n".join(ledger.lines())
    assert ledger.lost == [], "\n".join(ledger.lines())  # None: the clean stop took no snapshot
    assert_servers_on_the_final_weights(run_dir, steps, servers)
