"""The inference server: one HTTP contract (docs/contract.md) in front of any engine backend.

    pipeline-rl serve --backend vllm --model DIR --host 127.0.0.1 --port 8000 [--token T]

Routes: generation (/v1/chat/completions, /v1/completions, /v1/models — API key when configured),
weight transfer (/init_process_group, /request_weight_update, /destroy_process_group — Bearer token when
configured), and curl-friendly introspection (/health, /capabilities, /debug/state, /metrics).
Every request error is a 4xx `{"error", "detail"}`; limits and overload answers: inference_shim/limits.py.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference_shim.backends.base import Backend
from inference_shim.backends.common import ContractError, SamplingRequest
from inference_shim.limits import AdmissionGate, GuardMiddleware, Limits, check_generation
from inference_shim.metrics import RouteMetricsMiddleware, ShimMetrics
from inference_shim.openai_format import (
    SSE_DONE,
    chat_chunk,
    chat_response,
    chat_role_chunk,
    completion_chunk,
    completion_response,
    new_id,
    sse_error,
    usage_chunk,
)
from inference_shim.openai_protocol import ChatCompletionRequest, CompletionRequest
from inference_shim.procs import reserve_port
from inference_shim.protocol import ErrorResponse, InitProcessGroupRequest, WeightUpdateRequest
from inference_shim.tool_calls import ChoiceTools, output_constraint

log = logging.getLogger("inference_shim")


class ServeConfig(BaseModel):
    """Flags of `pipeline-rl serve`."""

    backend: Literal["vllm", "sglang", "torch", "capture"] = Field(
        default="vllm",
        description="Engine behind the contract (torch: plain torch + transformers, for tiny models and "
        "machines without vLLM; capture: receive weights only, no engine).",
    )
    host: str = Field(default="127.0.0.1", description="Bind address; loopback unless you mean to expose it.")
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port.")
    token: str | None = Field(default=None, description="Bearer token required on control routes.")
    api_key: str | None = Field(default=None, description="Bearer key required on /v1/ routes; None: open.")
    limits: Limits = Field(default_factory=Limits, description="Body size, admission and request limits.")
    log_level: str = Field(default="info", description="uvicorn / logging level.")
    await_weights: bool = Field(
        default=False, description="Answer 503 awaiting_weights on generation until the first update."
    )

    @model_validator(mode="after")
    def _exposed_needs_token(self) -> ServeConfig:
        if self.host not in LOOPBACK_HOSTS and not self.token:
            raise ValueError(
                f"--host {self.host} exposes the control routes beyond this machine: set a token "
                "($PIPELINE_RL_TOKEN or --token), or bind 127.0.0.1"
            )
        return self


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

# The `error` code of an HTTP error the framework raises itself (unknown path, wrong method, body
# that cannot be parsed, body over the limit): every error body is {"error", "detail"}.
HTTP_ERROR_CODES = {
    400: "invalid_json",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
}


def _error(status: int, error: str, detail: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=ErrorResponse(error=error, detail=detail).model_dump())


def create_app(
    backend: Backend,
    metrics: ShimMetrics,
    token: str | None = None,
    limits: Limits | None = None,
    api_key: str | None = None,
) -> FastAPI:
    limits = limits or Limits()
    # Tokenization and chat templates run here, off the event loop, so one huge prompt cannot stall
    # /health, streams or a weight update. One thread: a Hugging Face fast tokenizer is not safe to
    # call from several threads at once ("Already borrowed").
    tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await backend.start()
        # Everything alive now (torch, the engine, the tokenizer: ~0.64 M objects) lives as long as the
        # server. Frozen, a full garbage collection skips it: under 1 ms instead of 0.6-0.8 s on these
        # 2 cores (measured in this process), a pause that /health and every stream would share.
        gc.collect()
        gc.freeze()
        log.info("engine ready: %s", backend.capabilities().model_dump_json())
        watchdog = asyncio.create_task(_watch_engine(backend, app))
        try:
            yield
        finally:
            watchdog.cancel()
            await backend.stop()
            tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="pipeline-rl inference shim", lifespan=lifespan)
    app.state.engine_failure = None  # set by _watch_engine; serve() then exits non-zero
    # Outermost first: count every answer (the guard's 401/413/503 included), then the guard.
    app.add_middleware(
        GuardMiddleware,
        limits=limits,
        gate=AdmissionGate(limits.max_concurrent_requests, limits.max_queued_requests),
        api_key=api_key,
    )
    app.add_middleware(RouteMetricsMiddleware, metrics=metrics)
    backend.token = token  # signs/verifies the weight plane's store values (protocol.sign_value)

    def require_token(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        if not hmac.compare_digest(header.encode(), f"Bearer {token}".encode()):
            raise ContractError(
                401, "unauthorized", "send 'Authorization: Bearer <token>' (the server's --token)"
            )

    @app.exception_handler(ContractError)
    async def _contract_error(_: Request, e: ContractError) -> JSONResponse:
        return _error(e.status, e.error, e.detail)

    @app.exception_handler(Exception)
    async def _server_fault(_: Request, e: Exception) -> JSONResponse:
        # Still logged with its traceback by the server; the client gets the contract's error body.
        return _error(500, "internal_error", f"{type(e).__name__}: {e}"[:500])

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        response = _error(e.status_code, HTTP_ERROR_CODES.get(e.status_code, "http_error"), str(e.detail))
        response.headers.update(e.headers or {})  # e.g. Allow on a 405
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return _error(400, "invalid_json", "the request body is not valid JSON")
        detail = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg')}" for err in errors[:5]
        )
        return _error(422, "invalid_request", detail)

    # ------------------------------------------------------------------ introspection
    @app.get("/health")
    async def health():
        h = backend.health_now()
        return JSONResponse(status_code=200 if h.status == "ok" else 503, content=h.model_dump())

    @app.get("/capabilities")
    async def capabilities():
        return backend.capabilities().model_dump()

    @app.get("/debug/state")
    async def debug_state(request: Request):
        state = backend.debug_state()
        try:
            require_token(request)
        except ContractError:
            # Introspection stays open, but where the trainer's store listens is for the token holder:
            # whoever reaches the store can tamper with its keys (unsigned rendezvous, forged values).
            if state.group is not None:
                state.group = state.group.redacted()
        return state.model_dump()

    @app.get("/metrics")
    async def prometheus():
        return Response(content=metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        name = backend.capabilities().model
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": 0, "owned_by": "pipeline-rl"}],
        }

    # ------------------------------------------------------------------ weight transfer (control)
    @app.post("/init_process_group", dependencies=[Depends(require_token)])
    async def init_process_group(req: InitProcessGroupRequest):
        return (await backend.init_process_group(req)).model_dump()

    @app.post("/request_weight_update", dependencies=[Depends(require_token)])
    async def request_weight_update(req: WeightUpdateRequest):
        return (await backend.request_weight_update(req)).model_dump()

    @app.post("/destroy_process_group", dependencies=[Depends(require_token)])
    async def destroy_process_group():
        await backend.destroy_process_group()
        return {"status": "destroyed"}

    # ------------------------------------------------------------------ generation
    def sampling(
        req: ChatCompletionRequest | CompletionRequest, top_logprobs: int, max_tokens: int | None
    ) -> SamplingRequest:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        return SamplingRequest(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            n=req.n,
            seed=req.seed,
            stop=stop,
            top_logprobs=top_logprobs,
            ignore_eos=req.ignore_eos,
        )

    def model_name() -> str:
        return backend.capabilities().model

    def admit(req: ChatCompletionRequest | CompletionRequest) -> None:
        """Refuse, before any tokenization: a request beyond the limits (400) or a server that must not
        generate now (503, e.g. weights_incomplete)."""
        check_generation(req, limits)
        backend.check_can_generate()

    async def off_loop(fn, *args) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(tokenize_pool, fn, *args)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        admit(req)
        messages = _template_messages(req)
        tool_specs = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        prompt_ids = await off_loop(_render_chat, backend, messages, req.add_generation_prompt, tool_specs)
        params = sampling(req, req.top_logprobs or 0, req.max_completion_tokens or req.max_tokens)
        params.constraint = output_constraint(req)
        if params.constraint is not None and not backend.structured_output:
            raise ContractError(
                400,
                "structured_output_unsupported",
                f"the {backend.name} backend cannot constrain output (response_format, tool_choice "
                "'required' or named); docs/contract.md lists the features per backend",
            )
        # One reader per choice (a streaming tool parser keeps state); a backend that parses no tool calls
        # refuses tool_choice auto here, before any generation.
        readers = [
            ChoiceTools(req, backend.tool_parser(tool_specs) if req.tool_mode == "auto" else None)
            for _ in range(req.n)
        ]
        want_logprobs = req.logprobs
        token_text = backend.token_text
        if not req.stream:
            async for choices in backend.generate(prompt_ids, params, stream=False):
                backend.check_can_generate()  # an update failed mid-apply meanwhile: 503, not its tokens
                return _json(
                    chat_response(
                        model_name(), prompt_ids, choices, want_logprobs, token_text, readers.__getitem__
                    )
                )
        generator = _guarded(backend, backend.generate(prompt_ids, params, stream=True))
        first = await _first_or_error(generator)  # errors before streaming starts become proper 4xx

        async def events():
            rid, created, name = new_id("chatcmpl"), int(time.time()), model_name()
            for index in range(req.n):
                yield chat_role_chunk(rid, name, created, index, prompt_ids)
            generated = 0
            try:
                batch = first
                while batch is not None:
                    for delta in batch:
                        generated += len(delta.token_ids)
                        yield chat_chunk(
                            rid, name, created, delta, want_logprobs, token_text, readers[delta.index]
                        )
                    batch = await anext(generator, None)
                if wants_usage(req):
                    yield usage_chunk(True, rid, name, created, len(prompt_ids), generated)
            except Exception as e:  # the status line is already sent: report in-band
                log.exception("stream failed")
                yield sse_error(e)
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        admit(req)
        if isinstance(req.prompt, str):
            prompt_ids = await off_loop(backend.text_prompt_ids, req.prompt)
        else:
            prompt_ids = list(req.prompt)
            backend.check_token_ids(prompt_ids)
        if not prompt_ids:
            raise ContractError(400, "empty_prompt", "the prompt has no tokens")
        params = sampling(req, req.logprobs or 0, req.max_tokens or 16)
        if not req.stream:
            async for choices in backend.generate(prompt_ids, params, stream=False):
                backend.check_can_generate()
                return _json(
                    completion_response(model_name(), prompt_ids, choices, req.logprobs, backend.token_text)
                )
        generator = _guarded(backend, backend.generate(prompt_ids, params, stream=True))
        first = await _first_or_error(generator)

        async def events():
            rid, created, name = new_id("cmpl"), int(time.time()), model_name()
            generated = 0
            try:
                batch = first
                while batch is not None:
                    for delta in batch:
                        generated += len(delta.token_ids)
                        yield completion_chunk(rid, name, created, delta)
                    batch = await anext(generator, None)
                if wants_usage(req):
                    yield usage_chunk(False, rid, name, created, len(prompt_ids), generated)
            except Exception as e:
                log.exception("stream failed")
                yield sse_error(e)
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _json(response: BaseModel) -> Response:
    # Serialized by pydantic directly: FastAPI's generic encoder is slower and refuses a -inf logprob.
    return Response(content=response.model_dump_json(), media_type="application/json")


def wants_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
    """A stream ends with a usage chunk (no choices) when the client asked for one, as OpenAI's does."""
    return req.stream_options is not None and req.stream_options.include_usage


