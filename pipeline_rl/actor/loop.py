"""The actor: turns this actor's shard of prompts into complete GRPO groups on the `rollouts` topic.

    pipeline-rl actor --config RUN/config.json --index 0          # what the launcher runs
    summary = await run_actor(cfg, actor_index=0, max_groups=16)  # tests and tools

One asyncio loop per actor process talks to every inference server (`inference.urls`) over HTTP. For
each prompt of `task.problems(shard_index=index, num_shards=num_actors, seed=actor.seed)` it samples
`actor.attempts` completions (`actor.request_mode`: one chat request with n=attempts, or one request per
sample), grades them (tasks.Grader, never on the event loop for slow graders), and writes ONE
RolloutGroup once every sample is in. Nothing partial is ever written, so a group is written once.

Routing: every request goes to the healthy server with the fewest requests in flight, never above
`actor.max_in_flight_per_server`. A connection error, 5xx or timeout marks the server unhealthy (it is
probed on /health every `actor.health_probe_interval_s`) and the request is retried on another one;
its partial result is never used, so a sample is neither lost nor duplicated. No healthy server for
`actor.all_servers_down_deadline_s` -> AllServersDown (main exits non-zero).

Admission invariant (enforced before each group starts; docs/actor.md explains it at length):
    G = trainer.batch_size / attempts        groups per optimizer step (weight version = steps done)
    A = actor.num_actors, B = actor.max_buffered_groups, L = actor.max_lag
    q = B if A == 1 else min(B // A, G*(L+1) // A, G*L // (A-1))   own share: most own groups in flight
    R = (A-1) * q                            worst case of the other actors' groups in flight
    W = rollouts.total_written() (+ own writes since it was read), F = own groups in flight
    V = latest published WeightVersionEvent.version, V_floor = min(V, start version of own in-flight)
    T = latest groups_consumed, D = sum over preprocessors of latest groups_dropped, C = T + D
    start one more group only if   F + 1 <= q
                              and  W + F + R + 1 - C <= B                       (bounded buffer)
                              and  W + F + R + 1 - D <= G * (V_floor + L + 1)   (lag)
With one actor, and groups trained in stream order, this guarantees for every group g started when
the published version was V_g: (1) groups started but not consumed never exceed B; (2) g is trained
at step s with (s - 1) - V_g <= L. The actor waits (deadline `actor.trainer_wait_deadline_s` without
trainer progress), it never drops work.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from inference_shim.client import AsyncShimClient, ShimError
from inference_shim.protocol import VersionSpan
from pipeline_rl.config import RunConfig, load_run_config
from pipeline_rl.messages import (
    PreprocessorProgress,
    RolloutGroup,
    Sample,
    StatsRecord,
    WeightVersionEvent,
)
from pipeline_rl.streams import (
    ROLLOUTS,
    STATS,
    TRAINER_EVENTS,
    StreamsError,
    make_reader,
    make_writer,
)
from pipeline_rl.tasks import Grader, Problem, compute_reward, make_task

logger = logging.getLogger("pipeline_rl.actor")

_POLL_S = 0.25  # safety net of every event-driven wait: re-check state at least this often


class ActorError(RuntimeError):
    """The actor cannot go on; the message says what to check or change."""


class AllServersDown(ActorError):
    pass


class TrainerStalled(ActorError):
    pass


# ----------------------------------------------------------------------------------------------------
# Admission gate (pure: unit-tested without servers)
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GateLimits:
    groups_per_step: int  # G
    max_lag: int  # L
    max_buffered: int  # B
    own_quota: int  # q
    others_reserve: int  # R

    @classmethod
    def from_config(cls, cfg: RunConfig) -> GateLimits:
        a = cfg.actor
        groups_per_step = cfg.trainer.batch_size // a.attempts
        n, b, lag = a.num_actors, a.max_buffered_groups, a.max_lag
        # Several actors split both budgets evenly; G*L // (n-1) keeps enough lag room for the last
        # group of a step even when every other actor holds its whole share (else: deadlock).
        quota = (
            b if n == 1 else min(b // n, groups_per_step * (lag + 1) // n, groups_per_step * lag // (n - 1))
        )
        if quota < 1:
            raise ActorError(
                f"{n} actors cannot share max_buffered_groups={b} with max_lag={lag} "
                f"({groups_per_step} groups per step): each actor must reserve room for the others' "
                "in-flight groups. Raise actor.max_lag / actor.max_buffered_groups or use one actor."
            )
        limits = cls(groups_per_step, lag, b, quota, (n - 1) * quota)
        if b - limits.others_reserve < groups_per_step:
            raise ActorError(
                f"actor.max_buffered_groups={b} leaves fewer than one optimizer step ({groups_per_step} "
                f"groups) to {n} actor(s): the trainer could never fill a batch. Raise it to at least "
                f"{groups_per_step * n}."
            )
        return limits


def gate_block(
    limits: GateLimits, *, written: int, in_flight: int, consumed: int, dropped: int, version_floor: int
) -> Literal["lag", "buffer"] | None:
    """Why one more group may not start now (None: it may). See the module docstring for the rule."""
    started = written + in_flight + limits.others_reserve + 1  # including the new group
    if started - dropped > limits.groups_per_step * (version_floor + limits.max_lag + 1):
        return "lag"
    if in_flight + 1 > limits.own_quota or started - consumed > limits.max_buffered:
        return "buffer"
    return None


@dataclass
class TrainerProgress:
    """What trainer_events says: the latest version and consumption (dropped groups count as consumed)."""

    version: int = 0
    groups_trained: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def apply(self, message: Any) -> None:
        # Latest, not max: a trainer restored from a checkpoint rewinds both, and re-reads what follows.
        if isinstance(message, WeightVersionEvent):
            self.version, self.groups_trained = message.version, message.groups_consumed
        elif isinstance(message, PreprocessorProgress):
            self.dropped[message.preprocessor_id] = message.groups_dropped

    @property
    def groups_dropped(self) -> int:
        return sum(self.dropped.values())

    @property
    def groups_consumed(self) -> int:
        return self.groups_trained + self.groups_dropped


# ----------------------------------------------------------------------------------------------------
# Routing
# ----------------------------------------------------------------------------------------------------
@dataclass
class Server:
    index: int
    url: str
    client: AsyncShimClient
    healthy: bool = True
    in_flight: int = 0
    assigned: int = 0
    failures: int = 0


class Router:
    """Least-loaded choice among healthy servers under a per-server cap on requests in flight."""

    def __init__(self, servers: list[Server], cap: int, all_down_deadline_s: float, slot_deadline_s: float):
        self.servers = servers
        self.cap = cap
        self.all_down_deadline_s = all_down_deadline_s
        self.slot_deadline_s = slot_deadline_s
        self._changed = asyncio.Event()
        self._all_down_since: float | None = None if any(s.healthy for s in servers) else time.monotonic()

    def pick(self) -> Server | None:
        candidates = [s for s in self.servers if s.healthy and s.in_flight < self.cap]
        # Ties go to the server given the least work so far, so idle servers share the load evenly.
        return min(candidates, key=lambda s: (s.in_flight, s.assigned), default=None)

    async def acquire(self) -> Server:
        waited_since = time.monotonic()
        while True:
            server = self.pick()
            if server is not None:
                server.in_flight += 1
                server.assigned += 1
                return server
            now = time.monotonic()
            if self._all_down_since is not None:
                left = self._all_down_since + self.all_down_deadline_s - now
                if left <= 0:
                    raise AllServersDown(
                        f"no inference server answered /health for {self.all_down_deadline_s:.0f}s "
                        f"(actor.all_servers_down_deadline_s): {[s.url for s in self.servers]}. Check the "
                        "servers' logs in the run directory and that inference.urls is right."
                    )
            else:
                left = waited_since + self.slot_deadline_s - now
                if left <= 0:
                    raise ActorError(
                        f"no request slot freed for {self.slot_deadline_s:.0f}s although every request has "
                        "a timeout (actor.request_timeout_s): this is a bug in the actor's bookkeeping"
                    )
            self._changed.clear()  # no await since pick(): no release can slip in between
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, _POLL_S))

    def release(self, server: Server) -> None:
        server.in_flight -= 1
        self._changed.set()

    def mark_failed(self, server: Server, reason: str) -> None:
        server.failures += 1
        if server.healthy:
            logger.warning("server %s marked unhealthy: %s", server.url, reason)
        server.healthy = False
        if self._all_down_since is None and not any(s.healthy for s in self.servers):
            self._all_down_since = time.monotonic()
            logger.error("every inference server is down; waiting up to %.0fs", self.all_down_deadline_s)
        self._changed.set()

    def mark_healthy(self, server: Server) -> None:
        if not server.healthy:
            logger.info("server %s is healthy again", server.url)
        server.healthy = True
        self._all_down_since = None
        self._changed.set()


def _retryable(err: Exception) -> bool:
    """Errors another server may not have: transport failures, timeouts, 5xx. A 4xx is our bug."""
    return isinstance(err, httpx.TransportError) or (isinstance(err, ShimError) and err.status >= 500)


# ----------------------------------------------------------------------------------------------------
# Responses
# ----------------------------------------------------------------------------------------------------
@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    spans: list[VersionSpan]
    finish_reason: str
    text: str
    server: str


def parse_chat_response(body: dict, n: int, server: str) -> list[Completion]:
    """Completions of a chat response, checked against the contract (raises ActorError if broken)."""

    def broken(why: str) -> ActorError:
        return ActorError(f"{server} broke the inference contract ({why}); see docs/contract.md")

    choices = body.get("choices") or []
    if len(choices) != n:
        raise broken(f"asked for n={n} choices, got {len(choices)}")
    prompt_ids = body.get("prompt_token_ids")
    if not prompt_ids:
        raise broken("no prompt_token_ids")
    out = []
    for choice in sorted(choices, key=lambda c: c["index"]):
        ids = choice.get("token_ids")
        content = (choice.get("logprobs") or {}).get("content")
        if ids is None or content is None or len(content) != len(ids):
            raise broken("token_ids and logprobs.content missing or of different lengths")
        if choice.get("weight_versions") is None:
            raise broken("no weight_versions: the server does not report per-token versions")
        spans = [VersionSpan.model_validate(s) for s in choice["weight_versions"]]
        edges = [0] + [e for s in spans for e in (s.start, s.end)] + [len(ids)]
        if ids and (edges[0::2] != edges[1::2] or any(s.start >= s.end for s in spans)):
            raise broken(f"weight_versions {spans} do not tile [0, {len(ids)})")
        out.append(
            Completion(
                prompt_token_ids=list(prompt_ids),
                token_ids=list(ids),
                logprobs=[float(e["logprob"]) for e in content],
                spans=spans,
                finish_reason=choice.get("finish_reason") or "unknown",
                text=(choice.get("message") or {}).get("content") or "",
                server=server,
            )
        )
    return out


# ----------------------------------------------------------------------------------------------------
# The actor
# ----------------------------------------------------------------------------------------------------
@dataclass
class ActorSummary:
    groups_started: int = 0
    groups_written: int = 0
    samples: int = 0
    tokens: int = 0
    retries: int = 0
    server_failures: int = 0
    waits_lag: int = 0
    waits_buffer: int = 0
    wait_s_lag: float = 0.0
    wait_s_buffer: float = 0.0
    elapsed_s: float = 0.0
    group_ids: list[str] = field(default_factory=list)


@dataclass
class _Window:
    """What was produced since the last stats record."""

    samples: int = 0
    tokens: int = 0
    rewards: list[float] = field(default_factory=list)
    lags: Counter[int] = field(default_factory=Counter)  # lag in versions -> tokens
    since: float = field(default_factory=time.monotonic)


class Actor:
    def __init__(self, cfg: RunConfig, actor_index: int, stop: asyncio.Event, max_groups: int | None):
        a = cfg.actor
        if not 0 <= actor_index < a.num_actors:
            raise ActorError(f"actor index {actor_index} is outside [0, actor.num_actors={a.num_actors})")
        if not cfg.inference.urls:
            raise ActorError("inference.urls is empty: the launcher fills it, or set it to running servers")
        self.cfg, self.index, self.stop, self.max_groups = cfg, actor_index, stop, max_groups
        self.limits = GateLimits.from_config(cfg)
        self.task = make_task(cfg.task)
        self.summary = ActorSummary()
        self.progress = TrainerProgress()
        self.window = _Window()
        self.in_flight_versions: Counter[int] = Counter()  # start version -> own groups in flight
        self.wake = asyncio.Event()  # something the admission gate depends on changed
        self.probe_now = asyncio.Event()  # a request failed: probe unhealthy servers now
        self.failure: BaseException | None = None
        self.rollouts = make_writer(cfg.streams, ROLLOUTS)
        self.stats = make_writer(cfg.streams, STATS)
        self.write_lock = asyncio.Lock()
        clients = [AsyncShimClient(u, cfg.inference.token, a.request_timeout_s) for u in cfg.inference.urls]
        self.router = Router(
            [Server(i, c.base_url, c) for i, c in enumerate(clients)],
            cap=a.max_in_flight_per_server,
            all_down_deadline_s=a.all_servers_down_deadline_s,
            slot_deadline_s=a.request_timeout_s + 60,
        )

    # -- driver -------------------------------------------------------------------------------------
    async def run(self) -> ActorSummary:
        start = time.monotonic()
        self.grader = Grader.from_config(self.task, self.cfg.task)
        events = make_reader(self.cfg.streams, TRAINER_EVENTS)
        groups: set[asyncio.Task] = set()
        helpers: list[asyncio.Task] = []
        try:
            await self._read_events(events, block_s=0.0)  # catch up before the first admission
            await asyncio.gather(*(self._probe(s) for s in self.router.servers))
            for coro in (self._follow_events(events), self._probe_loop(), self._stats_loop()):
                helpers.append(self._spawn(coro))
            problems = self.task.problems(
                shard_index=self.index,
                num_shards=self.cfg.actor.num_actors,
                seed=self.cfg.actor.seed,
                split="train",
            )
            while not self._done_starting():
                problem = next(problems, None)
                if problem is None:
                    logger.info("actor%d: its shard of %s has no more prompts", self.index, self.task.name)
                    break
                admitted = await self._admit()
                if admitted is None:
                    break
                groups.add(self._spawn(self._run_group(problem, *admitted)))
                groups = {t for t in groups if not t.done()}
            while self.failure is None and not self.stop.is_set():
                self.wake.clear()
                groups = {t for t in groups if not t.done()}
                if not groups:
                    break
                await self._wait_wake()
            if self.failure is not None:
                raise self.failure
        finally:
            for task in [*groups, *helpers]:
                task.cancel()
            await asyncio.gather(*groups, *helpers, return_exceptions=True)
            self.summary.elapsed_s = time.monotonic() - start
            with contextlib.suppress(Exception):  # a last record must never mask the real error
                await asyncio.to_thread(self.stats.write, self._stats_record())
            self.grader.close()
            for server in self.router.servers:
                await server.client.aclose()
        return self.summary

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)

        def done(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None and self.failure is None:
                self.failure = t.exception()
            self.wake.set()

        task.add_done_callback(done)
        return task

    def _done_starting(self) -> bool:
        if self.failure is not None:
            raise self.failure
        return self.stop.is_set() or (
            self.max_groups is not None and self.summary.groups_started >= self.max_groups
        )

    async def _wait_wake(self) -> None:
        """Wait for `wake` (cleared by the caller BEFORE it read the state it decides on)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), _POLL_S)

    # -- admission ----------------------------------------------------------------------------------
    async def _admit(self) -> tuple[int, float] | None:
        """Wait until the gate lets one more group start: (published version, time.time()) at that
        moment, or None if the actor is to stop starting groups."""
        blocked: str | None = None
        blocked_since = last_progress = time.monotonic()
        seen = None
        while not self._done_starting():
            self.wake.clear()
            own_before = self.summary.groups_written
            written = await asyncio.to_thread(self.rollouts.total_written)
            # Own writes that finished during the read may be missing from it: add them (double counting
            # one is conservative, missing one is not).
            written += self.summary.groups_written - own_before
            p = self.progress
            in_flight = sum(self.in_flight_versions.values())
            floor = min([p.version, *self.in_flight_versions])
            reason = gate_block(
                self.limits,
                written=written,
                in_flight=in_flight,
                consumed=p.groups_consumed,
                dropped=p.groups_dropped,
                version_floor=floor,
            )
            now = time.monotonic()
            if reason != blocked and blocked is not None:
                self._count_wait(blocked, now - blocked_since)
            if reason is None:
                self.summary.groups_started += 1
                self.in_flight_versions[p.version] += 1
                return p.version, time.time()
            if reason != blocked:
                blocked, blocked_since = reason, now
                setattr(self.summary, f"waits_{reason}", getattr(self.summary, f"waits_{reason}") + 1)
            state = (p.version, p.groups_consumed, self.summary.groups_written)
            if state != seen:
                seen, last_progress = state, now
            elif now - last_progress > self.cfg.actor.trainer_wait_deadline_s:
                raise TrainerStalled(
                    f"waited {now - last_progress:.0f}s ({reason} limit) without the trainer consuming "
                    f"anything: version {p.version}, {p.groups_consumed} groups consumed, {written} written. "
                    "Check the trainer and preprocessor logs, or raise actor.trainer_wait_deadline_s."
                )
            await self._wait_wake()
        if blocked is not None:
            self._count_wait(blocked, time.monotonic() - blocked_since)
        return None

    def _count_wait(self, reason: str, seconds: float) -> None:
        name = f"wait_s_{reason}"
        setattr(self.summary, name, getattr(self.summary, name) + seconds)

    # -- one group ----------------------------------------------------------------------------------
    async def _run_group(self, problem: Problem, start_version: int, started_at: float) -> None:
        a = self.cfg.actor
        parts = [a.attempts] if a.request_mode == "n" else [1] * a.attempts
        done = await asyncio.gather(*(self._generate(problem.messages, n) for n in parts))
        completions = [c for part in done for c in part]
        grades = await asyncio.gather(*(self.grader.grade_async(problem, c.text) for c in completions))
        group_id = f"{self.index}:{problem.prompt_index}"
        samples = [
            Sample(
                sample_id=f"{group_id}/{i}",
                prompt_token_ids=c.prompt_token_ids,
                completion_token_ids=c.token_ids,
                completion_logprobs=c.logprobs,
                version_spans=c.spans,
                finish_reason=c.finish_reason,
                reward=compute_reward(
                    grade, c.finish_reason, len(c.token_ids), a.max_tokens, self.cfg.reward
                ),
                completion_text=c.text,
                server=c.server,
            )
            for i, (c, grade) in enumerate(zip(completions, grades, strict=True))
        ]
        group = RolloutGroup(
            group_id=group_id,
            task=self.task.name,
            prompt_index=problem.prompt_index,
            actor_id=self.index,
            samples=samples,
            metadata={
                **problem.metadata,
                "answer": problem.answer,
                "start_version": start_version,
                "started_at": started_at,
                "grades": list(grades),
            },
        )
        async with self.write_lock:  # one writer call at a time (the Writer is not thread-safe)
            await asyncio.to_thread(self.rollouts.write, group)
        self.in_flight_versions[start_version] -= 1
        if not self.in_flight_versions[start_version]:
            del self.in_flight_versions[start_version]
        self.summary.groups_written += 1
        self.summary.group_ids.append(group_id)
        self._account(samples)
        self.wake.set()

    async def _generate(self, messages: list[dict], n: int) -> list[Completion]:
        a = self.cfg.actor
        failures = 0
        while True:
            server = await self.router.acquire()
            try:
                body = await server.client.chat(
                    messages,
                    n=n,
                    max_tokens=a.max_tokens,
                    temperature=a.temperature,
                    top_p=a.top_p,
                    logprobs=True,
                )
            except Exception as err:
                if not _retryable(err):
                    if isinstance(err, ShimError):
                        raise ActorError(f"request refused, retrying cannot help: {err}") from err
                    raise
                self.router.mark_failed(server, f"{type(err).__name__}: {err}")
                self.probe_now.set()
                self.summary.server_failures += 1
                failures += 1
                if failures > a.request_retries:
                    raise ActorError(
                        f"a request failed {failures} times on {[s.url for s in self.router.servers]} (last: "
                        f"{type(err).__name__}: {err}); raise actor.request_retries or fix the servers"
                    ) from err
                self.summary.retries += 1
                continue
            finally:
                self.router.release(server)
            return parse_chat_response(body, n, server.url)

    # -- background ---------------------------------------------------------------------------------
    async def _read_events(self, reader, block_s: float) -> None:
        while True:
            entries = await asyncio.to_thread(reader.read, 256, block_s)
            for entry in entries:
                self.progress.apply(entry.message)
            if entries:
                self.wake.set()
            if len(entries) < 256:
                return

    async def _follow_events(self, reader) -> None:
        while True:
            await self._read_events(reader, block_s=0.5)

    async def _probe(self, server: Server) -> None:
        try:
            healthy = (await server.client.health()).status == "ok"
        except (httpx.HTTPError, ShimError, ValueError):
            healthy = False
        if healthy:
            self.router.mark_healthy(server)
        elif server.healthy:
            self.router.mark_failed(server, "/health did not answer ok")

    async def _probe_loop(self) -> None:
        while True:
            # A failure triggers a probe at once: a request can fail on a keep-alive connection the
            # server closed at that moment, and a healthy server should not sit out a whole interval.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.probe_now.wait(), self.cfg.actor.health_probe_interval_s)
            self.probe_now.clear()
            await asyncio.gather(*(self._probe(s) for s in self.router.servers if not s.healthy))

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.actor.stats_interval_s)
            record = self._stats_record()
            await asyncio.to_thread(self.stats.write, record)

    def _account(self, samples: list[Sample]) -> None:
        w = self.window
        version = self.progress.version
        for s in samples:
            w.samples += 1
            w.tokens += len(s.completion_token_ids)
            w.rewards.append(s.reward)
            for span in s.version_spans:
                # A server may apply a version a moment before its event reaches us: count that as 0.
                w.lags[max(0, version - span.version)] += span.end - span.start
        self.summary.samples += len(samples)
        self.summary.tokens += sum(len(s.completion_token_ids) for s in samples)

    def _stats_record(self) -> StatsRecord:
        w, self.window = self.window, _Window()
        dt = max(time.monotonic() - w.since, 1e-9)
        lag_tokens = sum(w.lags.values())
        s = self.summary
        values: dict[str, float | int | str | None] = {
            "samples_per_s": w.samples / dt,
            "tokens_per_s": w.tokens / dt,
            "reward_mean": sum(w.rewards) / len(w.rewards) if w.rewards else None,
            "lag_min": min(w.lags) if w.lags else None,
            "lag_mean": sum(k * v for k, v in w.lags.items()) / lag_tokens if lag_tokens else None,
            "lag_max": max(w.lags) if w.lags else None,
            "trainer_version": self.progress.version,
            "groups_consumed": self.progress.groups_consumed,
            "groups_started": s.groups_started,
            "groups_written": s.groups_written,
            "groups_in_flight": sum(self.in_flight_versions.values()),
            "waits_lag": s.waits_lag,
            "waits_buffer": s.waits_buffer,
            "wait_s_lag": s.wait_s_lag,
            "wait_s_buffer": s.wait_s_buffer,
            "retries": s.retries,
            "server_failures": s.server_failures,
            "healthy_servers": sum(srv.healthy for srv in self.router.servers),
        }
        for srv in self.router.servers:
            values[f"in_flight_server{srv.index}"] = srv.in_flight
            values[f"failures_server{srv.index}"] = srv.failures
        return StatsRecord(source=f"actor{self.index}", values=values)


async def run_actor(
    cfg: RunConfig,
    actor_index: int,
    *,
    stop: asyncio.Event | None = None,
    max_groups: int | None = None,
) -> ActorSummary:
    """Generate groups until `stop` is set or `max_groups` groups are written (then every started group
    is written before returning). Raises ActorError (AllServersDown, TrainerStalled, ...) or StreamsError."""
    actor = Actor(cfg, actor_index, stop or asyncio.Event(), max_groups)
    return await actor.run()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="pipeline-rl actor", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="RUN/config.json written by the launcher")
    parser.add_argument("--index", type=int, required=True, help="this actor's shard, 0..num_actors-1")
    parser.add_argument("--max-groups", type=int, default=None, help="stop after this many groups")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    cfg = load_run_config(args.config)

    async def run() -> ActorSummary:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await run_actor(cfg, args.index, stop=stop, max_groups=args.max_groups)

    try:
        summary = asyncio.run(run())
    except (ActorError, StreamsError) as err:
        raise SystemExit(f"actor{args.index}: {type(err).__name__}: {err}") from None
    logger.info(
        "actor%d done: %d groups, %d samples in %.1fs",
        args.index,
        summary.groups_written,
        summary.samples,
        summary.elapsed_s,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
