"""`Grader`: grade completions (and score them with a user's reward) without stalling the caller's loop.

    grader = Grader.from_config(task, task_cfg)       # or Grader(task, timeout_s=5.0, num_workers=2)
    grade = await grader.grade_async(problem, completion_text)   # in the actor's event loop
    grade = grader.grade(problem, completion_text)               # from plain (non-async) code
    judged = await grader.judge_async(problem, text)             # Judgement: grade, and the user's score
    grader.close()                                    # or use it as a context manager

Tasks whose `worker_grade_fn` is None (arith: one integer comparison) are graded inline. The others
(math-verify, which can hang on adversarial input) run in a `TimeoutPool` of worker processes: a
call that runs past `timeout_s` has its worker killed and replaced and grades as `unparseable`,
the same grade math-verify itself gives when its parser times out, and the answer that a grader
cannot evaluate in time is treated like one it cannot read. A worker that dies mid-call (e.g. an
OOM kill on a monstrous expression) grades the same way. Both are counted in `stats()`. An exception
raised by the grading function itself is a bug and propagates.

A reward by reference (`task.reward=pkg.module:fn`, fn(problem, completion_text) -> float, async
allowed) always runs in the worker processes, with the same timeout: it is the user's code, so a
call that raises, hangs past the timeout, kills its worker or returns anything but a finite number
gives a Judgement with an `error` saying which, and the caller drops that sample (its ledger entry and
dead letter carry the reason); it never stops the caller.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline_rl.references import resolve_callable
from pipeline_rl.tasks.base import Grade, Problem, Task
from pipeline_rl.tasks.pool import CallTimeout, TimeoutPool, WorkerDied, WorkerError

if TYPE_CHECKING:
    from pipeline_rl.tasks.config import TaskConfig

logger = logging.getLogger(__name__)

TIMEOUT_GRADE: Grade = "unparseable"
"""What a grading call that times out (or kills its worker) counts as."""


@dataclass(frozen=True)
class Judgement:
    """A completion's grade by the task and, with a reward by reference, the user's score (or why not)."""

    grade: Grade
    score: float | None = None  # the user reward's value; None without one, or when it failed
    error: str | None = None  # why the user reward gave no usable value: the sample is dropped


def call_reward(reference: str, problem: Problem, text: str) -> object:
    """Run in a grading worker: the user's reward on one completion (awaited when it is async)."""
    fn = resolve_callable(reference, "task.reward")
    value = fn(problem, text)
    if inspect.isawaitable(value):
        value = asyncio.run(_awaited(value))
    return value


async def _awaited(value):
    return await value


def reward_value(value: object) -> tuple[float | None, str | None]:
    """(score, None) for a finite number, else (None, what was wrong with it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, f"returned {type(value).__name__} {str(value)[:80]!r}, not a float"
    if not math.isfinite(value):
        return None, f"returned {value}, not a finite number"
    return float(value), None


class Grader:
    """Grades `(problem, completion_text)` for one task, inline or in a timeout-guarded process pool."""

    def __init__(
        self,
        task: Task,
        timeout_s: float = 5.0,
        num_workers: int = 2,
        grade_fn: Callable[[Problem, str], Grade] | None = None,
        reward: str | None = None,
    ):
        """`grade_fn` overrides `task.worker_grade_fn` (must be module-level: it is pickled); tests use it.
        `reward` is a `pkg.module:fn` reference scoring every completion (judge_async)."""
        self.task = task
        self.timeout_s = timeout_s
        self.reward = reward
        self._fn = grade_fn or task.worker_grade_fn
        self._pool: TimeoutPool | None = None
        self.reward_failures = 0
        if self._fn is not None or reward is not None:
            preload = tuple(
                m for m in (self._fn and self._fn.__module__, reward and reward.split(":")[0]) if m
            )
            self._pool = TimeoutPool(num_workers, preload=preload, name=f"grader-{task.name}")

    @classmethod
    def from_config(cls, task: Task, cfg: TaskConfig) -> Grader:
        return cls(task, timeout_s=cfg.grade_timeout_s, num_workers=cfg.grade_workers, reward=cfg.reward)

    def _submit(self, problem: Problem, text: str) -> Future:
        assert self._pool is not None and self._fn is not None
        return self._pool.submit(self._fn, problem, text, timeout_s=self.timeout_s)

    def _timed_out(self, exc: CallTimeout | WorkerDied, problem: Problem) -> Grade:
        logger.warning(
            "grading prompt %d of %s: %s -> %s", problem.prompt_index, self.task.name, exc, TIMEOUT_GRADE
        )
        return TIMEOUT_GRADE

    def grade(self, problem: Problem, completion_text: str) -> Grade:
        """Blocking variant (waits up to the timeout); never call it on an event loop thread."""
        if self._fn is None:
            return self.task.grade(problem, completion_text)
        try:
            return self._submit(problem, completion_text).result()
        except (CallTimeout, WorkerDied) as exc:
            return self._timed_out(exc, problem)

    async def grade_async(self, problem: Problem, completion_text: str) -> Grade:
        """Grade without blocking the running event loop (the work happens in a worker process)."""
        if self._fn is None:
            return self.task.grade(problem, completion_text)
        try:
            return await asyncio.wrap_future(self._submit(problem, completion_text))
        except (CallTimeout, WorkerDied) as exc:
            return self._timed_out(exc, problem)

    async def score_async(self, problem: Problem, completion_text: str) -> tuple[float | None, str | None]:
        """The user reward's value of one completion, or (None, why it has none): raised, timed out,
        killed its worker, or returned no finite number."""
        assert self._pool is not None and self.reward is not None
        future = self._pool.submit(
            call_reward, self.reward, problem, completion_text, timeout_s=self.timeout_s
        )
        try:
            score, error = reward_value(await asyncio.wrap_future(future))
        except CallTimeout:
            score, error = None, f"ran past task.grade_timeout_s={self.timeout_s:g} s"
        except WorkerDied as exc:
            score, error = None, f"its worker died ({exc})"
        except WorkerError as exc:
            last = str(exc).strip().splitlines()[-1:] or ["?"]
            score, error = None, f"raised {last[0][:200]}"
        if error is not None:
            self.reward_failures += 1
            error = f"task.reward={self.reward} {error}"
            logger.warning("prompt %d: %s: the sample is dropped", problem.prompt_index, error)
        return score, error

    async def judge_async(self, problem: Problem, completion_text: str) -> Judgement:
        """The task's grade and, with a reward by reference, the user's score of one completion."""
        if self.reward is None:
            return Judgement(await self.grade_async(problem, completion_text))
        grade, (score, error) = await asyncio.gather(
            self.grade_async(problem, completion_text), self.score_async(problem, completion_text)
        )
        return Judgement(grade, score, error)

    def stats(self) -> dict[str, int]:
        """Counters for logging: grading calls that timed out, workers that died during a call, failed rewards."""
        if self._pool is None:
            return {"grade_timeouts": 0, "grade_worker_deaths": 0, "reward_failures": 0}
        return {
            "grade_timeouts": self._pool.timeouts,
            "grade_worker_deaths": self._pool.deaths,
            "reward_failures": self.reward_failures,
        }

    def worker_pids(self) -> list[int | None]:
        """Process ids of the grading workers (empty when grading inline)."""
        return self._pool.worker_pids() if self._pool else []

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> Grader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
