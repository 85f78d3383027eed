"""Turns engine-neutral ChoiceDeltas into OpenAI-compatible JSON (chat and legacy completions).

Extensions beyond the OpenAI schema (the official client keeps unknown fields, so they are reachable
as attributes or via `.model_extra`): `prompt_token_ids` on the response, and per choice `token_ids`,
`weight_versions` (list of {version, start, end} spans over the choice's token indices).
"""

from __future__ import annotations

import json
import time
import uuid

from inference_shim.backends.base import ChoiceDelta


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _spans(delta: ChoiceDelta) -> list[dict] | None:
    return None if delta.version_spans is None else [s.model_dump() for s in delta.version_spans]


def _chat_logprobs(delta: ChoiceDelta, token_text) -> dict:
    content = []
    for i, (tid, lp) in enumerate(zip(delta.token_ids, delta.logprobs, strict=True)):
        text = delta.token_strings[i] if i < len(delta.token_strings) else token_text(tid)
        top = delta.top_logprobs[i] if i < len(delta.top_logprobs) else {}
        content.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": token_text(t), "logprob": v, "bytes": list(token_text(t).encode())}
                    for t, v in top.items()
                ],
            }
        )
    return {"content": content}


def chat_response(
    model: str, prompt_ids: list[int], choices: list[ChoiceDelta], want_logprobs: bool, token_text
) -> dict:
    out_choices = []
    for c in sorted(choices, key=lambda c: c.index):
        out_choices.append(
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason,
                "logprobs": _chat_logprobs(c, token_text) if want_logprobs else None,
                "token_ids": c.token_ids,
                "weight_versions": _spans(c),
            }
        )
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": out_choices,
        "prompt_token_ids": prompt_ids,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens,
        },
    }


def chat_chunk(
    response_id: str,
    model: str,
    created: int,
    delta: ChoiceDelta | None,
    want_logprobs: bool,
    token_text,
    *,
    role: bool = False,
    index: int = 0,
) -> str:
    """One SSE `data:` line. role=True emits the opening chunk of a choice (role only)."""
    if role:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "finish_reason": None,
            "logprobs": None,
        }
    else:
        assert delta is not None
        choice = {
            "index": delta.index,
            "delta": {"content": delta.text} if delta.text or delta.finish_reason is None else {},
            "finish_reason": delta.finish_reason,
            "logprobs": _chat_logprobs(delta, token_text) if want_logprobs and delta.token_ids else None,
            "token_ids": delta.token_ids,
        }
        if delta.version_spans is not None:
            choice["weight_versions"] = _spans(delta)
    chunk = {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    return f"data: {json.dumps(chunk)}\n\n"


def completion_response(
    model: str, prompt_ids: list[int], choices: list[ChoiceDelta], top_logprobs: int | None, token_text
) -> dict:
    out_choices = []
    for c in sorted(choices, key=lambda c: c.index):
        logprobs = None
        if top_logprobs is not None:
            tokens = [token_text(t) for t in c.token_ids]
            offsets, pos = [], 0
            for t in tokens:
                offsets.append(pos)
                pos += len(t)
            logprobs = {
                "tokens": tokens,
                "token_logprobs": c.logprobs,
                "top_logprobs": [{token_text(t): v for t, v in top.items()} for top in c.top_logprobs]
                if top_logprobs
                else None,
                "text_offset": offsets,
            }
        out_choices.append(
            {
                "index": c.index,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": logprobs,
                "token_ids": c.token_ids,
                "weight_versions": _spans(c),
            }
        )
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": out_choices,
        "prompt_token_ids": prompt_ids,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens,
        },
    }


def completion_chunk(response_id: str, model: str, created: int, delta: ChoiceDelta) -> str:
    choice = {
        "index": delta.index,
        "text": delta.text,
        "finish_reason": delta.finish_reason,
        "logprobs": None,
        "token_ids": delta.token_ids,
        "token_logprobs": delta.logprobs,
    }
    if delta.version_spans is not None:
        choice["weight_versions"] = _spans(delta)
    chunk = {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    return f"data: {json.dumps(chunk)}\n\n"
