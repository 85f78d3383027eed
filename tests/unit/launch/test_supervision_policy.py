"""The launcher's restart decision as pure functions: backoff doubling and its cap, the per-process
budget, the per-role counts that /status shows, and the error that names the process once it is spent."""

from __future__ import annotations

import pytest

from pipeline_rl.config import RestartPolicy, SupervisionConfig
from pipeline_rl.launch.supervision import (
    BudgetSpent,
    Supervisor,
    describe_exit,
    restart_argv,
    restart_delay,
)


def test_backoff_doubles_up_to_its_cap_then_the_budget_ends():
    policy = RestartPolicy(max_restarts=5, backoff_s=1.0, max_backoff_s=5.0)
    assert [restart_delay(policy, n) for n in range(6)] == [1.0, 2.0, 4.0, 5.0, 5.0, None]


def test_zero_budget_never_restarts():
    assert restart_delay(RestartPolicy(max_restarts=0), 0) is None


def test_huge_restart_counts_stay_finite():
    policy = RestartPolicy(max_restarts=10_000, backoff_s=1.0, max_backoff_s=30.0)
    assert restart_delay(policy, 5000) == 30.0


def test_supervisor_schedules_counts_per_process_and_gives_up_naming_the_role():
    sup = Supervisor(SupervisionConfig(actor=RestartPolicy(max_restarts=1, backoff_s=2.0)))
    assert sup.policy("servers") is not None and sup.policy("trainer") is not None
    assert sup.schedule("actor0", "actors", -9, now=100.0) == 2.0
    assert sup.pending("actor0")
    assert sup.due(now=101.0) == []  # not yet: the backoff holds it
    assert sup.due(now=102.0) == ["actor0"] and not sup.pending("actor0")
    # actor1 has its own budget.
    assert sup.schedule("actor1", "actors", 1, now=103.0) == 2.0
    assert sup.due(now=106.0) == ["actor1"]
    assert sup.restarts_by_role() == {
        "servers": 0,
        "trainer": 0,
        "actors": 2,
        "preprocessors": 0,
        "stages": 0,
        "redis": 0,
    }
    with pytest.raises(BudgetSpent) as err:
        sup.schedule("actor0", "actors", -9, now=110.0)
    message = str(err.value)
    for words in ("actor0", "role actors", "-9 (SIGKILL)", "supervision.actor.max_restarts=1"):
        assert words in message


def test_a_role_without_policy_is_not_restartable():
    with pytest.raises(ValueError, match="not restartable"):
        Supervisor(SupervisionConfig()).schedule("evaluator", "evaluators", 1)


def test_restarted_servers_await_weights_and_a_restarted_trainer_resumes():
    server = ["python", "-m", "inference_shim", "--port", "1"]
    assert restart_argv("servers", server) == [*server, "--await-weights"]
    assert restart_argv("servers", restart_argv("servers", server)) == [*server, "--await-weights"]
    trainer = ["python", "-m", "pipeline_rl.cli", "train", "--config", "c.json"]
    assert restart_argv("trainer", trainer)[-1] == "--resume"
    assert restart_argv("actors", ["a"]) == ["a"]


def test_exit_codes_name_their_signal():
    assert describe_exit(1) == "1" and describe_exit(-15) == "-15 (SIGTERM)" and describe_exit(None) == "None"
