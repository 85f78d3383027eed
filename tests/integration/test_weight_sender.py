"""The weight sender against servers that fail: the trainer's deadline when a server never joins, and a
push that does not wait for its results while a server dies before applying it. (Bucket planning and
validation: tests/unit/shim/test_weight_plan.py.)

The "server that never joins" is a hand-written stand-in (a tiny HTTP server that answers
/capabilities and then hangs on /init_process_group): it injects a fault no healthy real server has.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from inference_shim.client import served_version
from inference_shim.protocol import TensorMeta
from inference_shim.weight_sender import WeightPushError, WeightSender


def _meta(name: str, shape: list[int], dtype: str = "float32") -> TensorMeta:
    return TensorMeta(name=name, dtype=dtype, shape=shape)


class _NeverJoins(BaseHTTPRequestHandler):
    def do_GET(self):
        body = {
            "contract_version": "2.0",
            "backend": "stand-in",
            "engine_version": "0",
            "model": "m",
            "workers": 1,
            "transports": ["gloo"],
            "pause_modes": ["keep"],
            "dtypes": ["float32"],
            "per_token_versions": True,
            "staged_receive": True,
            "max_model_len": 64,
        }
        self._send(200, body)

    def do_POST(self):
        time.sleep(30)  # accepted the call, never joins the group
        self._send(504, {"error": "join_failed"})

    def _send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_trainer_whose_server_never_joins_raises_within_its_deadline():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NeverJoins)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    sender = WeightSender([url], backend="gloo", timeout_s=3)
    start = time.monotonic()
    with pytest.raises(WeightPushError) as raised:
        sender.connect()
    elapsed = time.monotonic() - start
    server.shutdown()
    assert url in str(raised.value) and raised.value.servers
    assert elapsed < 3 + 5, f"took {elapsed:.1f}s for a 3 s deadline"


def test_a_push_that_does_not_wait_settles_later_and_a_server_killed_before_applying_fails_it(tmp_path):
    # push(settle=False) returns once the bytes are sent; settle(), or the next push, reads the results.
    # Caused for real: the second server SIGKILLs itself once it has received its 3rd update, before
    # applying it (fault point server.received@3, as in the chaos tests).
    from support.servers import checkpoint_params, serve_argv, start_child, stop_process_tree, wait_healthy

    from inference_shim.procs import free_port
    from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model

    model = build_tiny_model(tmp_path / "model", TinyModelSpec(seed=0))
    named = checkpoint_params(model)
    faults = {"PIPELINE_RL_FAULTS": "server.received@3", "PIPELINE_RL_FAULTS_DIR": str(tmp_path / "faults")}
    procs, urls = [], []
    try:
        for i, env in enumerate([{}, faults]):
            port = free_port()
            argv = serve_argv(model, port, backend="capture", extra=["--log-level", "warning"])
            log_path = tmp_path / f"server{i}.log"
            procs.append((start_child(argv, env=dict(os.environ, **env), log_path=log_path), log_path))
            urls.append(f"http://127.0.0.1:{port}")
        for url, (proc, log_path) in zip(urls, procs, strict=True):
            wait_healthy(url, 60, proc, log_path)
        sender = WeightSender(urls, backend="gloo", timeout_s=30)
        sender.connect()
        try:
            sent = sender.push_tensors(1, named, settle=False)
            assert not sent.settled and sent.results == [] and sent.num_buckets >= 1
            settled = sender.settle()
            assert settled is not None and settled.settled and settled.version == 1
            assert sorted(r.server_id for r in settled.results) == sorted(urls)
            assert all(r.ok for r in settled.results)
            assert settled.total_seconds >= sent.blocked_seconds
            assert [_served_version(u) for u in urls] == [1, 1]
            assert sender.settle() is None  # nothing pending any more

            sender.push_tensors(2, named, settle=False)
            report = sender.push_tensors(3, named, settle=False)  # settles 2 first; server 2 dies on 3
            assert _served_version(urls[0]) >= 2
            with pytest.raises(WeightPushError) as raised:
                sender.push_tensors(4, named)  # raises 3's failure; nothing of 4 is sent
            assert urls[1] in raised.value.servers and urls[0] not in raised.value.servers
            assert "version 3" in str(raised.value)
            assert procs[1][0].wait(timeout=30) == -signal.SIGKILL
            assert _served_version(urls[0]) == 3 and report.version == 3
        finally:
            sender.close()
    finally:
        for proc, _ in procs:
            stop_process_tree(proc)


def _served_version(url: str) -> int:
    return served_version([url])
