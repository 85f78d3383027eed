"""Where greedy answers to the `remainder` task go wrong: the written chain of subtractions checked line by
line, for one or more models (a warm-up, an RL checkpoint), on the held-out problems every evaluator grades.

    .venv/bin/python -m benchmarks.remainder_errors artifacts/tiny-remainder RUN_DIR/checkpoints/step_NNNNNNNN/model

The grader reads only the final `answer: N`; this says whether a wrong (or right) final answer came from a
slip in one subtraction, a wrongly copied number, a chain that stops early or runs on, or the final
answer disagreeing with its own chain. Generation is the warm-up's own greedy evaluation
(pipeline_rl/demo/warmup.py's greedy_texts), so "graded" matches the accuracy `make demo-long` prints.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

from pipeline_rl.demo.warmup import right_in_any_format
from pipeline_rl.tasks.base import Problem
from pipeline_rl.tasks.remainder import operands

_LINE = re.compile(r"^(-?\d+)-(-?\d+)=(-?\d+)$")
_FINAL = re.compile(r"^answer:\s*([+-]?\d+)$")

# Verdicts, in the order a chain is checked; "right" and "right, signed" have a correct chain and answer.
RIGHT = "right"
RIGHT_SIGNED = "right, written +N (the grader wants N)"
NO_ANSWER = "no final answer line"
UNPARSEABLE = "final answer not an integer"
COPY = "a line starts from a wrong number"
SLIP = "a subtraction is wrong"
EARLY = "stops before the remainder"
OVERSHOOT = "subtracts past the remainder"
DISAGREES = "final answer differs from its chain"
VERDICTS = (RIGHT, RIGHT_SIGNED, SLIP, COPY, EARLY, OVERSHOOT, DISAGREES, NO_ANSWER, UNPARSEABLE)


def check_chain(problem: Problem, text: str) -> tuple[str, int | None]:
    """(verdict, 1-based number of the first bad line or None) for one completion of a remainder problem."""
    number, divisor = operands(problem.metadata["expr"])
    lines = [line.strip() for line in text.strip().split("\n") if line.strip()]
    finals = [line for line in lines if line.startswith("answer:")]
    if not finals:
        return NO_ANSWER, None
    final = _FINAL.match(finals[-1])
    if final is None:
        return UNPARSEABLE, None
    current = number
    chain = [match for match in map(_LINE.match, lines) if match]
    for index, match in enumerate(chain, start=1):
        a, b, c = (int(x) for x in match.groups())
        if a != current or b != divisor:
            return COPY, index
        if c != a - b:
            return SLIP, index
        current = c
    if current >= divisor:
        return EARLY, None
    if current < 0:
        return OVERSHOOT, None
    if int(final.group(1)) != current:
        return DISAGREES, None
    return (RIGHT_SIGNED if final.group(1).startswith("+") else RIGHT), None


# Chains by the subtractions they need: (label, most subtractions), shortest first.
STEP_BUCKETS = (("1-3", 3), ("4-10", 10), ("11-30", None))


def steps_bucket(problem: Problem) -> str:
    steps = problem.metadata["steps"]
    return next(label for label, most in STEP_BUCKETS if most is None or steps <= most)


def report(name: str, problems: list[Problem], texts: list[str], task) -> str:
    verdicts = [check_chain(p, t) for p, t in zip(problems, texts, strict=True)]
    counts = Counter(v for v, _ in verdicts)
    graded = sum(task.grade(p, t) == "correct" for p, t in zip(problems, texts, strict=True))
    any_format = sum(right_in_any_format(p, t) for p, t in zip(problems, texts, strict=True))
    first_bad = Counter(line for _, line in verdicts if line is not None)
    by_steps = {label: [0, 0] for label, _ in STEP_BUCKETS}
    for p, (verdict, _) in zip(problems, verdicts, strict=True):
        tally = by_steps[steps_bucket(p)]
        tally[0] += verdict in (RIGHT, RIGHT_SIGNED)
        tally[1] += 1
    n = len(problems)
    out = [f"{name}: graded correct {graded}/{n}; final number right in any format {any_format}/{n}"]
    out += [f"  {counts[v]:4d}  {v}" for v in VERDICTS if counts[v]]
    early = sum(c for line, c in first_bad.items() if line <= 2)
    out.append(f"  first bad line is line 1 or 2 in {early} of {sum(first_bad.values())} broken chains")
    out.append(
        "  whole chain right, by subtractions needed: "
        + ", ".join(f"{label}: {right}/{total}" for label, (right, total) in by_steps.items() if total)
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", type=Path, help="Hugging Face model directories")
    parser.add_argument(
        "--problems", type=int, default=100, help="held-out problems (default 100, as the evals)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=320, help="new tokens per answer (the recipe's 320)"
    )
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline_rl.demo.main import RECIPES
    from pipeline_rl.demo.warmup import greedy_texts
    from pipeline_rl.tasks import held_out_problems, make_task

    torch.set_num_threads(1)  # as the warm-up's own evaluation: the same numerics on every box
    task = make_task(RECIPES["remainder"].task)
    problems = held_out_problems(task, args.problems)
    for path in args.models:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        texts = greedy_texts(model, tokenizer, problems, args.max_tokens)
        print(report(str(path), problems, texts, task), flush=True)


if __name__ == "__main__":
    main()
