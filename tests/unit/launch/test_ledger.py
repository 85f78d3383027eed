"""The sample ledger (pipeline_rl/ledger.py) on real files: balance, torn lines left by a killed writer,
samples trained twice, rewinds of a resumed trainer, a writer SIGKILLed in the middle of its work, and
the positive accounting (located, held, abandoned, lost, not established)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from pipeline_rl.ledger import (
    DUPLICATE,
    FILTERED,
    TOO_STALE,
    LedgerWriter,
    ledger_dir,
    ledger_summary,
    record_exit,
    write_locations,
)


def _ids(group: str, n: int = 4) -> list[str]:
    return [f"{group}/{i}" for i in range(n)]


def test_a_run_that_trains_or_drops_everything_balances(tmp_path):
    actor = LedgerWriter(tmp_path, "actor0-aaaa")
    for g in ("0-aaaa:0", "0-aaaa:1", "0-aaaa:2", "0-aaaa:3"):
        actor.generated(g, _ids(g))
    prep = LedgerWriter(tmp_path, "prep0-bbbb")
    prep.dropped(FILTERED, _ids("0-aaaa:2"), group="0-aaaa:2")
    prep.dropped(FILTERED, _ids("0-aaaa:2"), group="0-aaaa:2")  # redone after a crash: same ids, once
    prep.dropped(DUPLICATE, _ids("0-aaaa:1"), group="0-aaaa:1")  # a second copy; the first is trained
    trainer = LedgerWriter(tmp_path, "trainer")
    trainer.resumed(0)
    trainer.trained(1, _ids("0-aaaa:0") + _ids("0-aaaa:1"))
    trainer.dropped(TOO_STALE, _ids("0-aaaa:3")[:1], step=2)
    trainer.trained(2, _ids("0-aaaa:3")[1:])
    s = ledger_summary(tmp_path)
    assert (s.generated, s.trained, s.dropped_total) == (16, 11, 5)
    assert s.dropped == {FILTERED: 4, TOO_STALE: 1, DUPLICATE: 4}
    assert s.in_flight == [] and s.duplicates_trained == [] and s.balanced
    assert s.lines()[0].startswith("ledger: balanced: generated 16 = trained 11 + dropped 5 + in flight 0")

    actor.generated("0-aaaa:4", _ids("0-aaaa:4", 2))  # generated, not consumed yet at stop
    s = ledger_summary(tmp_path)
    assert s.in_flight == ["0-aaaa:4/0", "0-aaaa:4/1"] and s.balanced


def test_a_sample_trained_twice_is_reported_and_unbalances(tmp_path):
    LedgerWriter(tmp_path, "actor0-x").generated("0-x:0", _ids("0-x:0"))
    trainer = LedgerWriter(tmp_path, "trainer")
    trainer.trained(1, _ids("0-x:0"))
    trainer.trained(2, _ids("0-x:0")[:1])
    s = ledger_summary(tmp_path)
    assert s.duplicates_trained == ["0-x:0/0"] and not s.balanced
    assert any("TRAINED TWICE: 0-x:0/0" in line for line in s.lines())


def test_a_resumed_trainer_voids_the_steps_after_its_checkpoint(tmp_path):
    LedgerWriter(tmp_path, "actor0-x").generated("0-x:0", _ids("0-x:0", 3))
    first = LedgerWriter(tmp_path, "trainer")
    first.resumed(0)
    first.trained(1, ["0-x:0/0"])
    first.trained(2, ["0-x:0/1"])  # checkpoint at step 1, then killed
    first.close()
    second = LedgerWriter(tmp_path, "trainer")
    second.resumed(1)
    second.trained(2, ["0-x:0/1"])  # step 2 redone from the same package
    second.trained(3, ["0-x:0/2"])
    s = ledger_summary(tmp_path)
    assert (s.trained, s.duplicates_trained, s.balanced) == (3, [], True)


def test_a_torn_last_line_is_skipped_and_the_next_writer_starts_a_clean_line(tmp_path):
    LedgerWriter(tmp_path, "actor0-x").generated("0-x:0", _ids("0-x:0", 2))
    trainer = LedgerWriter(tmp_path, "trainer")
    trainer.trained(1, ["0-x:0/0"])
    trainer.close()
    path = ledger_dir(tmp_path) / "trainer.jsonl"
    with open(path, "ab") as f:
        f.write(b'{"event":"trained","step":2,"ids":["0-x:0/')  # the writer died inside this write
    s = ledger_summary(tmp_path)
    assert (s.trained, s.unreadable_lines, s.in_flight, s.balanced) == (1, 1, ["0-x:0/1"], True)

    LedgerWriter(tmp_path, "trainer").trained(2, ["0-x:0/1"])  # the restarted writer appends
    assert path.read_bytes().count(b"\n") == 3  # the torn line was ended before the new one
    s = ledger_summary(tmp_path)
    assert (s.trained, s.unreadable_lines, s.in_flight, s.balanced) == (2, 1, [], True)


def test_lines_survive_sigkill_of_the_writer(tmp_path):
    """Every line append() returned from is on disk after kill -9 (no buffer in the process)."""
    code = (
        "import sys, time\n"
        "from pipeline_rl.ledger import LedgerWriter\n"
        "w = LedgerWriter(sys.argv[1], 'actor0-k')\n"
        "i = 0\n"
        "while True:\n"
        "    w.generated(f'0-k:{i}', [f'0-k:{i}/0'])\n"
        "    print(i, flush=True)\n"
        "    i += 1\n"
        "    time.sleep(0.001)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        confirmed = [int(proc.stdout.readline()) for _ in range(200)]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    s = ledger_summary(tmp_path)
    assert s.generated >= confirmed[-1] + 1 and s.unreadable_lines <= 1


def test_unknown_reasons_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown drop reason"):
        LedgerWriter(tmp_path, "prep0-x").dropped("bored", ["a"])


def test_an_empty_or_missing_ledger_is_balanced(tmp_path):
    s = ledger_summary(tmp_path / "nothing")
    assert (s.generated, s.files, s.balanced) == (0, 0, True)
    assert json.loads(json.dumps(s.as_dict()))["balanced"] is True  # serializable for tools


def test_every_untrained_sample_is_located_abandoned_or_named_lost(tmp_path):
    dead = LedgerWriter(tmp_path, "actor0-dead")  # an incarnation the launcher saw killed
    dead.append({"event": "start", "pid": 4242})
    for g in ("0-dead:0", "0-dead:1"):
        dead.generated(g, _ids(g))
    live = LedgerWriter(tmp_path, "actor1-live")
    live.started()
    for g in ("1-live:0", "1-live:1", "1-live:2", "1-live:3"):
        live.generated(g, _ids(g))
    trainer = LedgerWriter(tmp_path, "trainer")
    trainer.trained(1, _ids("0-dead:0") + _ids("1-live:0"))
    # Without a snapshot nothing is called located or lost, and the report says why.
    before = ledger_summary(tmp_path)
    assert before.lost is None and before.located is None and before.balanced
    assert any("not established" in line for line in before.lines())

    prep = LedgerWriter(tmp_path, "prep0-x")
    prep.held("preprocessor 0 (open batch)", _ids("1-live:2")[:2])
    prep.held("preprocessor 0 (open batch)", _ids("1-live:2"))  # the newest held line replaces it
    write_locations(tmp_path, {"rollouts (not acknowledged)": _ids("1-live:1")}, unknown=[])
    record_exit(tmp_path, "actor0", 4242, -9)
    summary = ledger_summary(tmp_path)
    assert summary.located == {"rollouts (not acknowledged)": 4, "preprocessor 0 (open batch)": 4}
    assert summary.abandoned == _ids("0-dead:1"), "the killed incarnation's last group, not lost"
    assert summary.lost == _ids("1-live:3") and not summary.balanced
    text = "\n".join(summary.lines())
    assert "lost 4" in text and "LOST: 1-live:3/0" in text and "abandoned 4" in text, text

    # A place the snapshot could not read may hold the rest: lost is then not established.
    write_locations(tmp_path, {"rollouts (not acknowledged)": _ids("1-live:1")}, unknown=["rollouts: down"])
    partial = ledger_summary(tmp_path)
    assert partial.lost is None and partial.balanced
    assert "not established: rollouts: down" in "\n".join(partial.lines())
