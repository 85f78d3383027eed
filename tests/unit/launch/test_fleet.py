"""The job's server list (pipeline_rl/fleet.py) and the launcher's POST /servers (pipeline_rl/launch/
fleet_route.py) without servers: a loopback HTTP stub answers /capabilities for an "added" server.

    .venv/bin/python -m pytest -q tests/unit/test_fleet.py
"""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpx
import pytest

from pipeline_rl.fleet import FleetWatch, read_fleet, write_fleet
from pipeline_rl.launch.fleet_route import ServersChange
from pipeline_rl.launch.monitor import serve_status


def test_watch_reports_each_change_once_and_ignores_a_missing_or_broken_file(tmp_path):
    watch = FleetWatch(tmp_path, ["http://a:1/"])
    assert watch.poll() is None  # no file: the config's list holds
    write_fleet(tmp_path, ["http://a:1"])
    assert watch.poll() is None  # same list
    write_fleet(tmp_path, ["http://a:1", "http://b:2/"])
    os.utime(tmp_path / "fleet.json", ns=(1, 10**18))  # a new mtime even within the clock's resolution
    assert watch.poll() == ["http://a:1", "http://b:2"]
    assert watch.poll() is None
    (tmp_path / "fleet.json").write_text("{not json")
    os.utime(tmp_path / "fleet.json", ns=(1, 2 * 10**18))
    assert watch.poll() is None and read_fleet(tmp_path) is None


@pytest.fixture
def capabilities_stub():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/capabilities" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def _launcher(tmp_path, urls):
    cfg = SimpleNamespace(
        run_dir=tmp_path, inference=SimpleNamespace(urls=urls), supervision=SimpleNamespace(stop_grace_s=1)
    )
    return SimpleNamespace(run_dir=tmp_path, cfg=cfg, children=[])


def test_add_and_remove_change_the_file_and_refuse_what_cannot_be_done(tmp_path, capabilities_stub):
    change = ServersChange(_launcher(tmp_path, ["http://127.0.0.1:9"]))
    assert change.handle({"add": capabilities_stub + "/"}) == (
        200,
        {"servers": ["http://127.0.0.1:9", capabilities_stub]},
    )
    assert read_fleet(tmp_path) == ["http://127.0.0.1:9", capabilities_stub]
    assert change.handle({"add": capabilities_stub})[0] == 409
    code, body = change.handle({"add": "http://127.0.0.1:1"})
    assert code == 422 and body["error"] == "unreachable"
    assert change.handle({"add": "ftp://x"})[0] == 422
    assert change.handle({"add": "http://x:1", "remove": "http://y:2"})[0] == 400
    assert change.handle({"remove": "http://127.0.0.1:2"})[0] == 404
    assert change.handle({"remove": "http://127.0.0.1:9"}) == (200, {"servers": [capabilities_stub]})
    assert change.handle({"remove": capabilities_stub})[0] == 409  # a job keeps one server
    assert read_fleet(tmp_path) == [capabilities_stub]


def test_status_route_needs_the_token_to_change_servers(tmp_path, capabilities_stub):
    change = ServersChange(_launcher(tmp_path, ["http://127.0.0.1:9"]))
    server = serve_status(0, lambda: {"ok": True}, change.handle, token="secret")
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        assert httpx.get(f"{base}/status").json() == {"ok": True}
        body = {"add": capabilities_stub}
        assert httpx.post(f"{base}/servers", json=body).status_code == 401
        assert (
            httpx.post(
                f"{base}/servers", content=b"[1]", headers={"Authorization": "Bearer secret"}
            ).status_code
            == 400
        )
        answer = httpx.post(f"{base}/servers", json=body, headers={"Authorization": "Bearer secret"})
        assert answer.status_code == 200 and capabilities_stub in answer.json()["servers"]
    finally:
        server.shutdown()
