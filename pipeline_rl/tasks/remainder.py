"""`remainder`: a remainder found by written repeated subtraction, the long-answer task.

    task = RemainderTask(max_steps=30, max_divisor=9)
    problem = next(task.problems(shard_index=0, num_shards=1, seed=0, split="train"))
    problem.messages[0]["content"]   # 'Subtract 7 from 23 until less than 7 is left. Reply with answer: <integer>'
    task.solution_text(problem)      # '23-7=16\n16-7=9\n9-7=2\nanswer: 2'
    task.grade(problem, "...answer: 2")  # 'correct'

Real reasoning RL spends its time generating long answers whose length varies with the problem, so
requests wait on stragglers and the engine, not the trainer, is the bottleneck. The demo's answers are
a few tokens long; this task's are one line per subtraction (`a-k=b`, ~8-10 characters, and the
character tokenizer makes a character a token), and the number of lines is the quotient, drawn
log-uniformly from 1..max_steps: most answers are short, a tail is long (~15-290 tokens at 30 steps).

Every line needs only what is close by: the previous line's result and the divisor, which appears
once in the prompt; the model stops after the first result below the divisor. That is deliberate. The
first long task, `chainsum` (a sum of up to 20 listed terms, one running-sum line per term), asked the
model to find the k-th term of the prompt for line k; the 1M-parameter demo model learned the format
and the additions but never that lookup (600 warm-up steps: 0-8% of sums right over three formats;
docs/decisions.md, "The long-answer task").

Graded on the final answer only (`answer: <integer>`, the last one counts, as in arith); one slip in
any line makes it wrong, so long problems are harder and accuracy has room to grow.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from pipeline_rl.tasks.arith import parse_answer
from pipeline_rl.tasks.base import Grade, Problem, Split, generated_problems

if TYPE_CHECKING:
    from pipeline_rl.tasks.config import TaskConfig

REMAINDER_PROMPT = (
    "Subtract {divisor} from {number} until less than {divisor} is left. Reply with answer: <integer>"
)
MIN_DIVISOR = 2


def subtraction_lines(number: int, divisor: int) -> list[str]:
    """['23-7=16', '16-7=9', '9-7=2'] for 23 and 7: one line per subtraction, the last result < divisor."""
    lines = []
    while number >= divisor:
        lines.append(f"{number}-{divisor}={number - divisor}")
        number -= divisor
    return lines


class RemainderTask:
    """Generated (number, divisor) pairs with 1..max_steps subtractions and divisors 2..max_divisor;
    `test` is a fixed set excluded from `train`."""

    name = "remainder"
    worker_grade_fn = None  # an integer comparison: grade inline

    def __init__(self, max_steps: int = 30, max_divisor: int = 9, test_size: int = 200):
        if max_steps < 1:
            raise ValueError(f"task.options.max_steps={max_steps} must be >= 1")
        if max_divisor < MIN_DIVISOR:
            raise ValueError(f"task.options.max_divisor={max_divisor} must be >= {MIN_DIVISOR}")
        self.max_steps, self.max_divisor = max_steps, max_divisor
        self._test = self._make_test_set(test_size)

    def _draw(self, rng: random.Random) -> tuple[str, int]:
        # Log-uniform number of subtractions: as many problems with 2-4 lines as with 8-16.
        steps = min(self.max_steps, int(math.exp(rng.uniform(0.0, math.log(self.max_steps + 1)))))
        divisor = rng.randint(MIN_DIVISOR, self.max_divisor)
        number = steps * divisor + rng.randint(0, divisor - 1)
        return f"{number} mod {divisor}", number % divisor

    def _make_test_set(self, size: int) -> list[tuple[str, int]]:
        rng = random.Random(f"remainder-test:{self.max_steps}:{self.max_divisor}")
        seen: dict[str, int] = {}
        for _ in range(size * 100):  # small problems repeat; give up long before an endless loop
            expr, value = self._draw(rng)
            seen.setdefault(expr, value)
            if len(seen) >= size:
                return list(seen.items())
        raise ValueError(
            f"task.test_size={size}: only {len(seen)} distinct remainder problems were drawn; lower it or "
            "raise task.options.max_steps / task.options.max_divisor"
        )

    def _problem(self, index: int, expr: str, value: int, split: Split) -> Problem:
        number, divisor = operands(expr)
        return Problem(
            prompt_index=index,
            messages=[{"role": "user", "content": REMAINDER_PROMPT.format(number=number, divisor=divisor)}],
            answer=str(value),
            metadata={"split": split, "expr": expr, "steps": number // divisor},
        )

    def problems(self, shard_index: int, num_shards: int, seed: int, split: Split) -> Iterator[Problem]:
        return generated_problems(
            self.name, self._test, self._draw, self._problem, shard_index, num_shards, seed, split
        )

    def solution_text(self, problem: Problem) -> str:
        """The worked answer (supervised warm-up): every subtraction, then `answer: N`."""
        return "\n".join(
            [*subtraction_lines(*operands(problem.metadata["expr"])), f"answer: {problem.answer}"]
        )

    def grade(self, problem: Problem, completion_text: str) -> Grade:
        value = parse_answer(completion_text)
        if value is None:
            return "unparseable"
        return "correct" if value == int(problem.answer) else "wrong"

    def final_answer(self, completion_text: str) -> str | None:
        """The answer a completion gives (the integer after its last `answer:`), for majority votes."""
        value = parse_answer(completion_text)
        return None if value is None else str(value)


def operands(expr: str) -> tuple[int, int]:
    """(number, divisor) of a problem's `expr`, e.g. '23 mod 7' -> (23, 7)."""
    number, divisor = expr.split(" mod ")
    return int(number), int(divisor)


class RemainderOptions(BaseModel):
    """`task=remainder`'s options (task.options.*)."""

    model_config = ConfigDict(extra="forbid")

    max_steps: int = Field(default=30, ge=1, description="Most subtractions (answer lines, ~9 tokens each).")
    max_divisor: int = Field(default=9, ge=MIN_DIVISOR, description="Divisors are drawn from 2..this.")


def make_task(options: RemainderOptions, config: TaskConfig) -> RemainderTask:
    return RemainderTask(options.max_steps, options.max_divisor, config.test_size)
