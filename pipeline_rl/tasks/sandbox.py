"""Runs an episode's tool calls in a sandbox: a fresh Python process per call, with a wall-clock and CPU
deadline, an address-space limit and an isolated interpreter (`python -I`: no user site, no PYTHONPATH,
no current directory), confined by Linux namespaces (`unshare`, as root or with user namespaces):

  * files: its own mount namespace where every mount is read-only except the call's own empty working
    directory (its cwd, $HOME and $TMPDIR), removed after the call;
  * user: where the actor runs as root, the call runs as `nobody` (uid 65534) once its tool file is
    loaded, so even a path the read-only remount missed is not the tool's to write;
  * network: by default a new network namespace with nothing in it (ToolSpec.network="isolated");
    "allowed" shares the host's network, for tools that must reach a service.

Nothing falls back silently: where the namespaces cannot be had, `check_sandbox` (called when a tool task
is built, so at start) raises SandboxUnavailable, saying what to change.

A tool is a function `name(**arguments) -> str` in a Python file; the model chose the arguments, so
anything can happen inside. Whatever happens (an exception, a timeout, running out of memory, output
that is not text) comes back as a ToolResult whose `output` is an observation for the model, never an
exception in the actor:

    result = await run_tool(ToolSpec(path=Path("calculator.py"), function="calc"), {"expression": "2*3"})
    result.ok, result.output  # True, "6"

The tool file's top level runs before the uid drop (it is the operator's code, and may import from
anywhere the actor can read); only the call, with the model's arguments, runs as `nobody`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

CHILD = Path(__file__).with_name("sandbox_child.py")
OUTPUT_LIMIT = 64 * 1024  # bytes read back from a tool; more is cut (the episode bounds observations too)


@dataclass(frozen=True)
class ToolSpec:
    path: Path  # the Python file that defines the function
    function: str
    timeout_s: float = 5.0
    memory_mb: int = 512
    network: Literal["isolated", "allowed"] = "isolated"


@dataclass
class ToolResult:
    ok: bool
    output: str  # the tool's text, or what went wrong, phrased as an observation


NOBODY = 65534  # the uid and gid a call runs as where the actor is root


class SandboxUnavailable(ValueError):
    """This machine cannot give tools the isolation their spec asks for."""


def _namespaces(network: str) -> list[str]:
    """The `unshare` prefix giving a call its own mount (and, isolated, network) namespace: as root, or
    in a user namespace mapped to the caller; [] when neither works here. Each candidate is tried with
    the child's own confinement (--probe), so a namespace the remounts fail in does not count."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    flags = ["--mount", "--net"] if network == "isolated" else ["--mount"]
    with tempfile.TemporaryDirectory(prefix="prl-tool-probe-") as box:
        drop = _make_box(box)
        probe = [sys.executable, "-I", str(CHILD), "--box", box, *drop, "--probe"]
        for argv in ([unshare, *flags], [unshare, *flags, "--map-root-user"]):
            try:
                if subprocess.run([*argv, *probe], capture_output=True, timeout=30).returncode == 0:
                    return argv
            except (OSError, subprocess.TimeoutExpired):
                continue
    return []


_PREFIXES: dict[str, list[str]] = {}


def _prefix(network: str) -> list[str]:
    if network not in _PREFIXES:
        _PREFIXES[network] = _namespaces(network)
    return _PREFIXES[network]


def check_sandbox(spec: ToolSpec) -> None:
    """Raise SandboxUnavailable unless tool calls of `spec` can run confined here (see the docstring)."""
    if _prefix(spec.network):
        return
    what = "a mount and a network namespace" if spec.network == "isolated" else "a mount namespace"
    hint = (
        "; or, for a tool that must reach the network, task.tool_network=allowed"
        if spec.network == "isolated"
        else ""
    )
    raise SandboxUnavailable(
        f"tool sandbox: this machine gives the actor no {what} (`unshare` failed or is missing), so tool "
        "calls could write outside their directory or reach the network: run the actor as root, or "
        "enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
        f"user.max_user_namespaces > 0){hint}"
    )


def network_isolated() -> bool:
    """Whether tool processes can run without a network on this machine."""
    return bool(_prefix("isolated"))


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
    """Call the tool once in its sandbox (see the module docstring); never raises for the tool's sake
    (SandboxUnavailable, a fault of the machine, does)."""
    check_sandbox(spec)
    try:
        payload = json.dumps(arguments).encode()
    except (TypeError, ValueError) as e:
        return ToolResult(False, f"error: arguments are not JSON ({e})")
    box = tempfile.mkdtemp(prefix="prl-tool-")
    try:
        return await _call(spec, payload, box)
    finally:
        shutil.rmtree(box, ignore_errors=True)


def _make_box(box: str) -> list[str]:
    """BOX/work (the call's cwd) and BOX/python (a mount point, see sandbox_child.py); the child's
    --drop-to flags: a root actor's call runs as nobody, in a directory nobody owns."""
    work = os.path.join(box, "work")
    os.mkdir(work)
    os.mkdir(os.path.join(box, "python"))
    if os.geteuid() != 0:
        return []
    os.chmod(box, 0o755)
    os.chown(work, NOBODY, NOBODY)
    return ["--drop-to", str(NOBODY)]


async def _call(spec: ToolSpec, payload: bytes, box: str) -> ToolResult:
    drop = _make_box(box)
    workdir = os.path.join(box, "work")
    argv = [*_prefix(spec.network), sys.executable, "-I", str(CHILD), "--box", box, *drop]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        str(spec.path),
        spec.function,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=_limits(spec),
        start_new_session=True,  # its own process group: a timeout kills whatever it started too
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONHASHSEED": "0",
            "HOME": workdir,
            "TMPDIR": workdir,
        },
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
