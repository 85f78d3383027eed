"""The fault-injection hook (inference_shim/faults.py): spec parsing, and a fault that fires once per
marker directory at its N-th hit, in real child processes.

    .venv/bin/python -m pytest -q tests/unit/test_faults.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from inference_shim.faults import fired, parse

HIT_THREE_TIMES = "from inference_shim.faults import fault_point\nfor i in range(3):\n    fault_point('p')\n    print(i, flush=True)\n"


def test_parse_reads_points_and_counts_and_refuses_bad_entries():
    assert parse("") == {}
    assert parse("a@2, b") == {"a": 2, "b": 1}
    for bad in ("a@0", "a@x", "@3"):
        with pytest.raises(ValueError, match="bad fault"):
            parse(bad)


def _run(spec: str, faults_dir) -> subprocess.CompletedProcess:
    env = {**os.environ, "PIPELINE_RL_FAULTS": spec, "PIPELINE_RL_FAULTS_DIR": str(faults_dir)}
    return subprocess.run([sys.executable, "-c", HIT_THREE_TIMES], env=env, capture_output=True, text=True)


def test_a_fault_kills_at_its_nth_hit_once_per_directory(tmp_path):
    first = _run("p@2", tmp_path)
    lines = first.stdout.splitlines()
    assert first.returncode == -signal.SIGKILL and lines[0] == "0", first
    assert lines[1].startswith("fault injected at p (hit 2): SIGKILL") and len(lines) == 2, first
    assert fired(tmp_path) == ["p"]
    again = _run("p@2", tmp_path)  # a restarted process: the fault was claimed already
    assert again.returncode == 0 and again.stdout.split() == ["0", "1", "2"], again


def test_no_spec_no_fault(tmp_path):
    quiet = _run("", tmp_path)
    assert quiet.returncode == 0 and quiet.stdout.split() == ["0", "1", "2"]
    assert fired(tmp_path) == []
