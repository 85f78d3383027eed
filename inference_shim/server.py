"""The inference server: one HTTP contract (docs/contract.md) in front of any engine backend.

    pipeline-rl serve --backend vllm --model DIR --host 127.0.0.1 --port 8000 [--token T]

Routes (one module each under inference_shim/routes/): generation (/v1/chat/completions, /v1/completions,
/v1/models — API key when configured), weight transfer (/init_process_group, /request_weight_update,
/destroy_process_group — Bearer token when configured), and curl-friendly introspection (/health,
/capabilities, /debug/state, /metrics). This module assembles them with what they share: the error
handlers, the middleware, and the lifespan that starts the engine and stops the server if it dies.
Every request error is a 4xx `{"error", "detail"}`; limits and overload answers: inference_shim/limits.py.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference_shim.backends.base import Backend
from inference_shim.backends.common import ContractError
from inference_shim.limits import AdmissionGate, GuardMiddleware, Limits
from inference_shim.metrics import RouteMetricsMiddleware, ShimMetrics
from inference_shim.procs import LOOPBACK_HOSTS, reserve_port
from inference_shim.protocol import ErrorResponse
from inference_shim.routes.generation import generation_router
from inference_shim.routes.introspection import introspection_router
from inference_shim.routes.weights import weights_router

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
    allow_open_v1: bool = Field(
        default=False,
        description="Serve /v1/ without an API key on a non-loopback address (behind a gateway that "
        "authenticates); refused otherwise.",
    )
    limits: Limits = Field(default_factory=Limits, description="Body size, admission and request limits.")
    log_level: str = Field(default="info", description="uvicorn / logging level.")
    await_weights: bool = Field(
        default=False, description="Answer 503 awaiting_weights on generation until the first update."
    )
    update_mode: Literal["inflight", "drain"] = Field(
        default="inflight",
        description="inflight: updates land between two decode steps; drain: finish the requests in "
        "flight on the old weights first (docs/engines.md, Drain-then-swap).",
    )
    drain_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Drain mode: the longest wait for the turn, then for the requests in flight.",
    )

    @model_validator(mode="after")
    def _exposed_needs_token(self) -> ServeConfig:
        if self.host not in LOOPBACK_HOSTS and not self.token:
            raise ValueError(
                f"--host {self.host} exposes the control routes beyond this machine: set a token "
                "($PIPELINE_RL_TOKEN or --token), or bind 127.0.0.1"
            )
        if self.host not in LOOPBACK_HOSTS and not self.api_key and not self.allow_open_v1:
            raise ValueError(
                f"--host {self.host} would serve generation (/v1/*) to anyone who reaches it: set an API "
                "key ($PIPELINE_RL_API_KEY or --api-key; a launched run makes one, or takes "
                "inference.api_key), bind 127.0.0.1, or pass --allow-open-v1 behind a gateway that "
                "authenticates"
            )
        return self

    @property
    def exposed(self) -> bool:
        """Bound beyond this machine: /debug/state then answers the token holder only."""
        return self.host not in LOOPBACK_HOSTS


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
    exposed: bool = False,
) -> FastAPI:
    """The app over one backend: the routers of inference_shim/routes/, the contract's error bodies for
    every failure, the API-key/limits guard and metrics middleware, and the engine's lifespan."""
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

    @app.exception_handler(ContractError)
    async def _contract_error(_: Request, e: ContractError) -> JSONResponse:
        response = _error(e.status, e.error, e.detail)
        response.headers.update(e.headers or {})
        return response

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

    app.include_router(introspection_router(backend, metrics, token, exposed))
    app.include_router(generation_router(backend, limits, tokenize_pool))
    app.include_router(weights_router(backend, token))
    return app


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
    backend.update_mode, backend.drain_timeout_s = cfg.update_mode, cfg.drain_timeout_s
    app = create_app(backend, metrics, cfg.token, cfg.limits, cfg.api_key, cfg.exposed)
    config = uvicorn.Config(app, log_level=cfg.log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    if app.state.engine_failure is not None:
        raise SystemExit(f"inference server stopped: {app.state.engine_failure}")
