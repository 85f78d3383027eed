"""SGLang backend: SGLang's own HTTP server, started privately on loopback, behind the shim's contract.

    python -m inference_shim --backend sglang --model DIR --dtype bfloat16 --port 8000     (GPU machine)

The engine runs as a child process (sglang_process.py) and is driven only through its native routes
(sglang_client.py). How the contract maps onto them:

  contract route              SGLang route(s)
  /v1/chat|completions    ->  /generate {input_ids, sampling_params, return_logprob, top_logprobs_num, stream}
  /init_process_group     ->  /init_weights_update_group {master_address, master_port, rank_offset,
                              world_size, group_name, backend}   (after the trainer's store answered)
  /request_weight_update  ->  validate (4xx before any data), then in the background (base.Backend's
                              lifecycle): wait for the trainer's "go", /pause_generation {mode},
                              /begin_weight_update, /update_weights_from_distributed {names, dtypes,
                              shapes, group_name, load_format: "flattened_bucket", flush_cache,
                              weight_version} once per bucket, /end_weight_update, /continue_generation
  /destroy_process_group  ->  /destroy_weights_update_group {group_name}

SGLang receives the broadcast itself, inside its scheduler, and loads each bucket as it arrives, so it
cannot stage: generation is paused for the whole transfer (capabilities: staged_receive false). Its
group is a torch c10d group with packed buckets, advertised as transports "<backend>:c10d"; the
trainer's WeightSender picks that wire format from /capabilities. docs/sglang.md has the guarantees.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
import uuid
from collections.abc import AsyncIterator

import httpx

from inference_shim.backends.base import Backend, short
from inference_shim.backends.common import (
    ChoiceDelta,
    ContractError,
    SamplingRequest,
    prompt_room,
    spans_from_versions,
)
from inference_shim.backends.sglang_client import EngineError, SglangClient
from inference_shim.backends.sglang_process import SglangOptions, SglangProcess
from inference_shim.metrics import ShimMetrics
from inference_shim.openai_protocol import VersionSpan
from inference_shim.protocol import (
    Bucket,
    GroupState,
    InitProcessGroupRequest,
    UpdateResult,
    WeightUpdateRequest,
    decision_key,
    plan_buckets,
    verify_decision,
)

__all__ = ["SglangBackend", "SglangOptions"]


class SglangBackend(Backend):
    # What /capabilities reports (base.Backend.capabilities builds it). SGLang's scheduler receives the
    # broadcast itself (module docstring): c10d wires, no staging, no chain fan-out. Either pause mode
    # may be asked for; --kv-after-update picks the one this server uses (pause_mode).
    name = "sglang"
    transports = ("nccl:c10d", "gloo:c10d")
    pause_modes = ("retract", "in_place")
    per_token_versions = True
    staged_receive = False
    fanouts = ("broadcast",)

    def __init__(self, options: SglangOptions, metrics: ShimMetrics) -> None:
        super().__init__(metrics)
        self.options = options
        self.workers = options.tensor_parallel_size
        self.max_model_len = options.max_model_len
        self.process = SglangProcess(options)
        self.client: SglangClient | None = None
        self.labeling_version = 0  # version of the weights producing tokens now (see _choice)
        self._loaded_any = False  # some bucket of the current update reached SGLang's weights
        self._deadline = 0.0  # time.monotonic() by which the current update must be done

    # ------------------------------------------------------------------ lifecycle
    @property
    def pause_mode(self) -> str:
        return "retract" if self.options.kv_after_update == "recompute" else "in_place"

    @property
    def model_name(self) -> str:
        return self.options.model_name

    async def start(self) -> None:
        from transformers import AutoTokenizer

        from inference_shim.checkpoint_table import checkpoint_tensor_table

        o = self.options
        self.process.start()
        self.client = SglangClient(self.process.url, self.process.api_key)
        # While SGLang starts: the trainer must send tensors in the engine's dtype, under the
        # checkpoint's names and shapes.
        self.tokenizer = AutoTokenizer.from_pretrained(o.model)
        self.table = {name: (o.dtype, shape) for name, (_, shape) in checkpoint_tensor_table(o.model).items()}
        await self.process.wait_ready()
        info = await self.client.get_json("/server_info")
        self.engine_version = str(info.get("version", "unknown"))

    async def _stop_engine(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None
        await self.process.stop()

    # ------------------------------------------------------------------ introspection
    def engine_failure(self) -> str | None:
        code = self.process.exit_code() if self.client is not None else None
        return None if code is None else f"the SGLang child process exited with {code}"

    def _starting(self) -> bool:
        return self.client is None or self.process.proc is None

    def _unhealthy_detail(self) -> str | None:
        # A dead engine first: no update can make it serve again.
        code = self.process.exit_code()
        return f"SGLang exited with {code}" if code is not None else self.unhealthy

    def _dtypes(self) -> list[str]:
        return [self.options.dtype]  # known before start() reads the checkpoint: SGLang loads in it

    # ------------------------------------------------------------------ generation
    async def generate(
        self, prompt_ids: list[int], params: SamplingRequest, stream: bool
    ) -> AsyncIterator[list[ChoiceDelta]]:
        room = prompt_room(prompt_ids, self.options.max_model_len)
        sampling: dict = {
            "max_new_tokens": min(params.max_tokens or room, room),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "ignore_eos": params.ignore_eos,
        }
        if params.top_k > 0:
            sampling["top_k"] = params.top_k
        if params.stop:
            sampling["stop"] = params.stop
        rid = uuid.uuid4().hex
        bodies = []
        for i in range(params.n):
            body = {
                "rid": f"{rid}-{i}",
                "input_ids": prompt_ids,
                # Always streamed from the engine, also for a plain response: chunk arrival times are what
                # labels tokens with versions when the engine reports no spans of its own.
                "stream": True,
                "sampling_params": sampling
                | ({"sampling_seed": params.seed + i} if params.seed is not None else {}),
                "return_logprob": True,
            }
            if params.top_logprobs:
                body["top_logprobs_num"] = params.top_logprobs
            bodies.append(body)

        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._choice(i, body, queue)) for i, body in enumerate(bodies)]
        final: list[ChoiceDelta] = [ChoiceDelta(i, "", [], [], []) for i in range(params.n)]
        try:
            done = 0
            while done < params.n:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    done += 1
                    continue
                self.metrics.generated_tokens.inc(len(item.token_ids))
                if stream:
                    yield [item]
                else:
                    _merge(final[item.index], item)
            if not stream:
                yield final
        finally:
            for task in tasks:
                task.cancel()
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)

    async def _choice(self, index: int, body: dict, queue: asyncio.Queue) -> None:
        """Streams one choice from SGLang's /generate into `queue` as ChoiceDeltas; None when done."""
        seen_tokens, seen_text = 0, ""
        labels: list[int] = []
        try:
            async for out in self.client.generate(body, self.options.request_timeout_s):
                meta = out.get("meta_info") or {}
                # SGLang's chunks are cumulative (no --incremental-streaming-output): slice off what we sent.
                ids = out.get("output_ids") or []
                new_ids = ids[seen_tokens:]
                text = out.get("text") or ""
                new_text = text[len(seen_text) :] if text.startswith(seen_text) else text
                entries = (meta.get("output_token_logprobs") or [])[seen_tokens : seen_tokens + len(new_ids)]
                tops = (meta.get("output_top_logprobs") or [])[seen_tokens : seen_tokens + len(new_ids)]
                finish = meta.get("finish_reason")
                labels += [self.labeling_version] * len(new_ids)
                seen_tokens, seen_text = seen_tokens + len(new_ids), text
                if not new_ids and finish is None:
                    continue
                delta = ChoiceDelta(
                    index=index,
                    text=new_text,
                    token_ids=list(new_ids),
                    logprobs=[float(e[0]) for e in entries],
                    top_logprobs=[{int(t[1]): float(t[0]) for t in (top or [])} for top in tops],
                )
                if finish is not None:
                    delta.finish_reason = _finish_reason(finish)
                    delta.version_spans = _engine_spans(meta, seen_tokens) or spans_from_versions(labels)
                await queue.put(delta)
            await queue.put(None)
        except asyncio.CancelledError:
            raise
        except ContractError as e:
            await queue.put(e)
        except Exception as e:
            await queue.put(ContractError(502, "engine_error", f"{type(e).__name__}: {short(e)}"))

    # ------------------------------------------------------------------ update hooks (base.Backend)
    async def _join_group(self, req: InitProcessGroupRequest, timeout_s: float) -> list[int]:
        body = {
            "master_address": req.master_address,
            "master_port": req.master_port,
            "rank_offset": req.rank_offset,
            "world_size": req.world_size,
            "group_name": req.group_name,
            "backend": req.backend,
        }
        try:
            await self.client.control("/init_weights_update_group", body, timeout_s=timeout_s + 2)
        except httpx.TimeoutException:
            where = f"{req.master_address}:{req.master_port}"
            self.unhealthy = f"SGLang did not finish joining the weight group at {where}; restart the server"
            raise
        return [req.rank_offset + r for r in range(self.options.tensor_parallel_size)]

    async def _leave_group(self, group: GroupState) -> None:
        await self.client.control(
            "/destroy_weights_update_group", {"group_name": group.group_name}, timeout_s=60
        )

    async def _arm_receive(self, req: WeightUpdateRequest) -> None:
        self._loaded_any = False
        self._deadline = time.monotonic() + req.timeout_s

    async def _wait_received(self, req: WeightUpdateRequest, result: UpdateResult) -> None:
        # SGLang cannot stage: "received" here only means the trainer decided "go"; _apply receives.
        key = decision_key(self.group.group_name, req.update_id)
        await asyncio.to_thread(self.store.wait, [key], dt.timedelta(seconds=req.timeout_s))
        value = await asyncio.to_thread(self.store.get, key)
        decision = verify_decision(self.token, key, value, req.version)  # unsigned: refused, nothing loaded
        if decision != "go":
            raise RuntimeError(f"trainer decided {decision!r} for version {req.version}")

    async def _pause(self) -> None:
        await self.client.pause(self.pause_mode)

    async def _apply(self, req: WeightUpdateRequest, result: UpdateResult) -> None:
        buckets = plan_buckets(req.tensors, req.bucket_bytes)
        session = False
        try:
            await self.client.begin_session(_left(self._deadline))
            session = True
            receive_start = time.perf_counter()
            await self._send_buckets(req, buckets)
            result.receive_seconds = time.perf_counter() - receive_start
            result.total_bytes = self._wire_bytes(buckets)
            apply_start = time.perf_counter()
            session = False
            await self.client.end_session(_left(self._deadline))
            result.apply_seconds = time.perf_counter() - apply_start
        finally:
            if session:  # a failed update still closes SGLang's session, or the next one is refused
                with contextlib.suppress(Exception):
                    await self.client.end_session(_left(self._deadline))

    async def _set_version_label(self, version: int) -> None:
        # The engine's own label came with the last bucket (weight_version); this one labels tokens
        # by arrival for an SGLang that reports no spans: tokens after the resume are the new version's.
        self.labeling_version = version

    # _reset_cache: nothing to do; the flush rides on the last bucket (flush_cache in _send_buckets).

    async def _resume(self) -> None:
        await self.client.resume()

    def _partially_applied(self, applying: bool) -> bool:
        # SGLang loads each bucket as it arrives, so any loaded bucket means a possible mix.
        return self._loaded_any

    def _wire_bytes(self, buckets: list[Bucket]) -> int:
        # SGLang's buckets carry no alignment padding ("c10d" wire format): count the bytes it receives.
        return sum(slot.nbytes for b in buckets for slot in b.slots)

    async def _send_buckets(self, req: WeightUpdateRequest, buckets: list[Bucket]) -> None:
        """One /update_weights_from_distributed per bucket: SGLang joins that bucket's broadcast and loads it."""
        first_error: EngineError | None = None
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            metas = [req.tensors[slot.index] for slot in bucket.slots]
            body = {
                "names": [m.name for m in metas],
                "dtypes": [m.dtype for m in metas],
                "shapes": [list(m.shape) for m in metas],
                "group_name": self.group.group_name,
                "load_format": "flattened_bucket",
                # Flush once, after the last bucket: in 'retract' mode nothing is running, so every KV
                # entry computed by the old weights goes. In 'in_place' mode a flush would fail
                # (requests still hold KV), and "keep" wants them kept anyway.
                "flush_cache": last and self.options.kv_after_update == "recompute",
            }
            if last and first_error is None:
                # SGLang labels every later token with this version and records, per live request,
                # where the old version ended: exact per-token version spans.
                body["weight_version"] = str(req.version)
            try:
                await self.client.control(
                    "/update_weights_from_distributed", body, timeout_s=_left(self._deadline)
                )
            except EngineError as e:
                if "Failed to receive weights" in str(e):  # the collective failed: so does the trainer's
                    if first_error is not None:
                        raise first_error from e
                    raise
                # Received, then loading failed: keep receiving the remaining buckets so the trainer's
                # broadcast completes and it reads this server's error instead of timing out.
                first_error = first_error or e
            except httpx.TimeoutException:
                self._loaded_any = True  # SGLang may still be inside the collective: state unknown
                raise
            self._loaded_any = True
        if first_error is not None:
            raise first_error


