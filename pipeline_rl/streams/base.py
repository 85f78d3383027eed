"""The streams interface: a writer and two kinds of reader of typed messages, over any backend.

A backend implements `TopicStore` (the raw operations on one topic: append bytes, read bytes after a
position, consumer-group bookkeeping, trimming). Everything that must behave the same on every backend
lives here once: encoding messages, decoding them, moving malformed entries to the dead-letter topic,
re-delivering a restarted consumer's unacknowledged entries, taking over a dead consumer's entries.

Use the factories in `pipeline_rl.streams` rather than these classes directly:

    writer = make_writer(cfg, "rollouts");  writer.write(group)
    reader = make_reader(cfg, "rollouts", group="preprocess", consumer="prep0")
    for entry in reader.read(count=64, block_s=1.0): handle(entry.message)
    reader.ack([e.id for e in batch])                       # only after the work is durable

Ordering contract of a group reader: `read()` returns, in this order of preference, (1) entries this
consumer name was given before but never acknowledged (a restart after a crash), (2) entries another
consumer left unacknowledged for `claim_idle_s` (a dead consumer), (3) new entries. An entry counts as
done only when acked; until then it is redelivered (at-least-once; acks make it exactly-once as long as
work is idempotent or committed together with the ack).
"""

from __future__ import annotations

import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Self, get_args

from pydantic import BaseModel

from pipeline_rl.messages import DeadLetter, Message, decode_message
from pipeline_rl.streams.config import DEAD_LETTER, check_name

logger = logging.getLogger("pipeline_rl.streams")

# The concrete classes of the `Message` union: only these can be written, so readers can decode all.
MESSAGE_TYPES: tuple[type[BaseModel], ...] = get_args(get_args(Message)[0])

# (entry id, payload); payload None means the backend no longer holds the entry's data.
RawEntry = tuple[str, bytes | None]

_RAW_PREVIEW_CHARS = 4096


class StreamsError(RuntimeError):
    """A streams operation failed for a reason the caller cannot fix by retrying immediately."""


class StreamsUnavailable(StreamsError):
    """The backend stayed unreachable for the whole retry deadline."""


@dataclass(frozen=True)
class Entry:
    """One decoded message and its id on the topic (pass the id to `ack`, or keep it as a position)."""

    id: str
    message: Message


class TopicStore(ABC):
    """Raw operations on one topic of one backend. Ids are strings that sort in write order per topic.

    Implementations: redis_backend.RedisTopicStore, files_backend.FilesTopicStore.
    """

    topic: str
    start_position: str  # a position before the first entry ever written
    max_block_s: float  # longest block_s a read may ask for

    @abstractmethod
    def encode(self, data: dict[str, Any]) -> bytes: ...

    @abstractmethod
    def decode(self, payload: bytes) -> Any:
        """Bytes -> plain data (raises on bytes that are not the backend's encoding)."""

    @abstractmethod
    def open_sibling(self, topic: str) -> TopicStore:
        """A store for another topic of the same backend and run (used for the dead-letter topic)."""

    @abstractmethod
    def append(self, payloads: Sequence[bytes]) -> list[str]: ...

    @abstractmethod
    def read_after(self, position: str, count: int, block_s: float) -> list[RawEntry]: ...

    @abstractmethod
    def latest(self, n: int) -> list[RawEntry]:
        """The newest `n` entries, newest first."""

    @abstractmethod
    def length(self) -> int: ...

    @abstractmethod
    def trim(self, keep_last: int) -> int:
        """Drop old entries that every group has acknowledged; keep the newest `keep_last`. Returns #dropped."""

    @abstractmethod
    def group_ensure(self, group: str) -> None:
        """Create the group (starting before the oldest retained entry) if it does not exist."""

    @abstractmethod
    def group_read_new(self, group: str, consumer: str, count: int, block_s: float) -> list[RawEntry]: ...

    @abstractmethod
    def group_read_own_pending(self, group: str, consumer: str, after: str, count: int) -> list[RawEntry]: ...

    @abstractmethod
    def group_claim_idle(
        self, group: str, consumer: str, min_idle_s: float, count: int
    ) -> list[RawEntry]: ...

    @abstractmethod
    def group_ack(self, group: str, ids: Sequence[str]) -> int: ...

    @abstractmethod
    def group_set_position(self, group: str, position: str) -> None: ...

    @abstractmethod
    def group_pending(self, group: str) -> dict[str, int]:
        """Unacknowledged entries per consumer of `group`."""

    @abstractmethod
    def backlog(self, group: str) -> int:
        """Entries `group` has not acknowledged: pending + not yet delivered (all entries if no such group)."""

    @abstractmethod
    def unacked(self, group: str) -> list[RawEntry]:
        """The entries counted by backlog(group) themselves, pending first, then those not yet delivered
        (where the ledger's accounting finds samples that wait in a stream)."""

    def total_written(self) -> int:
        """Entries ever appended to the topic, trimmed ones included (never decreases).

        Lets one writer account for the writes of all others (the actors' backlog control).
        """
        raise NotImplementedError(f"{type(self).__name__} does not count the entries ever written")

    def reconnect_count(self) -> int:
        """How many times this store lost its connection and retried (0 for backends without one)."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Release what the store holds."""


