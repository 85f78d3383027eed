"""Stopping a child process together with everything it spawned (engine schedulers, workers).

Children are started in their own session (`start_new_session=True`), so their process group reaches
the whole tree: SIGTERM it, then SIGKILL whatever outlives the grace period. Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def stop_process_tree(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after grace_s."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
