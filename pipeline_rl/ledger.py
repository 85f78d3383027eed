"""The sample ledger: what happened to every generated sample of a run, kept in the run directory.

    from pipeline_rl.ledger import ledger_summary
    print("\\n".join(ledger_summary("runs/x").lines()))        # what `pipeline-rl report` shows

Every sample has a run-unique id (`<actor>-<incarnation>:<prompt_index>/<i>`, see docs/actor.md).
Each process that creates, trains or drops samples appends one JSON line per event to its OWN file
under <run_dir>/ledger/ (no two processes share a file, except the trainer's across its restarts,
which never overlap in time):

    actor<i>-<incarnation>.jsonl  {"event": "generated", "group": G, "ids": [...]}   before the stream write
                                  {"event": "carried", "group": G, "ids": [...]}   partial rollouts: a
                                  round cut these answers; written before the `carried` stream write
    prep<i>-<boot>.jsonl          {"event": "dropped", "reason": R, "group": G, "ids": [...]}   before the ack
    <stage><i>-<boot>.jsonl       the same, from a worker of a user stage of the graph (docs/graph.md)
    trainer.jsonl                 {"event": "trained", "step": S, "ids": [...]}
                                  {"event": "dropped", "reason": "too_stale", "step": S, "ids": [...]}
                                  {"event": "resume", "step": S}   written at every trainer start

Why these write points. Each line is written BEFORE the action it records becomes visible downstream
(write-ahead): a kill -9 between the two can only leave a line for something that then never happened
(a generated group that never reached the stream shows as in flight; a drop redone after a restart is
the same id with the same reason, and ids are counted as sets), never an action with no line.
The trainer's lines carry the step that trained them; a resumed trainer re-trains the steps after its
checkpoint, so its "resume" line voids every earlier line of a later step (append-only: nothing is
rewritten, the reader applies the rewind).

Durability: one os.write per line on an O_APPEND descriptor, so a line is in the kernel once append()
returns and survives kill -9 of the writer (not a power loss: no fsync, the checkpoint and the streams
are the durable state; the ledger is the audit). A writer killed inside a write leaves a torn last line;
the next writer of that file first ends it with a newline, and the reader skips unparsable lines and
counts them (`unreadable_lines`).

Positive accounting. `generated - trained - dropped` alone cannot tell a sample that waits from one that
vanished, so every other sample must be LOCATED, by id:
    locations.json   written by the launcher at a clean stop, before Redis stops (launch/locations.py):
                     {"complete": true, "places": {"<place>": [ids]}, "unknown": [what it could not read]}
                     places: a stream's entries not yet acknowledged by its consumers (rollouts: pending
                     or undelivered), a trainer rank's partition after its checkpointed position, a
                     rank's checkpointed read-but-untrained packages;
    {"event": "held", "place": P, "ids": [...]}   in any role's own file: where that role's samples
                     wait (the newest "held" line of a file and place replaces the earlier ones; an empty
                     list clears it) — the way a role adds a place of its own;
    exits.jsonl      the launcher's record of every process exit that was not a clean one
                     ({"name", "pid", "code"}), with each actor file's {"event": "start", "pid"} line:
                     the last "generated" group of an incarnation that exited so may never have reached
                     the stream (the write-ahead above) and is ABANDONED, not lost.
Anything else is LOST, named by id. Without a locations.json (the run crashed, or was interrupted)
the located and lost counts are not established, and the report says so.

Carried samples (sync partial rollouts, actor.round_tokens) are not generated yet: an answer a round cut
waits on the `carried` topic and is "generated" once a later round finishes it. Every id with a
"carried" line and no "generated" line must be located there at a clean stop (the snapshot's
`carried` place), else it is LOST like any other (`carried_lost`).

Drop reasons: filtered (all rewards equal: DAPO dynamic sampling), too_long (longer than
preprocess.seq_length with overlong=drop, or a prompt that fills it), untrainable (no token left to train
on, e.g. every completion id outside the vocabulary), malformed (a group the preprocessor could not
convert: dead-lettered), too_stale (older than actor.max_lag versions when the trainer got to it),
duplicate (a second stream entry of a group already taken: a copy, it does not count in the balance),
and `<stage>:<reason>` for a user stage of the graph (a filter's reason, or `<stage>:error` when its
function raised).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

LEDGER_DIR = "ledger"
# The place of the location snapshot that holds carried answers (the `carried` topic, unacknowledged).
CARRIED_PLACE = "carried (cut by a round, to continue in the next)"
TRAINER_FILE = "trainer.jsonl"
LOCATIONS_FILE = "locations.json"
EXITS_FILE = "exits.jsonl"

FILTERED = "filtered"
TOO_LONG = "too_long"
UNTRAINABLE = "untrainable"
MALFORMED = "malformed"
TOO_STALE = "too_stale"
DUPLICATE = "duplicate"
REWARD_FAILED = "reward_failed"  # the user's reward (task.reward) raised, hung or gave no finite number
REASONS = (FILTERED, TOO_LONG, UNTRAINABLE, MALFORMED, TOO_STALE, DUPLICATE, REWARD_FAILED)
# A user stage's drop (stages/chain.py): the stage's name, then the reason its function gave.
STAGE_REASON = re.compile(r"[a-z][a-z0-9_]*:[A-Za-z0-9_]+", re.ASCII)


def ledger_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / LEDGER_DIR


class LedgerWriter:
    """Appends events to <run_dir>/ledger/<name>.jsonl. One writer per file at a time; not thread-safe."""

    def __init__(self, run_dir: str | Path, name: str) -> None:
        self.path = ledger_dir(run_dir) / f"{name}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Unbuffered append mode: O_APPEND, and each write() below is one system call (no Python buffer
        # to lose on kill -9). A FileIO rather than a raw descriptor so that it closes when collected.
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - lives as long as the writer
        # A previous writer of this file killed mid-line: end its torn line so ours starts clean.
        size = os.fstat(self._file.fileno()).st_size
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    self._write(b"\n")

    def generated(self, group: str, ids: list[str]) -> None:
        self.append({"event": "generated", "group": group, "ids": ids})

    def carried(self, group: str, ids: list[str]) -> None:
        self.append({"event": "carried", "group": group, "ids": ids})

    def dropped(
        self,
        reason: str,
        ids: list[str],
        *,
        group: str | None = None,
        step: int | None = None,
        detail: str | None = None,
    ) -> None:
        if reason not in REASONS and not STAGE_REASON.fullmatch(reason):
            raise ValueError(f"unknown drop reason {reason!r}; one of {REASONS}, or <stage>:<reason>")
        record: dict[str, Any] = {"event": "dropped", "reason": reason, "ids": ids}
        if group is not None:
            record["group"] = group
        if step is not None:
            record["step"] = step
        if detail is not None:
            record["detail"] = detail
        self.append(record)

    def started(self) -> None:
        """This process's first line: its pid, matched against the launcher's record of unclean exits."""
        self.append({"event": "start", "pid": os.getpid()})

    def held(self, place: str, ids: list[str]) -> None:
        """This role's samples that wait in `place` now (replaces its earlier "held" line for it)."""
        self.append({"event": "held", "place": place, "ids": ids})

    def trained(self, step: int, ids: list[str]) -> None:
        self.append({"event": "trained", "step": step, "ids": ids})

    def resumed(self, step: int) -> None:
        """The trainer (re)starts after `step`: lines of later steps written before this one are void."""
        self.append({"event": "resume", "step": step})

    def append(self, record: dict[str, Any]) -> None:
        self._write((json.dumps(record, separators=(",", ":")) + "\n").encode())

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # a regular file takes it in one call; loop for the rare short write
            view = view[self._file.write(view) :]

    def close(self) -> None:
        self._file.close()