class _TopicHandle:
    """What writers and readers share: the topic's latest entry, its backlog, its length, trimming."""

    def __init__(self, store: TopicStore, trim_keep_last: int) -> None:
        self._store = store
        self._trim_keep_last = trim_keep_last

    @property
    def topic(self) -> str:
        return self._store.topic

    def latest(self) -> Entry | None:
        """The newest well-formed message of the topic (cheap: reads from the end), or None."""
        for entry_id, payload in self._store.latest(8):
            try:
                return Entry(entry_id, decode_entry(self._store, payload))
            except Exception as err:  # noqa: BLE001 - any undecodable entry is skipped, not fatal
                # Not a consumer: report only; the topic's consumers dead-letter the entry.
                logger.warning(
                    "streams: skipping malformed entry %s on %r in latest(): %s", entry_id, self.topic, err
                )
        return None

    def backlog(self, group: str) -> int:
        """Entries of the topic `group` has not acknowledged yet (pending + never delivered).

        For a positional reader's committed name it is the entries after the committed position.
        """
        return self._store.backlog(check_name(group, "group"))

    def length(self) -> int:
        """Entries currently retained on the topic."""
        return self._store.length()

    def total_written(self) -> int:
        """Entries ever appended to the topic by any writer, trimmed ones included (never decreases)."""
        return self._store.total_written()

    def trim(self) -> int:
        """Drop entries every consumer group has acknowledged (see docs/streams.md). Returns #dropped."""
        return self._store.trim(self._trim_keep_last)

    def close(self) -> None:
        self._store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Writer(_TopicHandle):
    """Appends typed messages to one topic. Safe to use from several processes at once."""

    def __init__(self, store: TopicStore, trim_keep_last: int = 1000, trim_every: int = 0) -> None:
        super().__init__(store, trim_keep_last)
        self._trim_every = trim_every
        self._since_trim = 0

    def write(self, message: BaseModel) -> str:
        """Append one message; returns its id."""
        return self.write_many([message])[0]

    def write_many(self, messages: Sequence[BaseModel]) -> list[str]:
        """Append messages in order, in one round trip; returns their ids."""
        for message in messages:
            if not isinstance(message, MESSAGE_TYPES):
                raise TypeError(
                    f"can only write pipeline_rl.messages types, got {type(message).__name__}: "
                    "add the class to messages.Message so readers can decode it"
                )
        payloads = [self._store.encode(m.model_dump(mode="json")) for m in messages]
        return self._append(payloads)

    def write_raw(self, data: bytes | dict[str, Any]) -> str:
        """Append a payload without validation (bytes as-is, a dict in the backend's encoding).

        For tools and tests that must put malformed entries on a topic; pipeline code uses write().
        """
        payload = data if isinstance(data, bytes) else self._store.encode(data)
        return self._append([payload])[0]

    def _append(self, payloads: list[bytes]) -> list[str]:
        if not payloads:
            return []
        ids = self._store.append(payloads)
        self._since_trim += len(payloads)
        if self._trim_every and self._since_trim >= self._trim_every:
            self._since_trim = 0
            self.trim()
        return ids


