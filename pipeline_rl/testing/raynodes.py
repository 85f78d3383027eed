"""A real multi-node Ray cluster on one machine: one `ray start` per simulated host (simhosts.py).

    with SimNet(["a", "b", "c"]) as net, RayNodes(net, {"a": 1, "b": 2, "c": 1}, workdir) as ray_nodes:
        ray_nodes.start()                         # head on the first host, workers on the others
        proc = net["a"].run(argv, env=ray_nodes.env("a"))   # a Ray client (driver, `ray job submit`)
        ray_nodes.lose("c")                       # link cut, then every process of c killed (-9)
        ray_nodes.rejoin("c")                     # link back, `ray start` again with c's address

Every node runs with Ray's token authentication (RAY_AUTH_MODE=token, the token in a 0600 file named
by RAY_AUTH_TOKEN_PATH), its own --temp-dir (sessions, sockets, logs), a capped object store, logical
CPUs (`cpus`: the slots the launcher places trainer ranks and servers on), and its cluster address as
--node-ip-address; the dashboard (and with it the Jobs API) runs on the head only, on its cluster
address. close() stops every process inside the nodes' namespaces (SIGTERM, then SIGKILL), never `ray stop`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline_rl.testing.simhosts import SimNet

RAY_PORT = 6379
DASHBOARD_PORT = 8265
OBJECT_STORE_BYTES = 100 * 1024 * 1024  # Ray's minimum is about 75 MB; its default is 30% of RAM per node
START_TIMEOUT_S = 120.0


class RayNodesError(RuntimeError):
    pass


class RayNodes:
    def __init__(self, net: SimNet, cpus: dict[str, int], workdir: str | os.PathLike) -> None:
        self.net = net
        self.cpus = cpus  # host name -> logical CPUs; the first host is the head
        self.head = next(iter(cpus))
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token_path = self.workdir / "ray-token"
        self.token_path.write_text(secrets.token_hex(32))
        self.token_path.chmod(0o600)
        self.ray = str(Path(sys.executable).with_name("ray"))
        # Unix socket paths must stay under ~107 bytes: short directories of their own under /tmp.
        self.temp_dirs = {name: Path(f"/tmp/prlray-{os.getpid()}-{name}") for name in cpus}

    @property
    def address(self) -> str:
        return f"{self.net[self.head].address}:{RAY_PORT}"

    @property
    def dashboard(self) -> str:
        return f"http://{self.net[self.head].address}:{DASHBOARD_PORT}"

    def env(self, name: str, **extra: str) -> dict[str, str]:
        """The environment of a Ray process or client on host `name`: Ray's token auth on."""
        return self.net[name].env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path), **extra)

    def _start_node(self, name: str) -> None:
        host = self.net[name]
        argv = [self.ray, "start", "--node-ip-address", host.address, "--temp-dir", str(self.temp_dirs[name])]
        argv += ["--num-cpus", str(self.cpus[name]), "--object-store-memory", str(OBJECT_STORE_BYTES)]
        argv += ["--disable-usage-stats"]
        if name == self.head:
            argv += ["--head", "--port", str(RAY_PORT), "--dashboard-host", host.address]
            argv += ["--dashboard-port", str(DASHBOARD_PORT)]
        else:
            argv += ["--address", self.address]
        log = self.workdir / f"ray-start-{name}.log"
        proc = host.run(argv, env=self.env(name), log_path=log)
        try:
            code = proc.wait(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        if code != 0:
            raise RayNodesError(f"`ray start` on {name} failed ({code}):\n{log.read_text()[-3000:]}")

    def start(self) -> None:
        for name in self.cpus:
            self._start_node(name)
        self.wait_nodes(len(self.cpus))

    def alive_nodes(self) -> int:
        code = (
            "import ray; ray.init(address='auto', logging_level='ERROR'); "
            "print(sum(1 for n in ray.nodes() if n['Alive']))"
        )
        proc = self.net[self.head].run(
            [sys.executable, "-c", code],
            env=self.env(self.head, RAY_ADDRESS=self.address),
            log_path=self.workdir / "ray-nodes.log",
        )
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            return -1
        lines = (self.workdir / "ray-nodes.log").read_text().split()
        return int(lines[-1]) if lines and lines[-1].isdigit() else -1

    def wait_nodes(self, count: int, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while (seen := self.alive_nodes()) != count:
            if time.monotonic() > deadline:
                raise RayNodesError(f"the Ray cluster shows {seen} live node(s), not {count}")
            time.sleep(1.0)

    def _signal_all(self, name: str, signum: int) -> int:
        """Send signum to every process inside host `name`'s namespace; how many there were."""
        netns = self.net[name].netns
        pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30)
        found = pids.stdout.split()
        for pid in found:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signum)
        return len(found)

    def lose(self, name: str) -> None:
        """The node is gone: its link cut, its raylet and every process on it killed."""
        self.net[name].link(False)
        self._signal_all(name, signal.SIGKILL)

    def rejoin(self, name: str) -> None:
        """The node is back: link up, `ray start` with its own address again (a new node id)."""
        self.net[name].link(True)
        self._start_node(name)

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop each node's processes, workers first. Not `ray stop`: it stops every Ray process the
        caller can signal on the machine, other clusters' included (the hosts share one PID space)."""
        for name in reversed(list(self.cpus)):
            self._signal_all(name, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(self._signal_all(name, 0) for name in self.cpus) and time.monotonic() < deadline:
            time.sleep(0.5)
        for name in self.cpus:
            self._signal_all(name, signal.SIGKILL)
        for name, path in self.temp_dirs.items():  # the job drivers' logs outlive the temp dirs
            for log in path.glob("session_latest/logs/job-driver-*.log"):
                shutil.copy(log, self.workdir / f"{name}-{log.name}")
            shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> RayNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
