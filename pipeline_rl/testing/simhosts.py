"""Simulated hosts on one machine: network namespaces on a private virtual switch (root only, Linux).

Tests and benchmarks use this to run one job "over several hosts" for real: every process of a host
sees only that host's network, so a server bound to host C's address is reachable from host A over the
simulated link and from nowhere else, and a link can be shaped (tbf) or cut while traffic flows.

    from pipeline_rl.testing.simhosts import SimNet, available, measure_throughput
    ok, why = available()                                   # (False, "not root") etc.
    with SimNet(["a", "b", "c"]) as net:                    # always cleaned up, even on Ctrl-C
        a, c = net["a"], net["c"]
        proc = c.run(argv, env=c.env(), log_path="c.log")  # Popen inside C, in its own session
        with a.entered():                                  # this thread's sockets live in A
            httpx.get(f"http://{c.address}:8000/health")
        c.shape("50mbit")                                  # tbf, both directions of C's link
        c.link(False); c.link(True)                        # cut, heal
        print(measure_throughput(a, c, megabytes=50) / 1e6, "MB/s")

Layout (written here because tests rely on it): a SimNet with hosts [h1, h2, ...] owns
  - a switch namespace `prl-<pid>-<seq>-sw` holding a bridge `br0` and, per host, the switch end of
    that host's cable, a veth named `h-<host>`;
  - one namespace per host, `prl-<pid>-<seq>-<host>`, whose cable end is called `eth0` (the same name
    on every host, so GLOO_SOCKET_IFNAME=eth0 everywhere), with `<subnet>.<i+1>/24` and `lo` up.
Nothing is created in the root namespace, and the hosts have no default route: traffic to any address
but the simulated hosts' fails at once ("network unreachable") instead of leaving the machine, and
concurrent SimNets (other processes, other tests) cannot collide even on the same subnet.

Cleanup: close() (the context manager, and an atexit hook for a plain close-less exit) stops every
process it started (whole process groups), kills whatever else still runs inside its namespaces, and
deletes them, which deletes the veths and the bridge with them. SimNet() first sweeps stale `prl-`
namespaces whose creating process is dead (a run killed with SIGKILL leaves them behind).

A cut link (`link(False)`) sets the switch end of the host's cable down: the host keeps its address
and sees NO-CARRIER, packets are dropped silently, so connections stall and time out as over a
pulled cable instead of failing fast. `tc netem` is not available on these kernels: rate shaping
only, no added latency or loss.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence

from inference_shim.procs import serve_argv, start_child, stop_process_tree

PREFIX = "prl"
DEFAULT_SUBNET = "10.231.0"  # private; exists only inside the namespaces a SimNet creates
HOST_IFNAME = "eth0"
_CLONE_NEWNET = 0x40000000
_HOST_NAME = re.compile(r"^[a-z0-9]{1,10}$")
_STALE_NS = re.compile(rf"^{PREFIX}-(\d+)-")
_seq = itertools.count()


class SimHostsError(RuntimeError):
    """An `ip`/`tc` command failed; the message has the command and its stderr."""


def _cmd(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise SimHostsError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def available() -> tuple[bool, str]:
    """Whether this machine can run a SimNet, and if not, why (for pytest.skip)."""
    if not os.uname().sysname == "Linux":
        return False, "simulated hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return False, "simulated hosts need root (network namespaces, veths, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        _cmd(["ip", "netns", "add", probe])
    except (SimHostsError, subprocess.TimeoutExpired) as e:
        return False, f"`ip netns add` does not work here: {e}"
    finally:
        _cmd(["ip", "netns", "del", probe], check=False)
    return True, "ok"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(netns: str) -> None:
    """SIGKILL every process inside netns, then delete it (its veths and bridge go with it)."""
    pids = _cmd(["ip", "netns", "pids", netns], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)
    _cmd(["ip", "netns", "del", netns], check=False)


def sweep_stale() -> list[str]:
    """Delete `prl-<pid>-...` namespaces whose creating process is gone; returns their names."""
    listed = _cmd(["ip", "netns", "list"], check=False).stdout.splitlines()
    stale = []
    for line in listed:
        name = line.split()[0] if line.strip() else ""
        found = _STALE_NS.match(name)
        if found and not _pid_alive(int(found.group(1))):
            _kill_namespace(name)
            stale.append(name)
    return stale


def _tbf_args(rate: str | float) -> list[str]:
    """tbf parameters for `rate` ("200mbit", "1gbit" or a number of Mbit/s)."""
    text = f"{rate}mbit" if isinstance(rate, int | float) else str(rate).strip().lower()
    found = re.fullmatch(r"([0-9.]+)\s*(k|m|g)bit", text)
    if not found:
        raise ValueError(f"rate {rate!r}: give Mbit/s as a number, or a string like '200mbit' or '1gbit'")
    bits = float(found.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[found.group(2)]
    # The bucket must hold a whole GSO super-packet (64 KiB) or tbf drops it, and ~4 ms of traffic so
    # the kernel timer granularity does not cap the rate.
    burst = max(128 * 1024, int(bits / 8 * 0.004))
    return ["tbf", "rate", f"{int(bits)}bit", "burst", str(burst), "latency", "50ms"]


class SimHost:
    """One simulated host: a namespace with address `address` on the SimNet's switch."""

    def __init__(self, net: SimNet, name: str, netns: str, address: str) -> None:
        self.net = net
        self.name = name
        self.netns = netns
        self.address = address
        self.peer = f"h-{name}"  # this host's cable end in the switch namespace

    def __repr__(self) -> str:
        return f"SimHost({self.name!r}, {self.address})"

    def env(self, base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
        """An environment for processes on this host: `base` (default: ours) + gloo on this host's link."""
        env = dict(os.environ if base is None else base)
        env["GLOO_SOCKET_IFNAME"] = HOST_IFNAME  # else gloo binds whatever the hostname resolves to
        env.update(extra)
        return env

    def run(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> subprocess.Popen:
        """Start argv inside this host; stopped (whole process group) when the SimNet closes.

        The child runs in its own session and gets SIGTERM if the calling thread exits (procs.start_child).
        env None: self.env(). log_path: stdout and stderr, truncated first.
        """
        # `ip` by its full path: Popen looks argv[0] up in the CHILD's PATH, which env may not have.
        ip = shutil.which("ip") or "ip"
        proc = start_child(
            [ip, "netns", "exec", self.netns, *argv],
            env=self.env() if env is None else env,
            log_path=log_path,
            cwd=cwd,
            append_log=False,
        )
        self.net._started.append(proc)
        return proc

    def start_server(
        self,
        model_dir: str | os.PathLike,
        port: int,
        *,
        token: str,
        api_key: str,
        log_path: str | os.PathLike,
        env: Mapping[str, str] | None = None,
        extra: Sequence[str] = (),
    ) -> tuple[str, subprocess.Popen]:
        """An inference server (`python -m inference_shim`) bound to this host's address; (url, process).

        A server on a non-loopback address must have a token (control routes) and an API key (/v1/*); they
        go in the environment, not argv. The caller waits for /health from a host (see entered()).
        """
        if not token or not api_key:
            raise ValueError("a server bound to a host address must be started with a token and an API key")
        child_env = self.env(env, PYTHONUNBUFFERED="1", PIPELINE_RL_TOKEN=token, PIPELINE_RL_API_KEY=api_key)
        proc = self.run(serve_argv(model_dir, port, host=self.address, extra=extra), child_env, log_path)
        return f"http://{self.address}:{port}", proc

    @contextlib.contextmanager
    def entered(self) -> Iterator[SimHost]:
        """Run the body with THIS THREAD inside the host's network (setns); restored on exit.

        Sockets opened in the body stay in this host's network after it; open no new connection to a
        simulated address outside such a block (it would go to the root namespace's routes).
        """
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{self.netns}", os.O_RDONLY)
        try:
            if libc.setns(target, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.netns} failed")
            try:
                yield self
            finally:
                if libc.setns(own, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back into the original namespace failed")
        finally:
            os.close(target)
            os.close(own)

    def link(self, up: bool) -> None:
        """Cut (up=False) or heal this host's cable; the host keeps its address and sockets."""
        _cmd(["ip", "-n", self.net.switch, "link", "set", self.peer, "up" if up else "down"])

    def shape(self, rate: str | float | None) -> None:
        """Limit both directions of this host's link to `rate` (tbf; "1gbit", "200mbit", Mbit/s); None: unlimited."""
        for netns, dev in ((self.netns, HOST_IFNAME), (self.net.switch, self.peer)):
            if rate is None:
                _cmd(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], check=False)
            else:
                _cmd(["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", *_tbf_args(rate)])


class SimNet:
    """Hosts on one switch; a context manager that always cleans up (see the module docstring)."""

    def __init__(
        self,
        hosts: Sequence[str] = ("a", "b"),
        *,
        subnet: str = DEFAULT_SUBNET,
        rate: str | float | None = None,
    ) -> None:
        ok, why = available()
        if not ok:
            raise SimHostsError(f"simulated hosts are not available: {why}")
        if len(set(hosts)) != len(hosts) or not all(_HOST_NAME.match(h) for h in hosts):
            raise ValueError(f"host names must be unique, 1-10 of [a-z0-9]: {list(hosts)}")
        if not 1 <= len(hosts) <= 250:
            raise ValueError("a SimNet has 1 to 250 hosts")
        sweep_stale()
        base = f"{PREFIX}-{os.getpid()}-{next(_seq)}"
        self.switch = f"{base}-sw"
        self.hosts = {
            name: SimHost(self, name, f"{base}-{name}", f"{subnet}.{i + 1}") for i, name in enumerate(hosts)
        }
        self._namespaces: list[str] = []
        self._started: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)
        try:
            self._build(rate)
        except BaseException:
            self.close()
            raise

    def _build(self, rate: str | float | None) -> None:
        self._add_namespace(self.switch)
        _cmd(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _cmd(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for host in self.hosts.values():
            self._add_namespace(host.netns)
            _cmd(["ip", "link", "add", HOST_IFNAME, "netns", host.netns, "type", "veth"]
                 + ["peer", "name", host.peer, "netns", self.switch])  # fmt: skip
            _cmd(["ip", "-n", self.switch, "link", "set", host.peer, "master", "br0", "up"])
            _cmd(["ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", HOST_IFNAME])
            _cmd(["ip", "-n", host.netns, "link", "set", HOST_IFNAME, "up"])
            _cmd(["ip", "-n", host.netns, "link", "set", "lo", "up"])
            if rate is not None:
                host.shape(rate)

    def _add_namespace(self, name: str) -> None:
        _cmd(["ip", "netns", "add", name])
        self._namespaces.append(name)

    def __getitem__(self, name: str) -> SimHost:
        return self.hosts[name]

    def __enter__(self) -> SimNet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def names(self) -> list[str]:
        """Every namespace this SimNet created (the switch first)."""
        return list(self._namespaces)

    def close(self) -> None:
        """Stop every process started here, then delete the namespaces. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            for proc in reversed(self._started):
                stop_process_tree(proc, grace_s=10.0)
        finally:
            for netns in reversed(self._namespaces):
                _kill_namespace(netns)
            atexit.unregister(self.close)


def measure_throughput(
    src: SimHost, dst: SimHost, megabytes: float = 50.0, timeout_s: float = 120.0
) -> float:
    """Raw TCP throughput src -> dst in bytes/s: one plain socket stream of `megabytes` MB.

    The receiver times from the first byte to EOF, so connection setup is not counted. A ceiling to
    compare weight broadcasts against (same link, no collective, no packing).
    """
    total = int(megabytes * 1e6)
    ready = threading.Event()
    port: list[int] = []
    result: dict[str, object] = {}

    def receive() -> None:
        try:
            with dst.entered(), socket.create_server((dst.address, 0)) as server:
                server.settimeout(timeout_s)
                port.append(server.getsockname()[1])
                ready.set()
                conn, _ = server.accept()
                with conn:
                    conn.settimeout(timeout_s)
                    buf = bytearray(1 << 20)
                    received, first = 0, None
                    while True:
                        n = conn.recv_into(buf)
                        if n == 0:
                            break
                        if first is None:
                            first = time.perf_counter()
                        received += n
                    result["bytes"] = received
                    result["seconds"] = time.perf_counter() - (first or time.perf_counter())
        except BaseException as e:  # handed to the caller's thread
            result["error"] = e
            ready.set()

    receiver = threading.Thread(target=receive, name="simhosts-sink", daemon=True)
    receiver.start()
    if not ready.wait(timeout_s) or "error" in result:
        raise SimHostsError(f"throughput receiver on {dst} failed: {result.get('error')}")

    def send() -> None:
        try:
            with src.entered(), socket.create_connection((dst.address, port[0]), timeout=timeout_s) as conn:
                chunk = b"\0" * (1 << 20)
                left = total
                while left > 0:
                    conn.sendall(chunk[: min(left, len(chunk))])
                    left -= min(left, len(chunk))
        except BaseException as e:
            result["error"] = e

    # The sender gets its own thread too: the caller's thread never changes namespace here.
    sender = threading.Thread(target=send, name="simhosts-source", daemon=True)
    sender.start()
    sender.join(timeout_s)
    receiver.join(timeout_s)
    if "error" in result or "seconds" not in result:
        raise SimHostsError(f"throughput {src} -> {dst} failed: {result.get('error', 'timed out')}")
    if result["bytes"] != total:
        raise SimHostsError(f"throughput {src} -> {dst}: received {result['bytes']} of {total} bytes")
    return float(result["bytes"]) / max(float(result["seconds"]), 1e-9)
