"""The torch engine (`--backend torch`) beyond the contract suite: what its own scheduling and sampling
must get right. A real server process (HTTP, the engine thread, a tiny model); the contract suite
(test_contract_suite.py, `torch`) covers updates, spans, auth and malformed input.

    .venv/bin/python -m pytest -q tests/integration/test_torch_engine.py      # ~30 s
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from support.servers import running_servers

from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model

MESSAGES = [{"role": "user", "content": "What is 3+4? Reply with answer: <integer>"}]


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> Iterator[str]:
    model = build_tiny_model(
        tmp_path_factory.mktemp("torch") / "tiny", TinyModelSpec(max_position_embeddings=128)
    )
    # Waves of at most 8 sequences, so the concurrency test below needs several waves.
    with running_servers(
        model, tmp_path_factory.mktemp("logs"), 1, backend="torch", extra=("--max-num-seqs", "8")
    ) as urls:
        yield urls[0]


def _chat(url: str, **body) -> dict:
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_seed_fixes_every_choice_and_choices_differ(url):
    body = {"max_tokens": 16, "temperature": 1.0, "n": 4, "seed": 1234, "ignore_eos": True}
    first, again = _chat(url, **body), _chat(url, **body)
    tokens = [c["token_ids"] for c in first["choices"]]
    assert tokens == [c["token_ids"] for c in again["choices"]]
    assert len({tuple(t) for t in tokens}) == 4  # each choice has its own stream
    other = _chat(url, **{**body, "seed": 1235})
    assert [c["token_ids"] for c in other["choices"]] != tokens
    unseeded = [_chat(url, max_tokens=16, ignore_eos=True)["choices"][0]["token_ids"] for _ in range(3)]
    assert len({tuple(t) for t in unseeded}) > 1


def test_greedy_is_deterministic_and_logprobs_are_of_the_raw_distribution(url):
    greedy = _chat(url, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3, ignore_eos=True)
    choice = greedy["choices"][0]
    assert (
        choice["token_ids"]
        == _chat(url, max_tokens=12, temperature=0, ignore_eos=True)["choices"][0]["token_ids"]
    )
    for entry in choice["logprobs"]["content"]:
        tops = entry["top_logprobs"]
        assert len(tops) == 3 and entry["logprob"] == pytest.approx(
            tops[0]["logprob"]
        )  # greedy = the top token
    hot = _chat(url, max_tokens=12, temperature=5.0, logprobs=True, seed=7, ignore_eos=True)["choices"][0]
    # Temperature changes what is sampled, not the logprobs reported (temperature 1): never above 0.
    assert all(e["logprob"] <= 0 for e in hot["logprobs"]["content"])


def test_stop_strings_and_finish_reasons(url):
    long = _chat(url, max_tokens=40, temperature=0, ignore_eos=True)["choices"][0]
    assert long["finish_reason"] == "length" and len(long["token_ids"]) == 40
    text = long["message"]["content"]
    stop = text[5:7]  # a string the greedy answer is known to contain
    cut = _chat(url, max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["message"]["content"] == text[: text.index(stop)]
    bad = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "stop": [""]}, timeout=30)
    assert bad.status_code == 400
    # More tokens than the context leaves: capped at the room, finish "length".
    room = _chat(url, max_tokens=10_000, temperature=0, ignore_eos=True)
    assert len(room["choices"][0]["token_ids"]) + len(room["prompt_token_ids"]) == 128


def test_concurrent_requests_of_different_lengths_all_complete_across_waves(url):
    def one(i: int) -> tuple[int, dict]:
        return i, _chat(url, max_tokens=1 + i % 9, n=1 + i % 3, ignore_eos=True, seed=i)

    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, range(24)))  # 48 sequences in waves of at most 8
    for i, response in results:
        assert len(response["choices"]) == 1 + i % 3
        for choice in response["choices"]:
            assert len(choice["token_ids"]) == 1 + i % 9 and choice["finish_reason"] == "length"
            assert choice["weight_versions"] == [{"version": 0, "start": 0, "end": 1 + i % 9}]


def test_a_stream_of_n_choices_ends_each_choice_once(url):
    body = {"messages": MESSAGES, "max_tokens": 6, "n": 3, "stream": True, "ignore_eos": True}
    tokens, finished = {0: [], 1: [], 2: []}, []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                tokens[choice["index"]] += choice.get("token_ids") or []
                if choice.get("finish_reason"):
                    finished.append(choice["index"])
    assert sorted(finished) == [0, 1, 2] and all(len(t) == 6 for t in tokens.values())


def test_a_client_that_leaves_mid_stream_does_not_stop_the_others(url):
    body = {"messages": MESSAGES, "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        next(line for line in response.iter_lines() if line.startswith("data: {"))  # then hang up
    after = _chat(url, max_tokens=5, ignore_eos=True)
    assert len(after["choices"][0]["token_ids"]) == 5
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"


def test_a_sequence_decodes_the_same_alone_and_left_padded_in_a_wave(url):
    # Prompts of different lengths share a wave (left-padded, masked, positions from the mask): every
    # answer and logprob must be what the same request gets alone.
    prompts = [f"What is {'1+' * k}2? Reply with answer: <integer>" for k in range(8)]

    def greedy(prompt: str) -> tuple[list[int], list[float]]:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 10, "temperature": 0}
        response = httpx.post(
            f"{url}/v1/chat/completions", json={**body, "logprobs": True, "ignore_eos": True}, timeout=60
        ).json()
        choice = response["choices"][0]
        return choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]

    alone = [greedy(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(greedy, prompts))
    for (tokens_a, logprobs_a), (tokens_b, logprobs_b) in zip(alone, together, strict=True):
        assert tokens_a == tokens_b
        assert max(abs(a - b) for a, b in zip(logprobs_a, logprobs_b, strict=True)) < 1e-4
