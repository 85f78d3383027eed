"""Held-out accuracy of whatever weights a server is serving: greedy completions of the task's test split.

    python -m pipeline_rl.eval.heldout --url http://127.0.0.1:8000 --problems 200

The launcher calls `evaluate_server` before RL starts (version 0) and after the last step, through the
same HTTP contract the actor uses, so the figure is exactly what the served weights do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections import Counter
from pathlib import Path

from inference_shim.client import AsyncShimClient
from pipeline_rl.actor.episode import EpisodeLimits, run_episode
from pipeline_rl.progress import Progress
from pipeline_rl.tasks import Grader, TaskConfig, held_out_problems, make_task


async def _evaluate(
    url: str,
    task_cfg: TaskConfig,
    num_problems: int,
    max_tokens: int,
    token: str | None,
    model_path: str | None = None,
    max_model_len: int = 4096,
    samples: int = 1,
    seed: int = 0,
    progress: bool = True,
    api_key: str | None = None,
) -> dict:
    task = make_task(task_cfg)
    multi_turn = getattr(task, "multi_turn", False)
    if multi_turn:  # episodes render the environment's turns with the model's tokenizer
        from transformers import AutoTokenizer

        if model_path is None:
            raise ValueError(f"evaluating the multi-turn task {task.name!r} needs the model's directory")
        if samples > 1:
            raise ValueError(f"samples={samples}: sampled evaluation of a multi-turn task is not supported")
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        limits = EpisodeLimits(
            max_turns=task_cfg.episode_max_turns,
            max_tokens_per_turn=max_tokens,
            token_budget=task_cfg.episode_token_budget,
        )
    problems = held_out_problems(task, num_problems)
    client = AsyncShimClient(url, token=token, timeout_s=120, api_key=api_key)
    limit = asyncio.Semaphore(64)

    async def greedy(problem) -> tuple[str, int]:
        if multi_turn:
            env = task.environment(problem)
            async with limit:
                episode = await run_episode(
                    client, tokenizer, env, limits, {"temperature": 0.0}, max_model_len
                )
            return "".join(episode.texts), max((s.version for s in episode.spans), default=-1)
        async with limit:
            response = await client.chat(problem.messages, max_tokens=max_tokens, temperature=0.0)
        choice = response.choices[0]
        return choice.message.content or "", max(
            (s.version for s in choice.weight_versions or []), default=-1
        )

    async def sampled(problem) -> list[str]:
        async with limit:
            response = await client.chat(
                problem.messages,
                max_tokens=max_tokens,
                temperature=1.0,
                n=samples,
                seed=seed + problem.prompt_index,
            )
        return [c.message.content or "" for c in response.choices]

    total = len(problems) * (2 if samples > 1 else 1)
    # A periodic evaluation (progress=False) runs beside the launcher's own progress lines.
    bar = Progress("held-out evaluation", total, unit="problem", quiet=True, enabled=progress)

    async def counted(work):
        out = await work
        bar.advance()
        return out

    grader = Grader.from_config(task, task_cfg)
    try:
        answers = await asyncio.gather(*(counted(greedy(p)) for p in problems))
        judged = await asyncio.gather(
            *(grader.judge_async(p, text) for p, (text, _) in zip(problems, answers, strict=True))
        )
        result = _summary(judged, task_cfg)
        result["problems"] = len(problems)
        result["weight_version"] = max(v for _, v in answers)
        if samples > 1:
            drawn = await asyncio.gather(*(counted(sampled(p)) for p in problems))
            result.update(await _sampled_summary(task, grader, problems, drawn))
    finally:
        bar.close()
        grader.close()
        await client.aclose()
    return result


def _summary(judged: list, task_cfg: TaskConfig) -> dict:
    """Accuracy (pass@1 of greedy answers) and, with a reward by reference, its mean over the answers
    it could score (and how many it could not)."""
    grades = [j.grade for j in judged]
    out = {
        "accuracy": grades.count("correct") / len(grades),
        "unparseable": grades.count("unparseable") / len(grades),
    }
    if task_cfg.reward is not None:
        scores = [j.score for j in judged if j.error is None]
        out["reward_mean"] = sum(scores) / len(scores) if scores else None
        out["reward_failed"] = len(judged) - len(scores)
    return out


async def _sampled_summary(task, grader: Grader, problems: list, drawn: list[list[str]]) -> dict:
    """pass@k (any of k samples correct) and, where the task names its final answer, maj@k (the most
    frequent final answer correct); the samples' mean reward with a reward by reference."""
    k = len(drawn[0])
    judged = await asyncio.gather(
        *(
            asyncio.gather(*(grader.judge_async(p, text) for text in texts))
            for p, texts in zip(problems, drawn, strict=True)
        )
    )
    out = {
        "samples": k,
        f"pass@{k}": sum(any(j.grade == "correct" for j in js) for js in judged) / len(problems),
    }
    final_answer = getattr(task, "final_answer", None)
    if final_answer is not None:
        wins = 0
        for texts, js in zip(drawn, judged, strict=True):
            votes = Counter(a for a in map(final_answer, texts) if a is not None)
            if votes:
                top = votes.most_common(1)[0][0]
                wins += next(
                    j.grade == "correct" for t, j in zip(texts, js, strict=True) if final_answer(t) == top
                )
        out[f"maj@{k}"] = wins / len(problems)
    if grader.reward is not None:
        scores = [j.score for js in judged for j in js if j.error is None]
        out[f"reward_mean@{k}"] = sum(scores) / len(scores) if scores else None
    return out


