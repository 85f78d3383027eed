"""Held-out accuracy of whatever weights a server is serving: greedy completions of the task's test split.

    python -m pipeline_rl.launch.evaluate --url http://127.0.0.1:8000 --problems 200

The launcher calls `evaluate_server` before RL starts (version 0) and after the last step, through the
same HTTP contract the actor uses, so the figure is exactly what the served weights do.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from inference_shim.client import AsyncShimClient
from pipeline_rl.tasks import TaskConfig, make_task


async def _evaluate(
    url: str, task_cfg: TaskConfig, num_problems: int, max_tokens: int, token: str | None
) -> dict:
    task = make_task(task_cfg)
    problems = []
    for problem in task.problems(shard_index=0, num_shards=1, seed=0, split="test"):
        problems.append(problem)
        if len(problems) >= num_problems:
            break
    client = AsyncShimClient(url, token=token, timeout_s=120)
    limit = asyncio.Semaphore(64)

    async def one(problem) -> tuple[str, int]:
        async with limit:
            response = await client.chat(problem.messages, max_tokens=max_tokens, temperature=0.0)
        choice = response.choices[0]
        versions = {span.version for span in choice.weight_versions or []}
        return task.grade(problem, choice.message.content or ""), max(versions, default=-1)

    try:
        results = await asyncio.gather(*(one(p) for p in problems))
    finally:
        await client.aclose()
    grades = [g for g, _ in results]
    return {
        "accuracy": grades.count("correct") / len(grades),
        "unparseable": grades.count("unparseable") / len(grades),
        "problems": len(grades),
        "weight_version": max(v for _, v in results),
    }


def evaluate_server(
    url: str, task_cfg: TaskConfig, num_problems: int, max_tokens: int, token: str | None = None
) -> dict:
    """{'accuracy', 'unparseable', 'problems', 'weight_version'} of greedy answers on the test split."""
    return asyncio.run(_evaluate(url, task_cfg, num_problems, max_tokens, token))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Greedy held-out accuracy of a running server.")
    parser.add_argument("--url", required=True)
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--task", default="arith")
    args = parser.parse_args(argv)
    print(json.dumps(evaluate_server(args.url, TaskConfig(name=args.task), args.problems, args.max_tokens)))


if __name__ == "__main__":
    main()
