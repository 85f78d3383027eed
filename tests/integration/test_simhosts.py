"""The simulated-hosts harness itself (pipeline_rl/testing/simhosts.py): reachability, cut and heal, tbf shaping,
cleanup on every exit path, the sweep of stale namespaces. Real namespaces, veths, bridge and tc; a few
seconds in all; skipped (with the reason) where namespaces cannot be created (not root, no iproute2).

    pytest -q tests/integration/test_simhosts.py
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from pipeline_rl.testing.simhosts import PREFIX, SimNet, available, measure_throughput

OK, WHY = available()
pytestmark = pytest.mark.skipif(not OK, reason=WHY)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _echo_server(host) -> tuple[int, threading.Thread]:
    """A one-connection echo server on host's address, in a thread inside host; returns (port, thread)."""
    ready, port = threading.Event(), []

    def serve() -> None:
        with host.entered(), socket.create_server((host.address, 0)) as server:
            server.settimeout(30)
            port.append(server.getsockname()[1])
            ready.set()
            conn, _ = server.accept()
            with conn:
                conn.sendall(conn.recv(64))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    return port[0], thread


def _connects(src, address: str, port: int, timeout_s: float = 1.5) -> bool:
    with src.entered():
        try:
            with socket.create_connection((address, port), timeout=timeout_s) as conn:
                conn.sendall(b"ping")
                return conn.recv(64) == b"ping"
        except OSError:
            return False


def test_two_hosts_reach_each_other_over_tcp():
    with SimNet(["a", "b"]) as net:
        a, b = net["a"], net["b"]
        assert a.address != b.address
        for src, dst in ((a, b), (b, a)):
            port, thread = _echo_server(dst)
            assert _connects(src, dst.address, port)
            thread.join(5)
        # A process started on a host sees that host's network: its own address, and no route out.
        out = subprocess.run(
            ["ip", "netns", "exec", a.netns, "ip", "-4", "-o", "addr"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert a.address in out and b.address not in out
        routes = subprocess.run(
            ["ip", "-n", a.netns, "route"], capture_output=True, text=True, check=True
        ).stdout
        assert "default" not in routes


def test_cut_link_blocks_and_heal_restores():
    with SimNet(["a", "b"]) as net:
        a, b = net["a"], net["b"]
        b.link(False)
        port, thread = _echo_server(b)
        assert not _connects(a, b.address, port)
        b.link(True)
        assert _connects(a, b.address, port, timeout_s=5)
        thread.join(5)


def test_tbf_shaping_lowers_throughput():
    with SimNet(["a", "b"]) as net:
        a, b = net["a"], net["b"]
        unshaped = measure_throughput(a, b, megabytes=50)
        b.shape("40mbit")  # 5 MB/s
        shaped = measure_throughput(a, b, megabytes=5)
        b.shape(None)
        again = measure_throughput(a, b, megabytes=50)
    assert 3e6 < shaped < 6.5e6, f"40 Mbit/s link measured {shaped / 1e6:.1f} MB/s"
    assert unshaped > 4 * shaped and again > 4 * shaped


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_cleanup_leaves_nothing_even_when_the_body_raises(error):
    with pytest.raises(error), SimNet(["a", "b", "c"], rate="1gbit") as net:
        names = net.names()
        assert set(names) <= _namespaces()
        proc = net["c"].run([sys.executable, "-c", "import time; time.sleep(600)"])
        raise error("the test body failed")
    assert proc.poll() is not None
    assert not set(names) & _namespaces()
    # veths and the bridge lived in those namespaces; the root namespace never held any of ours.
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert f": {PREFIX}" not in links and "h-a" not in links and "br0" not in links


def test_stale_namespaces_of_dead_processes_are_swept():
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = f"{PREFIX}-{int(dead.stdout)}-0-sw"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with SimNet(["a"]):
            assert stale not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
