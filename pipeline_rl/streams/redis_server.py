"""Start and stop a private redis-server on a free loopback port (tests, and the launcher).

    with RedisServer() as server:                 # 127.0.0.1, a free port, no persistence, temp dir
        cfg = StreamsConfig(redis_url=server.url)
        ...
    server = RedisServer(data_dir="runs/x/redis", persist=True).start()   # append-only file in data_dir
    server.stop(); server.start()                 # a restart keeps the port, so clients reconnect

The server binds 127.0.0.1 only and never a fixed port (the machine may be shared). start() waits for
PING with a deadline and raises with the tail of the server's log if it does not come up; stop() sends
SHUTDOWN and falls back to terminate/kill. With die_with_parent (Linux, the default) the kernel stops the server when the THREAD that called
start() exits (PR_SET_PDEATHSIG), so a crashed parent leaves no server behind on a shared machine: call
start() from the main thread or another thread that lives as long as the server should.
"""

from __future__ import annotations

import ctypes
import logging
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

logger = logging.getLogger("pipeline_rl.streams")

_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the caller must cope with losing a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client(port: int, timeout_s: float) -> redis.Redis:
    # No client-side retries: redis-py's default backoff would turn a refused PING or the connection
    # that SHUTDOWN closes into seconds of sleeping.
    return redis.Redis(
        host="127.0.0.1",
        port=port,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class RedisServer:
    """A redis-server child process. Not thread-safe; one owner starts and stops it."""

    def __init__(
        self,
        port: int | None = None,
        data_dir: str | Path | None = None,
        persist: bool = False,
        startup_timeout_s: float = 10.0,
        executable: str = "redis-server",
        die_with_parent: bool = True,
    ) -> None:
        if persist and data_dir is None:
            raise ValueError("RedisServer(persist=True) needs data_dir: where the append-only file lives")
        self.port = port
        self.persist = persist
        self.startup_timeout_s = startup_timeout_s
        self._executable = executable
        self._die_with_parent = die_with_parent and sys.platform.startswith("linux")
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._temp_dir: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("RedisServer has no port yet: call start() first")
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self._dir() / "redis.log"

    def _dir(self) -> Path:
        if self._data_dir is not None:
            self._data_dir.mkdir(parents=True, exist_ok=True)
            return self._data_dir
        if self._temp_dir is None:
            self._temp_dir = tempfile.mkdtemp(prefix="pipeline-rl-redis-")
        return Path(self._temp_dir)

    def _args(self, port: int) -> list[str]:
        args = [
            self._executable,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--protected-mode", "yes",
            "--daemonize", "no",
            "--dir", str(self._dir()),
            "--logfile", str(self.log_path),
            "--save", "",
        ]  # fmt: skip
        if self.persist:
            args += ["--appendonly", "yes", "--appendfsync", "everysec"]
        else:
            args += ["--appendonly", "no"]
        return args

    def start(self) -> RedisServer:
        """Start the server (no-op if running) and wait until it answers PING."""
        if self.running:
            return self
        if shutil.which(self._executable) is None:
            raise FileNotFoundError(
                f"{self._executable!r} not found on PATH: install it (apt-get install redis-server; "
                "scripts/setup.sh does) or point streams.redis_url at an existing server"
            )
        # A port picked by us may be taken between probing and binding: try a few fresh ones.
        attempts = 1 if self.port is not None else 3
        for attempt in range(attempts):
            port = self.port if self.port is not None else free_port()
            self._proc = subprocess.Popen(
                self._args(port),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=_die_with_parent if self._die_with_parent else None,
            )
            if self._wait_ready(port):
                self.port = port
                logger.info("streams: redis-server pid %d on %s", self._proc.pid, f"127.0.0.1:{port}")
                return self
            in_use = "Address already in use" in self._log_tail()
            self._kill()
            if not in_use or attempt == attempts - 1:
                raise RuntimeError(
                    f"redis-server did not answer PING on 127.0.0.1:{port} within {self.startup_timeout_s}s; "
                    f"its log ({self.log_path}) ends with:\n{self._log_tail()}"
                )
        raise AssertionError("unreachable")

    def _wait_ready(self, port: int) -> bool:
        deadline = time.monotonic() + self.startup_timeout_s
        client = _client(port, 1.0)
        try:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.ConnectionError:
                    pass
                except redis.ResponseError as err:  # LOADING: replaying the append-only file
                    if "LOADING" not in str(err):
                        raise
                time.sleep(0.02)
            return False
        finally:
            client.close()

    def _log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no log)"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SHUTDOWN (NOSAVE unless persisting) and wait; terminate/kill if it does not exit in time."""
        if self._proc is None:
            return
        if self._proc.poll() is None and self.port is not None:
            client = _client(self.port, 2.0)
            try:
                client.shutdown(nosave=not self.persist)
            except redis.RedisError as err:  # the server closes the socket as it exits; other errors too
                logger.debug("streams: redis SHUTDOWN: %s", err)
            finally:
                client.close()
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("streams: redis-server pid %d ignored SHUTDOWN; terminating", self._proc.pid)
        self._kill()

    def _kill(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)
        self._proc = None

    def cleanup(self) -> None:
        """Stop and remove the temporary directory (kept across stop/start so the port's log stays)."""
        self.stop()
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
