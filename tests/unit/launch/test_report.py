"""`pipeline-rl report RUN_DIR` prints the sample ledger and puts it in summary.json (no servers)."""

from __future__ import annotations

import json

from pipeline_rl.launch import report
from pipeline_rl.ledger import LedgerWriter


def _ledger(run_dir) -> None:
    actor = LedgerWriter(run_dir, "actor0-abc")
    actor.generated("0-abc:0", ["0-abc:0/0", "0-abc:0/1"])
    actor.generated("0-abc:1", ["0-abc:1/0", "0-abc:1/1"])
    actor.close()
    prep = LedgerWriter(run_dir, "prep0-x")
    prep.dropped("filtered", ["0-abc:1/0", "0-abc:1/1"], group="0-abc:1")
    prep.close()
    trainer = LedgerWriter(run_dir, "trainer")
    trainer.trained(1, ["0-abc:0/0"])
    trainer.close()


def test_report_prints_the_ledger_and_summary_holds_it(tmp_path, capsys) -> None:
    _ledger(tmp_path)
    summary = report.summarize(tmp_path, started_at=0.0, extra={})
    assert summary["ledger"]["generated"] == 4
    assert summary["ledger"]["trained"] == 1
    assert summary["ledger"]["in_flight"] == 1  # 0-abc:0/1 was generated, neither trained nor dropped
    assert json.loads((tmp_path / "summary.json").read_text())["ledger"] == summary["ledger"]

    report.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "generated 4 = trained 1 + dropped 2 + in flight 1" in out
    assert "trained twice: 0" in out


def test_phase_times_are_medians_with_their_share_of_the_step() -> None:
    from pipeline_rl.launch.report import phase_lines, phase_times

    rows = [
        {"step_s": 1.0, "wait_data_s": 0.1, "forward_s": 0.4, "optimizer_s": 0.2},
        {"step_s": 2.0, "wait_data_s": 0.3, "forward_s": 0.6, "optimizer_s": 0.2},
        {"step_s": 3.0, "wait_data_s": 0.2, "forward_s": 0.8},
    ]
    phases = phase_times(rows)
    assert list(phases) == ["wait_data_s", "forward_s", "optimizer_s", "step_s"]  # the order of a step
    assert phases["forward_s"] == {"median_s": 0.6, "share_of_step": 0.3}
    assert phases["optimizer_s"]["median_s"] == 0.2 and phases["step_s"]["median_s"] == 2.0
    assert phase_lines(phases)[2].split() == ["forward_s", "600.0", "ms", "30.0%"]
    assert phase_times([]) == {}
