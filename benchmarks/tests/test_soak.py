"""The soak benchmark (benchmarks/soak.py): its schedule and verdict, and the short soak itself — a
launched run on the torch engine for 170 s under seeded faults, one kill of every role (actor,
preprocessor, server, trainer, Redis) and, where root allows, over two simulated hosts with the servers'
host's link cut and healed (6 faults; one host and 5 faults otherwise), which must end with every server
on the final version, lost = 0 established by the ledger's positive accounting, nothing trained twice
and every role restarted.

    .venv/bin/python -m pytest -q benchmarks/tests/test_soak.py       (about 3 minutes)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.soak import KILLS, LINK_CUTS, STOPS, schedule, verdict
from benchmarks.tests.test_smoke import _bench, _failure_excerpt
from pipeline_rl.testing.simhosts import available


def test_the_schedule_is_seeded_and_kills_every_role_before_any_fault_repeats() -> None:
    faults = schedule(7, 1800, 20)
    assert [(f.role, f.action) for f in faults] == [(f.role, f.action) for f in schedule(7, 1800, 20)]
    assert len(faults) == 20 and {(f.role, f.action) for f in faults[: len(KILLS)]} == set(KILLS)
    assert {(f.role, f.action) for f in faults[len(KILLS) : len(KILLS) + len(STOPS)]} == set(STOPS)
    times = [f.at_s for f in faults]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 1800 * 1.01
    assert schedule(8, 1800, 20) != faults
    # Over simulated hosts the link cut joins the kills in the first round.
    faults = schedule(7, 1800, 20, link_cuts=True)
    assert {(f.role, f.action) for f in faults[: len(KILLS) + 1]} == set(KILLS + LINK_CUTS)


def test_the_verdict_names_every_broken_promise() -> None:
    good = {
        "exit_code": 0, "servers_on_final": True, "server_versions": [9, 9], "steps": 9, "lost": 0,
        "lost_ids": [], "trained_twice": 0, "restarts": {"actors": 1, "redis": 1},
        "faults": [{"action": "kill", "role": "actor", "target": "actor0", "error": None},
                   {"action": "kill", "role": "redis", "target": "redis", "error": None}],
    }  # fmt: skip
    assert verdict(good) == []
    bad = {**good, "lost": None, "trained_twice": 2, "restarts": {"redis": 1}, "servers_on_final": False}
    problems = " | ".join(verdict(bad))
    assert "lost None" in problems and "2 samples trained twice" in problems, problems
    assert "no restart of the actors" in problems and "servers on [9, 9]" in problems, problems


@pytest.mark.slow
def test_a_short_soak_loses_nothing_and_trains_nothing_twice(tmp_path: Path) -> None:
    results, out = tmp_path / "results", tmp_path / "out"
    args = ["soak", "--quick", "--doc", str(tmp_path / "b.md"), "--img-dir", str(tmp_path / "img")]
    args += ["--results-dir", str(results), "--out-dir", str(out)]
    hosts, _ = available()  # over simulated hosts as root (CI), on one host otherwise
    args += ["--hosts", "1" if hosts else "0"]
    done = _bench(*args, timeout_s=420, log_path=tmp_path / "soak.log")
    assert done.returncode == 0, _failure_excerpt(done.stdout)
    raw = json.loads((out / "soak-quick.json").read_text())
    assert verdict(raw) == [], "\n".join(verdict(raw)) + "\n" + "\n".join(raw["ledger"]) + raw["log_tail"]
    kills = {f["role"] for f in raw["faults"] if f["action"] == "kill" and f["recovered_s"] is not None}
    assert kills == {"actor", "preprocessor", "server", "trainer", "redis"}, raw["faults"]
    cuts = [f for f in raw["faults"] if f["action"] == "cut" and f["recovered_s"] is not None]
    assert len(cuts) == (1 if hosts else 0), raw["faults"]
    assert raw["lost"] == 0 and raw["trained_twice"] == 0 and raw["steps"] > 0
    record = json.loads((results / "soak.json").read_text())
    assert record["goals"][0]["status"] == "met" and record["images"], record["goals"]
    assert (tmp_path / "img" / "soak-quick.png").stat().st_size > 0
