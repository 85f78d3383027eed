"""A weight receiver that speaks the inference contract's control routes, without an engine.

    python -m pipeline_rl.trainer.capture_server --model artifacts/tiny-arith --port 8100
    # then point a trainer at it: inference.urls=[http://127.0.0.1:8100]

It joins the trainer's weight group as a real gloo peer (inference_shim.transfer: the same join and
bucket-receive code the vLLM worker uses), checks every update exactly like a server does
(inference_shim.backends.base.validate_update: names, shapes, dtypes, version, restore) and keeps the
tensors of the last update plus the history of versions. Uses: running a trainer without an inference
engine (dry runs), and tests that compare what a trainer pushed with what it holds. It cannot generate,
so actors must never be pointed at it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from pydantic import BaseModel, ValidationError

from inference_shim.backends.base import ContractError, validate_update
from inference_shim.protocol import (
    Capabilities,
    DebugState,
    HealthResponse,
    InitProcessGroupRequest,
    InitProcessGroupResponse,
    UpdateResult,
    WeightUpdateAccepted,
    WeightUpdateRequest,
    decision_key,
    plan_buckets,
    result_key,
)
from inference_shim.transfer import WeightGroup, connect_store, join_group, receive_buckets
from pipeline_rl.tiny_model import checkpoint_tensor_table

log = logging.getLogger("pipeline_rl.capture_server")


class CaptureServer:
    """Serve the control routes on host:port (0 = any free port) from a background thread."""

    def __init__(self, model_dir: str | Path, host: str = "127.0.0.1", port: int = 0) -> None:
        self.model_dir = str(model_dir)
        self.table = checkpoint_tensor_table(model_dir)
        self.version = 0
        self.group: WeightGroup | None = None
        self.server_id = ""
        self.pending: int | None = None
        self.received: dict[str, torch.Tensor] = {}
        self.history: list[dict] = []  # one entry per applied update: version, restore, time
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._http = ThreadingHTTPServer((host, port), _handler(self))
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True, name="capture-http")

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> CaptureServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def __enter__(self) -> CaptureServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_for_version(self, version: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.version < version:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"capture server at version {self.version}, not {version}, after {timeout_s}s"
                )
            time.sleep(0.05)

    # ------------------------------------------------------------------ routes
    def capabilities(self) -> Capabilities:
        return Capabilities(
            backend="capture",
            engine_version="none",
            model=self.model_dir,
            workers=1,
            transports=["gloo"],
            pause_modes=[],
            dtypes=sorted({dtype for dtype, _ in self.table.values()}),
            per_token_versions=False,
            staged_receive=True,
            max_model_len=0,
        )

    def debug_state(self) -> DebugState:
        return DebugState(
            weight_version=self.version,
            group=None if self.group is None else {"server_id": self.server_id, "rank": self.group.rank},
            pending_update=self.pending,
            last_update=None,
            last_error=self.last_error,
            in_flight_requests=0,
            paused=False,
            updates_applied=len(self.history),
        )

    def init_process_group(self, req: InitProcessGroupRequest) -> InitProcessGroupResponse:
        if self.group is not None:
            raise ContractError(409, "already_joined", "call POST /destroy_process_group first")
        started = time.monotonic()
        try:
            store = connect_store(
                req.master_address, req.master_port, is_master=False, world_size=None, timeout_s=req.timeout_s
            )
            self.group = join_group(
                store,
                rank=req.rank_offset,
                world_size=req.world_size,
                backend=req.backend,
                group_name=req.group_name,
                timeout_s=req.timeout_s,
            )
        except Exception as e:
            raise ContractError(504, "join_failed", f"{type(e).__name__}: {e}; is the trainer up?") from e
        self.server_id = req.server_id
        return InitProcessGroupResponse(ranks=[req.rank_offset], join_seconds=time.monotonic() - started)

    def destroy_process_group(self) -> dict:
        if self.group is None:
            raise ContractError(409, "no_process_group", "nothing to destroy")
        if self.pending is not None:
            raise ContractError(409, "update_in_progress", f"version {self.pending} is in flight")
        self.group = None
        return {"status": "destroyed"}

    def request_weight_update(self, req: WeightUpdateRequest) -> WeightUpdateAccepted:
        with self._lock:
            validate_update(req, self.table, self.version, self.pending, self.group is not None)
            self.pending = req.version
        threading.Thread(target=self._receive, args=(self.group, req), daemon=True).start()
        buckets = plan_buckets(req.tensors, req.bucket_bytes)
        return WeightUpdateAccepted(
            version=req.version, num_buckets=len(buckets), total_bytes=sum(b.nbytes for b in buckets)
        )

    def _receive(self, group: WeightGroup, req: WeightUpdateRequest) -> None:
        """Wait for the trainer's decision; on "go" receive every bucket, then report the result."""
        result = UpdateResult(server_id=self.server_id, version=req.version, ok=False)
        timeout = dt.timedelta(seconds=req.timeout_s)
        try:
            key = decision_key(group.group_name, req.update_id)
            group.store.wait([key], timeout)
            if group.store.get(key).decode() != "go":
                return  # aborted: nothing is sent, no result is expected
            started = time.monotonic()
            staged, total = receive_buckets(group, req.tensors, req.bucket_bytes)
            self.received = {name: tensor.clone() for name, tensor in staged}
            self.version = req.version
            self.history.append({"version": req.version, "restore": req.restore, "time": time.time()})
            result.ok, result.total_bytes = True, total
            result.receive_seconds = time.monotonic() - started
        except Exception as e:  # reported to the trainer through the result key
            result.error = self.last_error = f"{type(e).__name__}: {e}"
            log.error("update to version %d failed: %s", req.version, result.error)
        finally:
            self.pending = None
        group.store.set(result_key(group.group_name, req.update_id, self.server_id), result.model_dump_json())


def _handler(server: CaptureServer) -> type[BaseHTTPRequestHandler]:
    posts = {
        "/init_process_group": (InitProcessGroupRequest, server.init_process_group),
        "/request_weight_update": (WeightUpdateRequest, server.request_weight_update),
        "/destroy_process_group": (None, lambda: server.destroy_process_group()),
    }
    gets = {
        "/health": lambda: HealthResponse(status="ok", weight_version=server.version),
        "/capabilities": server.capabilities,
        "/debug/state": server.debug_state,
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            route = gets.get(self.path)
            if route is None:
                self._send(404, {"error": "not_found", "detail": self.path})
            else:
                self._send(200, route())

        def do_POST(self) -> None:
            model, route = posts.get(self.path, (None, None))
            if route is None:
                self._send(404, {"error": "not_found", "detail": self.path})
                return
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            try:
                answer = route(model.model_validate_json(body or b"{}")) if model else route()
                self._send(200, answer)
            except ValidationError as e:
                self._send(422, {"error": "invalid_request", "detail": str(e)[:2000]})
            except ContractError as e:
                self._send(e.status, {"error": e.error, "detail": e.detail})

        def _send(self, status: int, body: BaseModel | dict) -> None:
            data = (body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body)).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Receive a trainer's weight pushes without an engine.")
    parser.add_argument("--model", required=True, help="HF model directory (tensor names/shapes to accept)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    server = CaptureServer(args.model, args.host, args.port).start()
    print(f"capture server at {server.url} (Ctrl-C to stop)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
