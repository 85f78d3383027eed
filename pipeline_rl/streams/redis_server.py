"""Start and stop a private redis-server on a free loopback port (tests, and the launcher).

    with RedisServer() as server:                 # 127.0.0.1, a free port, a password, no persistence
        cfg = StreamsConfig(redis_url=server.url)  # redis://:PASSWORD@127.0.0.1:PORT/0
        ...
    server = RedisServer(data_dir="runs/x/redis", persist=True).start()   # append-only file in data_dir
    server.stop(); server.start()                 # a restart keeps the port and password: clients reconnect

The server binds 127.0.0.1 only (or `host`) and never a fixed port (the machine may be shared), and it
requires a password (generated unless given): any local user can reach a loopback port. The password
reaches redis-server through its config file (mode 0600, in a 0700 directory), never through argv,
which every user can read in /proc. `url` carries it; print `safe_url`. start() waits for
PING with a deadline and raises with the tail of the server's log if it does not come up; stop() sends
SHUTDOWN and falls back to SIGTERM/SIGKILL. The process mechanics are inference_shim.procs: with
die_with_parent (Linux, the default) the kernel stops the server when the THREAD that called start()
exits (PR_SET_PDEATHSIG), so a crashed parent leaves no server behind on a shared machine: call start()
from the main thread or another thread that lives as long as the server should.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from inference_shim.procs import free_port, log_tail, start_child, stop_process_tree
from pipeline_rl.streams.config import redact_url

logger = logging.getLogger("pipeline_rl.streams")


def _client(host: str, port: int, password: str, timeout_s: float) -> redis.Redis:
    # No client-side retries: redis-py's default backoff would turn a refused PING or the connection
    # that SHUTDOWN closes into seconds of sleeping.
    return redis.Redis(
        host=host,
        port=port,
        password=password,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


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
        host: str = "127.0.0.1",
        password: str | None = None,
    ) -> None:
        if persist and data_dir is None:
            raise ValueError("RedisServer(persist=True) needs data_dir: where the append-only file lives")
        self.port = port
        self.host = host
        # Hex: safe in a URL and in redis.conf without quoting.
        self.password = password or secrets.token_hex(24)
        self.persist = persist
        self.startup_timeout_s = startup_timeout_s
        self._executable = executable
        self._die_with_parent = die_with_parent
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._temp_dir: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("RedisServer has no port yet: call start() first")
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    @property
    def safe_url(self) -> str:
        """`url` without the password, for messages and logs."""
        return redact_url(self.url)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The redis-server process's pid (None before it started): what a fault test kills."""
        return None if self._proc is None else self._proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit status of a server that died (negative: killed by that signal); None while it runs
        or before it started."""
        return None if self._proc is None else self._proc.poll()

    @property
    def log_path(self) -> Path:
        return self._dir() / "redis.log"

    def _dir(self) -> Path:
        if self._data_dir is not None:
            # 0700: it holds the password (redis.conf) and the streams' data (the append-only file).
            self._data_dir.mkdir(parents=True, exist_ok=True)
            self._data_dir.chmod(0o700)
            return self._data_dir
        if self._temp_dir is None:
            self._temp_dir = tempfile.mkdtemp(prefix="pipeline-rl-redis-")
        return Path(self._temp_dir)

    def _args(self, port: int) -> list[str]:
        """Write redis.conf (0600; it holds the password) and return the argv that names it."""
        settings = {
            "port": str(port),
            "bind": self.host,
            "protected-mode": "yes",
            "requirepass": self.password,
            "daemonize": "no",
            "dir": f'"{self._dir()}"',
            "logfile": f'"{self.log_path}"',
            "save": '""',
            "appendonly": "yes" if self.persist else "no",
        }
        if self.persist:
            # everysec, not always. The fault to survive is a kill of redis-server itself (the launcher
            # restarts it), and for that fsync does not matter: Redis write()s the append-only buffer
            # before it sends the replies of that event-loop turn, so an acknowledged write is already in
            # the kernel (the one exception: while a background fsync stalls over 2 s on a saturated
            # disk, everysec postpones the write). fsync adds only the host crash, which takes the whole
            # run down anyway; `always` would pay an fsync per turn on the disk the checkpoints use.
            settings["appendfsync"] = "everysec"
        conf = self._dir() / "redis.conf"
        write_private(conf, "".join(f"{key} {value}\n" for key, value in settings.items()))
        return [self._executable, str(conf)]

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
            port = self.port if self.port is not None else free_port(self.host)
            # Its own log is --logfile; anything printed before that is parsed is dropped.
            self._proc = start_child(
                self._args(port), log_path=os.devnull, die_with_parent=self._die_with_parent
            )
            if self._wait_ready(port):
                self.port = port
                logger.info("streams: redis-server pid %d on %s", self._proc.pid, f"{self.host}:{port}")
                return self
            in_use = "Address already in use" in log_tail(self.log_path)
            self._kill()
            if not in_use or attempt == attempts - 1:
                raise RuntimeError(
                    f"redis-server did not answer PING on {self.host}:{port} within {self.startup_timeout_s}s; "
                    f"its log ({self.log_path}) ends with:\n{log_tail(self.log_path)}"
                )
        raise AssertionError("unreachable")

    def _wait_ready(self, port: int) -> bool:
        deadline = time.monotonic() + self.startup_timeout_s
        client = _client(self.host, port, self.password, 1.0)
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

    def stop(self, timeout_s: float = 10.0) -> None:
        """SHUTDOWN (NOSAVE unless persisting) and wait; terminate/kill if it does not exit in time."""
        if self._proc is None:
            return
        if self._proc.poll() is None and self.port is not None:
            client = _client(self.host, self.port, self.password, 2.0)
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
        stop_process_tree(self._proc, grace_s=5)
        self._proc = None

    def discard_persisted(self) -> None:
        """Delete the append-only data a previous server left in data_dir (call before start()): a new
        launch starts from empty streams, while a restart within the launch replays them."""
        if self.running:
            raise RuntimeError("discard_persisted() while the server runs")
        if self._data_dir is not None:
            shutil.rmtree(self._data_dir / "appendonlydir", ignore_errors=True)  # Redis 7
            (self._data_dir / "appendonly.aof").unlink(missing_ok=True)  # Redis 6 and older

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


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner only (0600), also when the file already exists.

    The file is created 0600 (no moment with the umask's mode) and re-chmodded when it existed.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
