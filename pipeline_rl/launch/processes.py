"""Child processes of a run: how each is described, started, watched and stopped.

Every child gets its own process session, so stopping it (SIGTERM, then SIGKILL after a grace period)
reaches everything it spawned — vLLM's EngineCore and worker processes, accelerate's ranks — and leaves
no orphan. Each child's command is also written as a re-runnable shell script under <run_dir>/cmd/.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# Variables that make a command reproducible; only these are written into the command files.
_RECORDED_ENV_PREFIXES = (
    "VLLM_",
    "OMP_",
    "HF_",
    "PIPELINE_RL_",
    "TOKENIZERS_",
    "CUDA_VISIBLE_DEVICES",
    "PYTHON",
)


@dataclass
class ProcessSpec:
    name: str  # unique: "server0", "trainer", "preprocessor0", "actor1"
    role: str  # servers | trainer | preprocessors | actors
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cores: list[int] | None = None
    port: int | None = None
    health_url: str | None = None

    def full_argv(self) -> list[str]:
        if self.cores:
            return ["taskset", "-c", ",".join(map(str, self.cores)), *self.argv]
        return list(self.argv)


class Child:
    def __init__(self, spec: ProcessSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0

    @property
    def name(self) -> str:
        return self.spec.name

    def start(self, base_env: dict[str, str]) -> None:
        env = dict(base_env, **self.spec.env, PYTHONUNBUFFERED="1")
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        self.proc = subprocess.Popen(
            self.spec.full_argv(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        self.started_at = time.monotonic()

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def wait(self, timeout_s: float) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])


def write_command_file(spec: ProcessSpec, env: dict[str, str], path: Path) -> None:
    recorded = {k: v for k, v in sorted({**env, **spec.env}.items()) if k.startswith(_RECORDED_ENV_PREFIXES)}
    lines = [
        "#!/usr/bin/env bash",
        f"# {spec.name} ({spec.role}); re-run from the repository root.",
        "set -e",
    ]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in recorded.items()]
    lines.append(shlex.join(spec.full_argv()))
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)


def stop_all(children: list[Child], grace_s: float = 10.0) -> None:
    """SIGTERM every live child, wait up to grace_s in total, then SIGKILL the rest (whole groups)."""
    for child in children:
        if child.alive:
            child.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        child.wait(max(0.0, deadline - time.monotonic()))
    for child in children:
        # Even an exited leader may leave members of its group behind (engine workers): kill the group.
        child.signal(signal.SIGKILL)
        child.wait(5.0)


def wait_healthy(children: list[Child], deadline_s: float) -> None:
    """Wait until every child with a health URL answers 200; raise naming the first that died or is late."""
    deadline = time.monotonic() + deadline_s
    pending = [c for c in children if c.spec.health_url]
    while pending:
        for child in list(pending):
            code = child.poll()
            if code is not None:
                raise ChildFailed(child, f"exited with code {code} while starting")
            try:
                if httpx.get(child.spec.health_url, timeout=2.0).status_code == 200:
                    pending.remove(child)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise ChildFailed(pending[0], f"not healthy after {deadline_s:.0f}s")
        if pending:
            time.sleep(0.5)


class ChildFailed(RuntimeError):
    def __init__(self, child: Child, what: str) -> None:
        super().__init__(f"{child.name} {what}")
        self.child = child
