"""Trackers of a user's own, given by reference (`tracking.sinks=[support.sinks:exploding]`) in tests."""

from __future__ import annotations

from pathlib import Path


class Exploding:
    """A sink that raises on every call."""

    name = "exploding"

    def __getattr__(self, method: str):
        def fail(*args, **kwargs):
            raise RuntimeError(f"the tracking service is down ({method})")

        return fail


def exploding(cfg, run_dir: Path) -> Exploding:
    return Exploding()


class Recording:
    """A sink that keeps every call, for the hub's unit tests."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def open(self, run) -> None:
        self.calls.append(("open", run))

    def scalars(self, values, step, wall_time) -> None:
        self.calls.append(("scalars", dict(values), step, wall_time))

    def table(self, key, columns, rows, step) -> None:
        self.calls.append(("table", key, list(columns), [list(r) for r in rows], step))

    def finish(self, summary, images) -> None:
        self.calls.append(("finish", summary, list(images)))

    def close(self) -> None:
        self.calls.append(("close",))

    def of(self, kind: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == kind]


def recording(cfg, run_dir: Path) -> Recording:
    return Recording()
