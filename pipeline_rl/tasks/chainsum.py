"""`chainsum`: sums of many small numbers with written running sums, the long-answer task.

    task = ChainSumTask(min_terms=2, max_terms=20, max_operand=9)
    problem = next(task.problems(shard_index=0, num_shards=1, seed=0, split="train"))
    problem.messages[0]["content"]   # 'Sum a=3 b=7 c=1 step by step. Reply with answer: <integer>'
    task.solution_text(problem)      # 'b=7: 3+7=10\nc=1: 10+1=11\nanswer: 11'
    task.grade(problem, "...answer: 11")  # 'correct'

Real reasoning RL spends its time generating long answers whose length varies with the problem, so
requests wait on stragglers and the engine, not the trainer, is the bottleneck. The demo's answers are
a few tokens long; this task's are one line per term ("label=term: running sum + term = new running
sum"), so with the character tokenizer an answer takes ~14 tokens per term: 2-20 terms give ~20-270
tokens. The number of terms is drawn log-uniformly, so most problems are short and a tail is long, as
with real reasoning traces. Each term has a letter label: a line starts with the next letter, and the
line restates `letter=` and the term that follows the same two characters in the prompt: the plainest
copy a small model learns (match the last two tokens, copy what came next there). By position ("the
k-th term of a run of digits and pluses") the 1M-parameter demo model did not learn the lookup in 600
warm-up steps (1% of sums right), nor with the label only at the line's start (8%). One slip anywhere makes the final answer wrong, so long
problems are harder and accuracy has room to grow.

Graded on the final answer only (`answer: <integer>`, the last one counts, as in arith); the running
sums are the model's own business.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

from pipeline_rl.tasks.arith import parse_answer
from pipeline_rl.tasks.base import Grade, Problem, Split, check_shard, generated_train_stream

CHAINSUM_PROMPT = "Sum {labelled} step by step. Reply with answer: <integer>"
LABELS = "abcdefghijklmnopqrstuvwxyz"  # one per term, so at most 26 terms


def labelled_terms(terms: list[int]) -> str:
    """'a=3 b=7 c=1' for [3, 7, 1]: how the prompt lists the terms."""
    return " ".join(f"{label}={term}" for label, term in zip(LABELS, terms, strict=False))


def running_sum_lines(terms: list[int]) -> list[str]:
    """['b=7: 3+7=10', 'c=1: 10+1=11'] for [3, 7, 1]: one line per addition after the first term."""
    lines, total = [], terms[0]
    for label, term in zip(LABELS[1:], terms[1:], strict=False):
        lines.append(f"{label}={term}: {total}+{term}={total + term}")
        total += term
    return lines


class ChainSumTask:
    """Generated sums of min_terms..max_terms operands from 0..max_operand; `test` is a fixed set
    excluded from `train`."""

    name = "chainsum"
    worker_grade_fn = None  # an integer comparison: grade inline

    def __init__(self, min_terms: int = 2, max_terms: int = 20, max_operand: int = 9, test_size: int = 200):
        if not 2 <= min_terms <= max_terms <= len(LABELS):
            raise ValueError(
                f"task.chainsum_min_terms={min_terms} and task.chainsum_max_terms={max_terms}: need "
                f"2 <= min_terms <= max_terms <= {len(LABELS)} (one letter label per term)"
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
            messages=[
                {"role": "user", "content": CHAINSUM_PROMPT.format(labelled=labelled_terms(_terms(expr)))}
            ],
            answer=str(value),
            metadata={"split": split, "expr": expr, "terms": expr.count("+") + 1},
        )

    def problems(self, shard_index: int, num_shards: int, seed: int, split: Split) -> Iterator[Problem]:
        check_shard(shard_index, num_shards)
        if split == "test":
            for index in range(shard_index, len(self._test), num_shards):
                yield self._problem(index, *self._test[index], split)
            return
        stream = generated_train_stream(
            "chainsum", seed, shard_index, num_shards, self._draw, self._test_exprs
        )
        for index, expr, value in stream:
            yield self._problem(index, expr, value, split)

    def solution_text(self, problem: Problem) -> str:
        """The worked answer (supervised warm-up): every running sum, then `answer: N`."""
        return "\n".join([*running_sum_lines(_terms(problem.metadata["expr"])), f"answer: {problem.answer}"])

    def grade(self, problem: Problem, completion_text: str) -> Grade:
        value = parse_answer(completion_text)
        if value is None:
            return "unparseable"
        return "correct" if value == int(problem.answer) else "wrong"


def _terms(expr: str) -> list[int]:
    return [int(t) for t in expr.split("+")]
