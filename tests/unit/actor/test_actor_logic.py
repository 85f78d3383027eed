"""The actor's logic without servers: the admission gate's lag and buffer limits, the trainer progress
it follows, per-request sampling seeds, least-loaded routing with health probes (dead URLs only), and
the responses checked against the contract."""

from __future__ import annotations

import asyncio
import tempfile
import time
import uuid

import pytest
from pydantic import ValidationError

from inference_shim.client import AsyncShimClient
from inference_shim.openai_protocol import ChatCompletionResponse
from pipeline_rl.actor import (
    ActorError,
    AllServersDown,
    GateLimits,
    Router,
    Server,
    TrainerProgress,
    completions_of,
    gate_block,
    request_seed,
)
from pipeline_rl.config import RunConfig
from pipeline_rl.messages import PreprocessorProgress, WeightVersionEvent


# ----------------------------------------------------------------------------------------------------
# Admission gate and trainer progress (pure logic)
# ----------------------------------------------------------------------------------------------------
def test_gate_lag_and_buffer_limits() -> None:
    one = GateLimits(groups_per_step=2, max_lag=1, max_buffered=5, own_quota=5, others_reserve=0)

    def block(**kw):
        state = {"written": 0, "in_flight": 0, "consumed": 0, "dropped": 0, "version_floor": 0} | kw
        return gate_block(one, **state)

    # Version 0, lag 1: groups 1..4 train at steps 1..2 with weights 0..1; the 5th would be 2 stale.
    assert block(in_flight=3) is None
    assert block(in_flight=4) == "lag"
    assert block(written=2, in_flight=2) == "lag"
    # After one step (version 1, 2 consumed) two more fit; an old group in flight keeps the floor at 0.
    assert block(written=5, consumed=2, version_floor=1) is None
    assert block(written=6, consumed=2, version_floor=1) == "lag"
    assert block(written=4, consumed=2, version_floor=0) == "lag"
    # Dropped groups never take a training slot: they free lag room (and count as consumed).
    assert block(written=6, consumed=3, dropped=1, version_floor=1) is None
    assert block(written=7, consumed=3, dropped=1, version_floor=1) == "lag"
    # Buffer: started and unconsumed may not exceed 5, whatever the lag allows.
    wide = GateLimits(groups_per_step=2, max_lag=100, max_buffered=5, own_quota=5, others_reserve=0)
    assert gate_block(wide, written=3, in_flight=1, consumed=0, dropped=0, version_floor=0) is None
    assert gate_block(wide, written=3, in_flight=2, consumed=0, dropped=0, version_floor=0) == "buffer"
    assert gate_block(wide, written=7, in_flight=1, consumed=4, dropped=0, version_floor=2) is None
    assert gate_block(wide, written=8, in_flight=1, consumed=4, dropped=0, version_floor=2) == "buffer"
    # With other actors: their worst-case in-flight groups are reserved, and this one keeps to its share.
    shared = GateLimits(groups_per_step=2, max_lag=100, max_buffered=6, own_quota=2, others_reserve=2)
    assert gate_block(shared, written=1, in_flight=1, consumed=0, dropped=0, version_floor=0) is None
    assert gate_block(shared, written=0, in_flight=2, consumed=0, dropped=0, version_floor=0) == "buffer"
    assert gate_block(shared, written=3, in_flight=0, consumed=0, dropped=0, version_floor=0) is None
    assert gate_block(shared, written=4, in_flight=0, consumed=0, dropped=0, version_floor=0) == "buffer"


def test_single_dropped_samples_free_lag_room_in_group_equivalents() -> None:
    """A filter that drops half of every group makes a step take twice G groups: without counting the
    dropped samples (P = samples_dropped / attempts) the lag limit would stop the actors for good."""
    limits = GateLimits(
        groups_per_step=2, max_lag=2, max_buffered=8, own_quota=8, others_reserve=0, attempts=4
    )
    # Version 2 after 2 steps of 4 half-groups each: 10 written, 8 trained, 20 samples dropped (5 groups' worth).
    state = {"written": 10, "in_flight": 0, "consumed": 8, "dropped": 0, "version_floor": 2}
    assert gate_block(limits, **state) == "lag"  # 11 > 2 * (2 + 2 + 1): the stall a thinning filter caused
    assert gate_block(limits, **state, samples_dropped=20) is None  # 11 - 5 <= 10
    assert gate_block(limits, **state | {"written": 15}, samples_dropped=20) == "lag"  # 16 - 5 > 10
    progress = TrainerProgress()
    progress.apply(PreprocessorProgress(preprocessor_id="odd0", groups_in=10, groups_dropped=0, samples_out=20,
                                        samples_dropped=20))  # fmt: skip
    progress.apply(PreprocessorProgress(preprocessor_id="prep0", groups_in=10, groups_dropped=1, samples_out=16,
                                        samples_dropped=2))  # fmt: skip
    assert (progress.samples_dropped, progress.groups_dropped) == (22, 1)


def test_gate_limits_from_config_share_budgets_between_actors() -> None:
    def limits(**actor) -> GateLimits:
        return GateLimits.from_config(_config("redis://unused", ["http://unused"], **actor))

    solo = limits(attempts=8, batch_size=32, max_lag=4, max_buffered_groups=64)
    assert (solo.groups_per_step, solo.own_quota, solo.others_reserve) == (4, 64, 0)
    # Two actors: each may hold a fifth of... min(64//2, 4*5//2, 4*4//1) = 10 groups; the other's 10 reserved.
    duo = limits(attempts=8, batch_size=32, max_lag=4, max_buffered_groups=64, num_actors=2)
    assert (duo.own_quota, duo.others_reserve) == (10, 10)
    # Progress check: an actor with nothing in flight can still start the last group of a step.
    assert gate_block(duo, written=3, in_flight=0, consumed=0, dropped=0, version_floor=0) is None
    with pytest.raises(ActorError, match="max_lag"):
        limits(attempts=2, batch_size=4, max_lag=0, num_actors=2)
    with pytest.raises(ActorError, match="max_buffered_groups"):
        limits(attempts=2, batch_size=8, max_buffered_groups=3)


