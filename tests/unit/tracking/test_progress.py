"""Progress where a user waits: a bar on a terminal (a real pty here), plain lines without a carriage
return or an escape code anywhere else."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from pipeline_rl.progress import LIBRARY_BARS_OFF, Progress, quiet_library_bars

REPO = Path(__file__).resolve().parents[3]


def test_off_a_terminal_it_writes_lines_every_n_and_a_last_one():
    out = io.StringIO()
    with Progress("warm-up", 10, every=4, stream=out) as bar:
        for i in range(10):
            bar.advance(note=f"loss {i}")
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "warm-up 4/10 loss 3",
        "warm-up 8/10 loss 7",
        "warm-up 10/10 loss 9",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_quiet_or_disabled_writes_nothing_off_a_terminal():
    out = io.StringIO()
    for kwargs in ({"quiet": True}, {"enabled": False}):
        with Progress("evaluation", 3, stream=out, **kwargs) as bar:
            bar.advance(3)
    assert out.getvalue() == ""


def _under_pty(argv: list[str], timeout_s: float = 120) -> str:
    """Run argv with stdout and stderr on a pseudo-terminal; everything it wrote."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal's size
    proc = subprocess.Popen(argv, stdout=follower, stderr=follower, stdin=subprocess.DEVNULL, cwd=REPO)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(leader)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    return b"".join(chunks).decode(errors="replace")


def test_the_warm_up_draws_bars_on_a_pty(tiny_model, tmp_path):
    """The demo's warm-up (what `make demo` runs first) on a terminal: its steps and its evaluation as
    bars. Off a terminal it writes plain lines: the Progress tests above, and the warm-up's own log
    lines, which benchmarks/tests read (`warm-up step 25/50`)."""
    argv = [sys.executable, "-m", "pipeline_rl.demo.warmup", "--base", str(tiny_model), "--steps", "4",
            "--batch-size", "2", "--eval-problems", "2", "--out", str(tmp_path / "warm")]  # fmt: skip
    on_tty = _under_pty(argv)
    redraws = re.findall(r"\r(?!\n)[^\r\n]*", on_tty)  # a carriage return that is not a line end: a bar
    assert any("warm-up" in r and "4/4" in r and "100%" in r for r in redraws), on_tty[-2000:]
    assert any("greedy answers" in r for r in redraws), on_tty[-2000:]


def test_the_launchers_children_get_the_libraries_bars_turned_off():
    env = quiet_library_bars({"PATH": "/bin"})
    assert env == {"PATH": "/bin", **LIBRARY_BARS_OFF}
