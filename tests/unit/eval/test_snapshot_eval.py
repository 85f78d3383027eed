"""Weight snapshots (trainer.snapshot_every_s) and their evaluation after a run (pipeline_rl/eval/snapshots.py):
each snapshot holds its version's weights, is graded once, and its weights are deleted after grading."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from support.training import hf_model, one_rank_package

from pipeline_rl.trainer import checkpoint
from pipeline_rl.trainer.step import train_step


def test_weight_snapshots_hold_each_versions_weights_and_are_evaluated_after_the_run(tiny_model, tmp_path):
    """trainer.snapshot_every_s: save_snapshot writes a loadable model of that version and an index row;
    eval.snapshots grades every snapshot afterwards and appends its eval rows to stats.jsonl."""
    from pipeline_rl.eval.snapshots import evaluate_snapshots
    from pipeline_rl.tasks import TaskConfig
    from pipeline_rl.trainer.strategies.ddp import DDPStrategy

    cfg, comm, package = one_rank_package(tiny_model, tmp_path, groups=2, seed=4)
    strategy = DDPStrategy(cfg, comm, tiny_model)
    for version in (1, 2):
        train_step(strategy, package, cfg.algo, step=version, temperature=1.0, comm=comm)
        checkpoint.save_snapshot(
            cfg.run_dir, version, strategy, comm, model_path=tiny_model, bucket_bytes=1 << 20
        )
    rows = checkpoint.read_snapshots(cfg.run_dir)
    assert [r["version"] for r in rows] == [1, 2] and rows[0]["time"] <= rows[1]["time"]
    saved = hf_model(Path(cfg.run_dir) / checkpoint.SNAPSHOTS / rows[1]["path"])
    for (name, a), (_, b) in zip(strategy.module.named_parameters(), saved.named_parameters(), strict=True):
        assert torch.equal(a, b), name  # the latest version, not the initial weights
    assert not (Path(cfg.run_dir) / checkpoint.SNAPSHOTS / "v00000002.tmp").exists()

    evals = evaluate_snapshots(Path(cfg.run_dir), TaskConfig(name="arith"), num_problems=5, max_tokens=4)
    assert [(e["weight_version"], e["time"], e["problems"]) for e in evals] == [
        (r["version"], r["time"], 5) for r in rows
    ]
    assert all(0.0 <= e["accuracy"] <= 1.0 for e in evals)
    stats = [json.loads(line) for line in (Path(cfg.run_dir) / "stats.jsonl").read_text().splitlines()]
    assert [r for r in stats if r.get("when") == "snapshot"] == evals


def test_evaluate_run_grades_each_snapshot_once_and_deletes_its_weights(tiny_model, tmp_path):
    """eval.snapshots.evaluate_run: one eval row per snapshot, the weights deleted after grading,
    and a second call on the same run changes nothing (the weights it would need are gone)."""
    from pipeline_rl.eval.snapshots import evaluate_run
    from pipeline_rl.trainer.strategies.ddp import DDPStrategy

    cfg, comm, package = one_rank_package(tiny_model, tmp_path, groups=2, seed=5)
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"num_problems": 5, "max_tokens": 4})})
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json())
    strategy = DDPStrategy(cfg, comm, tiny_model)
    for version in (1, 2):
        train_step(strategy, package, cfg.algo, step=version, temperature=1.0, comm=comm)
        checkpoint.save_snapshot(
            run_dir, version, strategy, comm, model_path=tiny_model, bucket_bytes=1 << 20
        )

    def eval_rows() -> list[dict]:
        lines = (run_dir / "stats.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r.get("when") == "snapshot"]

    evaluate_run(run_dir)
    assert [r["weight_version"] for r in eval_rows()] == [1, 2]
    assert not any(
        (run_dir / checkpoint.SNAPSHOTS / r["path"]).exists() for r in checkpoint.read_snapshots(run_dir)
    )
    evaluate_run(run_dir)  # it raised here before: the graded weights were gone
    assert [r["weight_version"] for r in eval_rows()] == [1, 2]
