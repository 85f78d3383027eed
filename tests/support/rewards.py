"""Rewards and tasks given by reference in tests (`task.reward=support.rewards:digit_share`): importable
in the launcher's children and their grading workers because tests put tests/ on PYTHONPATH.

digit_share scores any completion (even an untrained model's) with a value that varies between the
samples of a group, so GRPO's advantages are non-zero; the others fail in each way a user's reward can."""

from __future__ import annotations

import asyncio
import time

from pydantic import BaseModel, ConfigDict, Field


def digit_share(problem, text: str) -> float:
    """The share of the completion's characters that are digits (0 for an empty one)."""
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


async def async_digit_share(problem, text: str) -> float:
    await asyncio.sleep(0)
    return digit_share(problem, text)


def sometimes_broken(problem, text: str) -> float:
    """digit_share, except for completions whose length is 1 mod 7 (raises), 2 mod 7 (NaN) or 3 mod 7
    (None): about 3 samples in 7 fail, each in its own way."""
    kind = len(text) % 7
    if kind == 1:
        raise ValueError(f"no score for a completion of {len(text)} characters")
    if kind == 2:
        return float("nan")
    if kind == 3:
        return None
    return digit_share(problem, text)


def raises(problem, text: str) -> float:
    raise RuntimeError("the reward service is down")


def not_a_number(problem, text: str) -> float:
    return float("inf")


def returns_none(problem, text: str):
    return None


def returns_text(problem, text: str):
    return "0.5"


def hangs(problem, text: str) -> float:
    time.sleep(3600)
    return 0.0


class CountOptions(BaseModel):
    """Options of the test task below, validated by it."""

    model_config = ConfigDict(extra="forbid")

    up_to: int = Field(default=5, ge=1, le=50)


def count_task(options: CountOptions, config):
    """A task of the user's own: 'Count to N', graded by the last number written."""
    from support.user_task import CountTask

    return CountTask(options.up_to, config.test_size)


def untyped_factory(options, config):
    return None
