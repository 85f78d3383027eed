"""Start and stop REAL inference servers for benchmarks: our shim (`python -m inference_shim`) and, as the
baseline, vLLM's own OpenAI server on the same model.

    pool = ServerPool(log_dir)
    pool.prestart(ServerSpec("shim", model_dir), count=2)   # startups (~35 s each) overlap
    urls = pool.urls(ServerSpec("shim", model_dir), count=2)
    ...
    pool.release(model_dir)     # free the memory of a big model's servers before the next one
    pool.close()

Each server runs in its own process session (inference_shim.procs) so teardown kills the whole tree
(API process, EngineCore, workers), and it dies with a benchmark process that is killed hard.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from inference_shim.procs import (
    free_port,
    log_tail,
    own_core,
    serve_argv,
    start_child,
    stop_process_tree,
    wait_healthy,
)

START_DEADLINE_S = 300.0
PORT_ATTEMPTS = 3  # a picked free port can be taken by another process before the server binds it


def engine_env() -> dict[str, str]:
    """The environment every engine process on a CPU box needs (explicit settings in os.environ win)."""
    from inference_shim.cli import ENGINE_ENV_DEFAULTS

    return {**ENGINE_ENV_DEFAULTS, **os.environ, "PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True)
class ServerSpec:
    """What to run: our shim, or vLLM's own OpenAI server (the baseline), on one model."""

    kind: Literal["shim", "vllm"]
    model: Path
    max_model_len: int = 512
    max_num_seqs: int = 64
    extra: tuple[str, ...] = ()  # more command-line flags, e.g. ("--kv-after-update", "keep")
    # Extra environment; a value "a/b" gives server 0 "a", server 1 "b" (cycling), e.g. to bind
    # each server's vLLM-CPU worker to its own core: VLLM_CPU_OMP_THREADS_BIND=0/1.
    env: tuple[tuple[str, str], ...] = ()

    def environment(self, index: int) -> dict[str, str]:
        env = engine_env() | own_core(index)  # --server-env below may override the binding
        for key, value in self.env:
            choices = value.split("/")
            env[key] = choices[index % len(choices)]
        return env

    def command(self, port: int) -> list[str]:
        common = ["--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs)]
        common += ["--dtype", "float32", "--seed", "0"]
        if self.kind == "shim":
            return serve_argv(self.model, port, extra=(*common, *self.extra))
        # The baseline: vLLM's own OpenAI server, same engine settings.
        vllm = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        vllm += ["--model", str(self.model), "--host", "127.0.0.1", "--port", str(port), "--enforce-eager"]
        return [*vllm, *common, *self.extra]


@dataclass
class _Running:
    spec: ServerSpec
    index: int
    url: str
    proc: subprocess.Popen
    log_path: Path
    healthy: bool = False


class ServerPool:
    """Servers shared by the benchmarks of one `python -m benchmarks` invocation (started once, reused)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._running: dict[tuple[ServerSpec, int], _Running] = {}

    def prestart(self, spec: ServerSpec, count: int = 1) -> None:
        """Start any of servers 0..count-1 of spec that are not running yet; do not wait for them."""
        for index in range(count):
            if (spec, index) not in self._running:
                self._start(spec, index)

    def _start(self, spec: ServerSpec, index: int) -> _Running:
        port = free_port()
        log_path = self.log_dir / f"{spec.kind}-{spec.model.name}-{index}.log"
        # A fresh log per start: the lost-port check below must read this start's log only.
        proc = start_child(spec.command(port), spec.environment(index), log_path, append_log=False)
        server = _Running(spec, index, f"http://127.0.0.1:{port}", proc, log_path)
        self._running[(spec, index)] = server
        return server

    def urls(self, spec: ServerSpec, count: int = 1) -> list[str]:
        """URLs of servers 0..count-1 of spec, started if needed and healthy."""
        self.prestart(spec, count)
        for index in range(count):
            server = self._running[(spec, index)]
            if server.healthy and server.proc.poll() is not None:
                raise RuntimeError(f"server {server.url} died; log:\n{log_tail(server.log_path)}")
            for attempt in range(PORT_ATTEMPTS):
                if server.healthy:
                    break
                try:
                    wait_healthy(server.url, START_DEADLINE_S, server.proc, server.log_path)
                    server.healthy = True
                except RuntimeError:
                    # The port was free when we picked it; on a shared machine another process may
                    # bind it before the server does. Only that failure is worth another try.
                    lost_port = "address already in use" in log_tail(server.log_path).lower()
                    if not lost_port or attempt == PORT_ATTEMPTS - 1:
                        raise
                    stop_process_tree(server.proc)
                    server = self._start(spec, index)
        return [self._running[(spec, i)].url for i in range(count)]

    def started(self, spec: ServerSpec, count: int = 1) -> int:
        """How many of servers 0..count-1 of spec are already started (healthy or not)."""
        return sum((spec, i) in self._running for i in range(count))

    def pids(self, spec: ServerSpec, count: int = 1) -> list[int]:
        return [self._running[(spec, i)].proc.pid for i in range(count)]

    def release(self, model: Path | None = None) -> None:
        """Stop the servers of `model` (all servers when None)."""
        for key, server in list(self._running.items()):
            if model is None or server.spec.model == model:
                stop_process_tree(server.proc)
                del self._running[key]

    def close(self) -> None:
        self.release(None)

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
