"""Named fault points, for chaos tests and recovery benchmarks: a process kills itself at a chosen point.

    fault_point("checkpoint.write")        # in the code: nothing happens unless a fault names this point

    PIPELINE_RL_FAULTS="checkpoint.write@2,sender.broadcast@5" PIPELINE_RL_FAULTS_DIR=/tmp/run/faults

A fault `POINT@N` SIGKILLs the process the N-th time it reaches POINT (N defaults to 1). Each fault fires
once per $PIPELINE_RL_FAULTS_DIR (a marker file, created atomically, claims it), so a restarted process,
or the second server of a run, does not fire it again. Off (the variable unset or empty), fault_point
is one dictionary lookup on an empty dict. Points in the code:

    sender.broadcast   trainer rank 0, a bucket of a weight push on the wire (the servers are mid-receive)
    checkpoint.write   trainer rank 0, a checkpoint's files written but not yet published
    server.received    inference server, an update received but not yet applied
    actor.carried      actor (partial rollouts), a round's group carried or written, its old entry not acked
    stage.written      a user stage's worker, a group written to its output, its input entry not acked
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

ENV = "PIPELINE_RL_FAULTS"
DIR_ENV = "PIPELINE_RL_FAULTS_DIR"


def parse(spec: str) -> dict[str, int]:
    """'a@2,b' -> {'a': 2, 'b': 1}; raises ValueError naming a bad entry."""
    faults: dict[str, int] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        point, _, nth = entry.partition("@")
        if not point or (nth and not nth.isdigit()) or nth == "0":
            raise ValueError(f"{ENV}: bad fault {entry!r}: use POINT or POINT@N with N >= 1")
        faults[point] = int(nth or 1)
    return faults


_FAULTS = parse(os.environ.get(ENV, ""))
_HITS: Counter[str] = Counter()


def fault_point(name: str) -> None:
    """SIGKILL this process if a fault names this point and this is its N-th hit (see module docstring)."""
    nth = _FAULTS.get(name)
    if nth is None:
        return
    _HITS[name] += 1
    if _HITS[name] != nth or not _claim(name):
        return
    print(f"fault injected at {name} (hit {nth}): SIGKILL pid {os.getpid()}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _claim(name: str) -> bool:
    directory = os.environ.get(DIR_ENV)
    if not directory:
        return True  # no marker directory: every process fires its own faults
    Path(directory).mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(Path(directory) / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except FileExistsError:
        return False


def fired(directory: str | os.PathLike) -> list[str]:
    """The faults claimed in `directory` (for the test or benchmark that set them)."""
    path = Path(directory)
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else []