def read_records(path: Path) -> tuple[list[dict[str, Any]], int]:
    """(the parsable JSON-object lines of a ledger file in order, how many lines were not parsable)."""
    records, bad = [], 0
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # a torn last line (writer killed mid-write), or a line it left behind
            bad += 1
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            bad += 1
    return records, bad


def write_locations(run_dir: str | Path, places: dict[str, list[str]], unknown: list[str]) -> Path:
    """<run_dir>/ledger/locations.json (atomically): the launcher's snapshot at a clean stop."""
    path = ledger_dir(run_dir) / LOCATIONS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"complete": not unknown, "places": places, "unknown": unknown}))
    tmp.replace(path)
    return path


def record_exit(run_dir: str | Path, name: str, pid: int, code: int | None) -> None:
    """The launcher's line for a process that exited other than cleanly (killed, crashed)."""
    path = ledger_dir(run_dir) / EXITS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"name": name, "pid": pid, "code": code}) + "\n")


@dataclass
class LedgerSummary:
    """Counts of a run's ledger. `balanced`: every trained or dropped id was generated, none was both
    trained and dropped, none trained twice, and, with a location snapshot, none lost; then generated
    = trained + dropped + located + abandoned (+ lost), where without a snapshot `in_flight` stands for
    located + abandoned + lost."""

    generated: int = 0
    trained: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> distinct ids (duplicate: copies)
    in_flight: list[str] = field(default_factory=list)  # generated, neither trained nor dropped
    duplicates_trained: list[str] = field(default_factory=list)  # must stay empty
    trained_and_dropped: list[str] = field(default_factory=list)
    not_generated: list[str] = field(default_factory=list)  # trained/dropped with no "generated" line
    unreadable_lines: int = 0
    files: int = 0
    # Positive accounting (None: no snapshot at a clean stop, so not established):
    located: dict[str, int] | None = None  # place -> ids of in_flight found there
    abandoned: list[str] = field(default_factory=list)  # last group of an incarnation that exited uncleanly
    lost: list[str] | None = None  # in flight, found nowhere: must stay empty
    not_established: list[str] = field(default_factory=list)  # what the snapshot could not read
    carried: int = 0  # distinct samples a round cut at least once (partial rollouts)
    carried_open: list[str] = field(default_factory=list)  # carried, not generated (yet)
    carried_lost: list[str] | None = None  # carried_open found nowhere (None: not established)

    @property
    def dropped_total(self) -> int:
        """Distinct dropped samples (duplicate copies left out: their original is counted elsewhere)."""
        return sum(n for reason, n in self.dropped.items() if reason != DUPLICATE)

    @property
    def located_total(self) -> int:
        return sum((self.located or {}).values())

    @property
    def balanced(self) -> bool:
        return not (
            self.duplicates_trained
            or self.trained_and_dropped
            or self.not_generated
            or self.lost
            or self.carried_lost
        ) and (self.generated == self.trained + self.dropped_total + len(self.in_flight))

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "dropped_total": self.dropped_total,
            "located_total": self.located_total,
            "balanced": self.balanced,
        }

    def lines(self, max_ids: int = 10) -> list[str]:
        """Human-readable lines for `pipeline-rl report`."""

        def some(ids: list[str]) -> str:
            more = f" … (+{len(ids) - max_ids})" if len(ids) > max_ids else ""
            return ", ".join(ids[:max_ids]) + more

        reasons = ", ".join(f"{r} {n}" for r, n in sorted(self.dropped.items())) or "none"
        head = f"ledger: {'balanced' if self.balanced else 'NOT BALANCED'}: generated {self.generated} = "
        head += f"trained {self.trained} + dropped {self.dropped_total} + "
        if self.located is None:
            head += f"in flight {len(self.in_flight)}"
        else:
            rest = len(self.in_flight) - self.located_total - len(self.abandoned)
            lost = "not established" if self.lost is None else str(len(self.lost))
            head += f"located {self.located_total} + abandoned {len(self.abandoned)} + unlocated {rest}"
            head += f"; lost {lost}"
        out = [head, f"  dropped by reason: {reasons}", f"  trained twice: {len(self.duplicates_trained)}"]
        if self.carried:
            waiting = len(self.carried_open)
            lost = "not established" if self.carried_lost is None else str(len(self.carried_lost))
            out.append(
                f"  carried across rounds: {self.carried} samples, {self.carried - waiting} since finished, "
                f"{waiting} still carried; lost {lost}"
            )
        if self.located is None:
            out.append(
                "  located / lost: not established (no location snapshot: the run did not stop cleanly); "
                "the in-flight samples may wait in a stream or a checkpoint, or be lost"
            )
        for place, n in sorted((self.located or {}).items()):
            out.append(f"  located in {place}: {n}")
        for what in self.not_established:
            out.append(f"  not established: {what}")
        for name, ids in (
            ("in flight", self.in_flight if self.located is None else []),
            ("abandoned by a process that exited uncleanly", self.abandoned),
            ("LOST", self.lost or []),
            ("CARRIED AND LOST", self.carried_lost or []),
            ("TRAINED TWICE", self.duplicates_trained),
            ("TRAINED AND DROPPED", self.trained_and_dropped),
            ("NEVER GENERATED", self.not_generated),
        ):
            if ids:
                out.append(f"  {name}: {some(ids)}")
        if self.unreadable_lines:
            out.append(f"  unreadable lines skipped: {self.unreadable_lines} (torn by a killed writer)")
        return out


