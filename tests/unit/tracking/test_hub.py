"""The tracking hub: what each row of stats.jsonl becomes in a tracker, the tables of sampled completions,
the redaction of secrets, a failing sink, and TensorBoard's event files read back with TensorBoard's own
reader (real files; the launched run with all three trackers is tests/integration/test_tracking.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from support.sinks import Exploding, Recording

from pipeline_rl.config import RunConfig
from pipeline_rl.tracking.config import TrackingConfig
from pipeline_rl.tracking.hub import REDACTED, SAMPLE_COLUMNS, Trackers, redacted
from pipeline_rl.tracking.sinks import RunInfo, TensorBoardSink, markdown_table


def _hub(tmp_path: Path, sinks: list, **cfg) -> Trackers:
    run = RunInfo(run_dir=tmp_path, name="run", config={"lr": 1e-6}, resumed=False)
    (tmp_path / "tracking").mkdir(exist_ok=True)
    hub = Trackers(TrackingConfig(**cfg), run, sinks)
    hub._thread.start()
    hub._put(("open",))
    return hub


ROWS = [
    {"type": "eval", "time": 10.0, "when": "before", "accuracy": 0.25, "problems": 8, "reward_mean": None},
    {"type": "stats", "source": "trainer", "time": 11.0, "step": 1, "version": 1, "loss": 0.5, "note": "x"},
    {"type": "stats", "source": "actor0", "time": 11.5, "reward_mean": 0.75, "lag_max": 1, "flag": True},
    {"type": "version", "time": 12.0, "version": 2, "step": 2, "samples_consumed": 32, "servers": ["a", "b"]},
    {"type": "preprocessor", "time": 12.5, "preprocessor_id": "prep0", "groups_in": 9, "samples_out": 36},
    {"type": "stats", "source": "trainer", "time": 13.0, "step": 2, "version": 2, "loss": float("nan")},
]


def test_trainer_values_stay_at_their_steps_and_the_others_last_values_go_at_the_latest_step(tmp_path):
    sink = Recording()
    hub = _hub(tmp_path, [sink], flush_every_s=60)  # one flush: at the end
    hub.rows(ROWS)
    hub.servers(
        {
            "http://b:2": {"status": "starting", "weight_version": 0},
            "http://a:1": {"status": "ok", "weight_version": 2},
        }
    )
    hub.finish({"steps": 2}, [tmp_path / "missing.png"])
    scalars = sink.of("scalars")
    assert len(scalars) == 3, scalars  # the evaluation alone, then one call per trainer step
    assert scalars[0] == ("scalars", {"eval/accuracy": 0.25, "eval/problems": 8.0}, 0, 10.0)  # None left out
    assert scalars[1] == (
        "scalars",
        {"trainer/step": 1.0, "trainer/version": 1.0, "trainer/loss": 0.5},
        1,
        11.0,
    )
    values, step, wall_time = scalars[2][1:]
    assert step == 2 and wall_time > 13.0  # the servers' poll is stamped when it was made
    assert values == {
        "trainer/step": 2.0, "trainer/version": 2.0,  # NaN left out
        "actor0/reward_mean": 0.75, "actor0/lag_max": 1.0,  # no bools
        "weights/version": 2.0, "weights/step": 2.0, "weights/samples_consumed": 32.0, "weights/servers": 2.0,
        "prep0/groups_in": 9.0, "prep0/samples_out": 36.0,
        "server0/up": 1.0, "server0/weight_version": 2.0,  # in URL order: server0 is http://a:1
        "server1/up": 0.0, "server1/weight_version": 0.0,
    }  # fmt: skip
    assert sink.of("finish") == [("finish", {"steps": 2}, [])]  # a plot that is not there is skipped
    assert sink.calls[0][0] == "open" and sink.calls[-1] == ("close",)


def test_a_burst_of_rows_reaches_a_sink_as_one_call_per_step_with_the_last_values(tmp_path):
    """A preprocessor reports after every group: hundreds of rows a second become one value per flush."""
    sink = Recording()
    hub = _hub(tmp_path, [sink], flush_every_s=60)
    burst = [
        {"type": "preprocessor", "time": 20.0 + i, "preprocessor_id": "prep0", "groups_in": i}
        for i in range(500)
    ]
    trainer = [
        {"type": "stats", "source": "trainer", "time": 19.0 + s, "step": s, "loss": s / 10} for s in (7, 8)
    ]
    hub.rows([trainer[0], *burst, trainer[1]])
    hub.rows([{"type": "eval", "time": 600.0, "when": "after", "accuracy": 0.5}])
    hub.rows([{"type": "stats", "source": "trainer", "time": 601.0, "step": 8, "loss": 0.2}])
    hub.finish({}, [])
    assert sink.of("scalars") == [
        ("scalars", {"trainer/step": 7.0, "trainer/loss": 0.7}, 7, 26.0),
        ("scalars", {"trainer/step": 8.0, "trainer/loss": 0.8, "prep0/groups_in": 499.0}, 8, 519.0),
        ("scalars", {"eval/accuracy": 0.5}, 8, 600.0),  # what came before went first, then this alone
        ("scalars", {"trainer/step": 8.0, "trainer/loss": 0.2}, 8, 601.0),  # a redone step: its own call
    ]


def test_metrics_reach_the_sinks_every_flush_interval_while_the_run_goes_on(tmp_path):
    sink = Recording()
    hub = _hub(tmp_path, [sink], flush_every_s=0.2)
    hub.rows([{"type": "stats", "source": "trainer", "time": 1.0, "step": 1, "loss": 0.5}])
    deadline = time.monotonic() + 10
    while not sink.of("scalars") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sink.of("scalars") == [("scalars", {"trainer/step": 1.0, "trainer/loss": 0.5}, 1, 1.0)]
    hub.finish({}, [])


def test_sampled_completions_become_one_table_per_interval(tmp_path):
    sink = Recording()
    hub = _hub(tmp_path, [sink], samples_every_steps=4, samples_per_table=2, sample_chars=5)

    def sample(step: int, i: int) -> dict:
        return {
            "type": "sample", "time": 1.0, "source": "actor0", "step": step, "prompt": f"user: {i}+{i}=",
            "completion": f"{2 * i} done", "reward": 1.0, "grade": "correct", "weight_versions": [step - 1, step],
        }  # fmt: skip

    hub.rows([sample(1, 1), sample(2, 2), sample(3, 3), sample(5, 4), sample(9, 5)])
    hub.finish({}, [])
    tables = sink.of("table")
    assert [t[4] for t in tables] == [0, 4, 8]  # one per 4 steps, at the interval's first step
    assert all(t[1] == "samples" and t[2] == SAMPLE_COLUMNS for t in tables)
    first = tables[0][3]
    assert len(first) == 2  # samples_per_table: the third sample of the interval is left out
    assert first[0] == [1, "actor0", "user:", "2 don", 1.0, "correct", "0,1"]  # cut to sample_chars


def test_a_sink_that_raises_is_reported_once_and_the_others_go_on(tmp_path, capsys):
    good = Recording()
    hub = _hub(tmp_path, [Exploding(), good], flush_every_s=60)
    hub.rows(ROWS)
    hub.rows(ROWS)
    hub.finish({"steps": 2}, [])
    lines = [line for line in capsys.readouterr().out.splitlines() if "exploding" in line]
    assert len(lines) == 1 and "failed in open" in lines[0] and "the tracking service is down" in lines[0], (
        lines
    )
    # Each time: the evaluation (flushing what was pending); steps 1 and 2 after each.
    assert len(good.of("scalars")) == 6 and good.calls[-1] == ("close",)
    assert set(hub.failed) == {"exploding"}


def test_a_full_queue_drops_rows_and_says_so_without_blocking(tmp_path, capsys):
    hub = Trackers(TrackingConfig(queue_size=100), RunInfo(tmp_path, "run", {}, False), [Recording()])
    for _ in range(150):  # the thread is not started: nothing drains the queue
        hub.rows(ROWS)
    assert hub.dropped == 50
    hub._thread.start()
    hub.finish({}, [])
    assert "50 updates dropped" in capsys.readouterr().out


def test_secrets_are_redacted_from_the_config_the_trackers_get():
    cfg = RunConfig(
        model_path="/m",
        inference={"token": "tok-123"},
        streams={"backend": "redis", "redis_url": "redis://:hunter2@10.0.0.1:6379/0"},
        task={"name": "arith", "options": {}},
    )
    from pipeline_rl.config import public_config

    config = redacted(public_config(cfg).model_dump(mode="json"))
    text = json.dumps(config)
    assert "tok-123" not in text and "hunter2" not in text
    nested = redacted(
        {"a": {"judge_api_key": "sk-1", "keys": 3}, "b": ["https://u:pw@host/x"], "token": None}
    )
    assert nested == {
        "a": {"judge_api_key": REDACTED, "keys": 3},
        "b": ["https://u:***@host/x"],
        "token": None,
    }


def test_tensorboard_files_read_back_with_tensorboards_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    png = tmp_path / "plot.png"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.plot([0, 1], [1, 0])
    plt.savefig(png)
    plt.close()
    hub = _hub(tmp_path, [TensorBoardSink()], samples_every_steps=2, flush_every_s=60)
    hub.rows(ROWS)
    hub.rows([{"type": "sample", "time": 1.0, "source": "actor0", "step": 1, "prompt": "p|q", "completion": "c",
               "reward": 0.5, "grade": None, "weight_versions": [1]}])  # fmt: skip
    hub.finish({"steps": 2}, [png])
    events = EventAccumulator(
        str(tmp_path / "tracking" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}
    )
    events.Reload()
    assert [(e.step, e.value, e.wall_time) for e in events.Scalars("trainer/loss")] == [(1, 0.5, 11.0)]
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(0, 0.25)]
    config = events.Tensors("config")[0].tensor_proto.string_val[0].decode()
    assert json.loads(config.strip("`\n")) == {"lr": 1e-6}
    table = events.Tensors("samples")[0].tensor_proto.string_val[0].decode()
    assert table == markdown_table(SAMPLE_COLUMNS, [[1, "actor0", "p|q", "c", 0.5, None, "1"]])
    assert "p\\|q" in table
    assert events.Tags()["images"] == ["plots/plot"]


def test_a_sink_reference_that_does_not_resolve_fails_at_startup(tmp_path):
    from pipeline_rl.launch.preflight import tracking_problems

    cfg = RunConfig(model_path="/m", tracking={"sinks": ["support.sinks:nowhere"], "tensorboard": True})
    problems = tracking_problems(cfg)
    assert len(problems) == 1 and "support.sinks has no 'nowhere'" in problems[0], problems
    with pytest.raises(ValueError, match="is not a reference"):
        TrackingConfig(sinks=["no-colon"])
