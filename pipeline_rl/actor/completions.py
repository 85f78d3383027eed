"""A chat response as the actor uses it: one Completion per choice, with the contract's extensions
(prompt and completion token ids, sampler logprobs, weight-version spans) required present."""

from __future__ import annotations

from dataclasses import dataclass

from inference_shim.openai_protocol import ChatCompletionResponse, VersionSpan
from pipeline_rl.actor.errors import ActorError


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    spans: list[VersionSpan]
    finish_reason: str
    text: str
    server: str


def completions_of(response: ChatCompletionResponse, n: int, server: str) -> list[Completion]:
    """The response's choices as Completions. The typed response already checked what the contract
    promises (spans tile the tokens, one logprob per token); this checks that the extensions the actor
    asked for are there (raises ActorError)."""

    def broken(why: str) -> ActorError:
        return ActorError(f"{server} broke the inference contract ({why}); see docs/contract.md")

    if len(response.choices) != n:
        raise broken(f"asked for n={n} choices, got {len(response.choices)}")
    if not response.prompt_token_ids:
        raise broken("no prompt_token_ids")
    out = []
    for choice in sorted(response.choices, key=lambda c: c.index):
        content = choice.logprobs.content if choice.logprobs else None
        if choice.token_ids is None or content is None:
            raise broken("no token_ids or logprobs.content")
        if choice.weight_versions is None:
            raise broken("no weight_versions: the server does not report per-token versions")
        out.append(
            Completion(
                prompt_token_ids=list(response.prompt_token_ids),
                token_ids=choice.token_ids,
                logprobs=[e.logprob for e in content],
                spans=choice.weight_versions,
                finish_reason=choice.finish_reason or "unknown",
                text=choice.message.content or "",
                server=server,
            )
        )
    return out
