"""Child processes: the one home of picking a port, starting a child, waiting for its /health, reading
its log and stopping it with everything it spawned. Torch-free; used by the launcher, the benchmarks,
the tests and the backends that run an engine as a child process.

    port = free_port()
    env = {**os.environ, "PIPELINE_RL_TOKEN": token, **own_core(0)}          # server 0 on a core of its own
    proc = start_child(serve_argv(model_dir, port), env=env, log_path=log)   # own session, dies with us
    wait_healthy(f"http://127.0.0.1:{port}", 300, proc, log)                # raises with the log's tail
    ...
    stop_process_tree(proc)                                                 # SIGTERM group, then SIGKILL

Every child runs in its own session, so its process group reaches the whole tree (API process, engine
scheduler, workers) and a stop leaves no orphan. With die_with_parent (Linux) the kernel also signals the
child when the THREAD that started it exits, so a parent killed with SIGKILL leaves nothing behind on a
shared machine: start long-lived children from the main thread (or a thread that lives as long).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

# Bind addresses no other machine can reach: a server on one of them may run without token or API key.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    # Resolved once in the parent: the pre-exec hook must not import or load libraries after fork.
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None


_prctl = _load_prctl()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on host that was free a moment ago, drawn below the kernel's ephemeral range.

    Between this call and the bind of whoever uses the port (a launched server binds seconds later),
    any outgoing connection or bind(0) of the machine may take a port from the ephemeral range; below
    it only another free_port() caller can, and then only by drawing the same random port. The caller
    must still cope with losing that race. bind(0) where the range leaves no room below it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    for _ in range(64):
        port = _DRAW.randint(EXPLICIT_PORTS_FROM, low - 1) if low > EXPLICIT_PORTS_FROM + 1000 else 0
        if port in _HANDED_OUT:
            # One launcher draws a port per server and one for the trainer before any of them binds:
            # a second draw of the same number would pass the bind test below and collide later.
            continue
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = s.getsockname()[1]
        _HANDED_OUT.add(port)
        return port
    raise OSError(f"no free TCP port on {host} between {EXPLICIT_PORTS_FROM} and {low - 1}")


EXPLICIT_PORTS_FROM = 10000  # free_port() draws from here up to the ephemeral range
_DRAW = random.SystemRandom()  # never seeded: two processes that seeded `random` alike draw apart
_HANDED_OUT: set[int] = set()  # every port this process has returned; never returned twice


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def reserve_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port but not yet listening: from now on the kernel gives this port
    to no other bind(0) (free_port) and to no outgoing connection's local port, while a client that
    connects is still refused until a server listens on it.

    A server that binds only once its engine is up (uvicorn binds after the app's startup, ~20 s for
    vLLM) leaves the port its launcher picked with free_port() to whichever process needs a port
    meanwhile (seen once in a benchmark: "address already in use" after the engine had loaded);
    reserving it first shrinks that race to the server's own start. SO_REUSEADDR, as uvicorn sets it,
    so a restart on the same port is not refused for the old connections' TIME_WAIT.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve_argv(
    model: str | os.PathLike,
    port: int,
    host: str = "127.0.0.1",
    backend: str = "vllm",
    extra: Sequence[str] = (),
) -> list[str]:
    """argv of an inference server (`python -m inference_shim`) on model, listening on host:port.

    The control-route token is not an argument: pass it as PIPELINE_RL_TOKEN in the child's environment
    (the server reads it from there), so it never shows up in `ps` or in a command file's argv.
    """
    argv = [sys.executable, "-m", "inference_shim", "--model", str(model), "--port", str(port)]
    return [*argv, "--host", host, "--backend", backend, *extra]


def own_core(index: int) -> dict[str, str]:
    """Environment that binds server `index`'s vLLM-CPU worker to a core of its own (round robin).

    vLLM's automatic binding puts every server's worker on the same core, where one starves the other
    (docs/decisions.md, "Each server on its own core").
    """
    cores = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cores[index % len(cores)])}


def start_child(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    log_path: str | os.PathLike | None = None,
    cwd: str | os.PathLike | None = None,
    die_with_parent: bool = True,
    *,
    append_log: bool = True,
    death_signal: int = signal.SIGTERM,
) -> subprocess.Popen:
    """Start argv in its own session; stop it with stop_process_tree.

    env: the child's whole environment (None: inherit ours). log_path: stdout and stderr go there
    (appended unless append_log=False; None: inherit ours). die_with_parent: on Linux the kernel sends
    death_signal to the child when the calling thread exits (PR_SET_PDEATHSIG; it survives exec).
    """
    preexec = None
    if die_with_parent and _prctl is not None:
        prctl = _prctl

        def preexec() -> None:  # runs in the child between fork and exec: nothing but the syscall
            prctl(_PR_SET_PDEATHSIG, death_signal)

    log = None
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab" if append_log else "wb")  # noqa: SIM115 - the child holds its own copy
    try:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT if log is not None else None,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=preexec,
        )
    finally:
        if log is not None:
            log.close()


def log_tail(path: str | os.PathLike | None, lines: int = 40) -> str:
    """The last lines of a log file, or "(no log)" when there is none to read."""
    if path is None:
        return "(no log)"
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def last_error_line(path: str | os.PathLike | None, since: int = 0) -> str | None:
    """The last line our logging wrote at ERROR level ("<name> ERROR <message>") in a log file after byte
    `since`: a child's own reason for failing, which tracebacks of its wrappers (accelerate, torchrun)
    may follow for pages. `since` skips what earlier starts of the child appended to the same log."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(since)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    return next((line.strip() for line in reversed(lines) if " ERROR " in line), None)


def wait_healthy(
    url: str,
    deadline_s: float,
    proc: subprocess.Popen | None = None,
    log_path: str | os.PathLike | None = None,
    path: str = "/health",
    awaiting_ok: bool = False,
) -> None:
    """Poll GET url+path until it answers 200 (or, awaiting_ok, 503 awaiting_weights: a server started
    with --await-weights is up and waits for the trainer's push, which may be what the caller precedes).

    Raises RuntimeError as soon as proc (if given) has exited, TimeoutError after deadline_s; both
    messages carry the tail of log_path when one is given.
    """
    deadline = time.monotonic() + deadline_s
    tail = (lambda: f"; log {log_path}:\n{log_tail(log_path)}") if log_path is not None else (lambda: "")
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with code {proc.returncode} during startup{tail()}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            answer = httpx.get(url + path, timeout=2.0)
            if answer.status_code == 200:
                return
            if (
                awaiting_ok
                and answer.status_code == 503
                and answer.json().get("status") == "awaiting_weights"
            ):
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy after {deadline_s:.0f}s{tail()}")
        time.sleep(0.5)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send sig to proc's process group (the whole tree of a child started by start_child)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def stop_process_tree(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after grace_s.

    The group is killed even when the leader has already exited: an engine's workers may outlive it.
    """
    if proc.poll() is None:
        signal_group(proc, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    signal_group(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