def test_trainer_progress_counts_drops_as_consumed_and_follows_restores() -> None:
    p = TrainerProgress()
    p.apply(WeightVersionEvent(version=3, step=3, samples_consumed=24, groups_consumed=6))
    p.apply(PreprocessorProgress(preprocessor_id="p0", groups_in=9, groups_dropped=2, samples_out=0))
    p.apply(PreprocessorProgress(preprocessor_id="p1", groups_in=4, groups_dropped=1, samples_out=0))
    p.apply(PreprocessorProgress(preprocessor_id="p0", groups_in=11, groups_dropped=3, samples_out=0))
    assert (p.version, p.groups_dropped, p.groups_consumed) == (3, 4, 10)
    p.apply(WeightVersionEvent(version=2, step=2, samples_consumed=16, groups_consumed=4))  # restored
    assert (p.version, p.groups_consumed) == (2, 8)


def test_request_seeds_are_stable_distinct_and_leave_room_for_n() -> None:
    seeds = {(r, p, k): request_seed(r, p, k) for r in (0, 1) for p in range(50) for k in range(8)}
    assert len(set(seeds.values())) == len(seeds)  # no two requests share a random stream
    assert all(request_seed(*key) == seed for key, seed in seeds.items())  # same inputs, same seed
    assert all(0 <= s and s + 255 < 2**63 for s in seeds.values())  # choice i of n is sampled with s + i


# ----------------------------------------------------------------------------------------------------
# Routing
# ----------------------------------------------------------------------------------------------------
def test_router_least_loaded_with_cap_and_health() -> None:
    async def scenario() -> None:
        servers = [
            Server(i, f"http://127.0.0.1:{9 + i}", AsyncShimClient(f"http://127.0.0.1:{9 + i}"))
            for i in range(3)
        ]
        router = Router(servers, cap=2, all_down_deadline_s=0.5, slot_deadline_s=30)
        picked = [(await router.acquire()).index for _ in range(6)]
        assert picked == [0, 1, 2, 0, 1, 2]  # least loaded first, ties spread evenly
        with pytest.raises(TimeoutError):  # every server at its cap: wait
            await asyncio.wait_for(router.acquire(), 0.3)
        waiter = asyncio.ensure_future(router.acquire())
        await asyncio.sleep(0.05)
        router.release(servers[1])
        assert (await asyncio.wait_for(waiter, 1.0)).index == 1  # a freed slot wakes the waiter
        router.release(servers[2])
        router.release(servers[2])
        router.mark_failed(servers[2], "test")  # the least loaded, but unhealthy: skipped
        router.release(servers[0])
        assert (await router.acquire()).index == 0
        router.mark_healthy(servers[2])
        assert (await router.acquire()).index == 2
        for s in servers:
            router.mark_failed(s, "test")
        t0 = time.monotonic()
        with pytest.raises(AllServersDown, match="all_servers_down_deadline_s"):
            await router.acquire()
        # Waits out its 0.5 s deadline, then raises; the upper bound only rules out a hang, loosely,
        # because `make test` runs this file beside another one on the same cores.
        assert 0.4 < time.monotonic() - t0 < 5.0
        for s in servers:
            await s.client.aclose()

    asyncio.run(scenario())


def _chat_body(n: int = 2, spans=None, length: int = 3) -> dict:
    choice = {
        "message": {"role": "assistant", "content": "abc"},
        "finish_reason": "length",
        "token_ids": list(range(5, 5 + length)),
        "logprobs": {"content": [{"token": "x", "logprob": -1.0}] * length},
        "weight_versions": spans if spans is not None else [{"version": 0, "start": 0, "end": length}],
        "some_future_openai_field": {"x": 1},  # responses tolerate unknown fields
    }
    choices = [dict(choice, index=i) for i in range(n)]
    return {"id": "c", "model": "m", "prompt_token_ids": [1, 2], "choices": choices}


def test_responses_are_checked_against_the_contract() -> None:
    def completions(body: dict, n: int = 2):
        return completions_of(ChatCompletionResponse.model_validate(body), n, "s")

    out = completions(
        _chat_body(spans=[{"version": 1, "start": 0, "end": 1}, {"version": 2, "start": 1, "end": 3}])
    )
    assert [c.token_ids for c in out] == [[5, 6, 7]] * 2 and out[0].spans[1].version == 2
    # A restored checkpoint may lower the version mid-request: spans need not increase.
    completions(
        _chat_body(spans=[{"version": 2, "start": 0, "end": 1}, {"version": 1, "start": 1, "end": 3}])
    )
    # The typed model checks what the contract promises: spans tile the tokens, one logprob per token.
    for spans in ([{"version": 0, "start": 0, "end": 2}], [{"version": 0, "start": 1, "end": 3}]):
        with pytest.raises(ValidationError, match="tile"):
            completions(_chat_body(spans=spans))
    body = _chat_body()
    body["choices"][1]["logprobs"]["content"] = body["choices"][1]["logprobs"]["content"][:2]
    with pytest.raises(ValidationError, match="2 logprobs for 3 token_ids"):
        completions(body)
    # The actor checks that it got what it asked for.
    with pytest.raises(ActorError, match="n=3"):
        completions(_chat_body(), 3)
    body = _chat_body()
    body["choices"][0]["weight_versions"] = None
    with pytest.raises(ActorError, match="weight_versions"):
        completions(body)


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
