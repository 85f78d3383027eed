"""Tools run by episodes, in their sandbox, each fault caused for real: a tool that spins, sleeps,
allocates 1 GB, opens a connection to a listening port, writes outside its directory, raises, or gets
arguments it does not take. Each comes back as an observation (ToolResult.ok false, a message for the
model) within its deadline; a machine without the namespaces stops the task at start.

    .venv/bin/python -m pytest -q tests/unit/tasks/test_sandbox.py
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pipeline_rl.tasks.calculator as calculator
from pipeline_rl.tasks.sandbox import NOBODY, ToolSpec, network_isolated, run_tool

REPO = Path(__file__).resolve().parents[3]

EVIL = """
import os, socket, time
def connect(port):
    socket.create_connection(("127.0.0.1", port), timeout=1)
    return "connected"
def spin():
    while True:
        pass
def sleep():
    time.sleep(100)
def hog():
    return len(bytearray(10**9))
def boom():
    raise RuntimeError("kaput")
def write(paths):
    written = []
    for path in paths:
        try:
            with open(path, "w") as f:
                f.write("escaped")
            written.append(path)
        except OSError:
            pass
    return repr((written, os.listdir("."), os.getuid(), os.environ["HOME"] == os.getcwd(), os.getcwd()))
"""


def _run(spec: ToolSpec, arguments: dict):
    started = time.monotonic()
    result = asyncio.run(run_tool(spec, arguments))
    return result, time.monotonic() - started


def test_the_calculator_computes_and_refuses_what_is_not_arithmetic():
    calc = ToolSpec(path=Path(calculator.__file__), function="calc", timeout_s=2, memory_mb=256)
    assert _run(calc, {"expression": "4821*37"})[0].output == "178377"
    assert _run(calc, {"expression": "(7-10)//2"})[0].output == "-2"
    refused, _ = _run(calc, {"expression": "__import__('os').system('true')"})
    assert not refused.ok and "not integer arithmetic" in refused.output
    wrong_args, _ = _run(calc, {"expr": "1"})
    assert not wrong_args.ok and "unexpected keyword argument" in wrong_args.output
    endless, took = _run(calc, {"expression": "9**9**9"})
    assert not endless.ok and "did not finish within 2 s" in endless.output and took < 10


@pytest.mark.parametrize(
    ("function", "fragment"),
    [
        ("spin", "did not finish"),
        ("sleep", "did not finish"),
        ("hog", "MemoryError"),
        ("boom", "RuntimeError: kaput"),
    ],
)
def test_a_misbehaving_tool_is_an_observation_within_its_deadline(tmp_path, function, fragment):
    (tmp_path / "evil.py").write_text(EVIL)
    result, took = _run(
        ToolSpec(path=tmp_path / "evil.py", function=function, timeout_s=2, memory_mb=256), {}
    )
    assert not result.ok and fragment in result.output and took < 10


def test_a_tool_has_no_network(tmp_path):
    if not network_isolated():
        pytest.skip("unshare --net is not allowed on this machine: tools run with the network")
    (tmp_path / "evil.py").write_text(EVIL)
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        spec = ToolSpec(path=tmp_path / "evil.py", function="connect", timeout_s=2)
        result, _ = _run(spec, {"port": listener.getsockname()[1]})
    finally:
        listener.close()
    assert not result.ok and "OSError" in result.output


def test_a_tool_writes_only_in_its_own_empty_directory(tmp_path):
    """Every write outside the call's directory fails (the tool's own directory, /tmp, /dev/shm, the
    checkout, $HOME of the actor); inside it works; the directory starts empty and is gone after."""
    (tmp_path / "evil.py").write_text(EVIL)
    tmp_path.chmod(0o777)  # writable by anyone: only the sandbox stands between the tool and it
    outside = [tmp_path / "escaped.txt", Path("/tmp") / f"prl-escape-{os.getpid()}", REPO / "escaped.txt"]
    outside += [Path("/dev/shm") / f"prl-escape-{os.getpid()}"] if Path("/dev/shm").is_dir() else []
    outside += [Path.home() / f"prl-escape-{os.getpid()}"]
    spec = ToolSpec(path=tmp_path / "evil.py", function="write", timeout_s=5)
    try:
        result, _ = _run(spec, {"paths": [*map(str, outside), "inside.txt"]})
        assert result.ok, result.output
        written, listing, uid, home_is_cwd, cwd = eval(result.output)  # the tool's repr of plain values
        assert written == ["inside.txt"] and listing == ["inside.txt"] and home_is_cwd, result.output
        assert not [p for p in outside if p.exists()], "a sandboxed tool wrote outside its directory"
        if os.geteuid() == 0:
            assert uid == NOBODY, "a root actor's tools run as nobody"
    finally:
        for p in outside:
            p.unlink(missing_ok=True)
    box = Path(cwd).parent  # prl-tool-*: the call's work/ and its mount point
    assert box.name.startswith("prl-tool-") and not box.exists(), f"{box} outlived the call"


def test_a_machine_without_the_sandbox_stops_a_tool_task_at_start(tmp_path):
    """No `unshare` on PATH (a real absence, not a mock): building the calc task fails, naming the fix,
    for the default tool_network=isolated and for allowed (files are confined either way)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(shutil.which("true"), bin_dir / "true")
    code = (
        "from pipeline_rl.tasks import make_task\n"
        "from pipeline_rl.tasks.config import TaskConfig\n"
        "for network in ('isolated', 'allowed'):\n"
        "    try:\n"
        "        make_task(TaskConfig(name='calc', tool_network=network))\n"
        "    except Exception as e:\n"
        "        print(network, type(e).__name__, e)\n"
    )
    env = {**os.environ, "PATH": str(bin_dir), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert set(lines) == {"isolated", "allowed"}, done.stdout + done.stderr[-2000:]
    for network, words in (("isolated", "task.tool_network=allowed"), ("allowed", "a mount namespace")):
        assert lines[network].startswith("SandboxUnavailable") and words in lines[network], lines[network]
        assert "user namespaces" in lines[network]
