"""`longtail`: `remainder`'s written subtractions with reasoning RL's length shape, most answers short.

    task = LongtailTask(test_size=100)  # 80% of problems 1-2 lines, 20% 20-30 lines; divisors 2..19
    problem = next(task.problems(shard_index=0, num_shards=1, seed=0, split="train"))
    task.solution_text(problem)         # '31-17=14\nanswer: 14'  (or a chain of 20-30 lines)
    python -m pipeline_rl.tasks.longtail   # the length histogram (the tiny tokenizer: a token per character)

Reasoning RL's answers are mostly short with a tail of long ones: the 90th-percentile length is many
times the median, and a synchronous round waits on its few longest answers while the engine runs
nearly empty. `remainder` draws its line counts log-uniformly, a spread without that shape (90th
percentile ~3x the median). Here a problem is short (1..short_steps subtractions, P(q) ~ 1/q^2, so
most need one) or, with probability tail_share, long (tail_min_steps..max_steps, uniform): with the
defaults the median answer is one line (~17 tokens), the 90th percentile ~14x that, and the longest
(331 tokens) fits the recipe's `actor.max_tokens=352`.

Divisors go up to 19 (remainder: 9) because short problems are few: with divisors 2..9 there are only
44 distinct one-line problems, and a held-out set of 64 would leave training none. The test split is
stratified by position (problem i is long exactly when floor(i * tail_share) steps up), so every
prefix, the evaluators' first 100 included, has the mixture's share of long problems, although short
problems repeat and long ones rarely do; a train draw that is held out is redrawn with the same line
count, so train keeps the mixture too. Grading, prompt and worked answer are remainder's.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from collections import Counter
from collections.abc import Callable, Iterable
from itertools import islice
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline_rl.tasks.base import Problem
from pipeline_rl.tasks.remainder import MIN_DIVISOR, RemainderTask, operands

if TYPE_CHECKING:
    from pipeline_rl.tasks.config import TaskConfig


class LongtailTask(RemainderTask):
    """remainder problems whose subtraction count is a mixture: 1..short_steps, or with probability
    tail_share tail_min_steps..max_steps (uniform within each part); `test` is stratified and excluded
    from `train`."""

    name = "longtail"

    def __init__(
        self,
        max_steps: int = 30,
        max_divisor: int = 19,
        short_steps: int = 2,
        tail_min_steps: int = 20,
        tail_share: float = 0.2,
        test_size: int = 200,
    ):
        if not 1 <= short_steps < tail_min_steps <= max_steps:
            raise ValueError(
                f"task.options: need 1 <= short_steps ({short_steps}) < tail_min_steps ({tail_min_steps}) "
                f"<= max_steps ({max_steps})"
            )
        if not 0.0 < tail_share < 1.0:
            raise ValueError(f"task.options.tail_share={tail_share} must be in (0, 1)")
        self.short_steps, self.tail_min_steps, self.tail_share = short_steps, tail_min_steps, tail_share
        super().__init__(max_steps, max_divisor, test_size)
        self._held_out = {expr for expr, _ in self._test}
        # Train redraws a held-out problem with the same line count, which needs one left to draw.
        per_count = sum(range(MIN_DIVISOR, max_divisor + 1))  # (divisor, remainder) pairs
        held = Counter(operands(expr)[0] // operands(expr)[1] for expr in self._held_out)
        if any(n >= per_count for n in held.values()):
            raise ValueError(
                f"task.test_size={test_size} holds out every {per_count} problem(s) of some line count, "
                "leaving train none; lower it or raise task.options.max_divisor"
            )

    def _steps(self, rng: random.Random, long: bool) -> int:
        if long:
            return rng.randint(self.tail_min_steps, self.max_steps)
        # P(q) ~ 1/q^2: most short problems need one line, so the median answer is one line long.
        weights = [1 / q**2 for q in range(1, self.short_steps + 1)]
        return rng.choices(range(1, self.short_steps + 1), weights)[0]

    @staticmethod
    def _with_steps(rng: random.Random, steps: int, max_divisor: int) -> tuple[str, int]:
        divisor = rng.randint(MIN_DIVISOR, max_divisor)
        number = steps * divisor + rng.randint(0, divisor - 1)
        return f"{number} mod {divisor}", number % divisor

    def _draw(self, rng: random.Random) -> tuple[str, int]:
        # A held-out draw is redrawn with the same number of lines: redrawing the whole mixture (what the
        # train stream does for remainder) would tilt it towards long problems, since many more short
        # ones are held out.
        steps = self._steps(rng, rng.random() < self.tail_share)
        while True:
            expr, value = self._with_steps(rng, steps, self.max_divisor)
            if expr not in self._held_out:
                return expr, value

    def _make_test_set(self, size: int) -> list[tuple[str, int]]:
        rng = random.Random(
            f"longtail-test:{self.max_steps}:{self.max_divisor}:{self.short_steps}:"
            f"{self.tail_min_steps}:{self.tail_share}"
        )
        seen: dict[str, int] = {}
        for i in range(size):
            long = math.floor((i + 1) * self.tail_share) > math.floor(i * self.tail_share)
            for _ in range(1000):  # short problems repeat; give up long before an endless loop
                expr, value = self._with_steps(rng, self._steps(rng, long), self.max_divisor)
                if expr not in seen:
                    seen[expr] = value
                    break
            else:
                raise ValueError(
                    f"task.test_size={size}: fewer distinct {'long' if long else 'short'} longtail problems "
                    "than the test set needs; lower it or raise task.options.max_divisor / short_steps"
                )
        return list(seen.items())


def length_stats(lengths: Iterable[int]) -> dict[str, float]:
    """p50, p90, max and p90/p50 of answer lengths (nearest-rank percentiles)."""
    ordered = sorted(lengths)

    def rank(q: float) -> int:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    p50, p90 = rank(0.5), rank(0.9)
    return {"p50": p50, "p90": p90, "max": ordered[-1], "mean": statistics.fmean(ordered), "ratio": p90 / p50}


def answer_lengths(
    task: RemainderTask, problems: Iterable[Problem], count_tokens: Callable[[str], int]
) -> list[int]:
    """Token lengths of the worked answers (`solution_text`, what the warm-up trains on) of `problems`."""
    return [count_tokens(task.solution_text(p)) for p in problems]


def histogram_table(lengths: list[int], width: int = 20) -> str:
    """A markdown table of `lengths` in bins of `width` tokens, with a bar per bin."""
    counts: dict[int, int] = {}
    for n in lengths:
        counts[n // width] = counts.get(n // width, 0) + 1
    rows = ["| tokens | answers | share (# = 1%) |", "|---|---|---|"]
    for b in range(min(counts), max(counts) + 1):
        share = counts.get(b, 0) / len(lengths)
        rows.append(
            f"| {b * width}-{b * width + width - 1} | {counts.get(b, 0)} | {'#' * round(share * 100)} |"
        )
    return "\n".join(rows)


class LongtailOptions(BaseModel):
    """`task=longtail`'s options (task.options.*)."""

    model_config = ConfigDict(extra="forbid")

    max_steps: int = Field(default=30, ge=2, description="Most subtractions of a long problem.")
    max_divisor: int = Field(default=19, ge=MIN_DIVISOR, description="Divisors are drawn from 2..this.")
    short_steps: int = Field(default=2, ge=1, description="Most subtractions of a short problem.")
    tail_min_steps: int = Field(default=20, ge=2, description="Fewest subtractions of a long problem.")
    tail_share: float = Field(default=0.2, gt=0, lt=1, description="Share of long problems.")

    @model_validator(mode="after")
    def _ordered(self) -> LongtailOptions:
        if not self.short_steps < self.tail_min_steps <= self.max_steps:
            raise ValueError(
                f"need short_steps ({self.short_steps}) < tail_min_steps ({self.tail_min_steps}) <= "
                f"max_steps ({self.max_steps})"
            )
        return self


