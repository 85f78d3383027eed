"""`chainsum`: sums of many small numbers with written running sums, the long-answer task.

    task = ChainSumTask(min_terms=2, max_terms=30, max_operand=9)
    problem = next(task.problems(shard_index=0, num_shards=1, seed=0, split="train"))
    problem.messages[0]["content"]   # 'Sum 3+7+1 step by step. Reply with answer: <integer>'
    task.solution_text(problem)      # '3+7=10\n10+1=11\nanswer: 11'
    task.grade(problem, "...answer: 11")  # 'correct'

Real reasoning RL spends its time generating long answers whose length varies with the problem, so
requests wait on stragglers and the engine, not the trainer, is the bottleneck. The demo's answers are
a few tokens long; this task's are one line per term ("running sum + next term = new running sum"), so
with the character tokenizer an answer takes ~10 tokens per term: 2-30 terms give ~18-280 tokens. The
number of terms is drawn log-uniformly, so most problems are short and a tail is long, as with real
reasoning traces. Each line is one small addition a tiny model can learn; one slip anywhere makes the
final answer wrong, so long problems are harder and accuracy has room to grow.

Graded on the final answer only (`answer: <integer>`, the last one counts, as in arith); the running
sums are the model's own business.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from itertools import count

from pipeline_rl.tasks.arith import parse_answer
from pipeline_rl.tasks.base import Grade, Problem, Split, check_shard

CHAINSUM_PROMPT = "Sum {expr} step by step. Reply with answer: <integer>"


def running_sum_lines(terms: list[int]) -> list[str]:
    """['3+7=10', '10+1=11'] for [3, 7, 1]: one line per addition after the first term."""
    lines, total = [], terms[0]
    for term in terms[1:]:
        lines.append(f"{total}+{term}={total + term}")
        total += term
    return lines


class ChainSumTask:
    """Generated sums of min_terms..max_terms operands from 0..max_operand; `test` is a fixed set
    excluded from `train`."""

    name = "chainsum"
    worker_grade_fn = None  # an integer comparison: grade inline

    def __init__(self, min_terms: int = 2, max_terms: int = 30, max_operand: int = 9, test_size: int = 200):
        if not 2 <= min_terms <= max_terms:
            raise ValueError(
                f"task.chainsum_min_terms={min_terms} and task.chainsum_max_terms={max_terms}: need "
                "2 <= min_terms <= max_terms"
            )
        if max_operand < 1:
            raise ValueError(f"task.chainsum_max_operand={max_operand} must be >= 1")
        self.min_terms, self.max_terms, self.max_operand = min_terms, max_terms, max_operand
        self._test = self._make_test_set(test_size)
        self._test_exprs = {expr for expr, _ in self._test}

    def _draw(self, rng: random.Random) -> tuple[str, int]:
        # Log-uniform number of terms: as many problems with 2-4 terms as with 8-16.
        low, high = math.log(self.min_terms), math.log(self.max_terms + 1)
        n = min(self.max_terms, int(math.exp(rng.uniform(low, high))))
        terms = [rng.randint(0, self.max_operand) for _ in range(n)]
        return "+".join(map(str, terms)), sum(terms)

    def _make_test_set(self, size: int) -> list[tuple[str, int]]:
        rng = random.Random(f"chainsum-test:{self.min_terms}:{self.max_terms}:{self.max_operand}")
        seen: dict[str, int] = {}
        for _ in range(size * 100):  # short sums repeat; give up long before an endless loop
            expr, value = self._draw(rng)
            seen.setdefault(expr, value)
            if len(seen) >= size:
                return list(seen.items())
        raise ValueError(
            f"task.test_size={size}: only {len(seen)} distinct chainsum problems were drawn; lower it or "
            "raise task.chainsum_max_terms / task.chainsum_max_operand"
        )

    def _problem(self, index: int, expr: str, value: int, split: Split) -> Problem:
        return Problem(
            prompt_index=index,
            messages=[{"role": "user", "content": CHAINSUM_PROMPT.format(expr=expr)}],
            answer=str(value),
            metadata={"split": split, "expr": expr, "terms": expr.count("+") + 1},
        )

    def problems(self, shard_index: int, num_shards: int, seed: int, split: Split) -> Iterator[Problem]:
        check_shard(shard_index, num_shards)
        if split == "test":
            for index in range(shard_index, len(self._test), num_shards):
                yield self._problem(index, *self._test[index], split)
            return
        # As in arith: problem g has its own RNG, so shards partition one stream whatever their number.
        for k in count():
            index = k * num_shards + shard_index
            rng = random.Random(f"chainsum:{seed}:{index}")
            expr, value = self._draw(rng)
            while expr in self._test_exprs:
                expr, value = self._draw(rng)
            yield self._problem(index, expr, value, split)

    def solution_text(self, problem: Problem) -> str:
        """The worked answer (supervised warm-up): every running sum, then `answer: N`."""
        terms = [int(t) for t in problem.metadata["expr"].split("+")]
        return "\n".join([*running_sum_lines(terms), f"answer: {problem.answer}"])

    def grade(self, problem: Problem, completion_text: str) -> Grade:
        value = parse_answer(completion_text)
        if value is None:
            return "unparseable"
        return "correct" if value == int(problem.answer) else "wrong"
