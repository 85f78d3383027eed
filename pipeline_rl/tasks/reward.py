"""Reward of one completion: a table over grades plus optional length shaping.

    cfg = RewardConfig(overlong_buffer=64)
    reward = compute_reward("correct", finish_reason="stop", completion_tokens=480, max_tokens=512, cfg=cfg)

reward = table[grade] - soft overlong penalty - truncation penalty (with a reward by reference,
task.reward, its score takes the table's place), where

- table: `correct` 1.0, `wrong` 0.0, `unparseable` -0.5 by default. Unparseable sits below wrong so
  that a group in which every answer is wrong still rewards the samples that answered in the required
  format (GRPO only learns from differences within a group); it sits only half as far below wrong as
  correct sits above it, so correctness dominates once the format is learned.
- soft overlong penalty (DAPO's "soft overlong punishment"): 0 up to `max_tokens - overlong_buffer`
  completion tokens, then growing linearly to `overlong_penalty` at `max_tokens`. Off when
  `overlong_buffer` is 0 (the default).
- truncation penalty: `length_penalty`, subtracted once when finish_reason == "length".

Penalties are given as non-negative magnitudes and subtracted.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pipeline_rl.tasks.base import Grade


class RewardConfig(BaseModel):
    """Reward table and length shaping; see the module docstring for the formula."""

    model_config = ConfigDict(extra="forbid")

    correct: float = Field(default=1.0, description="Reward of a correct answer.")
    wrong: float = Field(default=0.0, description="Reward of a well-formed but wrong answer.")
    unparseable: float = Field(
        default=-0.5,
        description="Reward when no answer in the required format is found (or grading timed out).",
    )
    overlong_buffer: int = Field(
        default=0,
        ge=0,
        description="Last tokens before max_tokens over which the soft overlong penalty ramps; 0 = off.",
    )
    overlong_penalty: float = Field(
        default=1.0, ge=0, description="Soft overlong penalty reached at max_tokens."
    )
    length_penalty: float = Field(
        default=0.0, ge=0, description="Penalty subtracted when finish_reason is 'length'."
    )


def overlong_penalty(completion_tokens: int, max_tokens: int, cfg: RewardConfig) -> float:
    """The soft overlong penalty magnitude (>= 0) for a completion of `completion_tokens` tokens."""
    if cfg.overlong_buffer == 0:
        return 0.0
    if cfg.overlong_buffer >= max_tokens:
        raise ValueError(
            f"reward.overlong_buffer={cfg.overlong_buffer} must be smaller than max_tokens={max_tokens}: "
            "lower overlong_buffer or raise the sampling max_tokens"
        )
    excess = completion_tokens - (max_tokens - cfg.overlong_buffer)
    return cfg.overlong_penalty * min(max(excess, 0), cfg.overlong_buffer) / cfg.overlong_buffer


def compute_reward(
    grade: Grade,
    finish_reason: str,
    completion_tokens: int,
    max_tokens: int,
    cfg: RewardConfig,
    score: float | None = None,
) -> float:
    """Reward of one completion; `max_tokens` is the completion-token limit it was sampled with. `score`,
    a user reward's value (task.reward), replaces the grade table; the length shaping applies to both."""
    if score is not None:
        reward = score
    else:
        reward = {"correct": cfg.correct, "wrong": cfg.wrong, "unparseable": cfg.unparseable}[grade]
    reward -= overlong_penalty(completion_tokens, max_tokens, cfg)
    if finish_reason == "length":
        reward -= cfg.length_penalty
    return reward