def _template_messages(req: ChatCompletionRequest) -> list[dict]:
    """The messages as the chat template gets them; a content part we cannot serve is a 400 that names
    its type (this server renders text only)."""
    for i, message in enumerate(req.messages):
        part = message.unsupported_part()
        if part is not None:
            raise ContractError(
                400,
                "unsupported_content",
                f"messages[{i}] has a content part of type {part!r}; this server accepts text parts only",
            )
    return [m.template_dict() for m in req.messages]


def _render_chat(
    backend: Backend, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None
) -> list[int]:
    """The chat prompt's token ids; a template that refuses these messages is the client's 400."""
    import jinja2

    try:
        return backend.chat_prompt_ids(messages, add_generation_prompt, tools)
    except ContractError:
        raise
    except (jinja2.TemplateError, ValueError, TypeError, KeyError) as e:
        # e.g. a role or an order of roles the model's chat template rejects (raise_exception in it)
        raise ContractError(400, "invalid_messages", f"the model's chat template refused them: {e}") from e


async def _guarded(backend: Backend, generator):
    """A stream's batches, each checked first: once an update failed mid-apply (weights_incomplete), not
    one more token goes out; the stream ends with the in-band error instead. Every backend, one place."""
    try:
        async for batch in generator:
            backend.check_can_generate()
            yield batch
    finally:
        await generator.aclose()  # the engine's request ends now, not when the garbage collector runs


