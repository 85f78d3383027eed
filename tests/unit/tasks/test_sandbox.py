"""Tools run by episodes, in their sandbox, each fault caused for real: a tool that spins, sleeps,
allocates 1 GB, opens a connection to a listening port, raises, or gets arguments it does not take. Each
comes back as an observation (ToolResult.ok false, a message for the model) within its deadline.

    .venv/bin/python -m pytest -q tests/unit/test_sandbox.py
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

import pipeline_rl.tasks.calculator as calculator
from pipeline_rl.tasks.sandbox import ToolSpec, network_isolated, run_tool

EVIL = """
import socket, time
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
