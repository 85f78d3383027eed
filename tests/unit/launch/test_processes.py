"""The launcher's wait for its servers while the trainer starts beside them (pipeline_rl/launch/processes.py):
real child processes, a real HTTP /health on loopback; no engine."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from inference_shim.procs import free_port, stop_process_tree
from pipeline_rl.launch.processes import Child, ChildFailed, ProcessSpec, wait_all_healthy

# A server that answers GET /health with 200 after `delay` seconds (nothing listens before).
SERVER = """
import http.server, sys, time
time.sleep(float(sys.argv[2]))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _children(tmp_path: Path, server_delay_s: float, trainer_code: str) -> list[Child]:
    port = free_port()
    server = ProcessSpec(
        "server0", "servers", [sys.executable, "-c", SERVER, str(port), str(server_delay_s)],
        url=f"http://127.0.0.1:{port}",
    )  # fmt: skip
    trainer = ProcessSpec("trainer", "trainer", [sys.executable, "-c", trainer_code])
    children = [Child(server, tmp_path / "server0.log"), Child(trainer, tmp_path / "trainer.log")]
    for child in children:
        child.start(dict(os.environ))
    return children


def _stop(children: list[Child]) -> None:
    for child in children:
        stop_process_tree(child.proc, grace_s=2)


def test_a_trainer_that_dies_while_the_servers_start_fails_the_wait_at_once_named(tmp_path):
    children = _children(tmp_path, server_delay_s=60, trainer_code="raise SystemExit(3)")
    started = time.monotonic()
    try:
        with pytest.raises(ChildFailed) as failed:
            wait_all_healthy(children, deadline_s=120)
    finally:
        _stop(children)
    assert failed.value.child.name == "trainer"
    assert "exited with code 3 while the servers started" in str(failed.value)
    assert time.monotonic() - started < 30, "the wait went on for the server after the trainer died"


def test_the_wait_ends_when_every_server_is_healthy_with_the_trainer_still_starting(tmp_path):
    children = _children(tmp_path, server_delay_s=1, trainer_code="import time; time.sleep(60)")
    try:
        wait_all_healthy(children, deadline_s=60)
        assert children[1].poll() is None
    finally:
        _stop(children)


def test_a_server_not_healthy_by_the_deadline_is_named(tmp_path):
    children = _children(tmp_path, server_delay_s=60, trainer_code="import time; time.sleep(60)")
    try:
        with pytest.raises(ChildFailed) as failed:
            wait_all_healthy(children, deadline_s=1)
    finally:
        _stop(children)
    assert failed.value.child.name == "server0" and "not healthy after 1s" in str(failed.value)
