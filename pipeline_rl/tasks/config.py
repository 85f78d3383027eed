"""`TaskConfig` (validated at startup) and `make_task`, which builds the task it names.

    cfg = TaskConfig(name="arith", options={"num_operands": 3, "operators": "+-*"})
    cfg = TaskConfig(name="dataset", dataset_path="/data/qa.jsonl", options={"prompt_field": "q"})
    cfg = TaskConfig(name="my_pkg.tasks:make_task", options={...})    # a task of the user's own
    cfg = TaskConfig(name="gsm8k", dataset_path="/data/gsm8k.jsonl", reward="my_pkg.rewards:score")
    task = make_task(cfg)

A task is built by a factory `make_task(options, config) -> Task`: `options` is an instance of the
factory's own pydantic model (the annotation of its first parameter), validated from `task.options` at
startup, so each task's options are checked by the task itself; `config` is this TaskConfig (test
size, data path, episode limits). The built-in tasks are factories like any other (BUILTIN_TASKS). A
factory without parameters takes no options. `task.reward`, when set, names a function
`(problem, completion_text) -> float` (async allowed) that scores every completion instead of the
grade table (pipeline_rl/tasks/grader.py runs it in worker processes with a timeout).

Dataset tasks load their data in `make_task`, so missing data or wrong field names fail at startup.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline_rl.references import is_reference, resolve_callable
from pipeline_rl.tasks.base import Task

BUILTIN_TASKS = {
    "arith": "pipeline_rl.tasks.arith:make_task",
    "remainder": "pipeline_rl.tasks.remainder:make_task",
    "longtail": "pipeline_rl.tasks.longtail:make_task",
    "calc": "pipeline_rl.tasks.calc:make_task",
    "gsm8k": "pipeline_rl.tasks.dataset:make_gsm8k",
    "math": "pipeline_rl.tasks.dataset:make_math",
    "dataset": "pipeline_rl.tasks.dataset:make_task",
}
# Per-task fields that became the task's own options: the old name is refused, naming the new one.
RENAMED = {
    "arith_num_operands": "options.num_operands",
    "arith_max_operand": "options.max_operand",
    "arith_operators": "options.operators",
    "remainder_max_steps": "options.max_steps",
    "remainder_max_divisor": "options.max_divisor",
    "calc_max_operand": "options.max_operand",
}


class TaskConfig(BaseModel):
    """Which task to train on, its options and data, its reward, and how grading is run."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        default="arith",
        description="A built-in task (arith, remainder, longtail, calc, gsm8k, math, dataset) or a reference "
        "pkg.module:function to a task factory of your own (docs/tasks.md, 'Bring your own task').",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="The task's own options, validated by its factory's options model."
    )
    reward: str | None = Field(
        default=None,
        description="pkg.module:function(problem, completion_text) -> float scoring every completion "
        "(async allowed), instead of the grade table (reward.correct/wrong/unparseable).",
    )
    episode_max_turns: int = Field(default=3, ge=1, description="Multi-turn tasks: model turns per episode.")
    episode_token_budget: int = Field(
        default=160, ge=8, description="Multi-turn tasks: model + environment tokens after the prompt."
    )
    tool_timeout_s: float = Field(
        default=5.0, gt=0, description="Multi-turn tasks: deadline of one tool call."
    )
    tool_network: Literal["isolated", "allowed"] = Field(
        default="isolated",
        description="Multi-turn tasks: isolated runs each tool call in an empty network namespace and "
        "stops the run at start where the machine cannot give one; allowed shares the host's network.",
    )
    test_size: int = Field(
        default=200, ge=1, description="Held-out test problems (generated tasks; data without a test split)."
    )
    dataset_path: str | None = Field(
        default=None,
        description="Dataset tasks: JSON/JSONL/parquet file, save_to_disk or Hub-layout directory; None = "
        "the local HF cache only.",
    )
    grade_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="Per-answer grading (or reward) limit; past it the answer grades 'unparseable'.",
    )
    grade_workers: int = Field(
        default=2, ge=1, description="Grading worker processes (slow graders, rewards)."
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            old = sorted(set(data) & set(RENAMED))
            if old:
                raise ValueError(
                    "; ".join(f"task.{key} is now task.{RENAMED[key]}" for key in old)
                    + " (each task validates its own options)"
                )
        return data

    @model_validator(mode="after")
    def _check(self) -> TaskConfig:
        factory = task_factory(self.name)
        model = options_model(factory)
        if model is None:
            if self.options:
                raise ValueError(f"task {self.name!r} takes no options; got {sorted(self.options)}")
        else:
            try:  # normalized: every option the task will see, defaults included
                self.options = model.model_validate(self.options).model_dump()
            except ValidationError as e:
                problems = "; ".join(
                    f"task.options.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()
                )
                raise ValueError(
                    f"task {self.name!r}: {problems} (its options: {', '.join(model.model_fields)})"
                ) from None
        if self.reward is not None:
            resolve_callable(self.reward, "task.reward")
        return self


def task_factory(name: str) -> Callable[..., Task]:
    """The factory a task name stands for: a built-in's, or the user's `pkg.module:function`."""
    if name in BUILTIN_TASKS:
        return resolve_callable(BUILTIN_TASKS[name], "task.name")
    if not is_reference(name):
        raise ValueError(
            f"task.name={name!r} is neither a built-in task ({', '.join(BUILTIN_TASKS)}) nor a reference "
            "pkg.module:function to a task factory of your own"
        )
    return resolve_callable(name, "task.name")


def options_model(factory: Callable) -> type[BaseModel] | None:
    """The pydantic model of a factory's options: the annotation of its first parameter (None: no options)."""
    parameters = list(inspect.signature(factory).parameters.values())
    if not parameters:
        return None
    model = parameters[0].annotation
    if isinstance(model, str):  # `from __future__ import annotations`: only this one is evaluated
        try:
            model = eval(model, getattr(factory, "__globals__", {}))  # noqa: S307 - the factory's own annotation
        except NameError:
            model = None
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise ValueError(
            f"task factory {factory.__module__}.{factory.__qualname__}: annotate its first parameter with the "
            "pydantic model of its options (def make_task(options: MyOptions, config: TaskConfig) -> Task), "
            "or give it no parameters"
        )
    return model


def make_task(cfg: TaskConfig) -> Task:
    """Build the configured task (dataset tasks load their local data here)."""
    factory = task_factory(cfg.name)
    model = options_model(factory)
    if model is None:
        return factory()
    options = model.model_validate(cfg.options)
    parameters = inspect.signature(factory).parameters
    return factory(options, cfg) if len(parameters) > 1 else factory(options)
