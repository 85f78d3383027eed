"""A STAND-IN for SGLang's HTTP server, for contract tests on machines where SGLang cannot run.

    python tests/support/sglang_standin.py --model-path DIR --host 127.0.0.1 --port 30000 [--api-key K] [--step-ms 10]

This is NOT SGLang (which needs CUDA: see NOTES-vllm-cpu.md). It speaks the part of SGLang 0.5.23's HTTP
API that the SGLang backend uses (inference_shim/backends/sglang_client.py), read from SGLang's
http_server.py, io_struct.py, api/v1/api_types.py and scheduler code, and checks requests as strictly
as SGLang does:
  - control bodies (/init_weights_update_group, /update_weights_from_distributed, /pause_generation, ...)
    are validated by pydantic like SGLang's msgspec structs: required fields, lax pydantic types,
    unknown keys ignored, errors -> 400 (SGLang turns FastAPI's 422 into 400);
  - /generate follows SGLang's JSON contract: unknown top-level keys ignored, unknown or mistyped
    sampling_params keys rejected, then SamplingParams.verify's value checks and the context-length
    check; features the stand-in does not implement are refused (400) rather than ignored;
  - the API key guards every route except /health, as SGLang's --api-key does.
What is real: the weight group (a torch c10d group built the way SGLang's init_weights_update_group
builds it), the broadcast it receives ("flattened_bucket": tensors packed back to back, or one broadcast
per tensor), the update session, pause modes and what they allow (a flush fails while requests still
hold KV), weight-version events and meta_info.weight_versions spans, cumulative streaming chunks.
What is fake: the model. One scheduler thread runs "steps" (every --step-ms) and control operations
in turn, like SGLang's scheduler, so a blocking collective stalls generation here too. Tokens and
logprobs are a deterministic function of (weights fingerprint, prompt, position): `reference()` below
tells a test exactly what the stand-in generates with given weights.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import hashlib
import json
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
import torch.distributed as dist
from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

FIRST_TOKEN = 4  # the tiny tokenizer's special tokens are 0..3: dummy tokens never hit EOS


# ---------------------------------------------------------------------------------------------------
# The fake model: what it generates, as a function of its weights
# ---------------------------------------------------------------------------------------------------
def fingerprint(named: dict[str, torch.Tensor]) -> int:
    """64-bit digest of every tensor's name, dtype, shape and bytes (order-independent)."""
    h = hashlib.sha256()
    for name in sorted(named):
        t = named[name].contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little")


