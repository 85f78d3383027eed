"""Weight sender and protocol units that need no engine: bucket planning, validation before any
collective, and the trainer's deadline when a server never joins.

The "server that never joins" is a hand-written stand-in (a tiny HTTP server that answers
/capabilities and then hangs on /init_process_group): it injects a fault no healthy real server has.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from inference_shim.backends.common import ContractError, validate_update
from inference_shim.protocol import BUCKET_ALIGN_BYTES, TensorMeta, WeightUpdateRequest, plan_buckets
from inference_shim.weight_sender import WeightPushError, WeightSender
from pipeline_rl.bench.servers import served_version


def _meta(name: str, shape: list[int], dtype: str = "float32") -> TensorMeta:
    return TensorMeta(name=name, dtype=dtype, shape=shape)


def test_plan_buckets_packs_in_order_aligned_and_bounded():
    metas = [_meta("a", [10]), _meta("b", [100]), _meta("c", [3]), _meta("big", [1000]), _meta("d", [1])]
    buckets = plan_buckets(metas, bucket_bytes=512)
    placed = [slot.index for bucket in buckets for slot in bucket.slots]
    assert placed == [0, 1, 2, 3, 4]  # every tensor once, in order
    for bucket in buckets:
        for slot in bucket.slots:
            assert slot.offset % BUCKET_ALIGN_BYTES == 0
            assert slot.nbytes == metas[slot.index].nbytes
        assert bucket.nbytes == bucket.slots[-1].offset + bucket.slots[-1].nbytes
        assert bucket.nbytes <= 512 or len(bucket.slots) == 1  # only an oversized tensor exceeds the size
    # a: 40 B at 0; b: 400 B at 64 (ends 464); c would start at the next aligned offset 512 and end
    # past 512 -> new bucket; big (4000 B) gets its own; d cannot follow big inside 512 B -> own bucket.
    assert [[(s.index, s.offset) for s in b.slots] for b in buckets] == [
        [(0, 0), (1, 64)],
        [(2, 0)],
        [(3, 0)],
        [(4, 0)],
    ]


def test_validate_update_rejects_every_bad_request_with_4xx():
    table = {"w": ("float32", [2, 3]), "b": ("float32", [3])}
    good = [_meta("w", [2, 3]), _meta("b", [3])]

    def check(tensors, version=2, current=1, pending=None, joined=True):
        req = WeightUpdateRequest(version=version, tensors=tensors)
        validate_update(req, table, current, pending, joined)

    check(good)  # accepted
    cases = {
        "no_process_group": dict(tensors=good, joined=False),
        "update_in_progress": dict(tensors=good, pending=2),
        "stale_version": dict(tensors=good, version=1),
    }
    for error, kwargs in cases.items():
        with pytest.raises(ContractError) as e:
            check(**kwargs)
        assert e.value.error == error and 400 <= e.value.status < 500
    for tensors, words in [
        ([_meta("w", [2, 3]), _meta("x", [3]), _meta("b", [3])], "unknown tensor name"),
        ([_meta("w", [3, 2]), _meta("b", [3])], "shape [3, 2] != expected [2, 3]"),
        ([_meta("w", [2, 3], "bfloat16"), _meta("b", [3])], "dtype bfloat16"),
        ([_meta("w", [2, 3])], "missing 1 tensor"),
        ([_meta("w", [2, 3]), _meta("w", [2, 3]), _meta("b", [3])], "sent twice"),
    ]:
        with pytest.raises(ContractError) as e:
            check(tensors)
        assert e.value.status == 422 and words in e.value.detail


def test_tensor_meta_rejects_unknown_dtype_and_negative_shape():
    with pytest.raises(ValueError, match="not supported"):
        _meta("w", [1], "int4")
    with pytest.raises(ValueError, match="negative"):
        _meta("w", [-1])


class _NeverJoins(BaseHTTPRequestHandler):
    def do_GET(self):
        body = {
            "contract_version": "1.0",
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


def test_cli_help_imports_no_heavy_modules():
    code = "import sys; from pipeline_rl import cli; cli.build_parser(); print(sorted({'torch','vllm','transformers'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"
    help_text = subprocess.run(
        [sys.executable, "-m", "pipeline_rl.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "serve" in help_text.stdout and "tiny-model" in help_text.stdout


def test_a_push_that_does_not_wait_settles_later_and_a_server_killed_before_applying_fails_it(tmp_path):
    # push(settle=False) returns once the bytes are sent; settle(), or the next push, reads the results.
    # Caused for real: the second server SIGKILLs itself once it has received its 3rd update, before
    # applying it (fault point server.received@3, as in the chaos tests).
    from _servers import checkpoint_params, serve_argv, start_child, stop_process_tree, wait_healthy

    from inference_shim.procs import free_port
    from pipeline_rl.tiny_model import TinyModelSpec, build_tiny_model

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
