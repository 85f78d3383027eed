"""The inference server: one HTTP contract (docs/contract.md) in front of any engine backend.

    pipeline-rl serve --backend vllm --model DIR --host 127.0.0.1 --port 8000 [--token T]

Routes: generation (/v1/chat/completions, /v1/completions, /v1/models), weight transfer
(/init_process_group, /request_weight_update, /destroy_process_group — Bearer token when configured),
and curl-friendly introspection (/health, /capabilities, /debug/state, /metrics).
"""

from __future__ import annotations

import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from inference_shim.backends.base import Backend, ContractError, SamplingRequest
from inference_shim.metrics import ShimMetrics
from inference_shim.openai_format import (
    SSE_DONE,
    chat_chunk,
    chat_response,
    chat_role_chunk,
    completion_chunk,
    completion_response,
    new_id,
    sse_error,
)
from inference_shim.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    InitProcessGroupRequest,
    WeightUpdateRequest,
)

log = logging.getLogger("inference_shim")


class ServeConfig(BaseModel):
    """Flags of `pipeline-rl serve`."""

    backend: Literal["vllm", "sglang", "capture"] = Field(
        default="vllm", description="Engine behind the contract (capture: receive weights only, no engine)."
    )
    host: str = Field(default="127.0.0.1", description="Bind address; loopback unless you mean to expose it.")
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port.")
    token: str | None = Field(default=None, description="Bearer token required on control routes.")
    log_level: str = Field(default="info", description="uvicorn / logging level.")


def _error(status: int, error: str, detail: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=ErrorResponse(error=error, detail=detail).model_dump())


def create_app(backend: Backend, metrics: ShimMetrics, token: str | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await backend.start()
        log.info("engine ready: %s", backend.capabilities().model_dump_json())
        try:
            yield
        finally:
            await backend.stop()

    app = FastAPI(title="pipeline-rl inference shim", lifespan=lifespan)
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

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return _error(400, "invalid_json", "the request body is not valid JSON")
        detail = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg')}" for err in errors[:5]
        )
        return _error(422, "invalid_request", detail)

    @app.middleware("http")
    async def _count(request: Request, call_next):
        response = await call_next(request)
        metrics.requests.labels(route=request.url.path, status=str(response.status_code)).inc()
        return response

    # ------------------------------------------------------------------ introspection
    @app.get("/health")
    async def health():
        h = backend.health()
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

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        messages = [m.model_dump() for m in req.messages]
        prompt_ids = backend.chat_prompt_ids(messages, req.add_generation_prompt)
        params = sampling(req, req.top_logprobs or 0, req.max_completion_tokens or req.max_tokens)
        want_logprobs = req.logprobs
        token_text = backend.token_text
        if not req.stream:
            async for choices in backend.generate(prompt_ids, params, stream=False):
                return _json(chat_response(model_name(), prompt_ids, choices, want_logprobs, token_text))
        generator = backend.generate(prompt_ids, params, stream=True)
        first = await _first_or_error(generator)  # errors before streaming starts become proper 4xx

        async def events():
            rid, created, name = new_id("chatcmpl"), int(time.time()), model_name()
            for index in range(req.n):
                yield chat_role_chunk(rid, name, created, index, prompt_ids)
            try:
                batch = first
                while batch is not None:
                    for delta in batch:
                        yield chat_chunk(rid, name, created, delta, want_logprobs, token_text)
                    batch = await anext(generator, None)
            except Exception as e:  # the status line is already sent: report in-band
                log.exception("stream failed")
                yield sse_error(e)
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        if isinstance(req.prompt, str):
            prompt_ids = backend.text_prompt_ids(req.prompt)
        else:
            prompt_ids = list(req.prompt)
        if not prompt_ids:
            raise ContractError(400, "empty_prompt", "the prompt has no tokens")
        params = sampling(req, req.logprobs or 0, req.max_tokens or 16)
        if not req.stream:
            async for choices in backend.generate(prompt_ids, params, stream=False):
                return _json(
                    completion_response(model_name(), prompt_ids, choices, req.logprobs, backend.token_text)
                )
        generator = backend.generate(prompt_ids, params, stream=True)
        first = await _first_or_error(generator)

        async def events():
            rid, created, name = new_id("cmpl"), int(time.time()), model_name()
            try:
                batch = first
                while batch is not None:
                    for delta in batch:
                        yield completion_chunk(rid, name, created, delta)
                    batch = await anext(generator, None)
            except Exception as e:
                log.exception("stream failed")
                yield sse_error(e)
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _json(response: BaseModel) -> Response:
    # Serialized by pydantic directly: FastAPI's generic encoder is slower and refuses a -inf logprob.
    return Response(content=response.model_dump_json(), media_type="application/json")


async def _first_or_error(generator):
    try:
        return await anext(generator)
    except StopAsyncIteration:
        return None


def make_backend(cfg: ServeConfig, engine_options: dict, metrics: ShimMetrics) -> Backend:
    if cfg.backend == "vllm":
        from inference_shim.backends.vllm_backend import VllmBackend, VllmOptions

        return VllmBackend(VllmOptions(**engine_options), metrics)
    if cfg.backend == "capture":
        from inference_shim.backends.capture_backend import CaptureBackend, CaptureOptions

        return CaptureBackend(CaptureOptions(**engine_options), metrics)
    from inference_shim.backends.sglang_backend import SglangBackend, SglangOptions

    return SglangBackend(SglangOptions(**engine_options), metrics)


def serve(cfg: ServeConfig, engine_options: dict) -> None:
    """Run the server until SIGINT/SIGTERM (blocking)."""
    import uvicorn

    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "binding %s: the control routes are reachable from the network%s",
            cfg.host,
            "" if cfg.token else " WITHOUT a token",
        )
    metrics = ShimMetrics()
    app = create_app(make_backend(cfg, engine_options, metrics), metrics, cfg.token)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, timeout_graceful_shutdown=5)
