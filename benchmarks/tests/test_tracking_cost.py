"""The tracking-cost benchmark's arithmetic and page section, from measured-run dicts (the runs themselves
are launched runs: `python -m benchmarks tracking-cost`), and the package set its setup figure installs."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.tests.test_smoke import _offline_context
from benchmarks.tracking_cost import extras_packages, publish_cost, summarize


def test_the_difference_of_medians_and_the_goal(tmp_path: Path) -> None:
    results = {
        "off": [{"samples_per_s": v} for v in (10.0, 12.0, 11.0)],
        "all three on": [{"samples_per_s": v} for v in (10.9, 10.5, 11.2)],
    }
    summary = summarize(results)
    assert summary["off"]["median"] == 11.0 and summary["all three on"]["median"] == 10.9
    assert round(summary["difference_percent"], 3) == round((10.9 - 11.0) / 11.0 * 100, 3)
    ctx = _offline_context(tmp_path, "python -m benchmarks tracking-cost")
    setup = {"packages": ["wandb==0.31.0"], "seconds": 12.5, "megabytes": 80.0}
    result = publish_cost(ctx, results, setup, seeds=3, wall_s=90, failures=[])
    goal = result["goals"][0]
    assert goal["status"] == "met" and "-0.9% against off" in goal["detail"], goal
    saved = json.loads((tmp_path / "results" / "tracking-cost.json").read_text())
    assert saved["tables"][0]["rows"][0][:2] == ["off", "3"]
    assert saved["tables"][1]["rows"][0][1:] == ["1", "80", "12.5"]
    slow = {"off": results["off"], "all three on": [{"samples_per_s": 9.0}]}
    assert publish_cost(ctx, slow, setup, 1, 90)["goals"][0]["status"] == "missed"


def test_the_setup_figure_counts_the_trackers_packages_and_not_the_base_install() -> None:
    names = {p.split("==")[0] for p in extras_packages()}
    assert {"wandb", "tensorboard", "mlflow-skinny", "sqlalchemy", "alembic"} <= names, names
    assert not names & {"torch", "transformers", "pydantic", "protobuf", "pipeline-rl"}, names
