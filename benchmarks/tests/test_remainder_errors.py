"""The remainder diagnostic's line-by-line check (benchmarks/remainder_errors.py), on hand-written
completions of one problem: 23 and 7, whose chain is 23-7=16, 16-7=9, 9-7=2, answer 2. No model."""

from __future__ import annotations

import pytest

from benchmarks import remainder_errors as re_
from pipeline_rl.tasks import TaskConfig, make_task

TASK = make_task(TaskConfig(name="remainder"))


def problem_23_mod_7():
    problem = TASK._problem(0, "23 mod 7", 2, "test")
    assert problem.messages[0]["content"].startswith("Subtract 7 from 23 until")
    return problem


@pytest.mark.parametrize(
    ("text", "verdict", "bad_line"),
    [
        ("23-7=16\n16-7=9\n9-7=2\nanswer: 2", re_.RIGHT, None),
        ("23-7=16\n16-7=9\n9-7=2\nanswer: +2", re_.RIGHT_SIGNED, None),
        ("23-7=16\n16-7=8\n8-7=1\nanswer: 1", re_.SLIP, 2),
        ("23-7=16\n15-7=8\n8-7=1\nanswer: 2", re_.COPY, 2),  # the right answer from a broken chain
        ("23-6=17\nanswer: 2", re_.COPY, 1),  # the wrong divisor
        ("23-7=16\n16-7=9\nanswer: 9", re_.EARLY, None),
        ("23-7=16\n16-7=9\n9-7=2\n2-7=-5\nanswer: -5", re_.OVERSHOOT, None),
        ("23-7=16\n16-7=9\n9-7=2\nanswer: 3", re_.DISAGREES, None),
        ("23-7=16\n16-7=9\n9-7=2", re_.NO_ANSWER, None),
        ("23-7=16\n16-7=9\n9-7=2\nanswer: two", re_.UNPARSEABLE, None),
    ],
)
def test_each_kind_of_mistake_is_named_with_its_first_bad_line(text, verdict, bad_line):
    assert re_.check_chain(problem_23_mod_7(), text) == (verdict, bad_line)


def test_the_report_counts_graded_any_format_and_whole_chains_apart():
    problem = problem_23_mod_7()
    texts = [
        "23-7=16\n16-7=9\n9-7=2\nanswer: 2",  # graded right, chain right
        "23-7=16\n16-7=9\n9-7=2\nanswer: +2",  # chain right, graded wrong, right in any format
        "23-7=16\n15-7=8\n8-7=1\nanswer: 2",  # graded right from a broken chain
        "23-7=16\n16-7=8\n8-7=1\nanswer: 1",  # wrong
    ]
    out = re_.report("m", [problem] * 4, texts, TASK)
    assert out.splitlines()[0] == "m: graded correct 2/4; final number right in any format 3/4"
    assert "   1  " + re_.RIGHT in out and "   1  " + re_.RIGHT_SIGNED in out
    assert "   1  " + re_.COPY in out and "   1  " + re_.SLIP in out
    assert "first bad line is line 1 or 2 in 2 of 2 broken chains" in out
    assert "whole chain right, by subtractions needed: 1-3: 2/4" in out
