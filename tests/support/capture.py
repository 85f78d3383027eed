"""An in-process capture server for trainer tests: the real FastAPI app (inference_shim/server.py) with the
capture backend (inference_shim/backends/capture_backend.py), served by uvicorn from a background thread.

    with CaptureServer(model_dir) as capture:      # listens on a free 127.0.0.1 port
        ...point a trainer at capture.url...
        capture.wait_for_version(3, timeout_s=30)
        capture.received["model.norm.weight"]     # the tensors of the last applied update
        capture.history                           # [{"version", "restore", "time"}, ...]

In-process so that a test reads what arrived straight from the backend (no files, no copies); the
weight group, HTTP and gloo transfer are real.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import torch
import uvicorn

from inference_shim.backends.capture_backend import CaptureBackend, CaptureOptions
from inference_shim.metrics import ShimMetrics
from inference_shim.server import create_app


class CaptureServer:
    def __init__(self, model_dir: str | Path, host: str = "127.0.0.1") -> None:
        metrics = ShimMetrics()
        self.backend = CaptureBackend(CaptureOptions(model=str(model_dir)), metrics)
        self._socket = socket.create_server((host, 0))
        self.url = f"http://{host}:{self._socket.getsockname()[1]}"
        config = uvicorn.Config(create_app(self.backend, metrics), log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True, name="capture-http"
        )

    @property
    def received(self) -> dict[str, torch.Tensor]:
        return self.backend.received

    @property
    def history(self) -> list[dict]:
        return self.backend.history

    def start(self) -> CaptureServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"capture server at {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()

    def __enter__(self) -> CaptureServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_for_version(self, version: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.backend.version < version:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"capture server at version {self.backend.version}, not {version}, after {timeout_s}s"
                )
            time.sleep(0.05)