def token_at(fp: int, prompt: list[int], position: int, vocab: int) -> tuple[int, float]:
    """Token and logprob the stand-in emits at output `position` for `prompt` under weights `fp`."""
    base = fp + 1_000_003 * sum(prompt) + 7919 * (len(prompt) + position)
    token = FIRST_TOKEN + base % (vocab - FIRST_TOKEN)
    return token, -(0.05 + (base // 7) % 997 / 1000.0)


def reference(model_dir: str | Path, prompt: list[int], count: int, dtype: str = "float32"):
    """(tokens, logprobs) the stand-in generates for `prompt` when serving the weights in model_dir."""
    weights, vocab = load_weights(model_dir, dtype)
    fp = fingerprint(weights)
    pairs = [token_at(fp, prompt, i, vocab) for i in range(count)]
    return [t for t, _ in pairs], [lp for _, lp in pairs]


def load_weights(model_dir: str | Path, dtype: str) -> tuple[dict[str, torch.Tensor], int]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        for name, t in load_file(str(path)).items():
            weights[name] = t.to(_dtype(dtype))
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    return weights, vocab


def _dtype(name: str) -> torch.dtype:
    return {"auto": torch.float32, "float": torch.float32, "half": torch.float16}.get(name) or getattr(
        torch, name
    )


# ---------------------------------------------------------------------------------------------------
# Request shapes (SGLang 0.5.23: io_struct.py BaseReq subclasses; extra keys are ignored there too)
# ---------------------------------------------------------------------------------------------------
class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")
    rid: str | None = None
    http_worker_ipc: str | None = None


class InitWeightsUpdateGroupReqInput(_Req):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroupReqInput(_Req):
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributedReqInput(_Req):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class PauseGenerationReqInput(_Req):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(_Req):
    torch_empty_cache: bool = True


class BeginWeightUpdateReqInput(_Req):
    selector: Literal["target", "draft", "all"] = "all"


class EndWeightUpdateReqInput(_Req):
    pass


# /generate: keys of sglang.api.v1.GenerateRequest / SamplingParams (0.5.23). The stand-in implements the
# "modeled" ones; a known but unmodeled key is refused, an unknown top-level key ignored (as SGLang does).
GENERATE_KEYS = {
    "rid", "text", "input_ids", "stream", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "token_ids_logprob", "return_hidden_states", "return_text_in_logprobs",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size",
    "routed_dp_rank", "disagg_prefill_dp_rank", "image_data", "mm_hashes", "video_data", "audio_data",
    "extra_key", "priority", "cache_salt", "require_reasoning", "lora_path", "session_params", "kv_hints",
    "routing_key", "max_thinking_tokens", "session_id", "custom_logit_processor", "custom_labels",
    "images_config", "return_prompt_token_ids", "routed_experts_start_len", "return_sampling_mask",
    "modalities",
}  # fmt: skip
GENERATE_MODELED = {
    "rid", "text", "input_ids", "stream", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs",
}  # fmt: skip
SAMPLING_TYPES = {  # key -> expected JSON type ("int" excludes booleans and floats, as SGLang's decoder)
    "max_new_tokens": "int", "stop": "str_or_list", "stop_token_ids": "int_list", "temperature": "float",
    "top_p": "float", "top_k": "int", "min_p": "float", "frequency_penalty": "float",
    "presence_penalty": "float", "repetition_penalty": "float", "min_new_tokens": "int", "n": "int",
    "ignore_eos": "bool", "skip_special_tokens": "bool", "spaces_between_special_tokens": "bool",
    "no_stop_trim": "bool", "sampling_seed": "int",
}  # fmt: skip
SAMPLING_UNMODELED = {
    "stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "stream_interval", "logit_bias",
    "custom_params", "beam_width", "watermark", "choice",
}  # fmt: skip


class BadRequest(ValueError):
    pass


def _typed(value, kind: str, key: str):
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, int | float) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "str_or_list": isinstance(value, str)
        or (isinstance(value, list) and all(isinstance(v, str) for v in value)),
        "int_list": isinstance(value, list)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value),
    }[kind]
    if not ok:
        raise BadRequest(f"invalid type for `{key}`: {type(value).__name__} {value!r}, expected {kind}")
    return value


def parse_generate(body, vocab: int, context_len: int) -> dict:
    """The checks SGLang runs on a /generate body, in its order; returns the normalized request."""
    if not isinstance(body, dict):
        raise BadRequest("invalid type: expected struct GenerateRequest")
    for key, value in body.items():
        if key in GENERATE_KEYS and key not in GENERATE_MODELED and value is not None:
            raise BadRequest(f"`{key}` is not implemented by the SGLang stand-in")
    req = {k: body.get(k) for k in GENERATE_MODELED}
    if req["input_ids"] is not None:
        _typed(req["input_ids"], "int_list", "input_ids")
    if req["text"] is not None and not isinstance(req["text"], str):
        raise BadRequest("batched `text` is not implemented by the SGLang stand-in")
    for key, kind in (("rid", "str"), ("stream", "bool"), ("return_logprob", "bool"),
                      ("top_logprobs_num", "int"), ("logprob_start_len", "int"),
                      ("return_text_in_logprobs", "bool")):  # fmt: skip
        if req[key] is not None:
            _typed(req[key], kind, key)
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadRequest("a list of sampling_params (batch) is not implemented by the SGLang stand-in")
    for key, value in sp.items():
        if key in SAMPLING_UNMODELED:
            raise BadRequest(f"sampling_params.{key} is not implemented by the SGLang stand-in")
        if key not in SAMPLING_TYPES:
            raise BadRequest(f"unknown field `{key}`, expected one of {sorted(SAMPLING_TYPES)}")
        if value is not None:
            _typed(value, SAMPLING_TYPES[key], f"sampling_params.{key}")
    sp = {key: value for key, value in sp.items() if value is not None}  # null means the default
    # io_struct GenerateReqInput._validate_inputs, then SamplingParams.verify
    if (req["text"] is None) == (req["input_ids"] is None):
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    temperature, top_p = sp.get("temperature", 1.0), sp.get("top_p", 1.0)
    top_k, max_new = sp.get("top_k", -1), sp.get("max_new_tokens", 128)
    if not math.isfinite(temperature) or temperature < 0:
        raise BadRequest(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}.")
    if top_k != -1 and top_k < 1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if max_new is not None and max_new < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {max_new}.")
    if sp.get("n", 1) != 1:
        raise BadRequest("parallel sampling (n > 1) is not implemented by the SGLang stand-in")
    if req["text"] is not None:
        raise BadRequest("text prompts are not implemented by the SGLang stand-in (send input_ids)")
    ids = req["input_ids"]
    if any(t < 0 or t >= vocab for t in ids):
        raise BadRequest(f"input_ids contain a token id outside [0, {vocab})")
    if len(ids) >= context_len:
        raise BadRequest(
            f"The input ({len(ids)} tokens) is longer than the model's context length ({context_len} tokens)."
        )
    if max_new is not None and len(ids) + max_new > context_len:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {context_len} tokens."
        )
    stop = sp.get("stop") or []
    return {
        "rid": req["rid"],
        "input_ids": list(ids),
        "stream": bool(req["stream"]),
        "max_new_tokens": max_new if max_new is not None else context_len - len(ids),
        "stop": [stop] if isinstance(stop, str) else list(stop),
        "return_logprob": bool(req["return_logprob"]),
        "top_logprobs_num": req["top_logprobs_num"] or 0,
    }


