"""Partial rollouts in sync mode (actor.round_tokens) in a launched run on a real vLLM-CPU server, through
a kill -9 of the actor at its worst moment.

Greedy sampling and a learning rate too small to change a float32 weight: every round pushes a new
version, but the weights stay those of the start, and the server runs one request at a time, so an
answer continued from its token ids must be exactly the uncut greedy answer (transformers' greedy tokens and logprobs, <= 1e-3), while its version
spans show the rounds it ran in. The actor SIGKILLs itself (fault hook actor.carried) right after a
round's carried group is durable on the `carried` topic and before its previous entry is acknowledged;
the launcher restarts it and the successor continues every cut answer. What must hold: the run ends
cleanly, the ledger balances with carried answers counted and none lost, answers spanned several rounds
and versions, and the trainer's lag stayed within the bound the launcher derived.

    .venv/bin/python -m pytest -q tests/integration/test_partial_rollouts.py     (about 2 minutes)
"""

from __future__ import annotations

import json

import pytest
from support.launching import assert_clean_finish, finish, start_run
from support.servers import transformers_greedy
from support.training import read_all

from inference_shim.faults import fired
from pipeline_rl.config import RunConfig
from pipeline_rl.ledger import ledger_summary
from pipeline_rl.streams import ROLLOUTS

pytestmark = pytest.mark.slow

STEPS = 8


def test_sync_rounds_continue_cut_answers_exactly_through_an_actor_kill(launch_model, tmp_path, monkeypatch):
    run_dir, faults_dir = tmp_path / "run", tmp_path / "faults"
    monkeypatch.setenv("PIPELINE_RL_FAULTS", "actor.carried@3")
    monkeypatch.setenv("PIPELINE_RL_FAULTS_DIR", str(faults_dir))
    proc, _ = start_run(
        launch_model,
        run_dir,
        "mode=sync",
        "streams=files",  # the rollouts stay readable after the run
        f"streams.files_dir={tmp_path / 'streams'}",
        "inference.num_servers=1",
        "actor.round_tokens=4",  # 12 tokens per answer at most: up to 3 rounds
        "actor.temperature=0",
        "actor.request_mode=per_sample",  # vLLM takes greedy requests with n=1 only
        "actor.max_in_flight_per_server=1",  # one request in flight: no batch can change a greedy pick
        "actor.attempts=2",
        "trainer.batch_size=4",
        "trainer.learning_rate=1e-12",
        f"trainer.max_steps={STEPS}",
        "supervision.actor.backoff_s=0.5",
        "trainer.push_timeout_s=60",  # no server fault here: a loaded box must not fail the first join
    )
    output = finish(proc, "", timeout_s=420)
    assert fired(faults_dir) == ["actor.carried"], output[-4000:]
    assert "restarted actor0" in output, output[-4000:]
    assert_clean_finish(proc, output, run_dir, STEPS, servers=1)

    cfg = RunConfig.model_validate_json((run_dir / "config.json").read_text())
    assert cfg.actor.max_lag == 3 and cfg.actor.max_buffered_groups == 4  # rounds.lag_bound(12, 4, 2, 4)
    ledger = ledger_summary(run_dir)
    assert ledger.carried > 0 and ledger.carried_lost == [], "\n".join(ledger.lines())

    groups = read_all(cfg, ROLLOUTS)
    carried = [g for g in groups if g.metadata.get("rounds", 1) > 1]
    assert carried, [g.metadata for g in groups]
    versions_seen = set()
    for g in carried[:6]:
        for s in g.samples:
            n = len(s.completion_token_ids)
            spans = [(v.version, v.start, v.end) for v in s.version_spans]
            assert (
                spans[0][1] == 0
                and spans[-1][2] == n
                and all(a[2] == b[1] for a, b in zip(spans, spans[1:], strict=False))
            )
            assert [v for v, _, _ in spans] == sorted({v for v, _, _ in spans})  # one span per version
            versions_seen.add(len(spans))
            greedy, logprobs = transformers_greedy(launch_model, s.prompt_token_ids, s.completion_token_ids)
            assert s.completion_token_ids == greedy, f"{s.sample_id} is not the uncut greedy answer"
            worst = max(abs(a - b) for a, b in zip(logprobs, s.completion_logprobs, strict=True))
            assert worst <= 1e-3, f"{s.sample_id}: sampled logprobs off by {worst:.2e}"
    assert max(versions_seen) >= 2, "no answer ran on two weight versions"
    metrics = [json.loads(x) for x in (run_dir / "trainer_metrics.jsonl").read_text().splitlines()]
    assert max(m.get("lag_max", 0) for m in metrics) <= cfg.actor.max_lag


def test_sync_rounds_carry_multi_turn_episodes(launch_model, tmp_path):
    """The calculator task's episodes in rounds of 4 model tokens on the torch engine: episodes are cut,
    carried with their environment's turns and continued until they end; the run ends cleanly with the
    carried answers counted and none lost, and each written episode's tokens are covered by version
    spans exactly where the model sampled them."""
    run_dir = tmp_path / "run"
    proc, _ = start_run(
        launch_model,
        run_dir,
        "mode=sync",
        "task=calc",
        "streams=files",
        f"streams.files_dir={tmp_path / 'streams'}",
        "inference.backend=torch",
        "inference.num_servers=1",
        "task.episode_max_turns=2",
        "task.episode_token_budget=40",
        "actor.round_tokens=4",
        "actor.attempts=2",
        "trainer.batch_size=4",
        "trainer.max_steps=4",
        "trainer.push_timeout_s=60",
    )
    output = finish(proc, "", timeout_s=300)
    assert_clean_finish(proc, output, run_dir, 4, servers=1)
    ledger = ledger_summary(run_dir)
    assert ledger.carried > 0 and ledger.carried_lost == [], "\n".join(ledger.lines())
    cfg = RunConfig.model_validate_json((run_dir / "config.json").read_text())
    assert cfg.actor.max_lag == 10  # rounds.lag_bound(40 episode tokens, 4, 2 groups per step, 4 buffered)
    carried = [g for g in read_all(cfg, ROLLOUTS) if g.metadata.get("rounds", 1) > 1]
    assert carried and all("turns" in g.metadata for g in carried)
    for g in carried:
        for s in g.samples:
            assert sum(span.end - span.start for span in s.version_spans) == sum(s.completion_mask or [])
