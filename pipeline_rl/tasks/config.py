"""`TaskConfig` (validated at startup) and `make_task`, which builds the task it names.

    cfg = TaskConfig(name="arith", arith_num_operands=3, arith_operators="+-*")
    task = make_task(cfg)
    grader = Grader.from_config(task, cfg)

gsm8k and math load their data in `make_task`, so a missing dataset fails at startup with a message
naming `dataset_path`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline_rl.tasks.arith import ArithTask, check_difficulty
from pipeline_rl.tasks.base import Task


class TaskConfig(BaseModel):
    """Which task to train on, its difficulty or data, and how its grading is run."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["arith", "remainder", "calc", "gsm8k", "math"] = Field(
        default="arith",
        description="Task to train and evaluate on (remainder: long written answers; calc: multi-turn, "
        "with a tool).",
    )
    arith_num_operands: int = Field(default=2, ge=2, le=8, description="arith: operands per expression.")
    arith_max_operand: int = Field(default=99, ge=1, description="arith: operands are drawn from 0..this.")
    arith_operators: str = Field(
        default="+-", description="arith: operators to draw from, a subset of '+-*'."
    )
    remainder_max_steps: int = Field(
        default=30,
        ge=1,
        description="remainder: most subtractions (answer lines, ~9 tokens each) of a problem.",
    )
    remainder_max_divisor: int = Field(
        default=9, ge=2, description="remainder: divisors are drawn from 2..this."
    )
    calc_max_operand: int = Field(default=999, ge=10, description="calc: factors are drawn from 0..this.")
    episode_max_turns: int = Field(default=3, ge=1, description="Multi-turn tasks: model turns per episode.")
    episode_token_budget: int = Field(
        default=160, ge=8, description="Multi-turn tasks: model + environment tokens after the prompt."
    )
    tool_timeout_s: float = Field(
        default=5.0, gt=0, description="Multi-turn tasks: deadline of one tool call."
    )
    test_size: int = Field(
        default=200, ge=1, description="Held-out test problems (arith; gsm8k/math data without a test split)."
    )
    dataset_path: str | None = Field(
        default=None,
        description="gsm8k/math: JSON/JSONL/parquet file or save_to_disk directory; None = local HF cache only.",
    )
    grade_timeout_s: float = Field(
        default=5.0, gt=0, description="Per-answer grading limit; past it the answer grades 'unparseable'."
    )
    grade_workers: int = Field(default=2, ge=1, description="Grading worker processes (gsm8k/math).")

    @model_validator(mode="after")
    def _check_arith(self) -> TaskConfig:
        if self.name == "arith":
            check_difficulty(
                self.arith_num_operands, self.arith_max_operand, self.arith_operators, self.test_size
            )
        return self


def make_task(cfg: TaskConfig) -> Task:
    """Build the configured task (loading gsm8k/math data from local files)."""
    if cfg.name == "arith":
        return ArithTask(cfg.arith_num_operands, cfg.arith_max_operand, cfg.arith_operators, cfg.test_size)
    if cfg.name == "remainder":
        from pipeline_rl.tasks.remainder import RemainderTask

        return RemainderTask(cfg.remainder_max_steps, cfg.remainder_max_divisor, cfg.test_size)
    if cfg.name == "calc":
        from pipeline_rl.tasks.calc import CalcTask

        return CalcTask(cfg.calc_max_operand, cfg.test_size, cfg.tool_timeout_s)
    # Imported here: math-verify and datasets are slow to import and arith needs neither.
    from pipeline_rl.tasks.math_tasks import Gsm8kTask, MathTask

    task_cls = Gsm8kTask if cfg.name == "gsm8k" else MathTask
    return task_cls(dataset_path=cfg.dataset_path, test_size=cfg.test_size)
