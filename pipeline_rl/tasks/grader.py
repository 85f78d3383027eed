"""`Grader`: grade completions without ever stalling the caller's event loop.

    grader = Grader.from_config(task, task_cfg)       # or Grader(task, timeout_s=5.0, num_workers=2)
    grade = await grader.grade_async(problem, completion_text)   # in the actor's event loop
    grade = grader.grade(problem, completion_text)               # from plain (non-async) code
    grader.close()                                    # or use it as a context manager

Tasks whose `worker_grade_fn` is None (arith: one integer comparison) are graded inline. The others
(math-verify, which can hang on adversarial input) run in a `TimeoutPool` of worker processes: a
call that runs past `timeout_s` has its worker killed and replaced and grades as `unparseable`,
the same grade math-verify itself gives when its parser times out, and the answer that a grader
cannot evaluate in time is treated like one it cannot read. A worker that dies mid-call (e.g. an
OOM kill on a monstrous expression) grades the same way. Both are counted in `stats()`. An exception
raised by the grading function itself is a bug and propagates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from pipeline_rl.tasks.base import Grade, Problem, Task
from pipeline_rl.tasks.pool import CallTimeout, TimeoutPool, WorkerDied

if TYPE_CHECKING:
    from pipeline_rl.tasks.config import TaskConfig

logger = logging.getLogger(__name__)

TIMEOUT_GRADE: Grade = "unparseable"
"""What a grading call that times out (or kills its worker) counts as."""


class Grader:
    """Grades `(problem, completion_text)` for one task, inline or in a timeout-guarded process pool."""

    def __init__(
        self,
        task: Task,
        timeout_s: float = 5.0,
        num_workers: int = 2,
        grade_fn: Callable[[Problem, str], Grade] | None = None,
    ):
        """`grade_fn` overrides `task.worker_grade_fn` (must be module-level: it is pickled); tests use it."""
        self.task = task
        self.timeout_s = timeout_s
        self._fn = grade_fn or task.worker_grade_fn
        self._pool: TimeoutPool | None = None
        if self._fn is not None:
            self._pool = TimeoutPool(num_workers, preload=(self._fn.__module__,), name=f"grader-{task.name}")

    @classmethod
    def from_config(cls, task: Task, cfg: TaskConfig) -> Grader:
        return cls(task, timeout_s=cfg.grade_timeout_s, num_workers=cfg.grade_workers)

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
        if self._pool is None:
            return self.task.grade(problem, completion_text)
        try:
            return self._submit(problem, completion_text).result()
        except (CallTimeout, WorkerDied) as exc:
            return self._timed_out(exc, problem)

    async def grade_async(self, problem: Problem, completion_text: str) -> Grade:
        """Grade without blocking the running event loop (the work happens in a worker process)."""
        if self._pool is None:
            return self.task.grade(problem, completion_text)
        try:
            return await asyncio.wrap_future(self._submit(problem, completion_text))
        except (CallTimeout, WorkerDied) as exc:
            return self._timed_out(exc, problem)

    def stats(self) -> dict[str, int]:
        """Counters for logging: grading calls that timed out, workers that died during a call."""
        if self._pool is None:
            return {"grade_timeouts": 0, "grade_worker_deaths": 0}
        return {"grade_timeouts": self._pool.timeouts, "grade_worker_deaths": self._pool.deaths}

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
