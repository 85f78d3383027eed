"""The update template's deadlines and recovery (inference_shim/backends/base.py), with engine calls that
hang or fail on purpose (tests/support/fake_backend.py): a stuck pause, label, cache reset or resume fails
the update cleanly (pending cleared, last_error set) instead of leaving it pending forever, and a server
whose weights may be mixed generates nothing (weights_incomplete) until an update is applied.

    .venv/bin/python -m pytest -q tests/unit/test_update_deadlines.py
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from support.fake_backend import PAUSE_BETWEEN_STEPS_S, FakeBackend

from inference_shim.backends.common import ContractError, SamplingRequest
from inference_shim.protocol import GroupState, TensorMeta, WeightUpdateRequest
from inference_shim.server import create_app

GROUP = GroupState(
    master_address="127.0.0.1",
    master_port=1,
    rank_offset=1,
    world_size=2,
    backend="gloo",
    group_name="weights",
    server_id="s",
    timeout_s=5,
    ranks=[1],
)


def _update(backend: FakeBackend, timeout_s: float = 0.3) -> None:
    req = WeightUpdateRequest(
        version=1, timeout_s=timeout_s, tensors=[TensorMeta(name="w", dtype="float32", shape=[2])]
    )
    backend.pending = req.version

    async def run():
        await asyncio.wait_for(backend._run_update(req, GROUP, None), timeout=10)

    asyncio.run(run())


def _params() -> SamplingRequest:
    return SamplingRequest(
        max_tokens=1, temperature=1.0, top_p=1.0, top_k=-1, n=1, seed=None, stop=[], top_logprobs=0
    )


def test_a_clean_update_publishes_the_version():
    backend = FakeBackend()
    _update(backend)
    assert backend.version == 1 and backend.pending is None and backend.last_error is None
    assert not backend.paused and backend.unhealthy is None


@pytest.mark.parametrize("stuck", ["pause"])
def test_stuck_pause_fails_cleanly_and_keeps_serving(stuck):
    backend = FakeBackend()
    backend.hang.add(stuck)
    _update(backend)
    assert backend.pending is None and backend.version == 0
    assert "pausing generation did not finish" in backend.last_error
    assert backend.unhealthy is None  # nothing was applied: the old weights still serve
    assert "resume" in backend.calls and not backend.paused  # a late pause cannot leave it paused
    assert "abort_in_flight" not in backend.calls
    backend.check_can_generate()


@pytest.mark.parametrize("stuck", ["apply", "set_version_label", "reset_cache", "resume"])
def test_stuck_step_after_the_pause_marks_weights_incomplete(stuck):
    backend = FakeBackend()
    backend.hang.add(stuck)
    _update(backend)
    assert backend.pending is None and backend.version == 0
    assert "did not finish within" in backend.last_error
    assert backend.unhealthy and "partially applied" in backend.unhealthy
    assert backend.health().status == "unhealthy"
    assert "abort_in_flight" in backend.calls and "discard" in backend.calls
    with pytest.raises(ContractError) as e:
        backend.check_can_generate()
    assert (e.value.status, e.value.error) == (503, "weights_incomplete")


@pytest.mark.parametrize("stream", [False, True])
def test_failed_apply_answers_in_flight_requests_503_not_their_tokens(stream):
    backend = FakeBackend()
    backend.hold = True  # a request frozen in the engine while the update pauses it
    backend.fail.add("apply")
    app = create_app(backend, backend.metrics)

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://shim") as client:
            body = {"prompt": [1, 2], "max_tokens": 1, "stream": stream}
            request = asyncio.create_task(client.post("/v1/completions", json=body))
            while backend.in_flight < 1:
                await asyncio.sleep(0.01)
            req = WeightUpdateRequest(
                version=1, timeout_s=1, tensors=[TensorMeta(name="w", dtype="float32", shape=[2])]
            )
            backend.pending = 1
            await backend._run_update(req, GROUP, None)
            backend.release.set()  # the engine lets it go after the failure
            return await request

    response = asyncio.run(asyncio.wait_for(scenario(), timeout=10))
    # Streamed too: a stream's first batch is awaited before its status line, so the 503 is proper.
    assert response.status_code == 503 and response.json()["error"] == "weights_incomplete"
    assert backend.pending is None and "apply failed" in backend.last_error
    assert "abort_in_flight" in backend.calls


def test_resume_that_never_returns_after_a_failed_pause_says_engine_paused():
    backend = FakeBackend()
    backend.fail.add("pause")
    backend.hang.add("resume")
    _update(backend)
    assert backend.pending is None
    assert backend.unhealthy and "left paused" in backend.unhealthy
    with pytest.raises(ContractError) as e:
        backend.check_can_generate()
    assert e.value.error == "engine_paused"


def test_an_applied_update_after_a_failed_apply_serves_again():
    """weights_incomplete lasts until a complete version is loaded: every update carries every weight."""
    backend = FakeBackend()
    backend.fail.add("apply")
    _update(backend)
    assert backend.unhealthy and backend.updates_failed == 1
    with pytest.raises(ContractError):
        backend.check_can_generate()
    backend.fail.clear()
    _update(backend)
    assert backend.unhealthy is None and backend.version == 1
    backend.check_can_generate()  # no 503 any more
    assert backend.debug_state().updates_failed == 1


def test_an_engine_that_applies_between_steps_is_never_paused_for_an_update():
    backend = FakeBackend()
    backend.applies_between_steps = True
    _update(backend)
    assert backend.version == 1 and backend.pending is None and backend.last_error is None
    assert backend.calls == ["wait_received", "apply_between_steps"]  # no pause, label or resume call
    assert backend.last_update.pause_seconds == PAUSE_BETWEEN_STEPS_S  # the engine's own figure
    assert not backend.paused and backend.debug_state().applies_between_steps


@pytest.mark.parametrize("fault", ["fail", "hang"])
def test_a_failed_apply_between_steps_ends_requests_in_flight_and_resumes(fault):
    """The engine leaves itself paused when its apply fails (weights may be mixed): the lifecycle aborts
    what is in flight, resumes and marks the weights incomplete, as after a failed apply in a pause."""
    backend = FakeBackend()
    backend.applies_between_steps = True
    getattr(backend, fault).add("apply_between_steps")
    _update(backend)
    assert backend.pending is None and backend.version == 0 and not backend.paused
    assert backend.calls == ["wait_received", "apply_between_steps", "abort_in_flight", "resume", "discard"]
    assert backend.unhealthy and "partially applied" in backend.unhealthy
    with pytest.raises(ContractError) as e:
        backend.check_can_generate()
    assert e.value.error == "weights_incomplete"
