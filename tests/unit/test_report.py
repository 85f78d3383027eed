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
