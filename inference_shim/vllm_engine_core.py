"""Runs inside vLLM's engine-core process: one call that swaps in a received update between two engine
steps, so that decoding never has to be paused around it.

Why: applying an update through pause -> apply -> label -> resume costs four calls from the shim to the
engine core, one of them (the pause) itself a round trip to the workers, and decoding stops for all of
them, a sizeable share of a 100 MB transfer on vLLM-CPU (docs/engines.md, "Swapping between two decode
steps"). But the
engine core already runs its clients' utility calls between two steps, in its own loop thread
(EngineCoreProc.run_busy_loop: read the input queue, then one step). Without a batch queue (no async
scheduling, no pipeline parallelism: vLLM-CPU always) no step is in flight while a utility runs. So one
utility that applies the staged weights on the workers and then sets the version label is atomic with
respect to decoding: the step before it ran the old weights under the old label, the step after it runs
the new ones under the new label, and decoding stops only for the call itself (the workers' swap: a few
pointer moves once the update is prepared beside the live model, inference_shim/vllm_shadow.py).

Loaded as a vLLM general plugin (the "vllm.general_plugins" entry point in pyproject.toml), which vLLM
loads in every process it starts, the engine core included (EngineCore.__init__). register() only adds
methods to EngineCore. The shim calls pr_swap_protocol() once at start and keeps the pause path where it
gets no SWAP_PROTOCOL back: the plugin not loaded (VLLM_PLUGINS excluding it) or a batch queue, where a
step may be in flight during a utility call (CUDA with async scheduling).
A vLLM internal: checked against vllm-cpu 0.32 (pinned in scripts/setup.sh).
"""

from __future__ import annotations

import logging
import time

SWAP_PROTOCOL = 1  # what pr_swap_protocol() answers where pr_swap_weights is atomic with respect to steps

log = logging.getLogger("inference_shim")


def register() -> None:
    """vLLM's plugin hook: give the engine core the two utility methods the shim calls.

    Never raises: vLLM calls every general plugin unguarded in each of its processes (engine core,
    workers, CLI parser, a plain `vllm serve`), so a failure here would take them all down. Without the
    methods the shim keeps the pause path and says why."""
    try:
        from vllm.v1.engine.core import EngineCore

        EngineCore.pr_swap_protocol = _swap_protocol
        EngineCore.pr_swap_weights = _swap_weights
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.warning("inference_shim.vllm_engine_core: not registered (%s: %s)", type(e).__name__, e)


def _swap_protocol(self) -> int:
    # A batch queue (async scheduling, pipeline parallelism) may have a step in flight during a utility
    # call; with data parallelism a paused engine is resumed only with its peers (a failed swap could
    # then stay paused).
    parallel = self.vllm_config.parallel_config
    atomic = self.batch_queue is None and parallel.data_parallel_size == 1
    return SWAP_PROTOCOL if atomic else 0


def _swap_weights(self, version: str, reset_kv: bool) -> tuple[float, list[float], int]:
    """Apply the staged update on every worker, label the steps that follow `version`, and drop the KV
    the old weights computed if asked. Returns (seconds without a step, each worker's apply seconds,
    tokens whose KV the reset dropped and the engine computes again)."""
    from vllm.v1.core.sched.interface import PauseState

    start = time.perf_counter()
    try:
        applied = self.model_executor.collective_rpc("pr_apply", args=(int(version),))
        self.set_weight_version(version)
        dropped = 0
        if reset_kv:
            dropped = sum(request.num_computed_tokens for request in self.scheduler.running)
            self.reset_prefix_cache(reset_running_requests=True)
    except BaseException:
        # The workers may hold a mix of weights, or old KV may be left: no step may run until the shim has
        # ended the requests in flight and resumed (its recovery path, as after a failed apply in a pause).
        self.scheduler.set_pause_state(PauseState.PAUSED_ALL)
        raise
    return time.perf_counter() - start, [float(s) for s in applied], dropped