class _Reader(_TopicHandle):
    """Decoding and dead-lettering shared by both reader kinds."""

    def __init__(self, store: TopicStore, trim_keep_last: int) -> None:
        super().__init__(store, trim_keep_last)
        self._dead_letters: Writer | None = None

    def _check_block(self, block_s: float) -> None:
        if not 0 <= block_s <= self._store.max_block_s:
            raise ValueError(
                f"block_s={block_s} must be in [0, {self._store.max_block_s}] "
                "(raise streams.op_timeout_s to block longer)"
            )

    def _decode_batch(self, raw: list[RawEntry]) -> tuple[list[Entry], list[str]]:
        """Decode entries; malformed ones go to the dead-letter topic. Returns (good, bad ids)."""
        good: list[Entry] = []
        dead: list[DeadLetter] = []
        for entry_id, payload in raw:
            try:
                good.append(Entry(entry_id, decode_entry(self._store, payload)))
            except Exception as err:  # noqa: BLE001 - bad data must never crash a consumer
                logger.warning(
                    "streams: malformed entry %s on topic %r moved to %r: %s: %s",
                    entry_id,
                    self.topic,
                    DEAD_LETTER,
                    type(err).__name__,
                    err,
                )
                dead.append(
                    DeadLetter(
                        topic=self.topic,
                        stream_id=entry_id,
                        error=f"{type(err).__name__}: {err}"[:2000],
                        raw=_preview(self._store, payload),
                    )
                )
        if dead:
            if self._dead_letters is None:
                self._dead_letters = Writer(self._store.open_sibling(DEAD_LETTER))
            self._dead_letters.write_many(dead)
        return good, [d.stream_id for d in dead]

    def close(self) -> None:
        if self._dead_letters is not None:
            self._dead_letters.close()
        super().close()


