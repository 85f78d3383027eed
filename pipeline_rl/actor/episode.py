"""Multi-turn episodes, token in / token out: the model answers, the environment replies (a tool's
result, a judge's message), and so on until the environment ends it, `max_turns` or the token budget.

The trained sequence is exactly what the server sampled plus the environment's tokens in between, never
a re-rendered, re-tokenized conversation (which drifts from what was sampled):
- turn 1 goes to /v1/chat/completions (the server renders the messages, and `tools`, with the model's
  chat template and returns the prompt's token ids);
- each environment reply is rendered to text by the same chat template (the text the template puts
  between the end of an assistant turn and the start of the next one, the reply in between), tokenized
  once, and appended to the token ids;
- every later turn goes to /v1/completions with the whole token sequence as its prompt.
The episode records per token whether the model sampled it (`mask` 1: trained) or the environment added
it (0), the sampler's logprob of every model token, and weight-version spans over the model's tokens (an
update between or during turns is normal: each turn's spans say which version sampled what).

    env = MyEnvironment(problem)  # implements Environment
    episode = await run_episode(client, tokenizer, env, EpisodeLimits(max_turns=4), sampling)
    sample = episode.sample(sample_id, reward=env.reward())
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from inference_shim.openai_protocol import VersionSpan
from pipeline_rl.actor.errors import ActorError
from pipeline_rl.actor.rounds import merge_spans
from pipeline_rl.messages import Sample

PLACEHOLDER = "\x00model-turn\x00"  # stands for an assistant turn's content while rendering what follows it


class Environment(Protocol):
    """One episode's world."""

    def messages(self) -> list[dict]:
        """The conversation the episode starts from."""
        ...

    def tools(self) -> list[dict] | None:
        """OpenAI function specs the chat template renders into the first prompt, or None."""
        ...

    async def reply(self, model_text: str, finish_reason: str) -> list[dict] | None:
        """The messages that answer the model's turn (e.g. `{"role": "tool", "content": "42"}`), or None
        when the episode is over. Must not raise for anything the model wrote: a malformed call, an
        unknown tool, a failing tool are observations for the model."""
        ...


@dataclass
class EpisodeLimits:
    max_turns: int = 4
    max_tokens_per_turn: int = 64
    token_budget: int = 512  # model + environment tokens after the prompt
    max_observation_chars: int = 400  # a longer environment message is cut, with a marker


