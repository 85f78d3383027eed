"""Experiment tracking in a launched run, all three trackers on at once, read back with each tracker's
own tooling: TensorBoard's EventAccumulator, W&B's `wandb leet inspect --json` on the offline run
(wandb 0.31.0, pinned in pyproject's extras) and MLflow's client on the run's SQLite store. Every
trainer metric and every held-out evaluation the run wrote to stats.jsonl must be in each, at its step;
each has the tables of sampled completions, the run's plots and summary; no secret of the run (its
token, its Redis password) appears in any file the trackers wrote. A fourth sink, given by reference,
raises on every call: the run completes, with one line saying so. The same run directory then resumes
its tracker runs (as a resumed launch does): W&B and MLflow continue the same run. Off a terminal,
neither the launcher's output nor any process's log holds a carriage return or an escape code (no
progress bar drawn into a file).

Real launcher, Redis, gloo and tiny model; the server runs the torch engine (the same contract, seconds
to start): what is tested is the trackers' side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.launching import SMALL_RUN, assert_clean_finish, finish, launch

from pipeline_rl.config import load_run_config

pytestmark = pytest.mark.slow

STEPS = 6
TRACKING = [
    "tracking.tensorboard=true",
    "tracking.wandb=true",
    "tracking.mlflow=true",
    "tracking.sinks=[support.sinks:exploding]",
    "tracking.samples_every_steps=2",
    "tracking.tags=[ci,tiny]",
    "tracking.group=tests",
]


def _stats(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "stats.jsonl").read_text().splitlines()]


def _wandb_records(run_dir: Path) -> list[dict]:
    wandb_dir = run_dir / "tracking" / "wandb"
    (run,) = [p for p in wandb_dir.iterdir() if p.name.startswith("offline-run-")]
    out = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(run)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def tracked_run(launch_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tracked") / "run"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("WANDB_API_KEY", None)
    env.pop("WANDB_MODE", None)
    proc = launch(
        [f"model_path={launch_model}", f"run_dir={run_dir}", "inference=torch", "inference.num_servers=1",
         *SMALL_RUN, f"trainer.max_steps={STEPS}", *TRACKING],
        env=env,
    )  # fmt: skip
    output = finish(proc, "", timeout_s=600)
    assert_clean_finish(proc, output, run_dir, STEPS, servers=1)
    return run_dir, output


def _trainer_values(run_dir: Path, key: str) -> list[tuple[int, float]]:
    rows = [r for r in _stats(run_dir) if r.get("type") == "stats" and r.get("source") == "trainer"]
    return sorted((r["step"], float(r[key])) for r in rows if isinstance(r.get(key), int | float))


def _eval_accuracies(run_dir: Path) -> list[float]:
    return [r["accuracy"] for r in _stats(run_dir) if r.get("type") == "eval"]


def test_the_run_completes_with_one_line_for_the_failing_sink_and_says_where_wandb_went(tracked_run):
    run_dir, output = tracked_run
    failing = [line for line in output.splitlines() if " failed in " in line and line.startswith("tracking:")]
    assert len(failing) == 1 and "exploding failed" in failing[0], failing  # the real three work
    assert "the tracking service is down" in failing[0], failing
    assert "tracking: tensorboard, wandb, mlflow, exploding" in output
    assert "tracking: W&B offline (no API key or login found" in output
    assert f"wandb sync {run_dir / 'tracking' / 'wandb'}" in output


def test_off_a_terminal_no_output_or_log_draws_a_bar(tracked_run):
    run_dir, output = tracked_run
    for name, text in [("launcher output", output)] + [
        (p.name, p.read_text(errors="replace")) for p in (run_dir / "logs").glob("*.log")
    ]:
        assert "\r" not in text and "\x1b[" not in text, (name, text[:2000])


def test_tensorboard_has_every_trainer_metric_and_evaluation(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = tracked_run
    events = EventAccumulator(
        str(run_dir / "tracking" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}
    )
    events.Reload()
    for key in ("loss", "reward", "lag_max", "samples_per_s"):
        written = _trainer_values(run_dir, key)
        assert (
            written
            and [(e.step, pytest.approx(e.value)) for e in events.Scalars(f"trainer/{key}")] == written
        )
    assert [pytest.approx(e.value) for e in events.Scalars("eval/accuracy")] == _eval_accuracies(run_dir)
    assert {"config", "samples", "summary"} <= set(events.Tags()["tensors"])
    assert any(tag.startswith("plots/") for tag in events.Tags()["images"])
    assert (
        "actor0/reward_mean" in events.Tags()["scalars"]
        and "server0/weight_version" in events.Tags()["scalars"]
    )


def test_wandb_offline_run_has_every_trainer_metric_evaluation_and_table(tracked_run):
    run_dir, _ = tracked_run
    records = _wandb_records(run_dir)
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["display_name"] == "run" and run["tags"] == ["ci", "tiny"] and run["run_group"] == "tests"
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    for key in ("loss", "reward", "lag_max"):
        logged = sorted(
            (int(h["trainer/step"]), h[f"trainer/{key}"]) for h in history if f"trainer/{key}" in h
        )
        assert logged == [(s, pytest.approx(v)) for s, v in _trainer_values(run_dir, key)], key
    assert [pytest.approx(h["eval/accuracy"]) for h in history if "eval/accuracy" in h] == _eval_accuracies(
        run_dir
    )
    assert any(h.get("samples._type") == "table-file" for h in history)
    assert any(any(k.startswith("plots/") for k in h) for h in history)
    config = run["config"]["update"]
    assert config["trainer"]["max_steps"] == STEPS and config["inference"]["token"] is None
    summary = {}
    for r in records:
        if r["type"] == "summary":
            summary.update(r["summary"]["update"])
    assert summary["steps"] == STEPS


def test_mlflow_run_has_every_trainer_metric_evaluation_and_artifact(tracked_run):
    from mlflow.tracking import MlflowClient

    run_dir, _ = tracked_run
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'tracking' / 'mlflow.db'}")
    run_id = json.loads((run_dir / "tracking" / "mlflow.json").read_text())["run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["trainer.max_steps"] == str(STEPS)
    assert {"ci", "tiny"} <= set(run.data.tags)
    for key in ("loss", "reward", "lag_max"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, f"trainer/{key}"))
        assert history == [(s, pytest.approx(v)) for s, v in _trainer_values(run_dir, key)], key
    evals = [
        m.value for m in sorted(client.get_metric_history(run_id, "eval/accuracy"), key=lambda m: m.timestamp)
    ]
    assert evals == [pytest.approx(a) for a in _eval_accuracies(run_dir)]
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.json", "summary.json", "plots", "samples"} <= artifacts, artifacts
    tables = client.list_artifacts(run_id, "samples")
    assert tables, "no table of sampled completions"
    table = json.loads(
        Path(client.download_artifacts(run_id, tables[0].path, str(run_dir / "dl"))).read_text()
    )
    assert table["columns"][:4] == ["step", "actor", "prompt", "completion"] and table["data"]


def test_no_secret_of_the_run_is_in_any_trackers_file(tracked_run):
    run_dir, _ = tracked_run
    cfg = load_run_config(run_dir / "config.json")
    from redis.connection import parse_url

    secrets = [cfg.inference.token, parse_url(cfg.streams.redis_url)["password"]]
    assert all(s and len(s) >= 16 for s in secrets), "the run has no secret to look for"
    files = [p for p in (run_dir / "tracking").rglob("*") if p.is_file()]
    assert len(files) > 5
    leaks = [(str(p), s[:4]) for p in files for s in secrets if s.encode() in p.read_bytes()]
    assert not leaks, leaks


def test_a_resumed_run_continues_the_same_tracker_runs(tracked_run):
    from mlflow.tracking import MlflowClient

    from pipeline_rl.tracking.hub import Trackers

    run_dir, _ = tracked_run
    cfg = load_run_config(run_dir / "config.json")
    cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"sinks": []})})
    before = {
        name: json.loads((run_dir / "tracking" / f"{name}.json").read_text()) for name in ("wandb", "mlflow")
    }
    trackers = Trackers.start(cfg, run_dir, resumed=True)
    trackers.rows([{"type": "stats", "source": "trainer", "time": 1e9, "step": STEPS + 1, "loss": 0.125}])
    trackers.finish({}, [])
    after = {
        name: json.loads((run_dir / "tracking" / f"{name}.json").read_text()) for name in ("wandb", "mlflow")
    }
    assert after == before
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'tracking' / 'mlflow.db'}")
    history = client.get_metric_history(before["mlflow"]["run_id"], "trainer/loss")
    assert (STEPS + 1, 0.125) in [(m.step, m.value) for m in history]
    runs = [p for p in (run_dir / "tracking" / "wandb").iterdir() if p.name.startswith("offline-run-")]
    assert len(runs) == 2 and all(p.name.endswith(before["wandb"]["run_id"]) for p in runs), runs