class GroupReader(_Reader):
    """A competing consumer in a consumer group: read a batch, process it, then ack() its ids.

    Several processes may read one topic with the same group and different consumer names; each entry
    goes to one of them. Give each consumer a stable name (e.g. 'preprocessor0'): after a crash, the
    same name gets its unacknowledged entries back first; entries of a consumer that never comes back
    are taken over by others once idle for `claim_idle_s`.
    """

    def __init__(
        self,
        store: TopicStore,
        group: str,
        consumer: str,
        claim_idle_s: float | None,
        claim_every_s: float,
        trim_keep_last: int = 1000,
    ) -> None:
        super().__init__(store, trim_keep_last)
        self.group = check_name(group, "group")
        self.consumer = check_name(consumer, "consumer")
        self._claim_idle_s = claim_idle_s
        self._claim_every_s = claim_every_s
        self._next_claim = 0.0
        # Ids handed to the caller and not acked yet: never hand them out twice in this process.
        self._outstanding: set[str] = set()
        self._recovering = True
        self._pending_after = store.start_position
        self._reconnects = store.reconnect_count()
        store.group_ensure(self.group)

    def read(self, count: int = 100, block_s: float = 1.0) -> list[Entry]:
        """Up to `count` messages; waits up to `block_s` for new ones, returns [] if none came."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self._check_block(block_s)
        deadline = time.monotonic() + block_s
        while True:
            raw = self._next_raw(count, max(0.0, deadline - time.monotonic()))
            if self._store.reconnect_count() != self._reconnects:
                # A reply lost with the connection may have delivered entries to us that we never saw:
                # they sit in our pending list, so look there again (already-held ids are filtered).
                self._reconnects = self._store.reconnect_count()
                self._recovering, self._pending_after = True, self._store.start_position
            if not raw:
                if self._recovering or time.monotonic() < deadline:
                    continue
                return []
            good, bad = self._decode_batch(raw)
            if bad:
                self._store.group_ack(self.group, bad)  # only now: the dead letters are written
            self._outstanding.update(e.id for e in good)
            if good:
                return good

    def ack(self, ids: Iterable[str]) -> int:
        """Mark entries done; returns how many were pending (0 for ids another consumer already acked)."""
        ids = list(ids)
        if not ids:
            return 0
        acked = self._store.group_ack(self.group, ids)
        self._outstanding.difference_update(ids)
        return acked

    def pending(self) -> dict[str, int]:
        """Unacknowledged entries of this group per consumer name."""
        return self._store.group_pending(self.group)

    def _next_raw(self, count: int, block_s: float) -> list[RawEntry]:
        if self._recovering:
            raw = self._store.group_read_own_pending(self.group, self.consumer, self._pending_after, count)
            if raw:
                self._pending_after = raw[-1][0]
                return self._not_outstanding(raw)
            self._recovering = False
        now = time.monotonic()
        if self._claim_idle_s is not None and now >= self._next_claim:
            raw = self._store.group_claim_idle(self.group, self.consumer, self._claim_idle_s, count)
            fresh = self._not_outstanding(raw)
            # A full batch of others' entries means there may be more: look again on the next read.
            self._next_claim = now if fresh and len(raw) >= count else now + self._claim_every_s
            if fresh:
                return fresh
        return self._not_outstanding(self._store.group_read_new(self.group, self.consumer, count, block_s))

    def _not_outstanding(self, raw: list[RawEntry]) -> list[RawEntry]:
        # Redis's XAUTOCLAIM also returns our own idle entries, which the caller may still be working on.
        return [(i, p) for i, p in raw if i not in self._outstanding]


class PositionalReader(_Reader):
    """A single consumer that tracks its own position (each trainer rank on its own partition).

    Nothing is acknowledged: checkpoint `position` with your state and pass it back as `start_after`
    to resume exactly after the last entry you processed. Call `commit(name)` once that checkpoint is
    durable, so trimming keeps everything after it and `backlog(name)` reports your lag.
    """

    def __init__(self, store: TopicStore, start_after: str | None = None, trim_keep_last: int = 1000) -> None:
        super().__init__(store, trim_keep_last)
        self._position = start_after if start_after is not None else store.start_position

    @property
    def position(self) -> str:
        """Id of the last entry read (well-formed or not); the start position before any read."""
        return self._position

    def read(self, count: int = 100, block_s: float = 1.0) -> list[Entry]:
        """Up to `count` messages after `position`; waits up to `block_s`, returns [] if none came."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self._check_block(block_s)
        deadline = time.monotonic() + block_s
        while True:
            raw = self._store.read_after(self._position, count, max(0.0, deadline - time.monotonic()))
            if not raw:
                return []
            good, _ = self._decode_batch(raw)
            self._position = raw[-1][0]
            if good or time.monotonic() >= deadline:
                return good

    def commit(self, name: str, position: str | None = None) -> None:
        """Record `position` (default: the current one) as durable progress of reader `name`.

        Shares the namespace of consumer groups: trim() keeps entries after it, backlog(name) counts them.
        """
        self._store.group_set_position(check_name(name, "reader name"), position or self._position)


def decode_entry(store: TopicStore, payload: bytes | None) -> Message:
    if payload is None:
        raise StreamsError("the entry's data was deleted from the stream while it was pending")
    data = store.decode(payload)
    if not isinstance(data, dict):
        raise TypeError(f"payload decodes to {type(data).__name__}, expected a mapping with a 'kind'")
    return decode_message(data)


def _preview(store: TopicStore, payload: bytes | None) -> str:
    """Readable, truncated form of an undecodable payload for the dead letter."""
    if payload is None:
        return "<deleted>"
    try:
        text = json.dumps(store.decode(payload), default=repr)
    except Exception:  # noqa: BLE001 - fall back to the raw bytes
        text = payload.decode("utf-8", "backslashreplace")
    return text[:_RAW_PREVIEW_CHARS]
