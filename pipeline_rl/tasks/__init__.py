"""Prompt sources, graders and rewards for the actor.

    from pipeline_rl.tasks import Grader, RewardConfig, TaskConfig, compute_reward, make_task

    task = make_task(TaskConfig(name="arith"))
    with Grader.from_config(task, task_cfg) as grader:
        for problem in task.problems(shard_index=0, num_shards=1, seed=0, split="train"):
            grade = await grader.grade_async(problem, completion_text)
            reward = compute_reward(grade, finish_reason, completion_tokens, max_tokens, RewardConfig())

Modules: base (Problem, Task), arith, remainder, longtail, calc, dataset (dataset, gsm8k, math), math_grading (math-verify),
data (local dataset loading), pool (process pool with a hard timeout), grader, reward, config.
See docs/tasks.md.
"""

from pipeline_rl.tasks.arith import ARITH_ALPHABET, ArithTask, arith_solution_text
from pipeline_rl.tasks.base import Grade, Problem, Split, Task, held_out_problems
from pipeline_rl.tasks.config import TaskConfig, make_task
from pipeline_rl.tasks.grader import Grader
from pipeline_rl.tasks.reward import RewardConfig, compute_reward

__all__ = [
    "ARITH_ALPHABET",
    "ArithTask",
    "Grade",
    "Grader",
    "Problem",
    "RewardConfig",
    "Split",
    "Task",
    "TaskConfig",
    "arith_solution_text",
    "compute_reward",
    "held_out_problems",
    "make_task",
]
