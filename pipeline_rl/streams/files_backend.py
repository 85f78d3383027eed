"""Files backend: each topic is a directory of JSONL segment files, for a machine without Redis.

Layout under `<files_dir>/<run_name>/<topic>/`:
    00000000000000000000.jsonl   segments, named by the global byte offset of their first byte
    .lock                        writers append under an exclusive flock of this file
    .written                     entries ever appended (total_written), updated under that lock
    .groups/<group>.json         consumer-group state: {"delivered": offset, "pending": {id: ...}}
    .groups/<group>.lock         group operations run under an exclusive flock of this file

An entry is one line of JSON. Its id is the global byte offset just past its newline, so ids grow with
every write, survive trimming, and "after position p" simply means "from byte p on". Readers only see
complete lines; a line torn by a crashed writer is closed by the next writer and then dead-lettered.

Consumer groups mirror Redis: reading moves `delivered` forward and records the entries as pending for
the consumer; ack removes them; a consumer's pending entries come back to it after a restart, and
others may claim them once idle. The state file is replaced atomically (write, fsync, rename) on every
change, so a crash leaves either the old or the new state.

Limits: several processes on ONE machine (flock; no network filesystems); trimming works per segment
(a segment goes once every entry in it is acknowledged by every group, and never the newest segment);
length() and backlog() count lines, so they cost a read of the retained data.
"""

from __future__ import annotations

import bisect
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline_rl.streams.base import RawEntry, StreamsUnavailable, TopicStore
from pipeline_rl.streams.config import StreamsConfig, check_topic

logger = logging.getLogger("pipeline_rl.streams")

_SUFFIX = ".jsonl"
_CHUNK = 1 << 20


@contextmanager
def _flock(path: Path, timeout_s: float) -> Iterator[None]:
    """Exclusive flock of `path`, waiting at most `timeout_s` (locks are held for milliseconds)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline, delay = time.monotonic() + timeout_s, 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StreamsUnavailable(
                        f"{path} stayed locked for {timeout_s:.1f}s (streams.retry_deadline_s): another process "
                        "holds it; look for a stopped or hung pipeline process on this machine (a dead one "
                        "releases its locks)"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _iter_lines(path: Path, pos: int) -> Iterator[tuple[int, int, bytes]]:
    """(start, end, payload) of each complete line of `path` from byte `pos` on (end is past the newline)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; a segment may vanish between list and open
    except FileNotFoundError:
        return
    with f:
        f.seek(pos)
        buf = b""
        buf_start = pos
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                return  # what is left in buf is a line still being written
            buf += chunk
            start = 0
            while (nl := buf.find(b"\n", start)) >= 0:
                yield buf_start + start, buf_start + nl + 1, buf[start:nl]
                start = nl + 1
            buf, buf_start = buf[start:], buf_start + start


