"""Partial rollouts without servers: a round's arithmetic (pipeline_rl/actor/rounds.py), the config
rules, the lag the launcher derives, and the ledger's accounting of carried answers."""

from __future__ import annotations

import json

import pytest

from inference_shim.openai_protocol import VersionSpan
from pipeline_rl.actor import rounds
from pipeline_rl.config import RunConfig
from pipeline_rl.launch.plan import resolve
from pipeline_rl.ledger import CARRIED_PLACE, LOCATIONS_FILE, LedgerWriter, ledger_dir, ledger_summary
from pipeline_rl.messages import CarriedGroup, PartialSample


def _sample(prompt: int = 5, tokens: int = 0) -> PartialSample:
    return PartialSample(
        prompt_token_ids=list(range(prompt)),
        token_ids=[7] * tokens,
        logprobs=[-0.5] * tokens,
        version_spans=[VersionSpan(version=0, start=0, end=tokens)] if tokens else [],
    )


def _extend(sample, n, finish, version, asked, max_tokens=12, max_model_len=64):
    rounds.extend(
        sample,
        [1] * n,
        [-0.1] * n,
        [VersionSpan(version=version, start=0, end=n)] if n else [],
        "x" * n,
        finish,
        "http://s",
        asked=asked,
        max_tokens=max_tokens,
        max_model_len=max_model_len,
    )


def test_an_answer_cut_by_the_cap_stays_open_and_its_spans_continue_across_rounds():
    s = _sample()
    _extend(s, 4, "length", version=0, asked=4)
    assert s.finish_reason is None and s.segments == 1
    _extend(s, 4, "length", version=1, asked=4)
    _extend(s, 2, "stop", version=1, asked=4)
    assert s.finish_reason == "stop" and len(s.token_ids) == 10 and len(s.logprobs) == 10
    # Rounds 2 and 3 ran on version 1: one span over both, the seam merged.
    assert [(v.version, v.start, v.end) for v in s.version_spans] == [(0, 0, 4), (1, 4, 10)]
    assert s.text == "x" * 10 and s.segments == 3


def test_an_answer_that_reaches_max_tokens_or_the_context_ends_for_length():
    s = _sample(tokens=8)
    assert rounds.segment_tokens(s, max_tokens=12, round_tokens=4, max_model_len=64) == 4
    _extend(s, 4, "length", version=2, asked=4)
    assert s.finish_reason == "length"
    near = _sample(prompt=60, tokens=2)  # 2 tokens of room left in a 64-token context
    assert rounds.segment_tokens(near, max_tokens=12, round_tokens=4, max_model_len=64) == 2
    _extend(near, 2, "length", version=0, asked=2)
    assert near.finish_reason == "length"


def test_a_short_answer_in_its_first_round_is_done():
    s = _sample()
    _extend(s, 3, "stop", version=0, asked=4)
    assert s.finish_reason == "stop"
    # An engine stopping for length before the cap (its own limit) ends the answer too.
    t = _sample()
    _extend(t, 3, "length", version=0, asked=4)
    assert t.finish_reason == "length"


@pytest.mark.parametrize(
    "in_flight, cut, waiting, expected",
    [(0, 0, 0, True), (7, 0, 0, True), (8, 0, 0, False), (3, 2, 3, False), (1, 2, 4, True), (0, 8, 0, False)],
)
def test_a_new_group_starts_while_started_and_unconsumed_groups_are_below_the_buffer(
    in_flight, cut, waiting, expected
):
    assert rounds.may_start_new(in_flight, cut, waiting, max_buffered_groups=8) is expected


@pytest.mark.parametrize(
    "max_tokens, cap, groups, buffered, lag",
    [(12, 4, 4, 4, 2), (12, 4, 4, 8, 3), (12, 5, 4, 8, 3), (13, 4, 2, 3, 4)],
)
def test_the_lag_bound_counts_rounds_and_the_steps_a_written_group_may_wait(
    max_tokens, cap, groups, buffered, lag
):
    assert rounds.lag_bound(max_tokens, cap, groups, buffered) == lag


@pytest.mark.parametrize("max_tokens, cap, expected", [(12, 4, 3), (12, 5, 3), (13, 4, 4), (12, 11, 2)])
def test_rounds_per_answer_for_any_cap(max_tokens, cap, expected):
    assert rounds.max_rounds(max_tokens, cap) == expected


def _cfg(tmp_path, **actor):
    return RunConfig.model_validate(
        {
            "run_dir": str(tmp_path),
            "model_path": "/nonexistent",
            "mode": actor.pop("mode", "sync"),
            "actor": {"attempts": 4, "max_tokens": 12, **actor},
            "trainer": {"batch_size": 8},
            "streams": {"backend": "files", "files_dir": str(tmp_path / "streams")},
        }
    )


def test_the_launcher_sets_the_lag_a_carried_answer_needs(tmp_path):
    cfg = resolve(_cfg(tmp_path, round_tokens=5), tmp_path)  # 3 rounds, 2 groups per step, 4 buffered
    assert cfg.actor.max_lag == 3 and cfg.actor.max_buffered_groups == 4
    plain = resolve(_cfg(tmp_path), tmp_path)
    assert plain.actor.max_lag == 0 and plain.actor.max_buffered_groups == 2


@pytest.mark.parametrize(
    "actor, message",
    [
        ({"mode": "pipeline", "round_tokens": 4}, "needs mode=sync"),
        ({"round_tokens": 12}, "must be below actor.max_tokens"),
    ],
)
def test_a_round_cap_that_cannot_work_is_refused(tmp_path, actor, message):
    with pytest.raises(ValueError, match=message):
        _cfg(tmp_path, **actor)


def _carried_group() -> CarriedGroup:
    return CarriedGroup(
        group_id="0-abc:7", problem={}, start_version=0, started_at=0.0, rounds=1, samples=[_sample()] * 2
    )


def test_the_ledger_counts_carried_answers_and_finds_the_open_ones_on_the_carried_topic(tmp_path):
    group = _carried_group()
    assert group.sample_ids() == ["0-abc:7/0", "0-abc:7/1"]
    w = LedgerWriter(tmp_path, "actor0-abc")
    w.started()
    w.carried("0-abc:7", ["0-abc:7/0", "0-abc:7/1"])  # round 1 cut both
    w.carried("0-abc:7", ["0-abc:7/1"])  # round 2 cut one again
    w.carried("0-abc:9", ["0-abc:9/0"])  # still carried when the run stopped
    w.generated("0-abc:7", ["0-abc:7/0", "0-abc:7/1"])
    w.close()
    t = LedgerWriter(tmp_path, "trainer")
    t.trained(1, ["0-abc:7/0", "0-abc:7/1"])
    t.close()

    before = ledger_summary(tmp_path)  # no snapshot: not established
    assert before.carried == 3 and before.carried_open == ["0-abc:9/0"] and before.carried_lost is None
    assert before.balanced and any("carried across rounds: 3" in line for line in before.lines())

    snapshot = {"complete": True, "places": {CARRIED_PLACE: ["0-abc:9/0"]}, "unknown": []}
    (ledger_dir(tmp_path) / LOCATIONS_FILE).write_text(json.dumps(snapshot))
    located = ledger_summary(tmp_path)
    assert located.carried_lost == [] and located.balanced

    snapshot["places"] = {}
    (ledger_dir(tmp_path) / LOCATIONS_FILE).write_text(json.dumps(snapshot))
    lost = ledger_summary(tmp_path)
    assert lost.carried_lost == ["0-abc:9/0"] and not lost.balanced
    assert any("CARRIED AND LOST: 0-abc:9/0" in line for line in lost.lines())
