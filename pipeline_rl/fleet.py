"""The servers of a running job: <run_dir>/fleet.json, which the launcher writes and the trainer and the
actors re-read, so a server can be added to or removed from a running job.

    write_fleet(run_dir, urls)                 # the launcher: at start, and on POST /servers
    watch = FleetWatch(run_dir, cfg.inference.urls)
    urls = watch.poll()                        # the new list when the file changed since the last poll, else None

`pipeline-rl fleet add|remove|list` (or curl against the launcher's `POST /servers`) changes it. The
trainer re-forms its weight group with the new list at a step boundary (an added server is admitted like
one coming back: it leaves any stale group and gets the current weights with the next push; a removed one
leaves the group); the actors route to added servers once the trainer's version events name them, and stop
sending to removed ones. Without the file (a run not started by the launcher) the config's list holds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FLEET_FILE = "fleet.json"

# Set by the launcher on the trainer it starts together with the servers: until this time (epoch
# seconds) the trainer waits for each server to be healthy before it forms the weight group. A trainer
# restarted later gets none and joins at once, leaving a server that is down out until it answers.
SERVERS_STARTING_UNTIL_ENV = "PIPELINE_RL_SERVERS_STARTING_UNTIL"


def fleet_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / FLEET_FILE


def write_fleet(run_dir: str | Path, urls: list[str]) -> None:
    """Replace the list atomically (readers never see half a file)."""
    path = fleet_path(run_dir)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"urls": [u.rstrip("/") for u in urls]}, indent=2) + "\n")
    os.replace(tmp, path)


def read_fleet(run_dir: str | Path) -> list[str] | None:
    """The list in the file, or None without a (readable) file."""
    try:
        urls = json.loads(fleet_path(run_dir).read_text())["urls"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return [str(u).rstrip("/") for u in urls] if isinstance(urls, list) else None


class FleetWatch:
    """Re-reads fleet.json when its modification time changes."""

    def __init__(self, run_dir: str | Path, initial: list[str]) -> None:
        self.path = fleet_path(run_dir)
        self.urls = [u.rstrip("/") for u in initial]
        self._stamp: int | None = None

    def poll(self) -> list[str] | None:
        """The new list if the file changed to a different one since the last poll, else None."""
        try:
            stamp = self.path.stat().st_mtime_ns
        except OSError:
            return None
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        urls = read_fleet(self.path.parent)
        if urls is None or urls == self.urls:
            return None
        self.urls = urls
        return urls