# ---------------------------------------------------------------------------------------------------
# The engine: one scheduler thread, as in SGLang
# ---------------------------------------------------------------------------------------------------
@dataclass
class Seq:
    rid: str
    prompt: list[int]
    max_new: int
    stop: list[str]
    logprobs: bool
    top_k: int
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    text: str = ""
    holds_kv: bool = False  # False while waiting: not started yet, or retracted by a pause
    finish: dict | None = None
    events: list[tuple[str, int]] = field(default_factory=list)  # (old version, tokens generated by it)


class Engine:
    def __init__(self, args) -> None:
        from transformers import AutoTokenizer

        self.args = args
        self.tokenizer = AutoTokenizer.from_pretrained(args.model_path)
        self.weights, self.vocab = load_weights(args.model_path, args.dtype)
        self.fp = fingerprint(self.weights)
        self.version = args.weight_version
        self.context_len = args.context_length
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.session = False
        self.paused = False
        self.loads: dict[str, int] = {}  # tensor name -> times loaded (for --fault-fail-load)
        self.seqs: dict[str, Seq] = {}
        self._new: list[Seq] = []
        self._ops: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="scheduler", daemon=True).start()

    async def call(self, fn, *args):
        """Run fn(*args) on the scheduler thread, between steps (it may block, e.g. in a collective)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._ops.put((fn, args, future))
        return await asyncio.wrap_future(future)

    def add(self, seq: Seq) -> None:
        with self._lock:
            self._new.append(seq)

    def abort(self, rid: str) -> None:
        self._ops.put((self._abort, (rid, "client went away"), None))

    def _run(self) -> None:
        step_s = self.args.step_ms / 1000.0
        while True:
            try:
                fn, args, future = self._ops.get(timeout=step_s if self.seqs or self._new else 0.05)
                try:
                    result = fn(*args)
                    if future is not None:
                        future.set_result(result)
                except BaseException as e:
                    if future is None:
                        raise
                    future.set_exception(e)
                continue  # drain control operations before the next step, as SGLang's event loop does
            except queue.Empty:
                pass
            with self._lock:
                for seq in self._new:
                    self.seqs[seq.rid] = seq
                self._new.clear()
            if not self.paused:
                for seq in list(self.seqs.values()):
                    self._step(seq)

    def _step(self, seq: Seq) -> None:
        seq.holds_kv = True  # (re-)prefilled with the weights loaded now
        token, lp = token_at(self.fp, seq.prompt, len(seq.ids), self.vocab)
        seq.ids.append(token)
        seq.lps.append(lp)
        seq.text = self.tokenizer.decode(seq.ids, skip_special_tokens=True)
        for s in seq.stop:
            if s and s in seq.text:
                seq.text = seq.text[: seq.text.index(s)]
                seq.finish = {"type": "stop", "matched": s}
        if seq.finish is None and len(seq.ids) >= seq.max_new:
            seq.finish = {"type": "length", "length": seq.max_new}
        self._emit(seq)

    def _emit(self, seq: Seq) -> None:
        meta = {
            "id": seq.rid,
            "finish_reason": seq.finish,
            "prompt_tokens": len(seq.prompt),
            "completion_tokens": len(seq.ids),
            "cached_tokens": 0,
            "weight_version": self.version,
        }
        if seq.logprobs:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(seq.ids, seq.lps, strict=True)]
            meta["output_token_logprobs_length"] = len(seq.ids)
            if seq.top_k:
                meta["output_top_logprobs"] = [
                    self._tops(t, lp, seq.top_k) for t, lp in zip(seq.ids, seq.lps, strict=True)
                ]
        if seq.finish is not None:
            meta["weight_versions"] = self._spans(seq)
            self.seqs.pop(seq.rid, None)
        out = {"text": seq.text, "output_ids": list(seq.ids), "meta_info": meta}
        seq.loop.call_soon_threadsafe(seq.out.put_nowait, out)

    def _tops(self, token: int, lp: float, k: int) -> list:
        span = self.vocab - FIRST_TOKEN
        return [[lp - 0.5 * j, FIRST_TOKEN + (token - FIRST_TOKEN + j) % span, None] for j in range(k)]

    def _spans(self, seq: Seq) -> list[dict]:
        """Version spans over the output tokens, from the events recorded at each version change."""
        spans: list[dict] = []
        for version, end in [*seq.events, (self.version, len(seq.ids))]:
            end = min(end, len(seq.ids))
            if spans and end <= spans[-1]["end"]:
                continue
            if spans and spans[-1]["version"] == version:
                spans[-1]["end"] = end
            else:
                spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
        return spans

    def _abort(self, rid: str | None, message: str) -> None:
        for seq in list(self.seqs.values()):
            if rid is None or seq.rid == rid:
                seq.finish = {"type": "abort", "message": message}
                self._emit(seq)

    # ------------------------------------------------------------------ control (scheduler thread)
    def pause(self, mode: str) -> None:
        self.paused = True
        if mode == "abort":
            self._abort(None, "Abort in waiting queue")
        elif mode == "retract":
            for seq in self.seqs.values():
                seq.holds_kv = False  # back to the waiting queue, KV freed

    def resume(self) -> None:
        self.paused = False

    def init_group(self, req: InitWeightsUpdateGroupReqInput) -> tuple[bool, str]:
        from torch.distributed.distributed_c10d import (
            Backend,
            PrefixStore,
            _new_process_group_helper,
            _world,
            rendezvous,
        )

        if req.group_name == "":
            raise AssertionError("Group name cannot be empty")
        timeout = dt.timedelta(seconds=self.args.pg_timeout_s)  # SGLang: torch's default, 30 minutes
        try:
            store, rank, world = next(
                rendezvous(
                    f"tcp://{req.master_address}:{req.master_port}",
                    req.rank_offset,
                    req.world_size,
                    timeout=timeout,
                )
            )
            store.set_timeout(timeout)
            pg, _ = _new_process_group_helper(
                world, rank, [], Backend(req.backend), PrefixStore(req.group_name, store),
                group_name=req.group_name, timeout=timeout,
            )  # fmt: skip
            _world.pg_group_ranks[pg] = {r: r for r in range(world)}
            self.groups[req.group_name] = pg
            return True, "Succeeded to initialize custom process group."
        except Exception as e:
            return False, f"Failed to initialize custom process group: {e}."

    def destroy_group(self, group_name: str) -> tuple[bool, str]:
        if group_name not in self.groups:
            return False, "The group to be destroyed does not exist."
        dist.destroy_process_group(self.groups.pop(group_name))
        return True, "Succeeded to destroy custom process group."

    def begin(self) -> tuple[bool, str]:
        if self.session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = True
        return True, "Success"

    def end(self) -> tuple[bool, str]:
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = False
        return True, "Success"

    def update(self, req: UpdateWeightsFromDistributedReqInput) -> tuple[bool, str]:
        if not self.session:
            return (
                False,
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
            )
        try:
            received = self._receive(req)
        except Exception as e:
            return False, f"Failed to receive weights: {e}"
        for name, tensor in received:  # loaded one by one, like model.load_weights: a failure leaves a mix
            current = self.weights.get(name)
            self.loads[name] = self.loads.get(name, 0) + 1
            if current is None or list(current.shape) != list(tensor.shape) or self._fault(name):
                return False, (
                    f"Failed to update parameter online: cannot load {name} {list(tensor.shape)}. "
                    "The full weights of the ModelRunner are partially updated. Please discard the whole weights."
                )
            self.weights[name] = tensor.to(current.dtype).clone()
        self.fp = fingerprint(self.weights)
        if req.weight_version is not None and req.weight_version != self.version:
            for seq in self.seqs.values():
                if seq.ids:
                    seq.events.append((self.version, len(seq.ids)))
            self.version = req.weight_version
        # A flush needs an idle engine; a paused one ignores its waiting queue (scheduler.flush_cache).
        if req.flush_cache and (
            any(s.holds_kv for s in self.seqs.values()) or (self._new and not self.paused)
        ):
            return False, (
                "Weights were updated, but the cache was not flushed because requests are still running "
                "or queued. Retract or finish them, then call /flush_cache."
            )
        return True, "Succeeded to update parameter online."

    def _fault(self, name: str) -> bool:
        """Fault injection (--fault-fail-load NAME:K): the K-th load of tensor NAME fails."""
        if not self.args.fault_fail_load:
            return False
        fault_name, count = self.args.fault_fail_load.rsplit(":", 1)
        return name == fault_name and self.loads[name] == int(count)

    def _receive(self, req: UpdateWeightsFromDistributedReqInput) -> list[tuple[str, torch.Tensor]]:
        if req.group_name not in self.groups:
            raise AssertionError(
                f"Group {req.group_name} not in {list(self.groups)}. Please call `init_weights_update_group` first."
            )
        pg = self.groups[req.group_name]
        dtypes = [getattr(torch, d) for d in req.dtypes]
        if req.load_format == "flattened_bucket":
            layout, offset = [], 0
            for name, dtype, shape in zip(req.names, dtypes, req.shapes, strict=True):
                if any(d < 0 for d in shape):
                    raise ValueError(f"Negative dimension in received tensor {name}: {shape}")
                if offset % dtype.itemsize:
                    raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
                size = math.prod(shape) * dtype.itemsize
                layout.append((name, dtype, shape, offset, size))
                offset += size
            if not layout:
                raise ValueError("Cannot create empty tensor bucket")
            flat = torch.empty(offset, dtype=torch.uint8)
            dist.broadcast(flat, src=0, group=pg)
            return [(n, flat[o : o + s].view(d).reshape(sh)) for n, d, sh, o, s in layout]
        if req.load_format is not None:
            raise ValueError(f"load_format {req.load_format!r} is not implemented by the SGLang stand-in")
        tensors = [
            (n, torch.empty(sh, dtype=d)) for n, d, sh in zip(req.names, dtypes, req.shapes, strict=False)
        ]  # SGLang: zip, no check
        works = [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in tensors]
        for work in works:
            work.wait()
        return tensors


# ---------------------------------------------------------------------------------------------------
# HTTP (routes of sglang/srt/entrypoints/http_server.py)
# ---------------------------------------------------------------------------------------------------
def create_app(args) -> FastAPI:
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await asyncio.to_thread(engine)  # load the "model" before serving, as SGLang does
        yield

    app = FastAPI(title="SGLang STAND-IN (not SGLang)", lifespan=lifespan)
    resumed = asyncio.Event()
    resumed.set()
    readers = {"count": 0, "writer": False}  # SGLang's model_update_lock: updates wait for requests

    def engine() -> Engine:
        if "engine" not in state:
            state["engine"] = Engine(args)
        return state["engine"]

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if args.api_key and not request.url.path.startswith(("/health", "/ready", "/metrics")):
            if request.headers.get("authorization", "") != f"Bearer {args.api_key}":
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError):
        message = f"{e} {e.errors()}"
        return JSONResponse(
            {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}, 400
        )

    def answer(ok_message: tuple[bool, str]) -> JSONResponse:
        ok, message = ok_message
        return JSONResponse({"success": ok, "message": message}, status_code=200 if ok else 400)

    @app.get("/health")
    async def health():
        return JSONResponse({}, status_code=200 if "engine" in state else 503)

    @app.get("/server_info")
    async def server_info():
        e = engine()
        return {"version": "0.5.23-standin", "model_path": args.model_path, "weight_version": e.version}

    @app.post("/init_weights_update_group")
    async def init_group(obj: Annotated[InitWeightsUpdateGroupReqInput, Body()]):
        return answer(await engine().call(engine().init_group, obj))

    @app.post("/destroy_weights_update_group")
    async def destroy_group(obj: Annotated[DestroyWeightsUpdateGroupReqInput, Body()]):
        return answer(await engine().call(engine().destroy_group, obj.group_name))

    @app.post("/begin_weight_update")
    async def begin(obj: Annotated[BeginWeightUpdateReqInput, Body()]):
        return answer(await engine().call(engine().begin))

    @app.post("/end_weight_update")
    async def end(obj: Annotated[EndWeightUpdateReqInput, Body()]):
        return answer(await engine().call(engine().end))

    @app.post("/update_weights_from_distributed")
    async def update(obj: Annotated[UpdateWeightsFromDistributedReqInput, Body()]):
        if obj.abort_all_requests:
            await engine().call(engine()._abort, None, "Abort all requests")
        if resumed.is_set():  # not paused: SGLang takes the writer lock and waits for every request
            readers["writer"] = True
            try:
                while readers["count"]:
                    await asyncio.sleep(0.01)
                return answer(await engine().call(engine().update, obj))
            finally:
                readers["writer"] = False
        return answer(await engine().call(engine().update, obj))

    @app.post("/pause_generation")
    async def pause(obj: Annotated[PauseGenerationReqInput, Body()]):
        resumed.clear()
        await engine().call(engine().pause, obj.mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def resume(obj: Annotated[ContinueGenerationReqInput, Body()]):
        await engine().call(engine().resume)
        resumed.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        e = engine()
        try:
            req = parse_generate(json.loads(await request.body()), e.vocab, e.context_len)
        except json.JSONDecodeError as err:
            return JSONResponse({"error": f"invalid JSON: {err}"}, status_code=400)
        except BadRequest as err:
            return JSONResponse({"error": {"message": str(err)}}, status_code=400)
        while readers["writer"]:
            await asyncio.sleep(0.01)
        await resumed.wait()  # a paused SGLang holds new requests until it continues
        readers["count"] += 1
        seq = Seq(
            rid=req["rid"] or f"standin-{time.monotonic_ns()}",
            prompt=req["input_ids"],
            max_new=req["max_new_tokens"],
            stop=req["stop"],
            logprobs=req["return_logprob"],
            top_k=req["top_logprobs_num"],
            out=asyncio.Queue(),
            loop=asyncio.get_running_loop(),
        )
        e.add(seq)

        async def outputs():
            try:
                while True:
                    out = await seq.out.get()
                    yield out
                    if out["meta_info"]["finish_reason"] is not None:
                        return
            finally:
                readers["count"] -= 1
                if seq.finish is None:
                    e.abort(seq.rid)

        if not req["stream"]:
            last = None
            async for out in outputs():
                last = out
            return last

        async def sse():
            async for out in outputs():
                yield f"data: {json.dumps(out)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="SGLang STAND-IN (tests only; not SGLang)")
    # The sglang.launch_server flags the SGLang backend passes; any other flag is an error, as in SGLang.
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"]
    )
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--tp-size", type=int, default=1, choices=[1])
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--log-level", default="warning")
    # stand-in only
    p.add_argument("--step-ms", type=float, default=10.0, help="time per decode step (all sequences)")
    p.add_argument("--pg-timeout-s", type=float, default=60.0, help="weight group timeout (SGLang: 30 min)")
    p.add_argument("--fault-fail-load", default=None, help="NAME:K: the K-th load of tensor NAME fails")
    args = p.parse_args(argv)

    import uvicorn

    uvicorn.run(create_app(args), host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
