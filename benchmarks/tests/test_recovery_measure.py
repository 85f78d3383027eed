"""The recovery benchmark's arithmetic (benchmarks/recovery.py: measure) on a made-up run: steady
steps, a gap after the fault, steps redone by a restarted trainer.

    .venv/bin/python -m pytest -q benchmarks/tests/test_recovery_measure.py
"""

from __future__ import annotations

import json

from benchmarks.recovery import WINDOW_S, measure


def test_recovery_time_dip_and_redone_steps(tmp_path):
    # 2 steps/s for 20 s, a fault at t=20, nothing until t=30, then 2 steps/s again. The trainer died at
    # step 40 and resumed from its checkpoint at step 30 (its metrics file was truncated to step 30).
    times = [i * 0.5 for i in range(1, 31)] + [30 + i * 0.5 for i in range(1, 41)]
    steps = list(range(1, 31)) + list(range(31, 71))
    lines = [{"step": s, "time": t} for s, t in zip(steps, times, strict=True)]
    (tmp_path / "trainer_metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    ledger = [{"event": "resume", "step": 0}]
    ledger += [{"event": "trained", "step": s, "ids": []} for s in range(1, 41)]
    ledger += [{"event": "resume", "step": 30}] + [
        {"event": "trained", "step": s, "ids": []} for s in range(31, 71)
    ]
    (tmp_path / "ledger").mkdir()
    (tmp_path / "ledger" / "trainer.jsonl").write_text("".join(json.dumps(x) + "\n" for x in ledger))
    result = measure(tmp_path, fault_at=20.0)
    assert result["steps_per_s_before"] == 2.0
    assert result["steps_redone"] == 10
    # Back to 80% of 2 steps/s once a window after t=30 holds >= 4.8 steps: at t=32.5 (5 steps: 30.5..32.5).
    assert abs(result["recovery_s"] - 12.5) < 1e-9, result
    assert result["dip"] == 0.0  # the windows inside the gap had no step
    assert WINDOW_S == 3.0
    assert result["samples_lost"] == 0 and result["duplicates_trained"] == 0  # no ledger: nothing generated
