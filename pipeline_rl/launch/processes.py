"""Child processes of a run: how each is described, started, watched and stopped.

The mechanics live in inference_shim.procs: every child gets its own process session, so stopping it
(SIGTERM, then SIGKILL after a grace period) reaches everything it spawned — vLLM's EngineCore and
worker processes, accelerate's ranks — and leaves no orphan, and it dies with a launcher killed hard.
Each child's command is also written as a re-runnable shell script under <run_dir>/cmd/ (0700); a
child's secret environment (the server's token) goes to <run_dir>/secrets/<name>.env (0600), which the
script sources, so the scripts themselves hold no secret.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from inference_shim import procs
from pipeline_rl.streams.redis_server import write_private

# Variables that make a command reproducible; only these are written into the command files.
_RECORDED_ENV_PREFIXES = (
    "VLLM_",
    "OMP_",
    "HF_",
    "PIPELINE_RL_",
    "TOKENIZERS_",
    "CUDA_VISIBLE_DEVICES",
    "PYTHON",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
)
# Never written into a command file, whatever the prefix: they are secrets.
SECRET_ENV = frozenset({"PIPELINE_RL_TOKEN", "PIPELINE_RL_API_KEY", "PIPELINE_RL_REDIS_PASSWORD"})


@dataclass
class ProcessSpec:
    name: str  # unique: "server0", "trainer", "preprocessor0", "actor1"
    role: str  # servers | trainer | preprocessors | actors
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cores: list[int] | None = None
    # False: the process binds its own compute to `cores` (a vLLM-CPU server's worker, through
    # VLLM_CPU_OMP_THREADS_BIND) and its other processes float, like the light roles.
    taskset: bool = True
    port: int | None = None  # a server's HTTP port; the trainer's rendezvous port
    url: str | None = None  # base URL of a server; the launcher waits for its /health
    gpus: list[str] | None = None  # CUDA_VISIBLE_DEVICES entries (platform=gpu), shown in the plan
    secret_env: dict[str, str] = field(default_factory=dict)  # environment only, never in files or argv

    def full_argv(self) -> list[str]:
        if self.cores and self.taskset:
            return ["taskset", "-c", ",".join(map(str, self.cores)), *self.argv]
        return list(self.argv)


class Child:
    def __init__(self, spec: ProcessSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.log_offset = 0  # where this start's output begins in the (appended) log

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def role(self) -> str:
        return self.spec.role

    def start(self, base_env: dict[str, str]) -> None:
        env = {**base_env, **self.spec.env, **self.spec.secret_env, "PYTHONUNBUFFERED": "1"}
        # Appended: a resumed run keeps the earlier runs' output in the same log.
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.proc = procs.start_child(
            self.spec.full_argv(), env=env, log_path=self.log_path, death_signal=self.death_signal
        )
        self.started_at = time.monotonic()

    @property
    def death_signal(self) -> int:
        """What the kernel sends this child when the launcher dies (killed hard: no orderly shutdown).
        A server gets SIGTERM, so it stops its engine processes itself (uvicorn's shutdown takes ~5 s);
        everything else SIGKILL: an actor's or preprocessor's graceful stop would wait for servers and
        Redis that die with the launcher, and their ledgers and streams are built for kill -9."""
        return signal.SIGTERM if self.spec.role == "servers" else signal.SIGKILL

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            procs.signal_group(self.proc, sig)

    def wait(self, timeout_s: float) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def log_tail(self, lines: int = 30) -> str:
        return procs.log_tail(self.log_path, lines)

    def last_error(self) -> str | None:
        """The last ERROR line this start of the child logged (not an earlier start's)."""
        return procs.last_error_line(self.log_path, since=self.log_offset)


def write_command_file(spec: ProcessSpec, env: dict[str, str], path: Path, secrets_dir: Path) -> None:
    """cmd/<name>.sh (0700): the child's recorded environment and argv; its secret environment is
    written to secrets_dir/<name>.env (0600) and sourced, never inlined."""
    secret_names = SECRET_ENV | spec.secret_env.keys()
    recorded = {
        k: v
        for k, v in sorted({**env, **spec.env}.items())
        if k.startswith(_RECORDED_ENV_PREFIXES) and k not in secret_names
    }
    lines = [
        "#!/usr/bin/env bash",
        f"# {spec.name} ({spec.role}); re-run from the repository root.",
        "set -e",
    ]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in recorded.items()]
    if spec.secret_env:
        env_file = secrets_dir / f"{spec.name}.env"
        write_private(env_file, "".join(f"export {k}={shlex.quote(v)}\n" for k, v in spec.secret_env.items()))
        lines.append(f"source {shlex.quote(str(env_file))}")
    lines.append(shlex.join(spec.full_argv()))
    # 0700 although it holds no secret: only the run's owner has any business re-running it.
    write_private(path, "\n".join(lines) + "\n")
    path.chmod(0o700)


def stop_all(children: list[Child], grace_s: float = 10.0) -> None:
    """SIGTERM every live child ONCE, wait up to grace_s in total, then SIGKILL every group.

    One SIGTERM only: the trainer takes a second signal as "abort now" and would skip its final
    checkpoint. The groups are SIGKILLed even when their leader exited: an engine's workers may outlive it.
    """
    for child in children:
        if child.alive:
            child.signal(signal.SIGTERM)
    # They stop in parallel: each gets what is left of the shared grace.
    deadline = time.monotonic() + grace_s
    for child in children:
        child.wait(max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.proc is not None:
            if child.alive:
                print(f"{child.name} still running {grace_s:.0f}s after SIGTERM: SIGKILL", flush=True)
            child.signal(signal.SIGKILL)
            child.wait(5.0)


def wait_all_healthy(children: list[Child], deadline_s: float) -> None:
    """Wait until every child with a URL answers /health; raise naming the first that died or is late.
    A child without a URL that exits meanwhile (the trainer starts with the servers) fails the wait too.

    The children start together, so waiting for them in turn costs no time; a later child that dies
    early is named once the earlier ones are up (or late).
    """
    deadline = time.monotonic() + deadline_s
    for child in children:
        if child.spec.url is None or child.proc is None:
            continue
        while True:
            for other in children:
                if other.spec.url is None and other.proc is not None and other.poll() is not None:
                    raise ChildFailed(other, f"exited with code {other.poll()} while the servers started")
            try:
                procs.wait_healthy(
                    child.spec.url,
                    min(2.0, max(0.0, deadline - time.monotonic())),
                    child.proc,
                    # Started to await the trainer's weights (restarted, rejoining, resuming): up at 503.
                    awaiting_ok="--await-weights" in child.spec.argv,
                )
                break
            except RuntimeError:
                raise ChildFailed(child, f"exited with code {child.poll()} while starting") from None
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise ChildFailed(child, f"not healthy after {deadline_s:.0f}s") from None


class ChildFailed(RuntimeError):
    def __init__(self, child: Child, what: str) -> None:
        super().__init__(f"{child.name} {what}")
        self.child = child
        self.what = what
