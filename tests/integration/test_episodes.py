"""Multi-turn episodes token in / token out against a REAL server (tiny model): the ids an episode
hands the trainer are exactly the server's sampled ids and the environment's rendered ids,
concatenated; masks mark which is which; logprobs and weight-version spans stay with the model's tokens
across turns, with a real weight update between two turns.

The server runs the torch engine (the same contract, seconds to start): the subject is the episode's
bookkeeping on the client side; what vLLM returns for the same requests is the contract suite's
(tests/integration/test_contract_suite.py runs it against both engines).

    .venv/bin/python -m pytest -q tests/integration/test_episodes.py
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from support.servers import running_servers
from transformers import AutoModelForCausalLM, AutoTokenizer

from inference_shim.client import AsyncShimClient
from inference_shim.weight_sender import WeightSender
from pipeline_rl.actor.episode import (
    Episode,
    EpisodeLimits,
    between_turns_text,
    replay_environment,
    run_episode,
)
from pipeline_rl.demo.tiny_model import build_tiny_model
from pipeline_rl.messages import RolloutGroup
from pipeline_rl.preprocess.ops import PreprocessConfig, group_to_training_samples

ASK = [{"role": "user", "content": "2+3="}]
TURN_TOKENS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("episodes") / "tiny")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with running_servers(model, tmp_path_factory.mktemp("logs"), 1, backend="torch") as urls:
        yield urls[0]


class RecordingClient(AsyncShimClient):
    """The real client, keeping each answer's sampled ids and logprobs for the test to compare."""

    def __init__(self, url: str) -> None:
        super().__init__(url, timeout_s=60)
        self.turns: list[tuple[list[int], list[float]]] = []

    async def chat(self, messages, **params):
        response = await super().chat(messages, **params)
        choice = response.choices[0]
        self.turns.append((choice.token_ids, [e.logprob for e in choice.logprobs.content]))
        return response

    async def completion(self, prompt, **params):
        response = await super().completion(prompt, **params)
        choice = response.choices[0]
        self.turns.append((choice.token_ids, choice.logprobs.token_logprobs))
        return response


class Judge:
    """Answers every model turn with a user message, `rounds` times; `between` runs before each reply
    (the test pushes weights there)."""

    def __init__(self, rounds: int, between=None) -> None:
        self.rounds, self.between, self.replies = rounds, between, []

    def messages(self):
        return ASK

    def tools(self):
        return None

    async def reply(self, model_text, finish_reason):
        if len(self.replies) == self.rounds:
            return None
        if self.between is not None:
            await self.between(len(self.replies))
        message = [{"role": "user", "content": f"try again ({len(self.replies) + 1})"}]
        self.replies.append(message)
        return message


def test_an_episode_is_the_sampled_ids_and_the_environments_ids_exactly(model, server):
    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    sender = WeightSender([server], backend="gloo", timeout_s=60)
    sender.connect()

    async def push_version_1(round_index: int) -> None:
        if round_index == 1:  # between the 2nd and the 3rd model turn
            with torch.no_grad():
                for p in hf.parameters():
                    p.add_(0.01)
            await asyncio.to_thread(sender.push_tensors, 1, list(hf.named_parameters()))

    async def play():
        client = RecordingClient(server)
        try:
            judge = Judge(rounds=2, between=push_version_1)
            limits = EpisodeLimits(max_turns=5, max_tokens_per_turn=TURN_TOKENS)
            sampling = {"temperature": 1.0, "ignore_eos": True}
            episode = await run_episode(client, tokenizer, judge, limits, sampling, max_model_len=512)
            return episode, client.turns, judge.replies
        finally:
            await client.aclose()

    try:
        episode, turns, replies = asyncio.run(asyncio.wait_for(play(), timeout=120))
    finally:
        sender.close()

    assert episode.turns == 3 and episode.end == "environment" and len(turns) == 3
    expected_ids, expected_mask, expected_logprobs = [], [], []
    for i, (ids, logprobs) in enumerate(turns):
        assert len(ids) == TURN_TOKENS
        expected_ids += ids
        expected_mask += [1] * len(ids)
        expected_logprobs += logprobs
        if i < len(replies):  # the environment's tokens: the template's text between two turns, tokenized
            text = between_turns_text(tokenizer, ASK, replies[i], ended_by_eos=False)
            assert (
                text
                == f"<|im_end|>\n<|im_start|>user\ntry again ({i + 1})<|im_end|>\n<|im_start|>assistant\n"
            )
            env_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            expected_ids += env_ids
            expected_mask += [0] * len(env_ids)
            expected_logprobs += [0.0] * len(env_ids)
    assert episode.token_ids == expected_ids
    assert episode.mask == expected_mask and episode.logprobs == expected_logprobs
    assert episode.prompt_token_ids == tokenizer.apply_chat_template(
        ASK, add_generation_prompt=True, return_dict=False
    )

    # Versions: turns 1-2 by version 0, turn 3 by version 1 (pushed between them); no span on the
    # environment's tokens.
    sample = episode.sample("g:0/0", reward=1.0)
    versions = sample.token_versions()
    model_versions = [v for v, m in zip(versions, episode.mask, strict=True) if m]
    assert model_versions == [0] * (2 * TURN_TOKENS) + [1] * TURN_TOKENS
    assert all(v == -1 for v, m in zip(versions, episode.mask, strict=True) if not m)

    # What the trainer gets: the model's tokens trained, the prompt and the environment's not.
    group = RolloutGroup(group_id="g:0", task="t", prompt_index=0, actor_id=0, samples=[sample, sample])
    cfg = PreprocessConfig(seq_length=512, drop_all_equal_groups=False)
    [trained, _] = group_to_training_samples(group, cfg)
    prompt_length = len(episode.prompt_token_ids)
    assert trained.input_ids == episode.prompt_token_ids + episode.token_ids
    assert trained.labels_mask == [0] * prompt_length + episode.mask
    assert trained.old_logprobs == [0.0] * prompt_length + episode.logprobs