@dataclass
class Episode:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # model and environment tokens, in order
    mask: list[int] = field(default_factory=list)  # 1: sampled by the model, 0: added by the environment
    logprobs: list[float] = field(default_factory=list)  # sampler's, 0.0 on environment tokens
    spans: list[VersionSpan] = field(default_factory=list)  # over token_ids; environment tokens: none
    texts: list[str] = field(default_factory=list)  # each model turn's text
    finishes: list[str] = field(default_factory=list)  # each model turn's finish reason
    turns: int = 0
    end: str = ""  # environment (it ended the episode), max_turns, token_budget, context
    finish_reason: str = ""  # of the last model turn
    observations_cut: int = 0
    server: str = ""
    # Where an episode a round cut (partial rollouts) goes on: "continue" (its last model turn was cut),
    # "reply" (the environment answers its last turn next), "model" (a model turn starts next); "" once
    # it ended. `replies`: environment replies in token_ids (an environment is rebuilt by replaying them).
    next: str = ""
    replies: int = 0
    turn_tokens: int = 0  # model tokens of the last turn so far
    turn_parts: int = 0  # requests that sampled the last turn (continuations take their own seeds)

    def add_model_turn(self, token_ids: list[int], logprobs: list[float], spans: list[VersionSpan]) -> None:
        self._add_model_tokens(token_ids, logprobs, spans)
        self.turns += 1
        self.turn_tokens, self.turn_parts = len(token_ids), 1

    def extend_model_turn(
        self, token_ids: list[int], logprobs: list[float], spans: list[VersionSpan]
    ) -> None:
        """More tokens of the last model turn (a round had cut it)."""
        self._add_model_tokens(token_ids, logprobs, spans)
        self.turn_tokens += len(token_ids)
        self.turn_parts += 1

    def _add_model_tokens(
        self, token_ids: list[int], logprobs: list[float], spans: list[VersionSpan]
    ) -> None:
        offset = len(self.token_ids)
        self.token_ids += token_ids
        self.mask += [1] * len(token_ids)
        self.logprobs += logprobs
        shifted = [VersionSpan(version=s.version, start=s.start + offset, end=s.end + offset) for s in spans]
        self.spans = merge_spans(self.spans, shifted)

    def add_environment(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.replies += 1

    def sample(self, sample_id: str, reward: float) -> Sample:
        return Sample(
            sample_id=sample_id,
            prompt_token_ids=self.prompt_token_ids,
            completion_token_ids=self.token_ids,
            completion_logprobs=self.logprobs,
            version_spans=self.spans,
            finish_reason=self.finish_reason,
            reward=reward,
            completion_text="".join(self.texts),
            server=self.server,
            completion_mask=self.mask,
        )

    def to_dict(self) -> dict:
        """Plain data (the `carried` topic's message holds it); from_dict reads it back."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["spans"] = [s.model_dump() for s in self.spans]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Episode:
        return cls(**{**data, "spans": [VersionSpan.model_validate(s) for s in data["spans"]]})


async def replay_environment(env: Environment, episode: Episode) -> None:
    """Bring a new environment to where `episode` left its own: its replies to the model turns already
    answered, asked again (partial rollouts continue an episode in another round, or after an actor
    restart). Sound for environments whose replies depend only on the model's turns."""
    for text, finish in zip(episode.texts[: episode.replies], episode.finishes, strict=False):
        await env.reply(text, finish)


def between_turns_text(tokenizer: Any, messages: list[dict], replies: list[dict], ended_by_eos: bool) -> str:
    """What the chat template writes after an assistant turn's content, then `replies`, then the opening
    of the next assistant turn. `ended_by_eos`: the model's own end-of-turn token is already in the
    sampled ids, so it is not written again."""
    turn = {"role": "assistant", "content": PLACEHOLDER}
    before = tokenizer.apply_chat_template([*messages, turn], tokenize=False)
    after = tokenizer.apply_chat_template(
        [*messages, turn, *replies], tokenize=False, add_generation_prompt=True
    )
    if not after.startswith(before):
        raise ActorError(
            "the model's chat template renders a conversation differently once it goes on, so an episode "
            "cannot append turns token by token; use a template whose output only grows"
        )
    text = before[before.index(PLACEHOLDER) + len(PLACEHOLDER) :] + after[len(before) :]
    eos = tokenizer.eos_token or ""
    if ended_by_eos and eos and text.startswith(eos):
        text = text[len(eos) :]
    return text


def _cut(replies: list[dict], limit: int) -> tuple[list[dict], int]:
    out, cut = [], 0
    for message in replies:
        content = str(message.get("content") or "")
        if len(content) > limit:
            message = {**message, "content": content[:limit] + " [cut]"}
            cut += 1
        out.append(message)
    return out, cut


async def run_episode(
    client: Any,
    tokenizer: Any,
    env: Environment,
    limits: EpisodeLimits,
    sampling: dict,
    max_model_len: int,
    seed: int | None = None,
    *,
    episode: Episode | None = None,
    round_tokens: int | None = None,
) -> Episode:
    """Play one episode on one server (`client`: AsyncShimClient). `sampling`: temperature, top_p, ...
    `seed`: the first turn's sampling seed (turn k samples with seed + k), or None for the engine's own
    random stream. Raises what the client raises (the caller retries the episode elsewhere); never for
    the model's output.

    Partial rollouts: with `round_tokens` it returns once the model sampled that many tokens in this call
    (the episode is then unfinished: `episode.end` is "" and `episode.next` says what comes next); pass
    such an `episode` back, with `env` brought to its state (replay_environment), to continue it."""
    left = math.inf if round_tokens is None else round_tokens

    def seeded(turn: int, part: int = 0) -> dict:
        # A continuation of a cut turn samples from a stream of its own.
        return {} if seed is None else {"seed": (seed + turn + 1_000_003 * part) % 2**63}

    def cut(finish_reason: str, got: int, asked: int, could_ask: int) -> bool:
        """The round's budget, not the turn's own limit, stopped this request."""
        return finish_reason == "length" and got >= asked and asked < could_ask

    messages = env.messages()
    if episode is None:
        tools = env.tools()
        could = min(limits.max_tokens_per_turn, limits.token_budget)
        asked = int(min(could, left))
        # The environment reads calls from the text (tool_choice none): the server only renders the tools.
        first = await client.chat(
            messages,
            **({"tools": tools, "tool_choice": "none"} if tools else {}),
            max_tokens=asked,
            logprobs=True,
            n=1,
            **sampling,
            **seeded(0),
        )
        [choice] = first.choices
        episode = Episode(prompt_token_ids=list(first.prompt_token_ids or []), server=client.base_url)
        logprobs = (
            [e.logprob for e in choice.logprobs.content]
            if choice.logprobs and choice.logprobs.content
            else []
        )
        _model_turn(
            episode, choice.token_ids, logprobs, choice.weight_versions, choice.message.content or "", choice
        )
        left -= len(episode.token_ids)
        episode.next = (
            "continue" if cut(episode.finish_reason, len(episode.token_ids), asked, could) else "reply"
        )
    episode.server = client.base_url
    eos_id = tokenizer.eos_token_id
    while True:
        if episode.next == "continue":
            could = _room(episode, limits, max_model_len, limits.max_tokens_per_turn - episode.turn_tokens)
            asked = int(min(could, left))
            if could < 1:
                episode.next = "reply"  # the turn reached its own limit exactly at the cut
                continue
            if asked < 1:
                return episode
            choice = await _sample_on(
                client, episode, asked, sampling, seeded(episode.turns - 1, episode.turn_parts)
            )
            got = _model_tokens(episode, choice, extend=True)
            left -= got
            if cut(choice.finish_reason or "", got, asked, could):
                return episode
            episode.next = "reply"
        if episode.next == "reply":
            replies = await env.reply(episode.texts[-1], episode.finish_reason)
            if replies is None:
                episode.end, episode.next = "environment", ""
                return episode
            if episode.turns >= limits.max_turns:
                episode.end, episode.next = "max_turns", ""
                return episode
            replies, n_cut = _cut(replies, limits.max_observation_chars)
            episode.observations_cut += n_cut
            ended_by_eos = bool(episode.token_ids) and episode.token_ids[-1] == eos_id
            between = between_turns_text(tokenizer, messages, replies, ended_by_eos)
            env_ids = list(tokenizer(between, add_special_tokens=False)["input_ids"])
            if _room(episode, limits, max_model_len, math.inf) - len(env_ids) < 1:
                episode.end, episode.next = "token_budget", ""
                return episode
            episode.add_environment(env_ids)
            episode.next = "model"
        if episode.next == "model":
            could = _room(episode, limits, max_model_len, limits.max_tokens_per_turn)
            asked = int(min(could, left))
            if asked < 1:
                return episode  # the round's budget is spent: the turn starts in the next round
            choice = await _sample_on(client, episode, asked, sampling, seeded(episode.turns))
            got = _model_tokens(episode, choice, extend=False)
            left -= got
            if cut(choice.finish_reason or "", got, asked, could):
                episode.next = "continue"
                return episode
            episode.next = "reply"


async def _sample_on(client: Any, episode: Episode, max_tokens: int, sampling: dict, seed: dict) -> Any:
    """The model's next tokens after everything the episode holds (/v1/completions on token ids)."""
    response = await client.completion(
        episode.prompt_token_ids + episode.token_ids,
        max_tokens=max_tokens,
        logprobs=0,
        n=1,
        **sampling,
        **seed,
    )
    [choice] = response.choices
    return choice


def _room(episode: Episode, limits: EpisodeLimits, max_model_len: int, turn_limit: float) -> int:
    """Tokens the model may still sample now: the turn's limit, the episode's budget, the context."""
    return int(
        min(
            turn_limit,
            limits.token_budget - len(episode.token_ids),
            max_model_len - len(episode.prompt_token_ids) - len(episode.token_ids),
        )
    )


def _model_tokens(episode: Episode, choice: Any, *, extend: bool) -> int:
    """A /v1/completions choice as the episode's next model tokens (a new turn, or more of the last)."""
    logprobs = list(choice.logprobs.token_logprobs or []) if choice.logprobs else []
    if extend:
        _check_turn(episode, choice.token_ids, logprobs, choice.weight_versions)
        episode.extend_model_turn(list(choice.token_ids), logprobs, list(choice.weight_versions))
        episode.texts[-1] += choice.text
        episode.finishes[-1] = episode.finish_reason = choice.finish_reason or "unknown"
    else:
        _model_turn(episode, choice.token_ids, logprobs, choice.weight_versions, choice.text, choice)
    return len(choice.token_ids)


def _check_turn(episode: Episode, token_ids, logprobs, spans) -> None:
    if token_ids is None or spans is None or len(logprobs) != len(token_ids):
        raise ActorError(
            f"{episode.server} broke the inference contract (a choice without token_ids, weight_versions or "
            "one logprob per token); see docs/contract.md"
        )


def _model_turn(episode: Episode, token_ids, logprobs, spans, text: str, choice) -> None:
    _check_turn(episode, token_ids, logprobs, spans)
    episode.add_model_turn(list(token_ids), list(logprobs), list(spans))
    episode.texts.append(text)
    episode.finish_reason = choice.finish_reason or "unknown"
    episode.finishes.append(episode.finish_reason)
