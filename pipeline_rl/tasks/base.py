"""The task interface every prompt source implements: `Problem`, `Grade` and the `Task` protocol.

An actor asks its task for its own shard of problems and grades completions with it:

    for problem in task.problems(shard_index=actor_id, num_shards=num_actors, seed=seed, split="train"):
        ...  # send problem.messages to /v1/chat/completions
        grade = await grader.grade_async(problem, completion_text)   # see grader.py

There is no central dataloader: each actor iterates its own disjoint shard, deterministically from the
seed. Grading goes through `Grader`, which runs slow graders in worker processes with a timeout.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from itertools import count
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

Grade = Literal["correct", "wrong", "unparseable"]
"""`unparseable`: the completion has no answer in the required format (or grading it timed out)."""

Split = Literal["train", "test"]


class Problem(BaseModel):
    """One prompt with its reference answer."""

    prompt_index: int = Field(
        description="Unique within a (task, split) over the whole run: the actor builds group ids from it."
    )
    messages: list[dict[str, str]] = Field(description="Chat messages ({'role', 'content'}) for the server.")
    answer: str = Field(description="Reference answer, as text.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Task-specific extras (row, split).")


class Task(Protocol):
    """A prompt source and its grader.

    `worker_grade_fn` is a module-level (so picklable) `(problem, completion_text) -> Grade` that
    `Grader` runs in a worker process under a timeout, or None when `grade` is cheap and safe to run
    inline on the caller's thread.
    """

    name: str
    worker_grade_fn: Callable[[Problem, str], Grade] | None

    def problems(self, shard_index: int, num_shards: int, seed: int, split: Split) -> Iterator[Problem]:
        """This shard's problems: `train` may be endless, `test` is a fixed set disjoint from `train`."""
        ...

    def grade(self, problem: Problem, completion_text: str) -> Grade:
        """Grade synchronously, with no timeout (use `Grader` for untrusted completions)."""
        ...


def held_out_problems(task: Task, count: int) -> list[Problem]:
    """The held-out set every evaluator grades: the first `count` problems of the test split at seed 0
    (the same for every run and every evaluator: the launcher's live one, the benchmarks' greedy one)."""
    out: list[Problem] = []
    for problem in task.problems(shard_index=0, num_shards=1, seed=0, split="test"):
        out.append(problem)
        if len(out) >= count:
            break
    return out


def check_shard(shard_index: int, num_shards: int) -> None:
    """Raise a clear error for an impossible shard, before any iteration starts."""
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index must be in [0, num_shards); got {shard_index=} {num_shards=}")


def generated_problems(
    key: str,
    test: list[tuple[str, int]],
    draw: Callable[[random.Random], tuple[str, int]],
    make_problem: Callable[[int, str, int, Split], Problem],
    shard_index: int,
    num_shards: int,
    seed: int,
    split: Split,
) -> Iterator[Problem]:
    """One shard of a generated task's split: `test` (the fixed held-out (expression, value) list) dealt
    round-robin over shards, or the endless train stream.

    Train problem g is drawn from its own RNG (seeded `key:seed:g`), so the union over shards does not
    depend on num_shards and shard s owns exactly the indices g = s (mod num_shards); a draw that is a
    test expression is drawn again.
    """
    check_shard(shard_index, num_shards)
    if split == "test":
        for index in range(shard_index, len(test), num_shards):
            yield make_problem(index, *test[index], split)
        return
    excluded = {expr for expr, _ in test}
    for k in count():
        index = k * num_shards + shard_index
        rng = random.Random(f"{key}:{seed}:{index}")
        expr, value = draw(rng)
        while expr in excluded:
            expr, value = draw(rng)
        yield make_problem(index, expr, value, split)