def evaluate_server(
    url: str,
    task_cfg: TaskConfig,
    num_problems: int,
    max_tokens: int,
    token: str | None = None,
    model_path: str | None = None,
    max_model_len: int = 4096,
    samples: int = 1,
    seed: int = 0,
    progress: bool = True,
    api_key: str | None = None,
) -> dict:
    """{'accuracy', 'unparseable', 'problems', 'weight_version'} of greedy answers on the test split
    (greedy episodes for a multi-turn task, which needs `model_path` for its tokenizer), with
    'reward_mean' for a reward by reference, and with samples > 1 also pass@k, maj@k (tasks that name
    their final answer) and the samples' mean reward."""
    return asyncio.run(
        _evaluate(
            url,
            task_cfg,
            num_problems,
            max_tokens,
            token,
            model_path,
            max_model_len,
            samples,
            seed,
            progress,
            api_key,
        )
    )


class RunEvaluations:
    """The launcher's evaluations of one run: before/after RL and periodic (eval.every_s), each appended
    to <run_dir>/stats.jsonl as type 'eval' (where the report's plots and the benchmarks read them).
    Each uses the first server that answers it (a server may be restarting)."""

    def __init__(self, cfg, run_dir: Path, write_rows=None) -> None:
        self.cfg = cfg  # a pipeline_rl.config.RunConfig
        self.run_dir = run_dir
        self.write_rows = write_rows  # the launcher's RunMonitor.record (stats.jsonl and the trackers)
        self.results: dict[str, dict] = {}  # "before" / "after" -> result
        self._thread: threading.Thread | None = None

    def measure(self, progress: bool = True) -> dict:
        from pipeline_rl.fleet import read_fleet

        e, inference = self.cfg.eval, self.cfg.inference
        errors = []
        for url in read_fleet(self.cfg.run_dir) or inference.urls:
            try:
                return evaluate_server(
                    url,
                    self.cfg.task,
                    e.num_problems,
                    e.max_tokens,
                    inference.token,
                    self.cfg.model_path,
                    inference.max_model_len,
                    progress=progress,
                    api_key=inference.api_key,
                )
            except Exception as err:  # the next server may answer
                errors.append(f"{url}: {type(err).__name__}: {err}")
        raise RuntimeError("no server could be evaluated: " + "; ".join(errors))

    def record(self, result: dict, when: str) -> None:
        row = {"type": "eval", "time": time.time(), "when": when, **result}
        if self.write_rows is not None:
            self.write_rows([row])
            return
        with (self.run_dir / "stats.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")

    def evaluate(self, when: str) -> None:
        result = self.measure()
        self.results[when] = result
        self.record(result, when)
        reward = f", mean reward {result['reward_mean']:.4g}" if result.get("reward_mean") is not None else ""
        print(
            f"held-out accuracy {when} RL: {result['accuracy']:.1%}{reward} (weight version {result['weight_version']})",
            flush=True,
        )

    def start_periodic(self) -> None:
        """One evaluation in a background thread, unless the previous one is still running."""

        def run() -> None:
            try:
                result = self.measure(progress=False)
            except Exception as e:  # a failed evaluation is reported, the run goes on
                print(f"(periodic evaluation failed: {e})", flush=True)
                return
            self.record(result, "periodic")

        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=run, name="periodic-eval", daemon=True)
            self._thread.start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Greedy held-out accuracy of a running server.")
    parser.add_argument("--url", required=True)
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--task", default="arith")
    parser.add_argument(
        "--model", default=None, help="the model's directory (multi-turn tasks: its tokenizer)"
    )
    args = parser.parse_args(argv)
    task = TaskConfig(name=args.task)
    print(json.dumps(evaluate_server(args.url, task, args.problems, args.max_tokens, model_path=args.model)))


if __name__ == "__main__":
    main()
