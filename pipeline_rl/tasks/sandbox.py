"""Runs an episode's tool calls in a sandbox: a fresh Python process per call, with a wall-clock and CPU
deadline, an address-space limit, no network (a new network namespace with nothing in it, via
`unshare --net`, when the machine allows it) and an isolated interpreter (`python -I`: no user site,
no PYTHONPATH, no current directory).

A tool is a function `name(**arguments) -> str` in a Python file; the model chose the arguments, so
anything can happen inside. Whatever happens (an exception, a timeout, running out of memory, output
that is not text) comes back as a ToolResult whose `output` is an observation for the model, never an
exception in the actor:

    result = await run_tool(ToolSpec(path=Path("calculator.py"), function="calc"), {"expression": "2*3"})
    result.ok, result.output  # True, "6"
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CHILD = Path(__file__).with_name("sandbox_child.py")
OUTPUT_LIMIT = 64 * 1024  # bytes read back from a tool; more is cut (the episode bounds observations too)


@dataclass(frozen=True)
class ToolSpec:
    path: Path  # the Python file that defines the function
    function: str
    timeout_s: float = 5.0
    memory_mb: int = 512


@dataclass
class ToolResult:
    ok: bool
    output: str  # the tool's text, or what went wrong, phrased as an observation


def _network_isolation() -> list[str]:
    """`unshare --net` (as root, or with user namespaces) when it works here; [] otherwise."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    for argv in ([unshare, "--net"], [unshare, "--net", "--map-root-user"]):
        try:
            if subprocess.run([*argv, "true"], capture_output=True, timeout=10).returncode == 0:
                return argv
        except (OSError, subprocess.TimeoutExpired):
            continue
    return []


_ISOLATION: list[str] | None = None


def network_isolated() -> bool:
    """Whether tool processes run without a network on this machine."""
    global _ISOLATION
    if _ISOLATION is None:
        _ISOLATION = _network_isolation()
    return bool(_ISOLATION)


def _limits(spec: ToolSpec):
    def apply() -> None:  # in the child, before exec
        import resource

        memory = spec.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        cpu = max(1, int(spec.timeout_s) + 1)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


async def run_tool(spec: ToolSpec, arguments: dict) -> ToolResult:
    """Call the tool once in its sandbox (see the module docstring); never raises for the tool's sake."""
    network_isolated()
    argv = [*(_ISOLATION or []), sys.executable, "-I", str(CHILD), str(spec.path), spec.function]
    try:
        payload = json.dumps(arguments).encode()
    except (TypeError, ValueError) as e:
        return ToolResult(False, f"error: arguments are not JSON ({e})")
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=_limits(spec),
        start_new_session=True,  # its own process group: a timeout kills whatever it started too
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0"},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(payload), timeout=spec.timeout_s)
    except TimeoutError:
        _kill_group(proc.pid)
        await proc.wait()
        return ToolResult(False, f"error: the tool did not finish within {spec.timeout_s:g} s")
    if proc.returncode != 0:
        if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            return ToolResult(False, f"error: the tool was stopped (CPU limit of ~{spec.timeout_s:g} s)")
        last = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return ToolResult(False, f"error: {last[0][:500]}")
    return ToolResult(True, out[:OUTPUT_LIMIT].decode(errors="replace"))


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