async def _first_or_error(generator):
    try:
        return await anext(generator)
    except StopAsyncIteration:
        return None


def make_backend(cfg: ServeConfig, engine_options: dict, metrics: ShimMetrics) -> Backend:
    if cfg.backend == "vllm":
        from inference_shim.backends.vllm_backend import VllmBackend, VllmOptions

        return VllmBackend(VllmOptions(**engine_options), metrics)
    if cfg.backend == "torch":
        from inference_shim.backends.torch_backend import TorchBackend, TorchOptions

        return TorchBackend(TorchOptions(**engine_options), metrics)
    if cfg.backend == "capture":
        from inference_shim.backends.capture_backend import CaptureBackend, CaptureOptions

        return CaptureBackend(CaptureOptions(**engine_options), metrics)
    from inference_shim.backends.sglang_backend import SglangBackend, SglangOptions

    return SglangBackend(SglangOptions(**engine_options), metrics)


ENGINE_WATCH_S = 1.0


async def _watch_engine(backend: Backend, app: FastAPI) -> None:
    """Once the engine has died, stop the server (SIGTERM to itself: uvicorn's graceful shutdown) so
    that it exits non-zero and a supervisor restarts it; a live process whose engine is gone would
    answer 503 forever."""
    while True:
        await asyncio.sleep(ENGINE_WATCH_S)
        try:
            failure = backend.engine_failure()
        except Exception as err:  # a broken check must not end the watch unseen
            failure = f"the engine's health check itself failed ({type(err).__name__}: {err})"
        if failure is not None:
            log.error("%s: stopping this server so that it can be restarted", failure)
            app.state.engine_failure = failure
            os.kill(os.getpid(), signal.SIGTERM)
            return


def serve(cfg: ServeConfig, engine_options: dict) -> None:
    """Run the server until SIGINT/SIGTERM (blocking)."""
    import uvicorn

    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.host not in LOOPBACK_HOSTS:  # ServeConfig refused this without a token
        log.warning("binding %s: the routes are reachable from the network; firewall the port", cfg.host)
    # The port first, the engine after: uvicorn binds only once the app's startup (the engine) is done.
    try:
        sock = reserve_port(cfg.host, cfg.port)
    except OSError as err:
        raise SystemExit(
            f"inference server: cannot bind {cfg.host}:{cfg.port} ({err}); pick another --port"
        ) from None
    metrics = ShimMetrics()
    backend = make_backend(cfg, engine_options, metrics)
    backend.awaiting_weights = cfg.await_weights
    app = create_app(backend, metrics, cfg.token, cfg.limits, cfg.api_key)
    config = uvicorn.Config(app, log_level=cfg.log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    if app.state.engine_failure is not None:
        raise SystemExit(f"inference server stopped: {app.state.engine_failure}")