def _finish_reason(finish: dict | str) -> str:
    kind = finish.get("type") if isinstance(finish, dict) else str(finish)
    return {"length": "length", "stop": "stop", "abort": "abort"}.get(kind, kind)


def _engine_spans(meta: dict, num_tokens: int) -> list[VersionSpan] | None:
    """SGLang's own per-token spans (meta_info.weight_versions, SGLang >= 0.5.23), if usable."""
    spans = meta.get("weight_versions")
    if not spans:
        return None
    try:
        out = [
            VersionSpan(version=int(s["version"]), start=int(s["start"]), end=int(s["end"])) for s in spans
        ]
    except (KeyError, TypeError, ValueError):
        return None  # a version label the shim did not set (e.g. "default"): fall back to its own
    if out[0].start != 0 or out[-1].end != num_tokens:
        return None
    return out


def _merge(total: ChoiceDelta, piece: ChoiceDelta) -> None:
    total.text += piece.text
    total.token_ids += piece.token_ids
    total.logprobs += piece.logprobs
    total.top_logprobs += piece.top_logprobs
    if piece.finish_reason is not None:
        total.finish_reason = piece.finish_reason
        total.version_spans = piece.version_spans


def _left(deadline: float) -> float:
    return max(1.0, deadline - time.monotonic())
