"""`arith`: generated integer arithmetic, the CPU demo task a tiny model trained from scratch can learn.

    task = ArithTask(num_operands=2, max_operand=99, operators="+-")
    problem = next(task.problems(shard_index=0, num_shards=1, seed=0, split="train"))
    problem.messages[0]["content"]   # 'What is 12+7? Reply with answer: <integer>'
    arith_solution_text(problem)     # 'answer: 19'
    task.grade(problem, "answer: 19")  # 'correct'

Format (kept short for a ~128-token, character-level context): the user message is
`What is <expr>? Reply with answer: <integer>`, where <expr> is operands and operators with no spaces
and the usual precedence (* before + and -). The completion must contain `answer: <integer>`
(lowercase, optional spaces after the colon, optional leading '-'); the last such match counts, text
around it is ignored. No match, or a number followed by a decimal part, is `unparseable`.

Every character a prompt or a solution can contain is in `ARITH_ALPHABET` (the chat template adds
role names and newlines on top; those are the tokenizer's concern).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from pipeline_rl.tasks.base import Grade, Problem, Split, generated_problems

if TYPE_CHECKING:
    from pipeline_rl.tasks.config import TaskConfig

ARITH_OPERATORS = "+-*"
ARITH_PROMPT = "What is {expr}? Reply with answer: <integer>"
ARITH_ALPHABET = " *+-0123456789:<>?RWaeghilnprstwy"
"""Every character an arith prompt (message content) or `arith_solution_text` can contain."""

# `answer:` then an integer; a decimal part ('5.5') makes it unparseable, a sentence-ending '.' does not.
_ANSWER_RE = re.compile(r"answer:\s*(-?\d+)(?!\.?\d)")


def evaluate(operands: list[int], operators: list[str]) -> int:
    """Value of `operands[0] op0 operands[1] op1 ...` with * binding tighter than + and -."""
    terms = [operands[0]]  # products, each later added with its sign
    signs = [1]
    for op, value in zip(operators, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value)
            signs.append(1 if op == "+" else -1)
    return sum(sign * term for sign, term in zip(signs, terms, strict=True))


def problem_space_size(num_operands: int, max_operand: int, operators: str) -> int:
    """How many distinct expressions a difficulty setting can generate."""
    return (max_operand + 1) ** num_operands * len(operators) ** (num_operands - 1)


def check_difficulty(num_operands: int, max_operand: int, operators: str, test_size: int) -> None:
    """Raise ValueError, naming the config fields to change, for an impossible setting."""
    if num_operands < 2 or max_operand < 1:
        raise ValueError(
            f"task.options.num_operands={num_operands} must be >= 2 and task.options.max_operand={max_operand} >= 1"
        )
    if not operators or set(operators) - set(ARITH_OPERATORS) or len(set(operators)) != len(operators):
        raise ValueError(
            f"task.options.operators={operators!r}: use distinct characters from {ARITH_OPERATORS!r}"
        )
    space = problem_space_size(num_operands, max_operand, operators)
    if 2 * test_size > space:  # the test set must leave most problems to train on
        raise ValueError(
            f"task.test_size={test_size} is more than half of the {space} distinct arith problems: "
            "lower task.test_size or raise task.options.num_operands / task.options.max_operand"
        )


def parse_answer(completion_text: str) -> int | None:
    """The integer after the last `answer:` in the text, or None if there is none."""
    matches = _ANSWER_RE.findall(completion_text)
    return int(matches[-1]) if matches else None


def arith_solution_text(problem: Problem) -> str:
    """The canonical completion (for supervised warm-up): exactly the required answer format."""
    return f"answer: {problem.answer}"


class ArithTask:
    """Generated arithmetic problems; `train` is endless, `test` is a fixed set excluded from `train`."""

    name = "arith"
    worker_grade_fn = None  # an integer comparison: grade inline

    def __init__(
        self, num_operands: int = 2, max_operand: int = 99, operators: str = "+-", test_size: int = 200
    ):
        check_difficulty(num_operands, max_operand, operators, test_size)
        self.num_operands = num_operands
        self.max_operand = max_operand
        self.operators = operators
        # The test set depends on the difficulty only, never on the run seed, so evaluations of
        # different runs are comparable; train draws skip these expressions.
        self._test = self._make_test_set(test_size)

    def _draw(self, rng: random.Random) -> tuple[str, int]:
        operands = [rng.randint(0, self.max_operand) for _ in range(self.num_operands)]
        ops = [rng.choice(self.operators) for _ in range(self.num_operands - 1)]
        expr = str(operands[0]) + "".join(op + str(v) for op, v in zip(ops, operands[1:], strict=True))
        return expr, evaluate(operands, ops)

    def _make_test_set(self, size: int) -> list[tuple[str, int]]:
        rng = random.Random(f"arith-test:{self.num_operands}:{self.max_operand}:{self.operators}")
        seen: dict[str, int] = {}
        while len(seen) < size:  # terminates: size <= half the space, checked above
            expr, value = self._draw(rng)
            seen.setdefault(expr, value)
        return list(seen.items())

    def _problem(self, index: int, expr: str, value: int, split: Split) -> Problem:
        return Problem(
            prompt_index=index,
            messages=[{"role": "user", "content": ARITH_PROMPT.format(expr=expr)}],
            answer=str(value),
            metadata={"split": split, "expr": expr},
        )

    def problems(self, shard_index: int, num_shards: int, seed: int, split: Split) -> Iterator[Problem]:
        return generated_problems(
            "arith", self._test, self._draw, self._problem, shard_index, num_shards, seed, split
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


class ArithOptions(BaseModel):
    """`task=arith`'s options (task.options.*)."""

    model_config = ConfigDict(extra="forbid")

    num_operands: int = Field(default=2, ge=2, le=8, description="Operands per expression.")
    max_operand: int = Field(default=99, ge=1, description="Operands are drawn from 0..this.")
    operators: str = Field(default="+-", description="Operators to draw from, a subset of '+-*'.")


def make_task(options: ArithOptions, config: TaskConfig) -> ArithTask:
    return ArithTask(options.num_operands, options.max_operand, options.operators, config.test_size)
