"""Generation routes, OpenAI-shaped (docs/contract.md): /v1/chat/completions, /v1/completions (plain or
streamed as server-sent events) and /v1/models. The API key and admission limits are the middleware's
(inference_shim/limits.py); request limits and the backend's can-generate check run here, before any
tokenization.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from inference_shim.backends.base import Backend
from inference_shim.backends.common import ContractError, SamplingRequest
from inference_shim.limits import Limits, check_generation
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
from inference_shim.protocol import BASE_MODEL_SUFFIX
from inference_shim.tool_calls import ChoiceTools, output_constraint

log = logging.getLogger("inference_shim")


def generation_router(backend: Backend, limits: Limits, tokenize_pool: ThreadPoolExecutor) -> APIRouter:
    """The generation routes; tokenization and chat templates run on `tokenize_pool` (server.create_app
    owns it and says why it has one thread)."""
    router = APIRouter()

    def model_name() -> str:
        return backend.capabilities().model

    def admit(req: ChatCompletionRequest | CompletionRequest) -> None:
        """Refuse, before any tokenization: a request beyond the limits (400) or a server that must not
        generate now (503, e.g. weights_incomplete, draining)."""
        check_generation(req, limits)
        backend.admit_request()

    async def off_loop(fn, *args) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(tokenize_pool, fn, *args)

    @router.get("/v1/models")
    async def models():
        names = [model_name()]
        if backend.lora_max_rank and backend.serves_base_alone:
            names.append(model_name() + BASE_MODEL_SUFFIX)
        return {
            "object": "list",
            "data": [{"id": n, "object": "model", "created": 0, "owned_by": "pipeline-rl"} for n in names],
        }

    def _sampling(
        req: ChatCompletionRequest | CompletionRequest, top_logprobs: int, max_tokens: int | None
    ) -> SamplingRequest:
        params = sampling_request(req, top_logprobs, max_tokens)
        if backend.lora_max_rank and req.model == model_name() + BASE_MODEL_SUFFIX:
            if not backend.serves_base_alone:
                raise ContractError(
                    400,
                    "base_model_unavailable",
                    f"the {backend.name} backend merges the adapter into its weights: it serves "
                    f"{model_name()!r} (base + adapter) only",
                )
            params.base_model = True
        return params

    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        admit(req)
        messages = _template_messages(req)
        tool_specs = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        prompt_ids = await off_loop(_render_chat, backend, messages, req.add_generation_prompt, tool_specs)
        params = _sampling(req, req.top_logprobs or 0, req.max_completion_tokens or req.max_tokens)
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
        ticket = backend.admit_request()  # again: a drain may have begun while the prompt was rendered
        if not req.stream:
            choices = await _whole(backend, backend.generate(prompt_ids, params, stream=False), ticket)
            return _json(
                chat_response(
                    model_name(), prompt_ids, choices, want_logprobs, token_text, readers.__getitem__
                )
            )
        generator = _guarded(backend, backend.generate(prompt_ids, params, stream=True), ticket)
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

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest):
        admit(req)
        if isinstance(req.prompt, str):
            prompt_ids = await off_loop(backend.text_prompt_ids, req.prompt)
        else:
            prompt_ids = list(req.prompt)
            backend.check_token_ids(prompt_ids)
        if not prompt_ids:
            raise ContractError(400, "empty_prompt", "the prompt has no tokens")
        params = _sampling(req, req.logprobs or 0, req.max_tokens or 16)
        ticket = backend.admit_request()
        if not req.stream:
            choices = await _whole(backend, backend.generate(prompt_ids, params, stream=False), ticket)
            return _json(
                completion_response(model_name(), prompt_ids, choices, req.logprobs, backend.token_text)
            )
        generator = _guarded(backend, backend.generate(prompt_ids, params, stream=True), ticket)
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

    return router


def sampling_request(
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


async def _guarded(backend: Backend, generator, ticket: int):
    """A request's batches, each checked first: once an update failed mid-apply (weights_incomplete) or
    a drain's bound ended the request (drain_timeout), not one more token goes out; a stream ends with
    the in-band error instead. Every backend, one place. The generator must be started (its first
    anext) right after admit_request gave `ticket`, with no await between: the engine then counts the
    request in flight before a drain can look."""
    try:
        async for batch in generator:
            backend.check_can_generate(ticket)
            yield batch
    except ContractError:
        # An engine that ends its requests with an error of its own (the torch engine's abort) says
        # why from the server's view: a drain's cut, or the weights' state.
        backend.check_can_generate(ticket)
        raise
    finally:
        await generator.aclose()  # the engine's request ends now, not when the garbage collector runs


async def _whole(backend: Backend, generator, ticket: int) -> list:
    """A non-streamed request's one batch (its complete choices), checked as _guarded checks a stream's."""
    guarded = _guarded(backend, generator, ticket)
    try:
        choices = await _first_or_error(guarded)
    finally:
        await guarded.aclose()
    if choices is None:
        raise RuntimeError("the engine ended a request without an answer")
    return choices


async def _first_or_error(generator):
    try:
        return await anext(generator)
    except StopAsyncIteration:
        return None
