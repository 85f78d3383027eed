"""User stage functions for the graph's tests, named by reference (support.stage_fns:NAME) as a user's
recipe would name its own."""

from __future__ import annotations


def short_answers(sample, group, min_tokens: int = 4) -> str | None:
    """A sample-level filter: drops completions shorter than min_tokens."""
    return "too_short" if len(sample.completion_token_ids) < min_tokens else None


def double_rewards(group, factor: float = 2.0):
    """A map: scales every reward."""
    samples = [s.model_copy(update={"reward": s.reward * factor}) for s in group.samples]
    return group.model_copy(update={"samples": samples})


def broken(group) -> str | None:
    raise RuntimeError("a bug in the user's stage")


def odd_attempts(sample, group) -> str | None:
    """A sample-level filter that drops every other attempt of a group: a known half, whatever the model."""
    return "odd" if int(sample.sample_id.rsplit("/", 1)[1]) % 2 else None
