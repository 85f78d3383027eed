"""A task written as a user would, outside the library: prompts 'Count to N', graded by whether the
completion ends with N. Built by support.rewards:count_task (task.name=support.rewards:count_task)."""

from __future__ import annotations

import re

from pipeline_rl.tasks import Problem


class CountTask:
    name = "count"
    worker_grade_fn = None

    def __init__(self, up_to: int, test_size: int) -> None:
        self.up_to, self.test_size = up_to, min(test_size, up_to)

    def problems(self, shard_index: int, num_shards: int, seed: int, split: str):
        numbers = range(1, self.test_size + 1) if split == "test" else range(1, self.up_to + 1)
        for index, n in enumerate(numbers):
            if index % num_shards == shard_index:
                yield Problem(
                    prompt_index=index,
                    messages=[{"role": "user", "content": f"Count to {n}."}],
                    answer=str(n),
                    metadata={"split": split},
                )

    def grade(self, problem: Problem, completion_text: str) -> str:
        numbers = re.findall(r"\d+", completion_text)
        if not numbers:
            return "unparseable"
        return "correct" if numbers[-1] == problem.answer else "wrong"
