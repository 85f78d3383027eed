"""inference_shim.procs with real processes (no mocks): ports, die-with-parent, tree stop, health wait.

.venv/bin/python -m pytest -q tests/unit/test_procs.py      # a few seconds
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from inference_shim.procs import (
    free_port,
    last_error_line,
    log_tail,
    reserve_port,
    serve_argv,
    start_child,
    stop_process_tree,
    wait_healthy,
)


def _gone(pid: int, timeout_s: float = 5.0) -> bool:
    """True once pid no longer runs (a zombie waiting for its reaper counts as gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_port_never_returns_a_port_twice_in_one_process(monkeypatch) -> None:
    # A launcher draws every server's port and the trainer's before any binds: a repeated random draw
    # must not hand out the same free port twice (it did once, and two roles fought over it).
    import inference_shim.procs as procs

    first = free_port()
    draws = iter([first, first, first + 1 if first + 1 < procs._ephemeral_low() else first - 1])
    monkeypatch.setattr(procs._DRAW, "randint", lambda low, high: next(draws))
    second = free_port()
    assert second != first


def test_serve_argv_runs_the_shim_module() -> None:
    argv = serve_argv("/m", 8123, extra=("--seed", "1"))
    assert argv[:3] == [sys.executable, "-m", "inference_shim"]
    assert argv[3:] == [
        "--model",
        "/m",
        "--port",
        "8123",
        "--host",
        "127.0.0.1",
        "--backend",
        "vllm",
        "--seed",
        "1",
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_child_dies_when_its_parent_is_killed(tmp_path: Path) -> None:
    # A parent that starts a long child and then hangs; SIGKILL gives it no chance to clean up.
    parent_code = textwrap.dedent("""
        import time
        from inference_shim.procs import start_child
        child = start_child(["sleep", "60"])
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        assert not _gone(child_pid, timeout_s=0.2)
        parent.kill()
        parent.wait(timeout=5)
        assert _gone(child_pid), "the child outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait(timeout=5)


def test_stop_process_tree_stops_children_that_ignore_sigterm(tmp_path: Path) -> None:
    # Grandchildren that ignore SIGTERM: only the SIGKILL of the whole group after the grace stops them.
    proc = start_child(["bash", "-c", "trap '' TERM; sleep 60 & sleep 60 & wait"], die_with_parent=False)
    deadline = time.monotonic() + 5
    while len(psutil.Process(proc.pid).children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children())]
    assert len(tree) == 3
    started = time.monotonic()
    stop_process_tree(proc, grace_s=0.5)
    assert time.monotonic() - started < 5
    assert all(_gone(pid) for pid in tree)


def test_wait_healthy_raises_with_the_log_tail_when_the_process_exits(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    proc = start_child(
        [sys.executable, "-c", "print('engine failed: no GPU'); raise SystemExit(3)"], log_path=log
    )
    with pytest.raises(RuntimeError, match="code 3") as err:
        wait_healthy(f"http://127.0.0.1:{free_port()}", 30, proc, log)
    assert "engine failed: no GPU" in str(err.value)
    assert log_tail(log) == "engine failed: no GPU"


def test_last_error_line_finds_the_childs_reason_above_its_wrappers_traceback(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    assert last_error_line(log) is None  # no log yet
    log.write_text(
        "2026-11-27 19:06:14,000 trainer[0] pipeline_rl.trainer ERROR first failure\n"
        "2026-11-27 19:06:14,438 trainer[0] pipeline_rl.trainer ERROR trainer failed: ValueError: set x=no\n"
        + "".join(f'  File "accelerate/launch.py", line {i}, in main\n' for i in range(40))
    )
    assert (
        last_error_line(log)
        == "2026-11-27 19:06:14,438 trainer[0] pipeline_rl.trainer ERROR trainer failed: ValueError: set x=no"
    )
    assert "trainer failed" not in log_tail(log, 30)  # why the launcher repeats it below the tail
    # A restart appends to the same log: its own start offset hides the earlier start's error.
    restarted_at = log.stat().st_size
    with log.open("a") as f:
        f.write("2026-11-27 19:10:00,000 trainer[0] pipeline_rl.trainer INFO rank 0/1 ready\n")
    assert last_error_line(log, since=restarted_at) is None
    assert "set x=no" in last_error_line(log)


def test_wait_healthy_returns_once_health_answers_and_times_out_otherwise(tmp_path: Path) -> None:
    port = free_port()
    server_code = textwrap.dedent(f"""
        from http.server import BaseHTTPRequestHandler, HTTPServer
        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.end_headers()
        HTTPServer(("127.0.0.1", {port}), H).serve_forever()
    """)
    proc = start_child([sys.executable, "-c", server_code], log_path=tmp_path / "server.log")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 30, proc)
        with pytest.raises(TimeoutError, match="not healthy after 1s"):
            wait_healthy(f"http://127.0.0.1:{port}", 1, proc, path="/missing")
    finally:
        stop_process_tree(proc, grace_s=2)


def test_a_reserved_port_is_taken_but_refuses_connections_until_served() -> None:
    # What the server does before its engine starts: the launcher's port is its own from then on, and a
    # health poll during the engine's startup is refused (not left hanging in a listen backlog).
    port = free_port()
    sock = reserve_port("127.0.0.1", port)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        sock.listen()  # what uvicorn does once the app has started
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        # A second server on the same port is told so at once, not after its engine has loaded.
        with pytest.raises(OSError):
            reserve_port("127.0.0.1", port)
    finally:
        sock.close()
