"""`gsm8k` and `math`: word / competition problems from local data, graded with math-verify.

    task = Gsm8kTask(dataset_path="/data/gsm8k")        # or MathTask(dataset_path=...); see data.py
    with Grader(task, timeout_s=5.0) as grader:       # grader.py: math-verify runs in worker processes
        for problem in task.problems(shard_index=0, num_shards=2, seed=0, split="train"):
            ...

Rows: gsm8k needs `question` and `answer` (the reference is the text after `####`, commas removed);
math needs `problem` and either `answer` or `solution` (the reference is the solution's last
`\\boxed{}`). Rows without a usable reference are skipped. The prompt asks for the final answer in
`\\boxed{}`; see math_grading.py for how it is graded.

Splits: the data's own `test` split when it has one; otherwise `test_size` rows of the train data,
chosen by a fixed seed (independent of the run seed), are held out as the test split. `train`
iterates forever, reshuffled per epoch; `test` is one pass in row order. A shard owns the rows with
`row % num_shards == shard_index`. `prompt_index` is `epoch * len(split) + row`, unique over a run.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from itertools import count
from typing import Any

from pipeline_rl.tasks.base import Grade, Problem, Split, check_shard
from pipeline_rl.tasks.data import load_local_splits
from pipeline_rl.tasks.math_grading import grade_boxed_problem, last_boxed

logger = logging.getLogger(__name__)

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_HOLDOUT_SEED = 20240601  # fixed: the held-out test rows must not move with the run seed


class _BoxedAnswerTask:
    """Shared loading, sharding and grading; subclasses say how a row becomes (question, answer)."""

    name: str
    hub_repo: str
    worker_grade_fn = staticmethod(grade_boxed_problem)

    def __init__(self, dataset_path: str | None = None, test_size: int = 500):
        raw = load_local_splits(dataset_path, self.hub_repo, self.name)
        train = self._examples(raw["train"])
        if "test" in raw:
            test = self._examples(raw["test"])
        else:
            if test_size >= len(train):
                raise ValueError(
                    f"{self.name}: test_size={test_size} leaves no train rows out of {len(train)}: "
                    "lower task.test_size or provide data with a test split"
                )
            held = set(random.Random(_HOLDOUT_SEED).sample(range(len(train)), test_size))
            test = [ex for i, ex in enumerate(train) if i in held]
            train = [ex for i, ex in enumerate(train) if i not in held]
        self._splits: dict[str, list[tuple[str, str, dict[str, Any]]]] = {"train": train, "test": test}

    def _example(self, row: dict[str, Any]) -> tuple[str, str, dict[str, Any]] | None:
        """(question, reference answer, metadata) of a row, or None when it has no usable answer."""
        raise NotImplementedError

    def _examples(self, rows: list[dict[str, Any]]) -> list[tuple[str, str, dict[str, Any]]]:
        examples = [ex for row in rows if (ex := self._example(row)) is not None]
        if len(examples) < len(rows):
            logger.warning(
                "%s: skipped %d rows without a usable answer", self.name, len(rows) - len(examples)
            )
        return examples

    def num_problems(self, split: Split) -> int:
        return len(self._splits[split])

    def _problem(self, index: int, row: int, split: Split, epoch: int) -> Problem:
        question, answer, metadata = self._splits[split][row]
        return Problem(
            prompt_index=index,
            messages=[{"role": "user", "content": f"{question}\n\n{BOXED_INSTRUCTION}"}],
            answer=answer,
            metadata={**metadata, "split": split, "row": row, "epoch": epoch},
        )

    def problems(self, shard_index: int, num_shards: int, seed: int, split: Split) -> Iterator[Problem]:
        check_shard(shard_index, num_shards)
        size = len(self._splits[split])
        rows = list(range(shard_index, size, num_shards))
        if not rows:
            raise ValueError(
                f"{self.name} {split}: shard {shard_index} of {num_shards} is empty ({size} rows)"
            )
        if split == "test":
            for row in rows:
                yield self._problem(row, row, split, epoch=0)
            return
        for epoch in count():
            order = rows[:]
            random.Random(f"{self.name}:{seed}:{shard_index}:{epoch}").shuffle(order)
            for row in order:
                yield self._problem(epoch * size + row, row, split, epoch)

    def grade(self, problem: Problem, completion_text: str) -> Grade:
        return grade_boxed_problem(problem, completion_text)


class Gsm8kTask(_BoxedAnswerTask):
    name = "gsm8k"
    hub_repo = "openai/gsm8k"

    def _example(self, row: dict[str, Any]) -> tuple[str, str, dict[str, Any]] | None:
        answer = str(row.get("answer", ""))
        # The reference solution ends with '#### <number>'; a bare answer column is used as is.
        final = answer.rsplit("####", 1)[-1].strip().replace(",", "")
        return (row["question"], final, {}) if final else None


class MathTask(_BoxedAnswerTask):
    name = "math"
    hub_repo = "DigitalLearningGmbH/MATH-lighteval"

    def _example(self, row: dict[str, Any]) -> tuple[str, str, dict[str, Any]] | None:
        answer = row.get("answer") or last_boxed(str(row.get("solution", "")))
        metadata = {key: row[key] for key in ("level", "type", "subject") if key in row}
        return (row["problem"], str(answer).strip(), metadata) if answer else None