def test_the_token_budget_ends_an_episode_before_the_context_does(model, server):
    tokenizer = AutoTokenizer.from_pretrained(model)

    async def play():
        client = AsyncShimClient(server, timeout_s=60)
        try:
            limits = EpisodeLimits(max_turns=50, max_tokens_per_turn=TURN_TOKENS, token_budget=60)
            sampling = {"temperature": 1.0, "ignore_eos": True}
            return await run_episode(client, tokenizer, Judge(rounds=50), limits, sampling, max_model_len=512)
        finally:
            await client.aclose()

    episode = asyncio.run(asyncio.wait_for(play(), timeout=120))
    assert episode.end == "token_budget" and 1 < episode.turns < 50
    assert len(episode.token_ids) <= 60


class Flood(Judge):
    """Answers with an observation far longer than the episode allows."""

    async def reply(self, model_text, finish_reason):
        if self.replies:
            return None
        self.replies.append([{"role": "tool", "content": "9" * 10_000}])
        return self.replies[-1]


def test_an_over_long_observation_is_cut_with_a_marker(model, server):
    tokenizer = AutoTokenizer.from_pretrained(model)

    async def play():
        client = AsyncShimClient(server, timeout_s=60)
        try:
            limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=TURN_TOKENS, max_observation_chars=50)
            sampling = {"temperature": 1.0, "ignore_eos": True}
            return await run_episode(client, tokenizer, Flood(rounds=1), limits, sampling, max_model_len=512)
        finally:
            await client.aclose()

    episode = asyncio.run(asyncio.wait_for(play(), timeout=120))
    assert episode.observations_cut == 1 and episode.turns == 2 and episode.end == "environment"
    environment = tokenizer.decode([t for t, m in zip(episode.token_ids, episode.mask, strict=True) if not m])
    assert "9" * 50 + " [cut]" in environment and "9" * 51 not in environment


def test_an_episode_cut_into_rounds_continues_to_the_uncut_episode(model, server):
    """Partial rollouts (actor.round_tokens) carry episodes too: played in rounds of 4 model tokens, any
    cut mid-turn, each round on a fresh environment rebuilt by replaying its replies and on an episode
    read back from its stream form, a greedy episode ends as the uncut one: the same ids, mask and turns."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    limits = EpisodeLimits(max_turns=5, max_tokens_per_turn=TURN_TOKENS)
    sampling = {"temperature": 0.0, "ignore_eos": True}

    async def play():
        client = AsyncShimClient(server, timeout_s=60)
        try:
            whole = await run_episode(client, tokenizer, Judge(rounds=2), limits, sampling, max_model_len=512)
            episode, rounds = None, 0
            while episode is None or not episode.end:
                env = Judge(rounds=2)
                if episode is not None:
                    episode = Episode.from_dict(json.loads(json.dumps(episode.to_dict())))
                    await replay_environment(env, episode)
                    assert len(env.replies) == episode.replies
                episode = await run_episode(
                    client,
                    tokenizer,
                    env,
                    limits,
                    sampling,
                    max_model_len=512,
                    episode=episode,
                    round_tokens=4,
                )
                rounds += 1
                assert rounds < 20, "the episode never ended"
            return whole, episode, rounds
        finally:
            await client.aclose()

    whole, carried, rounds = asyncio.run(asyncio.wait_for(play(), timeout=120))
    assert whole.turns == 3 and whole.end == "environment"
    assert rounds == 5  # 3 turns of 6 model tokens, 4 per round: 18 / 4 rounded up
    assert (carried.token_ids, carried.mask, carried.turns, carried.end) == (
        whole.token_ids,
        whole.mask,
        whole.turns,
        whole.end,
    )
    assert carried.texts == whole.texts and carried.finishes == whole.finishes
    assert max(abs(a - b) for a, b in zip(carried.logprobs, whole.logprobs, strict=True)) < 1e-4
    covered = sum(s.end - s.start for s in carried.spans)
    assert covered == sum(carried.mask)  # every model token has its version, no environment token does
