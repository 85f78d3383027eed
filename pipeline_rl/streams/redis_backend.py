"""Redis backend: one Redis stream per topic, consumer groups for competing consumers.

Key of a topic: '<run_name>:<topic>' (e.g. 'exp1:training_data/0'), so several runs share one server.
Each entry holds one field, b'd', with the message as msgpack (never pickle: a stream is data, and
decoding it must not execute anything).

Every call goes through `_call`: a lost connection (refused, reset, timed out, server loading) is
retried with exponential backoff until `retry_deadline_s`, then StreamsUnavailable says what to check.
Retried writes are at-least-once (a reply lost after the server applied XADD gives a duplicate entry).

Trimming rule (trim): the boundary of a group is its oldest pending id, or the id just after its
last-delivered id when nothing is pending; XTRIM MINID removes only entries older than the smallest
boundary over all groups and older than the newest `keep_last` entries. A topic with no group is never
trimmed (nobody has said what was consumed; positional readers join in with commit()).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgpack
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pipeline_rl.streams.base import RawEntry, StreamsError, StreamsUnavailable, TopicStore
from pipeline_rl.streams.config import StreamsConfig, check_topic, redact_url

logger = logging.getLogger("pipeline_rl.streams")

_FIELD = b"d"
_T = TypeVar("_T")

# Id of the n-th newest entry, or nil: computed in the server so trimming never ships payloads around.
_NTH_NEWEST_ID = """
local newest = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', ARGV[1])
if #newest < tonumber(ARGV[1]) then return false end
return newest[#newest][1]
"""

_clients: dict[tuple[str, float, int], redis.Redis] = {}
_clients_lock = threading.Lock()


def redis_client(url: str, op_timeout_s: float) -> redis.Redis:
    """A client for `url`, shared per process (one connection pool; fork-safe by keying on the pid)."""
    key = (url, op_timeout_s, os.getpid())
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = redis.Redis.from_url(
                url,
                socket_timeout=op_timeout_s,
                socket_connect_timeout=min(op_timeout_s, 5.0),
                # We retry ourselves, with a deadline; redis-py's own retries would hide the time spent.
                retry=Retry(NoBackoff(), 0),
            )
            _clients[key] = client
        return client


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _next_id(entry_id: str) -> str:
    ms, seq = _id_tuple(entry_id)
    return f"{ms}-{seq + 1}"


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisTopicStore(TopicStore):
    """One topic as the Redis stream '<run_name>:<topic>'."""

    start_position = "0-0"

    def __init__(self, cfg: StreamsConfig, topic: str) -> None:
        if not cfg.redis_url:
            raise ValueError(
                "streams.redis_url is unset: set it, or start a private server with "
                "pipeline_rl.streams.RedisServer (the launcher does this when the URL is unset)"
            )
        self.topic = check_topic(topic)
        self._cfg = cfg
        self._url = redact_url(cfg.redis_url)  # for messages and logs only: never print the password
        self._key = f"{cfg.run_name}:{topic}"
        self._r = redis_client(cfg.redis_url, cfg.op_timeout_s)
        self.max_block_s = cfg.op_timeout_s - 1.0
        self._reconnects = 0
        self._claim_cursor: dict[str, str] = {}
        self._nth_newest_id = self._r.register_script(_NTH_NEWEST_ID)

    # -- plumbing -----------------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        deadline: float | None = None
        delay = 0.05
        while True:
            try:
                return fn(*args, **kwargs)
            except redis.AuthenticationError as err:
                # A subclass of ConnectionError in redis-py, but waiting cannot fix a wrong password.
                raise StreamsError(
                    f"Redis at {self._url} refused our credentials during {what} on topic {self.topic!r}: "
                    f"{err}. streams.redis_url needs the server's password (redis://:PASSWORD@host:port/0); "
                    "children of a launched run read it from the run's secrets file."
                ) from None
            except (redis.ConnectionError, redis.TimeoutError) as err:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self._cfg.retry_deadline_s
                    logger.warning(
                        "streams: lost Redis at %s during %s on %r, retrying: %s",
                        self._url,
                        what,
                        self.topic,
                        err,
                    )
                if now >= deadline:
                    raise StreamsUnavailable(
                        f"Redis at {self._url} unreachable for {self._cfg.retry_deadline_s:.1f}s "
                        f"(streams.retry_deadline_s) during {what} on topic {self.topic!r}: {err}. "
                        "Check that redis-server is running (the launcher starts one when streams.redis_url "
                        "is unset; see its log in the run directory), that the URL and port are right, and "
                        "that the machine is not out of memory."
                    ) from err
                self._reconnects += 1
                time.sleep(min(delay, max(0.0, deadline - now)))
                delay = min(delay * 2, 2.0)

    def reconnect_count(self) -> int:
        return self._reconnects

    @staticmethod
    def _block_ms(block_s: float) -> int | None:
        ms = int(block_s * 1000)
        return ms if ms > 0 else None  # BLOCK 0 would mean "forever"

    @staticmethod
    def _entries(raw: Sequence[Any]) -> list[RawEntry]:
        out: list[RawEntry] = []
        for entry_id, fields in raw:
            if entry_id is None:
                continue  # Redis 6.2 XAUTOCLAIM: a nil slot for a deleted entry, id unknown
            # A pending entry whose data was deleted comes back with fields None.
            out.append((_s(entry_id), None if fields is None else fields.get(_FIELD, b"")))
        return out

    def _stream_entries(self, reply: Any) -> list[RawEntry]:
        # XREAD/XREADGROUP reply: [[key, [(id, fields), ...]]] (one stream asked for).
        if not reply:
            return []
        return self._entries(reply[0][1])

    # -- codec --------------------------------------------------------------------------------------
    def encode(self, data: dict[str, Any]) -> bytes:
        return msgpack.packb(data, use_bin_type=True)

    def decode(self, payload: bytes) -> Any:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True)

    def open_sibling(self, topic: str) -> RedisTopicStore:
        return RedisTopicStore(self._cfg, topic)

    # -- plain stream -------------------------------------------------------------------------------
    def append(self, payloads: Sequence[bytes]) -> list[str]:
        def run() -> list[Any]:
            pipe = self._r.pipeline(transaction=False)
            for payload in payloads:
                pipe.xadd(self._key, {_FIELD: payload})
            return pipe.execute()

        return [_s(i) for i in self._call("XADD", run)]

    def read_after(self, position: str, count: int, block_s: float) -> list[RawEntry]:
        reply = self._call(
            "XREAD", self._r.xread, {self._key: position}, count=count, block=self._block_ms(block_s)
        )
        return self._stream_entries(reply)

    def latest(self, n: int) -> list[RawEntry]:
        return self._entries(self._call("XREVRANGE", self._r.xrevrange, self._key, "+", "-", count=n))

    def length(self) -> int:
        return int(self._call("XLEN", self._r.xlen, self._key))

    def total_written(self) -> int:
        try:
            info = self._call("XINFO STREAM", self._r.xinfo_stream, self._key)
        except redis.ResponseError as err:
            if "no such key" in str(err).lower():
                return 0
            raise
        if "entries-added" not in info:
            raise StreamsError(
                f"Redis at {self._url} does not report 'entries-added' (XINFO STREAM): use redis-server >= 7.0"
            )
        return int(info["entries-added"])

    def _groups(self) -> list[dict[str, Any]]:
        try:
            return self._call("XINFO GROUPS", self._r.xinfo_groups, self._key)
        except redis.ResponseError as err:
            if "no such key" in str(err).lower():
                return []
            raise

    def trim(self, keep_last: int) -> int:
        groups = self._groups()
        if not groups:
            return 0
        boundaries = []
        for g in groups:
            boundary = _next_id(_s(g["last-delivered-id"]))
            if int(g["pending"]) > 0:
                oldest = self._call("XPENDING", self._r.xpending, self._key, g["name"])["min"]
                if oldest is not None and _id_tuple(_s(oldest)) < _id_tuple(boundary):
                    boundary = _s(oldest)
            boundaries.append(boundary)
        minid = min(boundaries, key=_id_tuple)
        if keep_last > 0:
            oldest_kept = self._call("EVALSHA", self._nth_newest_id, keys=[self._key], args=[keep_last])
            if oldest_kept is None:
                return 0  # fewer than keep_last entries
            minid = min(minid, _s(oldest_kept), key=_id_tuple)
        # Exact (no '~'): the rule above is the whole contract, no macro-node rounding on top.
        return int(self._call("XTRIM", self._r.xtrim, self._key, minid=minid, approximate=False))

    # -- consumer groups ----------------------------------------------------------------------------
    def group_ensure(self, group: str) -> None:
        try:
            self._call("XGROUP CREATE", self._r.xgroup_create, self._key, group, id="0", mkstream=True)
        except redis.ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    def _group_call(self, what: str, group: str, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        try:
            return self._call(what, fn, *args, **kwargs)
        except redis.ResponseError as err:
            if "NOGROUP" not in str(err):
                raise
            # The stream or group vanished: a Redis restarted without persistence, or a deleted key.
            logger.warning(
                "streams: consumer group %r of topic %r is gone (Redis restarted without persistence?); "
                "recreating it",
                group,
                self.topic,
            )
            self.group_ensure(group)
            return self._call(what, fn, *args, **kwargs)

    def group_read_new(self, group: str, consumer: str, count: int, block_s: float) -> list[RawEntry]:
        reply = self._group_call(
            "XREADGROUP",
            group,
            self._r.xreadgroup,
            group,
            consumer,
            {self._key: ">"},
            count=count,
            block=self._block_ms(block_s),
        )
        return self._stream_entries(reply)

    def group_read_own_pending(self, group: str, consumer: str, after: str, count: int) -> list[RawEntry]:
        # An explicit id instead of '>' returns this consumer's pending entries after it (never blocks).
        reply = self._group_call(
            "XREADGROUP", group, self._r.xreadgroup, group, consumer, {self._key: after}, count=count
        )
        return self._stream_entries(reply)

    def group_claim_idle(self, group: str, consumer: str, min_idle_s: float, count: int) -> list[RawEntry]:
        cursor = self._claim_cursor.get(group, "0-0")
        reply = self._group_call(
            "XAUTOCLAIM",
            group,
            self._r.xautoclaim,
            self._key,
            group,
            consumer,
            int(min_idle_s * 1000),
            start_id=cursor,
            count=count,
        )
        self._claim_cursor[group] = _s(reply[0])
        claimed = self._entries(reply[1])
        # Redis >= 7 drops pending ids whose data was deleted and lists them third: report, never lose.
        deleted = [(_s(i), None) for i in (reply[2] if len(reply) > 2 else [])]
        return claimed + deleted

    def group_ack(self, group: str, ids: Sequence[str]) -> int:
        return int(self._group_call("XACK", group, self._r.xack, self._key, group, *ids))

    def group_set_position(self, group: str, position: str) -> None:
        try:
            self._call("XGROUP SETID", self._r.xgroup_setid, self._key, group, position)
        except redis.ResponseError as setid_err:
            # No such group, or no such stream yet (each has its own error text): create it there.
            try:
                self._call(
                    "XGROUP CREATE", self._r.xgroup_create, self._key, group, id=position, mkstream=True
                )
            except redis.ResponseError:
                raise setid_err from None

    def group_pending(self, group: str) -> dict[str, int]:
        try:
            summary = self._call("XPENDING", self._r.xpending, self._key, group)
        except redis.ResponseError as err:
            if "NOGROUP" in str(err):
                return {}
            raise
        return {_s(c["name"]): int(c["pending"]) for c in summary["consumers"]}

    def backlog(self, group: str) -> int:
        for g in self._groups():
            if _s(g["name"]) == group:
                lag = g.get("lag")
                if lag is None:
                    # Redis cannot always derive the lag (e.g. after XGROUP SETID): count what follows.
                    lag = self._count_after(_s(g["last-delivered-id"]))
                return int(g["pending"]) + int(lag)
        return self.length()

    def unacked(self, group: str) -> list[RawEntry]:
        info = next((g for g in self._groups() if _s(g["name"]) == group), None)
        if info is None:
            return self._range_after("-")
        pending, start = [], "-"
        while True:
            page = self._call(
                "XPENDING", self._r.xpending_range, self._key, group, min=start, max="+", count=1000
            )
            pending += [_s(p["message_id"]) for p in page]
            if len(page) < 1000:
                break
            start = f"({pending[-1]}"
        out = []
        for entry_id in pending:  # an id deleted from the stream since its delivery has no entry left
            out += self._entries(self._call("XRANGE", self._r.xrange, self._key, entry_id, entry_id))
        return out + self._range_after(f"({_s(info['last-delivered-id'])}")

    def _range_after(self, start: str) -> list[RawEntry]:
        out: list[RawEntry] = []
        while True:
            page = self._entries(self._call("XRANGE", self._r.xrange, self._key, start, "+", count=1000))
            out += page
            if len(page) < 1000:
                return out
            start = f"({page[-1][0]}"

    def _count_after(self, entry_id: str) -> int:
        total, start = 0, f"({entry_id}"
        while True:
            page = self._call("XRANGE", self._r.xrange, self._key, start, "+", count=1000)
            total += len(page)
            if len(page) < 1000:
                return total
            start = f"({_s(page[-1][0])}"
