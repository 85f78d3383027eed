"""The actor's loop: turns this actor's shard of prompts into complete GRPO groups on the `rollouts` topic.

    summary = await run_actor(cfg, actor_index=0, max_groups=16)  # tests and tools

One asyncio loop per actor process talks to every inference server (`inference.urls`) over HTTP,
through inference_shim.client (typed responses, checked against the contract). For each prompt of
`task.problems(shard_index=index, num_shards=num_actors, seed=actor.seed)` it waits for the admission
gate (pipeline_rl/actor/gate.py), samples `actor.attempts` completions (`actor.request_mode`: one chat
request with n=attempts, or one request per sample) on the server the router picks
(pipeline_rl/actor/router.py), grades them (tasks.Grader, never on the event loop for slow graders),
and writes ONE RolloutGroup once every sample is in. Nothing partial is ever written, so a group is
written once; a failed request is retried on another server and its partial result never used.

Ids '<index>-<incarnation>:<prompt_index>' (a random incarnation per process start) never repeat,
although a restarted actor walks its prompts from 0 again. Sample ids go to the run's ledger
(pipeline_rl/ledger.py) as generated just before their group goes to the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from pydantic import ValidationError

from inference_shim.client import AsyncShimClient, ShimError
from inference_shim.faults import fault_point
from pipeline_rl.actor import rounds
from pipeline_rl.actor.completions import Completion, completions_of
from pipeline_rl.actor.episode import Episode, EpisodeLimits, replay_environment, run_episode
from pipeline_rl.actor.errors import ActorError, TrainerStalled
from pipeline_rl.actor.gate import GateLimits, TrainerProgress, gate_block
from pipeline_rl.actor.router import POLL_S, Router, Server, retryable
from pipeline_rl.config import RunConfig
from pipeline_rl.fleet import FleetWatch
from pipeline_rl.ledger import REWARD_FAILED, LedgerWriter
from pipeline_rl.messages import (
    CarriedGroup,
    CompletionSample,
    DeadLetter,
    PartialSample,
    RolloutGroup,
    Sample,
    StatsRecord,
)
from pipeline_rl.streams import (
    CARRIED,
    CARRY_GROUP,
    DEAD_LETTER,
    ROLLOUTS,
    STATS,
    TRAINER_EVENTS,
    make_reader,
    make_writer,
)
from pipeline_rl.tasks import Grader, Problem, compute_reward, make_task
from pipeline_rl.tasks.grader import Judgement

logger = logging.getLogger("pipeline_rl.actor")

WAIT_REASONS = ("lag", "buffer")  # what gate_block can answer


def request_seed(run_seed: int, prompt_index: int, part: int) -> int:
    """The sampling seed of one request: a hash of the run's seed, the problem and which of its requests
    (request_mode per_sample, or an episode) this is, so requests never share a random stream and a run
    with the same seed asks for the same streams."""
    digest = hashlib.blake2b(f"{run_seed}:{prompt_index}:{part}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2  # the engine takes seeds in [0, 2**63), and adds n - 1


@dataclass
class ActorSummary:
    groups_started: int = 0
    groups_written: int = 0
    samples: int = 0
    tokens: int = 0
    retries: int = 0
    server_failures: int = 0
    tool_faults: int = 0  # multi-turn tasks: malformed calls, unknown tools, tool errors (observations)
    episodes: int = 0
    episode_turns: int = 0
    waits: Counter[str] = field(default_factory=Counter)  # reason -> times admission blocked on it
    wait_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(WAIT_REASONS, 0.0))  # seconds
    elapsed_s: float = 0.0
    group_ids: list[str] = field(default_factory=list)
    carried: int = 0  # answers a round cut (partial rollouts), counted once per cut
    carried_groups: int = 0  # groups a round carried, counted once per round


def _tokenizer(model_path: str):
    from transformers import AutoTokenizer  # only multi-turn tasks pay for the import

    return AutoTokenizer.from_pretrained(model_path)


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
        # 48 random bits per process start: ids of two lives of one actor collide with odds ~2^-48.
        self.incarnation = uuid.uuid4().hex[:12]
        self.ledger = LedgerWriter(cfg.run_dir, f"actor{actor_index}-{self.incarnation}")
        self.ledger.started()  # its pid: an unclean exit (the launcher's record) abandons its last group
        self.limits = GateLimits.from_config(cfg)
        self.task = make_task(cfg.task)
        # Multi-turn tasks render the environment's turns to tokens on this side (token in / token out).
        self.tokenizer = _tokenizer(cfg.model_path) if getattr(self.task, "multi_turn", False) else None
        self.summary = ActorSummary()
        self.progress = TrainerProgress()
        self.window = _Window()
        self.in_flight_versions: Counter[int] = Counter()  # start version -> own groups in flight
        self.sequences_in_flight = 0  # answers the servers decode for this actor now
        self.wake = asyncio.Event()  # something the admission gate depends on changed
        self.probe_now = asyncio.Event()  # a request failed: probe unhealthy servers now
        self.failure: BaseException | None = None
        self.rollouts = make_writer(cfg.streams, ROLLOUTS)
        self.dead_letters = make_writer(cfg.streams, DEAD_LETTER)
        self.stats = make_writer(cfg.streams, STATS)
        # One thread writes every stats record, in the order they were made: a periodic write still
        # running when the actor stops (a cancelled await does not stop its thread) could otherwise land
        # after the final record and leave an older count last in the stream.
        self.stats_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"actor{actor_index}-stats")
        self.write_lock = asyncio.Lock()
        # Sampled completions for the trackers' tables: the first ones of every samples_every_steps steps.
        t = cfg.tracking
        self.share_samples = t.samples_every_steps if t.enabled else 0
        self.samples_bucket, self.samples_shared = -1, 0
        clients = [
            AsyncShimClient(u, cfg.inference.token, a.request_timeout_s, api_key=cfg.inference.api_key)
            for u in cfg.inference.urls
        ]
        self.fleet = FleetWatch(cfg.run_dir, cfg.inference.urls)
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
            if self.cfg.actor.round_tokens is not None:
                await self._run_rounds(problems)
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
            try:
                await self._write_stats(self._stats_record())
            except Exception as e:  # a last record must never mask the real error; say it is missing
                logger.warning("actor%d: its final stats record was not written: %s", self.index, e)
            self.stats_thread.shutdown(wait=False)
            self.grader.close()
            self.ledger.close()
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
            await asyncio.wait_for(self.wake.wait(), POLL_S)

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
                samples_dropped=p.samples_dropped,
            )
            now = time.monotonic()
            if reason != blocked and blocked is not None:
                self.summary.wait_s[blocked] += now - blocked_since
            if reason is None:
                self.summary.groups_started += 1
                self.in_flight_versions[p.version] += 1
                return p.version, time.time()
            if reason != blocked:
                blocked, blocked_since = reason, now
                self.summary.waits[reason] += 1
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
            self.summary.wait_s[blocked] += time.monotonic() - blocked_since
        return None

    # -- sync rounds with partial rollouts (actor.round_tokens; pipeline_rl/actor/rounds.py) -----------
    async def _run_rounds(self, problems: Iterator[Problem]) -> None:
        """Rounds until the actor stops or runs out of prompts and carried groups (rounds.py has the
        rule). A round's cut groups go to the `carried` topic and are acknowledged there only once their
        next state (written, or carried again) is durable, so a killed actor's successor continues them."""
        steps, buffered = self.limits.groups_per_step, self.cfg.actor.max_buffered_groups
        carried_in = make_reader(
            self.cfg.streams, CARRIED, group=CARRY_GROUP, consumer=f"actor{self.index}", claim_idle_s=None
        )
        self.carried_out = make_writer(self.cfg.streams, CARRIED)
        out_of_prompts = False
        try:
            while True:
                carried = await asyncio.to_thread(_read_all, carried_in)
                starting = not (out_of_prompts or self._done_starting())
                if not carried and not starting:
                    return
                round_version, cut_before = self.progress.version, self.summary.carried_groups
                active = {self._spawn(self._advance(g, entry_id, carried_in)) for entry_id, g in carried}
                while True:
                    self.wake.clear()
                    active = {t for t in active if not t.done()}
                    starting = starting and not self._done_starting()
                    if starting:
                        waiting = await self._groups_waiting()
                        cut = self.summary.carried_groups - cut_before
                        if rounds.may_start_new(len(active), cut, waiting, buffered):
                            problem = next(problems, None)
                            if problem is None:
                                logger.info(
                                    "actor%d: its shard of %s has no more prompts", self.index, self.task.name
                                )
                                out_of_prompts = starting = False
                                continue
                            self.summary.groups_started += 1
                            active.add(self._spawn(self._advance(self._fresh(problem), None, carried_in)))
                            continue
                    if not active:
                        break
                    await self._wait_wake()
                if self.failure is not None:
                    raise self.failure
                if self.stop.is_set():
                    return  # what this round cut waits on `carried` for the next start
                if await self._groups_waiting() >= steps:  # else the trainer lacks a batch: go on
                    await self._wait_version_after(round_version)
        finally:
            carried_in.close()
            self.carried_out.close()

    async def _groups_waiting(self) -> int:
        """Groups written (by anyone) and not yet consumed by the trainer."""
        own_before = self.summary.groups_written
        written = await asyncio.to_thread(self.rollouts.total_written)
        written += self.summary.groups_written - own_before  # own writes the read may have missed
        return written - self.progress.groups_consumed

    async def _wait_version_after(self, version: int) -> None:
        """Until the trainer publishes a version newer than `version` (the step of the last round)."""
        since = time.monotonic()
        while self.progress.version <= version:
            if self._done_starting():
                return
            if time.monotonic() - since > self.cfg.actor.trainer_wait_deadline_s:
                raise TrainerStalled(
                    f"waited {time.monotonic() - since:.0f}s for the step after version {version} with a "
                    f"round's groups written ({self.progress.groups_consumed} consumed). Check the trainer and "
                    "preprocessor logs, or raise actor.trainer_wait_deadline_s."
                )
            self.wake.clear()
            await self._wait_wake()

    def _fresh(self, problem: Problem) -> CarriedGroup:
        """A new group as a carried group that has run in no round yet."""
        return CarriedGroup(
            group_id=f"{self.index}-{self.incarnation}:{problem.prompt_index}",
            problem=problem.model_dump(),
            start_version=self.progress.version,
            started_at=time.time(),
            rounds=0,
            samples=[PartialSample(prompt_token_ids=[]) for _ in range(self.cfg.actor.attempts)],
        )

    async def _advance(self, group: CarriedGroup, entry_id: str | None, carried_in) -> None:
        """One round of a group: every unfinished answer gets up to round_tokens more tokens; then the
        group is written if every answer ended, else carried again. Its old `carried` entry is acked
        after either (a kill in between: the successor continues the group from the older state, and a
        second write of it is a duplicate the preprocessor drops)."""
        version = self.progress.version
        self.in_flight_versions[version] += 1
        try:
            problem = Problem.model_validate(group.problem)
            await self._segments(problem, group)
            group.rounds += 1
            if all(s.finish_reason is not None for s in group.samples) and self.tokenizer is not None:
                played = [Episode.from_dict(s.episode or {}) for s in group.samples]
                samples, judgements, extra = await self._judge_episodes(problem, group.group_id, played)
                extra = {**extra, "rounds": group.rounds, "segments": [s.segments for s in group.samples]}
                await self._write_group(
                    problem, group.group_id, group.start_version, group.started_at, samples, judgements, extra
                )
            elif all(s.finish_reason is not None for s in group.samples):
                completions = [
                    Completion(
                        prompt_token_ids=s.prompt_token_ids,
                        token_ids=s.token_ids,
                        logprobs=s.logprobs,
                        spans=s.version_spans,
                        finish_reason=s.finish_reason or "unknown",
                        text=s.text,
                        server=s.server,
                    )
                    for s in group.samples
                ]
                samples, judgements = await self._judge(problem, group.group_id, completions)
                extra = {"rounds": group.rounds, "segments": [s.segments for s in group.samples]}
                await self._write_group(
                    problem, group.group_id, group.start_version, group.started_at, samples, judgements, extra
                )
            else:
                async with self.write_lock:
                    cut = [
                        i
                        for i, s in zip(group.sample_ids(), group.samples, strict=True)
                        if s.finish_reason is None
                    ]
                    self.ledger.carried(group.group_id, cut)
                    await asyncio.to_thread(self.carried_out.write, group)
                self.summary.carried += len(cut)
                self.summary.carried_groups += 1
            fault_point("actor.carried")  # chaos tests: the new state is durable, the old not yet acked
            if entry_id is not None:
                await asyncio.to_thread(carried_in.ack, [entry_id])
        finally:
            self.in_flight_versions[version] -= 1
            if not self.in_flight_versions[version]:
                del self.in_flight_versions[version]
            self.wake.set()

    async def _segments(self, problem: Problem, group: CarriedGroup) -> None:
        """This round's requests of one group: a fresh group asks as request_mode says (chat, capped);
        a cut answer continues from its token ids on /v1/completions."""
        a, length = self.cfg.actor, self.cfg.inference.max_model_len or 10**9
        cap = a.round_tokens or a.max_tokens
        if self.tokenizer is not None:  # a multi-turn task: each answer is an episode
            unfinished = [i for i, s in enumerate(group.samples) if s.finish_reason is None]
            await asyncio.gather(*(self._play_round(problem, group, i, cap) for i in unfinished))
            return
        fresh = [i for i, s in enumerate(group.samples) if s.segments == 0]
        if len(fresh) == len(group.samples) and a.request_mode == "n":
            [done] = await asyncio.gather(
                self._generate(
                    problem.messages, a.attempts, self._seed(problem, 0), max_tokens=min(cap, a.max_tokens)
                )
            )
            for sample, c in zip(group.samples, done, strict=True):
                self._first_segment(sample, c, min(cap, a.max_tokens), length)
            return
        await asyncio.gather(
            *(
                self._continue(problem, group, i, cap, length)
                for i, s in enumerate(group.samples)
                if s.finish_reason is None
            )
        )

    async def _play_round(self, problem: Problem, group: CarriedGroup, i: int, cap: int) -> None:
        """One round of episode i of a multi-turn group: at most `cap` model tokens, the environment's
        turns in between (its tool time counts toward the round). A carried episode's environment is
        rebuilt by replaying its replies (replay_environment)."""
        sample = group.samples[i]
        carried = sample.episode
        play = self._episode_on_a_server(problem, i, carried=carried, round_tokens=cap)
        episode = await self._on_a_server(play)
        sample.episode, sample.segments = episode.to_dict(), sample.segments + 1
        if episode.end:
            sample.finish_reason = episode.finish_reason
            self.summary.episodes += 1
            self.summary.episode_turns += episode.turns

    def _first_segment(self, sample: PartialSample, c: Completion, asked: int, length: int) -> None:
        """A chat answer as the first round's tokens of `sample`."""
        sample.prompt_token_ids = c.prompt_token_ids
        rounds.extend(
            sample,
            c.token_ids,
            c.logprobs,
            c.spans,
            c.text,
            c.finish_reason,
            c.server,
            asked=asked,
            max_tokens=self.cfg.actor.max_tokens,
            max_model_len=length,
        )

    async def _continue(self, problem: Problem, group: CarriedGroup, i: int, cap: int, length: int) -> None:
        a = self.cfg.actor
        sample = group.samples[i]
        seed = self._seed(problem, a.attempts * sample.segments + i)
        if sample.segments == 0:
            asked = min(cap, a.max_tokens)
            [c] = await self._generate(problem.messages, 1, seed, max_tokens=asked)
            self._first_segment(sample, c, asked, length)
            return
        asked = rounds.segment_tokens(sample, a.max_tokens, cap, length)
        prompt = sample.prompt_token_ids + sample.token_ids

        async def ask(server: Server):
            response = await server.client.completion(
                prompt,
                max_tokens=asked,
                temperature=a.temperature,
                top_p=a.top_p,
                logprobs=0,
                n=1,
                **({} if seed is None else {"seed": seed}),
            )
            return response.choices[0], server.url

        choice, url = await self._on_a_server(ask)
        logprobs = list(choice.logprobs.token_logprobs or []) if choice.logprobs else []
        if (
            choice.token_ids is None
            or choice.weight_versions is None
            or len(logprobs) != len(choice.token_ids)
        ):
            raise ActorError(
                f"{url} broke the inference contract (a completion without token_ids, weight_versions or one "
                "logprob per token); see docs/contract.md"
            )
        rounds.extend(
            sample,
            list(choice.token_ids),
            logprobs,
            list(choice.weight_versions),
            choice.text,
            choice.finish_reason or "unknown",
            url,
            asked=asked,
            max_tokens=a.max_tokens,
            max_model_len=length,
        )

    # -- one group ----------------------------------------------------------------------------------
    async def _run_group(self, problem: Problem, start_version: int, started_at: float) -> None:
        group_id = f"{self.index}-{self.incarnation}:{problem.prompt_index}"
        if getattr(self.task, "multi_turn", False):
            samples, judgements, extra = await self._episodes(problem, group_id)
        else:
            samples, judgements = await self._single_turn(problem, group_id)
            extra = {}
        await self._write_group(problem, group_id, start_version, started_at, samples, judgements, extra)
        self.in_flight_versions[start_version] -= 1
        if not self.in_flight_versions[start_version]:
            del self.in_flight_versions[start_version]
        self.wake.set()

    async def _write_group(
        self,
        problem: Problem,
        group_id: str,
        start_version: int,
        started_at: float,
        samples: list[Sample],
        judgements: list[Judgement],
        extra: dict,
    ) -> None:
        """Ledger, then the stream: the scored samples as one RolloutGroup, the unscored as drops."""
        incarnation = group_id.split(":", 1)[0].split("-", 1)[1]  # a carried group keeps its first writer's
        failed = [(s, j.error) for s, j in zip(samples, judgements, strict=True) if j.error is not None]
        kept = [(s, j) for s, j in zip(samples, judgements, strict=True) if j.error is None]
        group = RolloutGroup(
            group_id=group_id,
            task=self.task.name,
            prompt_index=problem.prompt_index,
            actor_id=self.index,
            incarnation=incarnation,
            samples=[s for s, _ in kept],
            metadata={
                **problem.metadata,
                "answer": problem.answer,
                "start_version": start_version,
                "started_at": started_at,
                "grades": [j.grade for _, j in kept],
                **extra,
            },
        )
        async with self.write_lock:  # one writer call at a time (the Writer is not thread-safe)
            # Ledger first: a kill between the two leaves "generated, in flight", never an unknown id.
            self.ledger.generated(group_id, [s.sample_id for s in samples])
            if failed:
                await asyncio.to_thread(self._drop_unscored, group_id, failed)
            if kept:
                await asyncio.to_thread(self.rollouts.write, group)
        if kept:
            self.summary.groups_written += 1
            self.summary.group_ids.append(group_id)
            self._share_sample(problem, *kept[0])
        self._account([s for s, _ in kept])

    def _share_sample(self, problem: Problem, sample: Sample, judgement: Judgement) -> None:
        """One completion of this group for the trackers' table, while the table of the current
        samples_every_steps interval has room (written by the stats thread; never awaited)."""
        if not self.share_samples:
            return
        bucket = self.progress.version // self.share_samples
        if bucket != self.samples_bucket:
            self.samples_bucket, self.samples_shared = bucket, 0
        if self.samples_shared >= self.cfg.tracking.samples_per_table:
            return
        self.samples_shared += 1
        cut = self.cfg.tracking.sample_chars
        prompt = "\n".join(f"{m['role']}: {m['content']}" for m in problem.messages)
        record = CompletionSample(
            source=f"actor{self.index}",
            step=self.progress.version,
            prompt=prompt[-cut:],  # the end of a long prompt is the question
            completion=sample.completion_text[:cut],
            reward=sample.reward,
            grade=judgement.grade,
            weight_versions=sorted({span.version for span in sample.version_spans}),
        )
        with contextlib.suppress(RuntimeError):  # the stats thread is shut down once the actor stops
            self.stats_thread.submit(self.stats.write, record)

    def _drop_unscored(self, group_id: str, failed: list[tuple[Sample, str]]) -> None:
        """Samples the user's reward could not score: dropped with the reason, in the ledger and as dead
        letters (what the completion was, for a person to look at); the group goes on without them."""
        for sample, reason in failed:
            self.ledger.dropped(REWARD_FAILED, [sample.sample_id], group=group_id, detail=reason)
        self.dead_letters.write_many(
            [
                DeadLetter(
                    topic=ROLLOUTS, stream_id=s.sample_id, error=reason, raw=(s.completion_text or "")[:2000]
                )
                for s, reason in failed
            ]
        )

    async def _episodes(self, problem: Problem, group_id: str) -> tuple[list[Sample], list[Judgement], dict]:
        """A multi-turn task's group: `attempts` episodes, each judged on all the model's text."""
        a = self.cfg.actor
        played = await asyncio.gather(*(self._play(problem, i) for i in range(a.attempts)))
        return await self._judge_episodes(problem, group_id, played)

    async def _judge_episodes(
        self, problem: Problem, group_id: str, played: list[Episode]
    ) -> tuple[list[Sample], list[Judgement], dict]:
        judgements = await asyncio.gather(
            *(self.grader.judge_async(problem, "".join(e.texts)) for e in played)
        )
        budget = self.cfg.task.episode_token_budget
        samples = [
            e.sample(
                f"{group_id}/{i}",
                reward=compute_reward(
                    j.grade, e.finish_reason, sum(e.mask), budget, self.cfg.reward, j.score
                ),
            )
            for i, (e, j) in enumerate(zip(played, judgements, strict=True))
        ]
        extra = {"turns": [e.turns for e in played], "episode_ends": [e.end for e in played]}
        return samples, judgements, extra

    async def _single_turn(self, problem: Problem, group_id: str) -> tuple[list[Sample], list[Judgement]]:
        a = self.cfg.actor
        parts = [a.attempts] if a.request_mode == "n" else [1] * a.attempts
        done = await asyncio.gather(
            *(self._generate(problem.messages, n, self._seed(problem, i)) for i, n in enumerate(parts))
        )
        return await self._judge(problem, group_id, [c for part in done for c in part])

    async def _judge(
        self, problem: Problem, group_id: str, completions: list[Completion]
    ) -> tuple[list[Sample], list[Judgement]]:
        """A single-turn group's completions graded and rewarded, as Samples."""
        a = self.cfg.actor
        judgements = await asyncio.gather(*(self.grader.judge_async(problem, c.text) for c in completions))
        samples = [
            Sample(
                sample_id=f"{group_id}/{i}",
                prompt_token_ids=c.prompt_token_ids,
                completion_token_ids=c.token_ids,
                completion_logprobs=c.logprobs,
                version_spans=c.spans,
                finish_reason=c.finish_reason,
                reward=compute_reward(
                    j.grade, c.finish_reason, len(c.token_ids), a.max_tokens, self.cfg.reward, j.score
                ),
                completion_text=c.text,
                server=c.server,
            )
            for i, (c, j) in enumerate(zip(completions, judgements, strict=True))
        ]
        return samples, judgements

    def _seed(self, problem: Problem, part: int) -> int | None:
        if not self.cfg.actor.seed_requests:
            return None
        return request_seed(self.cfg.seed, problem.prompt_index, part)

    async def _generate(
        self, messages: list[dict], n: int, seed: int | None, max_tokens: int | None = None
    ) -> list[Completion]:
        a = self.cfg.actor

        async def ask(server: Server) -> list[Completion]:
            response = await server.client.chat(
                messages,
                n=n,
                max_tokens=a.max_tokens if max_tokens is None else max_tokens,
                temperature=a.temperature,
                top_p=a.top_p,
                logprobs=True,
                **({} if seed is None else {"seed": seed}),
            )
            return completions_of(response, n, server.url)

        return await self._on_a_server(ask, sequences=n)

    def _episode_settings(self) -> tuple[EpisodeLimits, dict]:
        a, t = self.cfg.actor, self.cfg.task
        limits = EpisodeLimits(
            max_turns=t.episode_max_turns,
            max_tokens_per_turn=a.max_tokens,
            token_budget=t.episode_token_budget,
        )
        return limits, {"temperature": a.temperature, "top_p": a.top_p}

    async def _play(self, problem: Problem, attempt: int) -> Episode:
        """One episode of a multi-turn task, on one server (a failed one: the whole episode again on
        another)."""
        episode = await self._on_a_server(self._episode_on_a_server(problem, attempt))
        self.summary.episodes += 1
        self.summary.episode_turns += episode.turns
        return episode

    def _episode_on_a_server(
        self, problem: Problem, attempt: int, carried: dict | None = None, round_tokens: int | None = None
    ):
        """The work _on_a_server runs for episode `attempt`: a new environment (brought to a `carried`
        episode's state by replaying its replies), then the episode, or one round of it."""
        limits, sampling = self._episode_settings()

        async def play(server: Server) -> Episode:
            env = self.task.environment(problem)
            episode = None
            if carried is not None:
                episode = Episode.from_dict(carried)  # a fresh copy for every attempt
                await replay_environment(env, episode)
            faults_before = len(env.faults)
            episode = await run_episode(
                server.client,
                self.tokenizer,
                env,
                limits,
                sampling,
                self.cfg.inference.max_model_len,
                seed=self._seed(problem, attempt),
                episode=episode,
                round_tokens=round_tokens,
            )
            self.summary.tool_faults += len(env.faults) - faults_before
            return episode

        return play

    async def _on_a_server(self, work, sequences: int = 1):
        """`await work(server)` on a server the router picks; a failure another server may not have is
        retried elsewhere, up to actor.request_retries times. `sequences`: how many the request decodes
        (stats: sequences in flight)."""
        a = self.cfg.actor
        failures = 0
        while True:
            server = await self.router.acquire()
            self.sequences_in_flight += sequences
            try:
                result = await work(server)
            except Exception as err:
                if self.router.defer(server, err):  # draining for a weight update: not a failure
                    continue
                if not retryable(err):
                    if isinstance(err, ShimError):
                        raise ActorError(f"request refused, retrying cannot help: {err}") from err
                    if isinstance(err, ValidationError):
                        raise ActorError(
                            f"{server.url} broke the inference contract ({err}); see docs/contract.md"
                        ) from err
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
                self.sequences_in_flight -= sequences
                self.router.release(server)
            if not self._in_weight_group(server):
                # Left out of the weight group (ejected): no more requests until it is back in. This
                # answer is kept; the trainer drops samples that are too old when it trains.
                self.router.mark_failed(server, "not in the trainer's weight group any more")
                self.probe_now.set()
            return result

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

    def _in_weight_group(self, server: Server) -> bool:
        """Whether the trainer's last event lists this server among those holding its version: one left
        out (ejected, restarting, not yet admitted) serves old weights whose samples would be dropped."""
        servers = self.progress.servers
        return servers is None or server.url in servers

    async def _probe(self, server: Server) -> None:
        try:
            healthy = (await server.client.health()).status == "ok" and self._in_weight_group(server)
        except (httpx.HTTPError, ShimError, ValueError):
            healthy = False
        if healthy:
            self.router.mark_healthy(server)
        elif server.healthy:
            self.router.mark_failed(server, "/health not ok, or not in the trainer's weight group")

    async def _probe_loop(self) -> None:
        while True:
            # A failure triggers a probe at once: a request can fail on a keep-alive connection the
            # server closed at that moment, and a healthy server should not sit out a whole interval.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.probe_now.wait(), self.cfg.actor.health_probe_interval_s)
            self.probe_now.clear()
            self._follow_fleet()
            await asyncio.gather(
                *(self._probe(s) for s in self.router.servers if not s.healthy and not s.removed)
            )

    def _follow_fleet(self) -> None:
        """Servers added to or removed from the job (pipeline_rl/fleet.py)."""
        urls = self.fleet.poll()
        if urls is None:
            return
        known = {s.url for s in self.router.servers if not s.removed}
        for url in urls:
            if url not in known:
                client = AsyncShimClient(
                    url,
                    self.cfg.inference.token,
                    self.cfg.actor.request_timeout_s,
                    api_key=self.cfg.inference.api_key,
                )
                self.router.add(Server(len(self.router.servers), client.base_url, client))
                logger.info("server %s added to the job", url)
        for url in known - set(urls):
            self.router.remove(url)
            logger.info("server %s removed from the job", url)

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.actor.stats_interval_s)
            await self._write_stats(self._stats_record())

    async def _write_stats(self, record: StatsRecord) -> None:
        await asyncio.wrap_future(self.stats_thread.submit(self.stats.write, record))

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
            "carried": s.carried,
            "sequences_in_flight": self.sequences_in_flight,
            "retries": s.retries,
            "server_failures": s.server_failures,
            "tool_faults": s.tool_faults,
            "turns_per_episode": s.episode_turns / s.episodes if s.episodes else None,
            "healthy_servers": sum(srv.healthy for srv in self.router.servers),
        }
        for reason in WAIT_REASONS:
            values[f"waits_{reason}"] = s.waits[reason]
            values[f"wait_s_{reason}"] = s.wait_s[reason]
        for srv in self.router.servers:
            values[f"in_flight_server{srv.index}"] = srv.in_flight
            values[f"failures_server{srv.index}"] = srv.failures
        return StatsRecord(source=f"actor{self.index}", values=values)


def _read_all(reader) -> list[tuple[str, CarriedGroup]]:
    """Every carried group the `carried` topic holds for this actor now: its own unacknowledged entries
    (a restart) first, then the new ones, oldest first."""
    out: list[tuple[str, CarriedGroup]] = []
    while entries := reader.read(count=256, block_s=0.0):
        out += [(e.id, e.message) for e in entries if isinstance(e.message, CarriedGroup)]
        reader.ack([e.id for e in entries if not isinstance(e.message, CarriedGroup)])
    return out


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