class FilesTopicStore(TopicStore):
    """One topic as a directory of JSONL segments."""

    start_position = "0"
    max_block_s = float("inf")

    def __init__(self, cfg: StreamsConfig, topic: str) -> None:
        assert cfg.files_dir is not None  # StreamsConfig's validator guarantees it
        self.topic = check_topic(topic)
        self._cfg = cfg
        self._dir = Path(cfg.files_dir) / cfg.run_name / topic
        self._groups_dir = self._dir / ".groups"  # hidden: no topic part can be named like it
        self._groups_dir.mkdir(parents=True, exist_ok=True)
        self._lock_path = self._dir / ".lock"

    # -- codec --------------------------------------------------------------------------------------
    def encode(self, data: dict[str, Any]) -> bytes:
        # json.dumps escapes newlines inside strings, so one message is always one line.
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()

    def decode(self, payload: bytes) -> Any:
        return json.loads(payload)

    def open_sibling(self, topic: str) -> FilesTopicStore:
        return FilesTopicStore(self._cfg, topic)

    # -- segments -----------------------------------------------------------------------------------
    def _segments(self) -> list[int]:
        return sorted(int(p.name[: -len(_SUFFIX)]) for p in self._dir.glob("*" + _SUFFIX))

    def _path(self, start: int) -> Path:
        return self._dir / f"{start:020d}{_SUFFIX}"

    def _fsync_dir(self, path: Path) -> None:
        if self._cfg.files_fsync:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def append(self, payloads: Sequence[bytes]) -> list[str]:
        for p in payloads:
            if b"\n" in p:
                raise ValueError("a files-backend payload must not contain a newline")
        with _flock(self._lock_path, self._cfg.retry_deadline_s):
            written_before = self._load_written()
            segs = self._segments()
            start = segs[-1] if segs else 0
            path = self._path(start)
            size = path.stat().st_size if path.exists() else 0
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    # A writer died mid-line: close the line so it becomes one (malformed) entry.
                    os.write(fd, b"\n")
                    size += 1
                if size >= self._cfg.segment_bytes:
                    if self._cfg.files_fsync:
                        os.fsync(fd)
                    os.close(fd)
                    fd = -1
                    start, size = start + size, 0
                    path = self._path(start)
                    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                    self._fsync_dir(self._dir)
                data = memoryview(b"".join(p + b"\n" for p in payloads))
                while data:
                    data = data[os.write(fd, data) :]
                if self._cfg.files_fsync:
                    os.fsync(fd)
            finally:
                if fd >= 0:
                    os.close(fd)
            # After the data: a writer killed in between leaves the count short by its batch, never long.
            self._save_written(written_before + len(payloads))
        ids, end = [], start + size
        for p in payloads:
            end += len(p) + 1
            ids.append(str(end))
        return ids

    def _load_written(self) -> int:
        try:
            return int((self._dir / ".written").read_text())
        except FileNotFoundError:
            # A topic written before the counter existed: its retained entries are the best lower bound.
            return self._count_from(0)

    def _save_written(self, count: int) -> None:
        path = self._dir / ".written"
        tmp = path.with_name(f".written.tmp{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(str(count))
            if self._cfg.files_fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)

    def total_written(self) -> int:
        with _flock(self._lock_path, self._cfg.retry_deadline_s):
            return self._load_written()

    def _read_from(self, offset: int, count: int) -> list[tuple[str, int, bytes]]:
        """Up to `count` complete lines at or after global byte `offset`: (id, start offset, payload)."""
        segs = self._segments()
        if not segs:
            return []
        if offset < segs[0]:
            if offset > 0:
                logger.warning(
                    "streams: entries of %r before offset %d were trimmed; skipping them", self.topic, segs[0]
                )
            offset = segs[0]
        i = bisect.bisect_right(segs, offset) - 1
        out: list[tuple[str, int, bytes]] = []
        while i < len(segs) and len(out) < count:
            base = segs[i]
            for s, e, payload in _iter_lines(self._path(base), offset - base):
                out.append((str(base + e), base + s, payload))
                if len(out) >= count:
                    break
            i += 1
            if i < len(segs):
                offset = segs[i]
        return out

    def _read_at(self, start: int) -> bytes | None:
        segs = self._segments()
        i = bisect.bisect_right(segs, start) - 1
        if i < 0:
            return None
        for _, _, payload in _iter_lines(self._path(segs[i]), start - segs[i]):
            return payload
        return None

    def _poll(self, fn: Callable[[], list[RawEntry]], block_s: float) -> list[RawEntry]:
        deadline = time.monotonic() + block_s
        while True:
            got = fn()
            remaining = deadline - time.monotonic()
            if got or remaining <= 0:
                return got
            time.sleep(min(self._cfg.poll_interval_s, remaining))

    def read_after(self, position: str, count: int, block_s: float) -> list[RawEntry]:
        offset = int(position)
        return self._poll(lambda: [(i, p) for i, _, p in self._read_from(offset, count)], block_s)

    def latest(self, n: int) -> list[RawEntry]:
        out: list[RawEntry] = []
        for base in reversed(self._segments()):
            path = self._path(base)
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            window = 64 * 1024
            while True:
                # Read a growing window from the end until it holds n complete lines or the whole file.
                pos = max(0, size - window)
                with open(path, "rb") as f:
                    f.seek(pos)
                    data = f.read(size - pos)
                complete = data[: data.rfind(b"\n") + 1]
                lines = complete.split(b"\n")[:-1]
                if pos > 0:
                    lines = lines[1:]  # the first piece may be the tail of a longer line
                if len(lines) >= n - len(out) or pos == 0:
                    break
                window *= 4
            end = base + pos + len(complete)
            for line in reversed(lines):
                out.append((str(end), line))
                end -= len(line) + 1
                if len(out) >= n:
                    return out
        return out

    def _count_from(self, offset: int) -> int:
        segs = self._segments()
        total = 0
        for i, base in enumerate(segs):
            seg_end = segs[i + 1] if i + 1 < len(segs) else None
            if seg_end is not None and seg_end <= offset:
                continue
            total += sum(1 for _ in _iter_lines(self._path(base), max(0, offset - base)))
        return total

    def length(self) -> int:
        return self._count_from(0)

    def trim(self, keep_last: int) -> int:
        with _flock(self._lock_path, self._cfg.retry_deadline_s):
            states = [self._load(p) for p in self._groups_dir.glob("*.json")]
            if not states:
                return 0
            # A segment may go when it ends at or before every group's boundary: all of it delivered,
            # and no pending entry (whose id is its end offset) inside it.
            bound = min(min([s["delivered"]] + [int(i) - 1 for i in s["pending"]]) for s in states)
            segs = self._segments()
            if keep_last > 0:
                kept = 0
                for base in reversed(segs):
                    kept += sum(1 for _ in _iter_lines(self._path(base), 0))
                    if kept >= keep_last:
                        bound = min(bound, base)
                        break
                else:
                    return 0
            removed = 0
            for i in range(len(segs) - 1):  # never the newest segment: writers append there
                if segs[i + 1] > bound:
                    break
                path = self._path(segs[i])
                removed += sum(1 for _ in _iter_lines(path, 0))
                path.unlink()
            if removed:
                self._fsync_dir(self._dir)
            return removed

    # -- consumer groups ----------------------------------------------------------------------------
    def _state_path(self, group: str) -> Path:
        return self._groups_dir / f"{group}.json"

    @contextmanager
    def _group(self, group: str) -> Iterator[dict[str, Any]]:
        """Load the group's state under its lock; saving is explicit (only changed state is written)."""
        with _flock(self._groups_dir / f"{group}.lock", self._cfg.retry_deadline_s):
            yield self._load(self._state_path(group))

    @staticmethod
    def _load(path: Path) -> dict[str, Any]:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return {"delivered": 0, "pending": {}}

    def _save(self, group: str, state: dict[str, Any]) -> None:
        path = self._state_path(group)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(state, f)
            if self._cfg.files_fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        self._fsync_dir(self._groups_dir)

    def group_ensure(self, group: str) -> None:
        with self._group(group) as state:
            if not self._state_path(group).exists():
                self._save(group, state)

    def group_read_new(self, group: str, consumer: str, count: int, block_s: float) -> list[RawEntry]:
        def attempt() -> list[RawEntry]:
            with self._group(group) as state:
                lines = self._read_from(state["delivered"], count)
                if not lines:
                    return []
                now = time.time()
                for entry_id, start, _ in lines:
                    state["pending"][entry_id] = {
                        "start": start,
                        "consumer": consumer,
                        "time": now,
                        "count": 1,
                    }
                state["delivered"] = int(lines[-1][0])
                self._save(group, state)
            return [(i, p) for i, _, p in lines]

        return self._poll(attempt, block_s)

    def _payloads(self, state: dict[str, Any], ids: list[str]) -> list[RawEntry]:
        return [(i, self._read_at(state["pending"][i]["start"])) for i in ids]

    def group_read_own_pending(self, group: str, consumer: str, after: str, count: int) -> list[RawEntry]:
        with self._group(group) as state:
            mine = sorted(
                (
                    int(i)
                    for i, p in state["pending"].items()
                    if p["consumer"] == consumer and int(i) > int(after)
                )
            )
            return self._payloads(state, [str(i) for i in mine[:count]])

    def group_claim_idle(self, group: str, consumer: str, min_idle_s: float, count: int) -> list[RawEntry]:
        with self._group(group) as state:
            now = time.time()
            idle = sorted(
                int(i)
                for i, p in state["pending"].items()
                if p["consumer"] != consumer and now - p["time"] >= min_idle_s
            )
            ids = [str(i) for i in idle[:count]]
            if not ids:
                return []
            for i in ids:
                p = state["pending"][i]
                p.update(consumer=consumer, time=now, count=p["count"] + 1)
            self._save(group, state)
            return self._payloads(state, ids)

    def group_ack(self, group: str, ids: Sequence[str]) -> int:
        with self._group(group) as state:
            acked = sum(1 for i in ids if state["pending"].pop(i, None) is not None)
            if acked:
                self._save(group, state)
            return acked

    def group_set_position(self, group: str, position: str) -> None:
        with self._group(group) as state:
            state["delivered"] = int(position)
            self._save(group, state)

    def group_pending(self, group: str) -> dict[str, int]:
        with self._group(group) as state:
            counts: dict[str, int] = {}
            for p in state["pending"].values():
                counts[p["consumer"]] = counts.get(p["consumer"], 0) + 1
            return counts

    def unacked(self, group: str) -> list[RawEntry]:
        state = self._load(self._state_path(group))
        out = [(i, payload) for i, p in state["pending"].items() if (payload := self._read_at(p["start"]))]
        offset = state["delivered"]
        while True:
            page = self._read_from(offset, 1000)
            out += [(i, payload) for i, _, payload in page]
            if len(page) < 1000:
                return out
            offset = int(page[-1][0])

    def backlog(self, group: str) -> int:
        if not self._state_path(group).exists():
            return self.length()
        with self._group(group) as state:
            return len(state["pending"]) + self._count_from(state["delivered"])
