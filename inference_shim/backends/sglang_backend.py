"""SGLang backend: SGLang's own HTTP server, started privately on loopback, behind the shim's contract.

    pipeline-rl serve --backend sglang --model DIR --dtype bfloat16 --port 8000     (GPU machine)

The shim starts `python -m sglang.launch_server --model-path DIR --host 127.0.0.1 --port <free>` as a
child process (its own session, killed with the shim), guarded by a random API key, and talks only to
SGLang's native routes (API of SGLang 0.5.23, read from its http_server.py / io_struct.py):

  contract route              SGLang route(s)
  /v1/chat|completions    ->  /generate {input_ids, sampling_params, return_logprob, top_logprobs_num, stream}
  /init_process_group     ->  /init_weights_update_group {master_address, master_port, rank_offset,
                              world_size, group_name, backend}   (after the trainer's store answered)
  /request_weight_update  ->  validate (4xx before any data), then in the background: wait for the
                              trainer's "go", /pause_generation {mode}, /begin_weight_update,
                              /update_weights_from_distributed {names, dtypes, shapes, group_name,
                              load_format: "flattened_bucket", flush_cache, weight_version} once per
                              bucket, /end_weight_update, /continue_generation, result key
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
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import httpx
from pydantic import BaseModel, Field, field_validator

from inference_shim.backends.base import (
    Backend,
    ChoiceDelta,
    ContractError,
    SamplingRequest,
    prompt_room,
    validate_update,
)
from inference_shim.metrics import ShimMetrics
from inference_shim.process_tree import stop_process_tree as _stop_tree
from inference_shim.protocol import (
    CONTRACT_VERSION,
    Bucket,
    Capabilities,
    HealthResponse,
    InitProcessGroupRequest,
    InitProcessGroupResponse,
    UpdateResult,
    UpdateTimings,
    VersionSpan,
    WeightUpdateAccepted,
    WeightUpdateRequest,
    decision_key,
    plan_buckets,
    result_key,
)

log = logging.getLogger("inference_shim.sglang")

# SGLang computes logprobs after temperature scaling unless told otherwise; the contract promises
# logprobs under the raw distribution (temperature 1), which is what the trainer's ratios need.
ENGINE_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}


class SglangOptions(BaseModel):
    """Engine settings of the SGLang backend (CLI flags of `pipeline-rl serve --backend sglang`)."""

    model: str = Field(description="Hugging Face model directory (--model-path).")
    served_model_name: str | None = Field(
        default=None, description="Name in /v1/models; default: the directory name."
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16", description="Weights dtype in the engine; pushed tensors must have it."
    )
    max_model_len: int = Field(
        default=4096, ge=16, description="Longest prompt + completion (--context-length)."
    )
    max_num_seqs: int | None = Field(
        default=None, ge=1, description="Most sequences decoded at once (--max-running-requests)."
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per server (--tp-size).")
    seed: int = Field(default=0, description="Engine seed (--random-seed).")
    mem_fraction_static: float | None = Field(
        default=None, gt=0, lt=1, description="GPU memory share for weights + KV (SGLang's default if unset)."
    )
    kv_after_update: Literal["recompute", "keep"] = Field(
        default="recompute",
        description="recompute: pause mode 'retract', KV of old weights flushed, in-flight requests re-prefill. "
        "keep: pause mode 'in_place', in-flight requests keep their KV; the radix cache is disabled.",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="More `sglang.launch_server` flags, passed verbatim."
    )
    engine_python: str = Field(
        default_factory=lambda: _default_engine_python(),
        description="Python that has SGLang: $PIPELINE_RL_SGLANG_PYTHON, else <this venv>/sglang/bin/python "
        "(scripts/setup.sh puts SGLang there: it pins its own torch), else this interpreter.",
    )
    launch_command: list[str] | None = Field(
        default=None,
        description="argv that replaces `<engine_python> -m sglang.launch_server` (tests start a stand-in).",
    )
    start_timeout_s: float = Field(
        default=900, gt=0, description="Deadline for the engine's first healthy /health."
    )
    request_timeout_s: float = Field(default=3600, gt=0, description="Deadline of one generation request.")

    @field_validator("extra_args")
    @classmethod
    def _no_incremental_streaming(cls, value: list[str]) -> list[str]:
        if "--incremental-streaming-output" in value:
            raise ValueError(
                "--incremental-streaming-output changes SGLang's stream chunks from cumulative to deltas, "
                "which the SGLang backend does not read: remove it from extra_args"
            )
        return value


class EngineError(RuntimeError):
    """SGLang answered a control call with an error (HTTP >= 400 or success: false)."""


class SglangBackend(Backend):
    name = "sglang"

    def __init__(self, options: SglangOptions, metrics: ShimMetrics) -> None:
        self.options = options
        self.metrics = metrics
        self.proc: subprocess.Popen | None = None
        self.engine_url = ""
        self._key = secrets.token_urlsafe(24)  # the engine's API key: only the shim can drive it
        self.http: httpx.AsyncClient | None = None
        self.tokenizer = None
        self.table: dict[str, tuple[str, list[int]]] = {}
        self.version = 0
        self.labeling_version = 0  # version of the weights producing tokens now (see _choice)
        self.pending: int | None = None
        self.group: dict | None = None
        self.store = None
        self.last_update: UpdateTimings | None = None
        self.last_error: str | None = None
        self.unhealthy: str | None = None
        self.paused = False
        self.updates_applied = 0
        self.in_flight = 0
        self.has_sessions = True  # /begin_weight_update exists (SGLang >= 0.5.23); probed on first use
        self._engine_version = "unknown"
        self._update_lock = asyncio.Lock()
        self._update_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def pause_mode(self) -> str:
        return "retract" if self.options.kv_after_update == "recompute" else "in_place"

    def launch_argv(self, port: int) -> list[str]:
        o = self.options
        argv = list(o.launch_command or [o.engine_python, "-m", "sglang.launch_server"])
        argv += ["--model-path", o.model, "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--served-model-name", self.model_name, "--dtype", o.dtype]
        argv += ["--context-length", str(o.max_model_len), "--tp-size", str(o.tensor_parallel_size)]
        argv += ["--random-seed", str(o.seed), "--weight-version", "0", "--api-key", self._key]
        if o.max_num_seqs is not None:
            argv += ["--max-running-requests", str(o.max_num_seqs)]
        if o.mem_fraction_static is not None:
            argv += ["--mem-fraction-static", str(o.mem_fraction_static)]
        if o.kv_after_update == "keep":
            # In-flight requests keep KV from the old weights; a radix cache would also hand old-weight
            # prefixes to NEW requests, which "keep" never promises.
            argv += ["--disable-radix-cache"]
        return argv + list(o.extra_args)

    async def start(self) -> None:
        from transformers import AutoTokenizer

        from pipeline_rl.tiny_model import checkpoint_tensor_table

        o = self.options
        port = _free_port()
        self.engine_url = f"http://127.0.0.1:{port}"
        argv = self.launch_argv(port)
        log.info("starting SGLang: %s", " ".join(a if a != self._key else "***" for a in argv))
        env = dict(os.environ, **ENGINE_ENV)
        # Own session: stop() can signal SGLang's whole tree. PDEATHSIG: it dies with a shim killed hard.
        self.proc = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        self.http = httpx.AsyncClient(
            base_url=self.engine_url,
            headers={"Authorization": f"Bearer {self._key}"},
            timeout=httpx.Timeout(60.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )
        self.tokenizer = AutoTokenizer.from_pretrained(o.model)
        # The trainer must send tensors in the engine's dtype, under the checkpoint's names and shapes.
        self.table = {name: (o.dtype, shape) for name, (_, shape) in checkpoint_tensor_table(o.model).items()}
        await self._wait_healthy()
        info = await self._get_json("/server_info")
        self._engine_version = str(info.get("version", "unknown"))
        self.metrics.weight_version.set(0)

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.options.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"SGLang exited with {self.proc.returncode} during startup (see its log above)"
                )
            with contextlib.suppress(httpx.HTTPError):
                if (await self.http.get("/health", timeout=5.0)).status_code == 200:
                    return
            await asyncio.sleep(0.5)
        raise TimeoutError(
            f"SGLang not healthy after {self.options.start_timeout_s:.0f}s at {self.engine_url}"
        )

    async def stop(self) -> None:
        if self._update_task is not None:
            self._update_task.cancel()
        if self.http is not None:
            await self.http.aclose()
            self.http = None
        if self.proc is not None:
            await asyncio.to_thread(_stop_tree, self.proc)
            self.proc = None

    @property
    def model_name(self) -> str:
        return self.options.served_model_name or Path(self.options.model.rstrip("/")).name

    # ------------------------------------------------------------------ introspection
    def health(self) -> HealthResponse:
        if self.http is None or self.proc is None:
            return HealthResponse(status="starting", weight_version=self.version)
        if self.proc.poll() is not None:
            detail = f"SGLang exited with {self.proc.returncode}"
            return HealthResponse(status="unhealthy", weight_version=self.version, detail=detail)
        if self.unhealthy:
            return HealthResponse(status="unhealthy", weight_version=self.version, detail=self.unhealthy)
        return HealthResponse(status="ok", weight_version=self.version)

    def capabilities(self) -> Capabilities:
        return Capabilities(
            contract_version=CONTRACT_VERSION,
            backend=self.name,
            engine_version=self._engine_version,
            model=self.model_name,
            workers=self.options.tensor_parallel_size,
            transports=["nccl:c10d", "gloo:c10d"],
            pause_modes=["retract", "in_place"],
            dtypes=[self.options.dtype],
            per_token_versions=True,
            staged_receive=False,
            max_model_len=self.options.max_model_len,
        )

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
            async with self.http.stream(
                "POST", "/generate", json=body, timeout=httpx.Timeout(self.options.request_timeout_s)
            ) as response:
                if response.status_code >= 400:
                    detail = (await response.aread()).decode(errors="replace")[:500]
                    raise ContractError(400 if response.status_code < 500 else 502, "engine_rejected", detail)
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    out = json.loads(line[6:])
                    if "error" in out:
                        raise ContractError(502, "engine_error", str(out["error"]))
                    meta = out.get("meta_info") or {}
                    # SGLang's chunks are cumulative (no --incremental-streaming-output): slice off what we sent.
                    ids = out.get("output_ids") or []
                    new_ids = ids[seen_tokens:]
                    text = out.get("text") or ""
                    new_text = text[len(seen_text) :] if text.startswith(seen_text) else text
                    entries = (meta.get("output_token_logprobs") or [])[
                        seen_tokens : seen_tokens + len(new_ids)
                    ]
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
                        delta.version_spans = _engine_spans(meta, seen_tokens) or _spans_from_labels(labels)
                    await queue.put(delta)
            await queue.put(None)
        except asyncio.CancelledError:
            raise
        except ContractError as e:
            await queue.put(e)
        except Exception as e:
            await queue.put(ContractError(502, "engine_error", f"{type(e).__name__}: {_short(e)}"))

    # ------------------------------------------------------------------ weight transfer
    async def init_process_group(self, req: InitProcessGroupRequest) -> InitProcessGroupResponse:
        from inference_shim.transfer import connect_store

        if self.group is not None:
            raise ContractError(409, "already_joined", "call POST /destroy_process_group first")
        start = time.monotonic()
        where = f"{req.master_address}:{req.master_port}"
        try:
            # The shim's own store client (decision and result keys). Connecting first also proves the
            # trainer is there: SGLang joins with a 30-minute default timeout and blocks its scheduler
            # (no generation) meanwhile, so it is only asked once the trainer's store answered.
            self.store = await asyncio.to_thread(
                connect_store,
                req.master_address,
                req.master_port,
                is_master=False,
                world_size=None,
                timeout_s=max(1.0, 0.4 * req.timeout_s),
            )
        except Exception as e:
            self.last_error = f"joining weight group failed: {e}"
            raise ContractError(
                504,
                "join_failed",
                f"could not join the weight group at {where} within {req.timeout_s:.0f}s "
                f"({type(e).__name__}: {_short(e)}); is the trainer up and listening?",
            ) from e
        body = {
            "master_address": req.master_address,
            "master_port": req.master_port,
            "rank_offset": req.rank_offset,
            "world_size": req.world_size,
            "group_name": req.group_name,
            "backend": req.backend,
        }
        remaining = max(1.0, req.timeout_s - (time.monotonic() - start))
        try:
            await self._control("/init_weights_update_group", body, timeout_s=remaining + 2)
        except Exception as e:
            self.store = None
            self.last_error = f"joining weight group failed: {e}"
            if isinstance(e, httpx.TimeoutException):
                self.unhealthy = (
                    f"SGLang did not finish joining the weight group at {where}; restart the server"
                )
            raise ContractError(
                504, "join_failed", f"SGLang could not join the weight group at {where}: {_short(e)}"
            ) from e
        ranks = [req.rank_offset + r for r in range(self.options.tensor_parallel_size)]
        self.group = req.model_dump() | {"ranks": ranks}
        return InitProcessGroupResponse(ranks=ranks, join_seconds=time.monotonic() - start)

    async def destroy_process_group(self) -> None:
        if self.group is None:
            raise ContractError(409, "no_process_group", "nothing to destroy")
        if self.pending is not None:
            raise ContractError(409, "update_in_progress", f"version {self.pending} is in flight")
        group_name = self.group["group_name"]
        self.group, self.store = None, None
        await self._control("/destroy_weights_update_group", {"group_name": group_name}, timeout_s=60)

    async def request_weight_update(self, req: WeightUpdateRequest) -> WeightUpdateAccepted:
        async with self._update_lock:
            validate_update(req, self.table, self.version, self.pending, self.group is not None)
            self.pending = req.version
        buckets = plan_buckets(req.tensors, req.bucket_bytes)
        self._update_task = asyncio.create_task(self._run_update(req, buckets))
        # SGLang's buckets carry no alignment padding ("c10d" wire format): count the bytes it receives.
        total = sum(slot.nbytes for b in buckets for slot in b.slots)
        return WeightUpdateAccepted(version=req.version, num_buckets=len(buckets), total_bytes=total)

    async def _run_update(self, req: WeightUpdateRequest, buckets: list[Bucket]) -> None:
        group_name, server_id = self.group["group_name"], self.group["server_id"]
        store = self.store
        result = UpdateResult(server_id=server_id, version=req.version, ok=False)
        deadline = time.monotonic() + req.timeout_s
        self._loaded_any = False
        try:
            key = decision_key(group_name, req.update_id)
            await asyncio.to_thread(store.wait, [key], dt.timedelta(seconds=req.timeout_s))
            decision = (await asyncio.to_thread(store.get, key)).decode()
            if decision != "go":
                raise RuntimeError(f"trainer decided {decision!r} for version {req.version}")
            paused_at = time.perf_counter()
            session = False
            try:
                await self._pause()
                await self._begin_session(deadline)
                session = True
                receive_start = time.perf_counter()
                await self._send_buckets(req, buckets, group_name, deadline)
                result.receive_seconds = time.perf_counter() - receive_start
                apply_start = time.perf_counter()
                session = False
                await self._end_session(deadline)
                result.apply_seconds = time.perf_counter() - apply_start
                self.labeling_version = req.version  # tokens after the resume come from the new weights
            finally:
                if session:  # a failed update still closes SGLang's session, or the next one is refused
                    with contextlib.suppress(Exception):
                        await self._end_session(deadline)
                await self._resume()
            result.pause_seconds = time.perf_counter() - paused_at
            result.total_bytes = sum(slot.nbytes for b in buckets for slot in b.slots)
            self._publish_update(result)
        except BaseException as e:
            # SGLang loads each bucket as it arrives, so any loaded bucket means a possible mix.
            self._record_failed_update(result, e, partially_applied=self._loaded_any)
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            self.pending = None
            if store is not None:
                await asyncio.to_thread(
                    store.set, result_key(group_name, req.update_id, server_id), result.model_dump_json()
                )

    async def _send_buckets(
        self, req: WeightUpdateRequest, buckets: list[Bucket], group_name: str, deadline: float
    ) -> None:
        """One /update_weights_from_distributed per bucket: SGLang joins that bucket's broadcast and loads it."""
        first_error: EngineError | None = None
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            metas = [req.tensors[slot.index] for slot in bucket.slots]
            body = {
                "names": [m.name for m in metas],
                "dtypes": [m.dtype for m in metas],
                "shapes": [list(m.shape) for m in metas],
                "group_name": group_name,
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
                await self._control("/update_weights_from_distributed", body, timeout_s=_left(deadline))
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

    async def _pause(self) -> None:
        self.paused = True
        await self._control("/pause_generation", {"mode": self.pause_mode}, timeout_s=60)

    async def _resume(self) -> None:
        # torch_empty_cache=false: returning cached blocks to the driver would lengthen the pause.
        await self._control("/continue_generation", {"torch_empty_cache": False}, timeout_s=60)
        self.paused = False

    async def _begin_session(self, deadline: float) -> None:
        if not self.has_sessions:
            return
        response = await self.http.post("/begin_weight_update", json={}, timeout=_left(deadline))
        if response.status_code == 404:
            # SGLang before 0.5.23 has no weight-update sessions and updates without one.
            self.has_sessions = False
            return
        _check(response, "/begin_weight_update")

    async def _end_session(self, deadline: float) -> None:
        if self.has_sessions:
            await self._control("/end_weight_update", {}, timeout_s=_left(deadline))

    # ------------------------------------------------------------------ engine HTTP
    async def _control(self, path: str, body: dict, timeout_s: float) -> dict:
        response = await self.http.post(path, json=body, timeout=timeout_s)
        return _check(response, path)

    async def _get_json(self, path: str) -> dict:
        response = await self.http.get(path, timeout=30.0)
        return _check(response, path)


def _check(response: httpx.Response, path: str) -> dict:
    """SGLang's control routes answer {"success": bool, "message": str}; anything else than success raises."""
    try:
        body = response.json()
    except ValueError:
        body = {"message": response.text[:500]}
    if response.status_code >= 400 or (isinstance(body, dict) and body.get("success") is False):
        raise EngineError(f"SGLang {path} answered {response.status_code}: {str(body)[:500]}")
    return body if isinstance(body, dict) else {"value": body}


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


def _spans_from_labels(labels: list[int]) -> list[VersionSpan]:
    spans: list[VersionSpan] = []
    for i, version in enumerate(labels):
        if spans and spans[-1].version == version:
            spans[-1].end = i + 1
        else:
            spans.append(VersionSpan(version=version, start=i, end=i + 1))
    return spans


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


def _default_engine_python() -> str:
    if os.environ.get("PIPELINE_RL_SGLANG_PYTHON"):
        return os.environ["PIPELINE_RL_SGLANG_PYTHON"]
    nested = Path(sys.prefix) / "sglang" / "bin" / "python"
    return str(nested) if nested.exists() else sys.executable


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGKILL it when the shim dies (prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _short(e: BaseException, limit: int = 400) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:limit]