def make_task(options: LongtailOptions, config: TaskConfig) -> LongtailTask:
    return LongtailTask(
        options.max_steps,
        options.max_divisor,
        options.short_steps,
        options.tail_min_steps,
        options.tail_share,
        config.test_size,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Answer lengths of the longtail task, as a histogram.")
    parser.add_argument("--tokenizer", help="a model directory whose tokenizer counts (default: characters)")
    parser.add_argument("--test-size", type=int, default=100, help="held-out problems (the recipe's: 100)")
    parser.add_argument("--train", type=int, default=2000, help="train problems (seed 0) for the second line")
    args = parser.parse_args(argv)
    count: Callable[[str], int] = len  # the tiny model's tokenizer: a token per character
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    task = LongtailTask(test_size=args.test_size)
    test = answer_lengths(task, task.problems(0, 1, 0, "test"), count)
    train = answer_lengths(task, islice(task.problems(0, 1, 0, "train"), args.train), count)
    for split, lengths in (("test", test), ("train", train)):
        stats = length_stats(lengths)
        print(
            f"{split} ({len(lengths)} answers): p50 {stats['p50']}, p90 {stats['p90']}, max {stats['max']}, "
            f"mean {stats['mean']:.0f} tokens; p90/p50 {stats['ratio']:.1f}"
        )
    print(f"\nheld-out answers (test split, {len(test)}):\n")
    print(histogram_table(test))


if __name__ == "__main__":
    main()