def ledger_summary(run_dir: str | Path) -> LedgerSummary:
    """Read every ledger file of the run and account for every sample id (see the module docstring)."""
    summary = LedgerSummary()
    generated: set[str] = set()
    carried: set[str] = set()
    dropped: dict[str, str] = {}  # id -> first reason (a redone drop repeats the same one)
    duplicate_copies = 0
    trained_lines: list[dict[str, Any]] = []
    held: dict[tuple[str, str], list[str]] = {}  # (file, place) -> its newest "held" ids
    last_generated: dict[int, list[str]] = {}  # pid of an actor incarnation -> its last group's ids
    root = ledger_dir(run_dir)
    paths = sorted(p for p in root.glob("*.jsonl") if p.name != EXITS_FILE) if root.is_dir() else []
    for path in paths:
        records, bad = read_records(path)
        summary.files += 1
        summary.unreadable_lines += bad
        if path.name == TRAINER_FILE:
            records = _apply_rewinds(records)
        pid = None
        for r in records:
            ids = [str(i) for i in r.get("ids", [])]
            event = r.get("event")
            if event == "start":
                pid = r.get("pid")
            elif event == "held":
                held[(path.name, str(r.get("place")))] = ids
            elif event == "generated":
                generated.update(ids)
                if pid is not None:
                    last_generated[pid] = ids
            elif event == "carried":
                carried.update(ids)
            elif event == "trained":
                trained_lines.append(r)
            elif event == "dropped" and r.get("reason") == DUPLICATE:
                duplicate_copies += len(ids)
            elif event == "dropped":
                for i in ids:
                    dropped.setdefault(i, str(r.get("reason")))
    trained = Counter(str(i) for r in trained_lines for i in r.get("ids", []))
    summary.generated = len(generated)
    summary.trained = len(trained)
    summary.dropped = dict(Counter(dropped.values()))
    if duplicate_copies:
        summary.dropped[DUPLICATE] = duplicate_copies
    summary.duplicates_trained = sorted(i for i, n in trained.items() if n > 1)
    summary.trained_and_dropped = sorted(set(trained) & set(dropped))
    summary.not_generated = sorted((set(trained) | set(dropped)) - generated)
    summary.in_flight = sorted(generated - set(trained) - set(dropped))
    summary.carried = len(carried)
    summary.carried_open = sorted(carried - generated)
    _locate(summary, root, held, last_generated)
    return summary


