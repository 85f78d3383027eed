"""Turns engine-neutral ChoiceDeltas into the OpenAI-compatible response models of inference_shim.protocol
(chat and legacy completions, whole and streamed) and their JSON / SSE lines.

Extensions beyond the OpenAI schema (the official client keeps unknown fields, so they are reachable
as attributes or via `.model_extra`): `prompt_token_ids` on the response (in a chat stream: on each
choice's opening role chunk), and per choice `token_ids`, `weight_versions` (list of {version, start,
end} spans over the choice's token indices). Whole responses are sent with every field, nulls included
(as before the models existed); stream chunks leave out null fields, which OpenAI clients read as null.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from inference_shim.backends.common import ChoiceDelta, ContractError
from inference_shim.openai_protocol import (
    AssistantDelta,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionResponse,
    StreamError,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from inference_shim.tool_calls import ChoiceTools

TokenText = Callable[[int], str]  # token id -> its text (the backend's detokenizer)

SSE_DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def sse(chunk: ChatCompletionChunk | CompletionChunk) -> str:
    """One SSE `data:` line."""
    return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


def sse_error(err: BaseException) -> str:
    """The in-band error line of a stream whose 200 status line is already sent. A ContractError keeps
    its contract code as `type` (e.g. weights_incomplete: the rest of this stream would have come from
    weights the server did not finish applying)."""
    if isinstance(err, ContractError):
        error = StreamError(message=err.detail or err.error, type=err.error)
    else:
        error = StreamError(message=str(err), type=type(err).__name__)
    return f'data: {{"error": {error.model_dump_json()}}}\n\n'


def _usage(prompt_ids: list[int], choices: list[ChoiceDelta]) -> Usage:
    return _counts(len(prompt_ids), sum(len(c.token_ids) for c in choices))


def _counts(prompt_tokens: int, completion_tokens: int) -> Usage:
    # The prompt counts once, whatever `n` is (as OpenAI counts it).
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def usage_chunk(
    chat: bool, response_id: str, model: str, created: int, prompt_tokens: int, completion_tokens: int
) -> str:
    """The last chunk of a stream asked with `stream_options.include_usage`: no choices, the whole
    response's token counts (sent after every choice finished, before [DONE])."""
    cls = ChatCompletionChunk if chat else CompletionChunk
    usage = _counts(prompt_tokens, completion_tokens)
    return sse(cls(id=response_id, created=created, model=model, choices=[], usage=usage))


def _top(token_text: TokenText, token_id: int, logprob: float) -> TopLogprob:
    text = token_text(token_id)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


def _chat_logprobs(delta: ChoiceDelta, token_text: TokenText) -> ChatLogprobs:
    content = []
    for i, (tid, lp) in enumerate(zip(delta.token_ids, delta.logprobs, strict=True)):
        text = delta.token_strings[i] if i < len(delta.token_strings) else token_text(tid)
        top = delta.top_logprobs[i] if i < len(delta.top_logprobs) else {}
        content.append(
            TokenLogprob(
                token=text,
                logprob=lp,
                bytes=list(text.encode()),
                top_logprobs=[_top(token_text, t, v) for t, v in top.items()],
            )
        )
    return ChatLogprobs(content=content)


def chat_response(
    model: str,
    prompt_ids: list[int],
    choices: list[ChoiceDelta],
    want_logprobs: bool,
    token_text: TokenText,
    tools: Callable[[int], ChoiceTools],
) -> ChatCompletionResponse:
    """`tools(index)` reads choice `index`'s text into the message (content, tool calls)."""
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        message, finish_reason = tools(c.index).message(c.text, c.finish_reason)
        out.append(
            ChatChoice(
                index=c.index,
                message=message,
                finish_reason=finish_reason,
                logprobs=_chat_logprobs(c, token_text) if want_logprobs else None,
                token_ids=c.token_ids,
                weight_versions=c.version_spans,
            )
        )
    return ChatCompletionResponse(
        id=new_id("chatcmpl"),
        model=model,
        prompt_token_ids=prompt_ids,
        usage=_usage(prompt_ids, choices),
        choices=out,
    )


def chat_role_chunk(response_id: str, model: str, created: int, index: int, prompt_ids: list[int]) -> str:
    """The opening chunk of choice `index`: its role, and the prompt's token ids."""
    choice = ChatChunkChoice(index=index, delta=AssistantDelta(role="assistant", content=""))
    return sse(
        ChatCompletionChunk(
            id=response_id, created=created, model=model, choices=[choice], prompt_token_ids=prompt_ids
        )
    )


def chat_chunk(
    response_id: str,
    model: str,
    created: int,
    delta: ChoiceDelta,
    want_logprobs: bool,
    token_text: TokenText,
    tools: ChoiceTools,
) -> str:
    """One piece of a choice; `tools` (that choice's) reads its text into content and tool call pieces.
    The final piece of a choice may carry no text: an empty delta then, as OpenAI sends."""
    message, finish_reason = tools.piece(delta.text, delta.token_ids, delta.finish_reason)
    choice = ChatChunkChoice(
        index=delta.index,
        delta=message,
        finish_reason=finish_reason,
        logprobs=_chat_logprobs(delta, token_text) if want_logprobs and delta.token_ids else None,
        token_ids=delta.token_ids,
        weight_versions=delta.version_spans,
    )
    return sse(ChatCompletionChunk(id=response_id, created=created, model=model, choices=[choice]))


def completion_response(
    model: str,
    prompt_ids: list[int],
    choices: list[ChoiceDelta],
    top_logprobs: int | None,
    token_text: TokenText,
) -> CompletionResponse:
    out_choices = []
    for c in sorted(choices, key=lambda c: c.index):
        logprobs = None
        if top_logprobs is not None:
            tokens = [token_text(t) for t in c.token_ids]
            offsets, pos = [], 0
            for t in tokens:
                offsets.append(pos)
                pos += len(t)
            logprobs = CompletionLogprobs(
                tokens=tokens,
                token_logprobs=c.logprobs,
                top_logprobs=[{token_text(t): v for t, v in top.items()} for top in c.top_logprobs]
                if top_logprobs
                else None,
                text_offset=offsets,
            )
        out_choices.append(
            CompletionChoice(
                index=c.index,
                text=c.text,
                finish_reason=c.finish_reason,
                logprobs=logprobs,
                token_ids=c.token_ids,
                weight_versions=c.version_spans,
            )
        )
    return CompletionResponse(
        id=new_id("cmpl"),
        model=model,
        choices=out_choices,
        prompt_token_ids=prompt_ids,
        usage=_usage(prompt_ids, choices),
    )


def completion_chunk(response_id: str, model: str, created: int, delta: ChoiceDelta) -> str:
    choice = CompletionChunkChoice(
        index=delta.index,
        text=delta.text,
        finish_reason=delta.finish_reason,
        token_ids=delta.token_ids,
        token_logprobs=delta.logprobs,
        weight_versions=delta.version_spans,
    )
    return sse(CompletionChunk(id=response_id, created=created, model=model, choices=[choice]))
