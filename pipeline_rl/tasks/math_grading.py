"""Grading `\\boxed{...}` answers with math-verify, for the gsm8k and math tasks.

    grade_boxed_answer("\\frac{1}{2}", "... so the answer is \\boxed{0.5}.")   # 'correct'

The completion's last `\\boxed{...}` is the answer; no box (or an empty one, or one math-verify
cannot parse) is `unparseable`. Equivalence is math-verify's `verify(parse(gold), parse(answer))`,
so `1/2`, `0.5`, `0.50` and `\\frac{1}{2}` all match.

math-verify's own timeouts use SIGALRM, which only works on a main thread and cannot interrupt a
computation stuck in C; they are disabled here and `Grader` (grader.py) enforces the timeout instead by
running these functions in worker processes it can kill. Calling them directly has no timeout.
"""

from __future__ import annotations

import logging

from math_verify import parse, verify

from pipeline_rl.tasks.base import Grade, Problem

# math-verify warns on every process start that its timeout is disabled; that is deliberate here.
logging.getLogger("math_verify").setLevel(logging.ERROR)
logger = logging.getLogger(__name__)

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _braced(text: str, start: int) -> str | None:
    """Content of the brace group opening at text[start] == '{', or None if it never closes."""
    depth = 0
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":  # an escaped brace (\{ in a set) does not nest
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`), else None."""
    found = []
    for command in _BOX_COMMANDS:
        at = text.find(command)
        while at >= 0:
            found.append((at, at + len(command)))
            at = text.find(command, at + 1)
    for _, after in sorted(found, reverse=True):
        if text.startswith("{", after):
            content = _braced(text, after)
        elif text.startswith(" ", after):  # `\boxed 5`: one token, up to whitespace or '$'
            words = text[after:].split("$")[0].split()
            content = words[0] if words else None
        else:
            content = None
        if content is not None:  # an unclosed box falls back to the one before it
            return content
    return None


def _compact(text: str) -> str:
    return "".join(text.split())


def final_boxed(text: str) -> str | None:
    """The answer a completion boxes last, whitespace removed (what a majority vote compares), or None."""
    content = last_boxed(text)
    return _compact(content) if content and content.strip() else None


def grade_boxed_answer(gold: str, completion_text: str) -> Grade:
    """Grade the last `\\boxed{}` of a completion against a gold answer (LaTeX or plain)."""
    content = last_boxed(completion_text)
    if content is None or not content.strip():
        return "unparseable"
    if _compact(content) == _compact(gold):  # cheap and exact: no sympy needed
        return "correct"
    predicted = parse(f"${content}$", parsing_timeout=None)
    if not predicted:
        return "unparseable"
    expected = parse(f"${gold}$", parsing_timeout=None)
    if not expected:
        # A data problem, not the model's: the string comparison above already failed.
        logger.warning("gold answer %r cannot be parsed; grading by string equality only", gold[:200])
        return "wrong"
    return "correct" if verify(expected, predicted, timeout_seconds=None) else "wrong"


def grade_boxed_problem(problem: Problem, completion_text: str) -> Grade:
    """`Task.worker_grade_fn` for the gsm8k and math tasks (module-level, so workers can unpickle it)."""
    return grade_boxed_answer(problem.answer, completion_text)