def _locate(
    summary: LedgerSummary,
    root: Path,
    held: dict[tuple[str, str], list[str]],
    last_generated: dict[int, list[str]],
) -> None:
    """Split in_flight into located / abandoned / lost with the launcher's snapshot (module docstring)."""
    path = root / LOCATIONS_FILE
    if not path.exists():
        return
    try:
        snapshot = json.loads(path.read_text())
    except ValueError as e:
        summary.not_established.append(f"{path.name} is unreadable ({e})")
        return
    places: dict[str, set[str]] = {p: set(ids) for p, ids in snapshot.get("places", {}).items()}
    for (_, place), ids in held.items():
        places.setdefault(place, set()).update(ids)
    summary.not_established = [str(u) for u in snapshot.get("unknown", [])]
    waiting = set(summary.in_flight)
    summary.located = {}
    for place, ids in places.items():
        found = waiting & ids
        if found:
            summary.located[place] = len(found)
            waiting -= found
    unclean: set[int] = set()
    exits = root / EXITS_FILE
    if exits.exists():
        unclean = {int(r["pid"]) for r in read_records(exits)[0] if r.get("pid") is not None}
    abandoned = {i for pid in unclean for i in last_generated.get(pid, [])} & waiting
    summary.abandoned = sorted(abandoned)
    # What the snapshot could not read may hold the rest: then lost is not established either.
    summary.lost = None if summary.not_established else sorted(waiting - abandoned)
    open_carried = set(summary.carried_open) - places.get(CARRIED_PLACE, set())
    summary.carried_lost = None if summary.not_established else sorted(open_carried)


def _apply_rewinds(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trainer's lines that still stand: a "resume" at step S voids earlier lines of steps > S."""
    kept: list[dict[str, Any]] = []
    for r in records:
        if r.get("event") == "resume":
            step = int(r.get("step", 0))
            kept = [k for k in kept if int(k.get("step", 0)) <= step]
        else:
            kept.append(r)
    return kept
