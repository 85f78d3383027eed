"""TRL's `GRPOTrainer` on one of our tasks: the baseline side of `python -m benchmarks vs-trl`.

Runs in the benchmark's own TRL venv (artifacts/trl-venv, made by benchmarks/vs_trl.py), never in
the project's; only `pipeline_rl.tasks` (torch-free, pydantic only) and the evaluator both sides share,
`pipeline_rl.eval.snapshots` (torch and transformers only), are imported from this repository, so TRL
sees exactly our problems, test split and grader:

    artifacts/trl-venv/bin/python -m benchmarks.trl_grpo --model artifacts/tiny-arith \
        --seed 0 --run-s 200 --out /tmp/trl.jsonl

What it does, as a user of TRL would: a `datasets.Dataset` of the task's train problems (the seed's
stream, in order), a reward function that grades with our grader and our reward table, `GRPOConfig`
with the benchmark's hyperparameters and TRL's defaults for everything else (loss_type "dapo",
scale_rewards "group", beta 0), one process with every core's torch threads.

The clock is training time: it starts when the first step starts and stops during each held-out
evaluation (greedy HF `generate` of the same test problems, every --eval-every-s seconds), so TRL is
never charged for our measuring. Writes JSON lines to --out: {"type": "eval", "t", "step", "accuracy"}
per evaluation and a final {"type": "summary", "steps", "samples", "train_s", "startup_s"}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _problems(task, seed: int, split: str, count: int) -> list:
    out = []
    for problem in task.problems(shard_index=0, num_shards=1, seed=seed, split=split):
        out.append(problem)
        if len(out) >= count:
            break
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-s", type=float, required=True, help="seconds of training (the clock)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--task-json", default="{}", help="TaskConfig fields as JSON (default: arith defaults)")
    p.add_argument("--eval-every-s", type=float, default=10.0, help="0: evaluate before and after only")
    p.add_argument("--eval-problems", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=128, help="samples per optimizer step")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, every core)")
    p.add_argument(
        "--float32",
        action="store_true",
        help="train in float32, not TRL's default bf16 (for a CPU without native bf16, where it is far slower)",
    )
    args = p.parse_args(argv)

    started = time.monotonic()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pipeline_rl.eval import snapshots as greedy_eval
    from pipeline_rl.tasks import RewardConfig, TaskConfig, compute_reward, held_out_problems, make_task

    if args.threads:
        torch.set_num_threads(args.threads)
    task_cfg = TaskConfig(**json.loads(args.task_json))
    task = make_task(task_cfg)
    reward_cfg = RewardConfig()
    steps_wanted = 100_000
    prompts_needed = int(args.run_s * 20 + 1000)  # far more than TRL trains on in run_s (~16 prompts/step)
    train = _problems(task, args.seed, "train", prompts_needed)
    test = held_out_problems(task, args.eval_problems)
    dataset = Dataset.from_list(
        [{"prompt": p.messages, "answer": p.answer, "index": p.prompt_index} for p in train]
    )
    by_index = {p.prompt_index: p for p in train}

    def reward(completions, index, **_) -> list[float]:
        rewards = []
        for completion, i in zip(completions, index, strict=True):
            grade = task.grade(by_index[i], completion[0]["content"])
            rewards.append(compute_reward(grade, "stop", 0, args.max_tokens, reward_cfg))
        return rewards

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    out = args.out.open("w")

    def write(row: dict) -> None:
        out.write(json.dumps(row) + "\n")
        out.flush()

    def held_out_accuracy() -> float:
        return greedy_eval.held_out_accuracy(model, tokenizer, task, test, args.max_tokens)

    class Clock(TrainerCallback):
        """Training-time clock with evaluations outside it; stops the run after run_s."""

        def __init__(self) -> None:
            self.start = None
            self.paused = 0.0
            self.next_eval = args.eval_every_s
            self.last_eval_step = -1

        def now(self) -> float:
            return time.monotonic() - self.start - self.paused

        def evaluate(self, step: int) -> None:
            t = self.now()
            pause = time.monotonic()
            write({"type": "eval", "t": t, "step": step, "accuracy": held_out_accuracy()})
            self.last_eval_step = step
            self.paused += time.monotonic() - pause

        def on_train_begin(self, targs, state, control, **kw):
            self.start = time.monotonic()
            write({"type": "eval", "t": 0.0, "step": 0, "accuracy": held_out_accuracy()})
            self.start = time.monotonic()  # the first evaluation is not training time either

        def on_step_end(self, targs, state, control, **kw):
            if args.eval_every_s and self.now() >= self.next_eval:
                self.evaluate(state.global_step)
                while self.next_eval <= self.now():
                    self.next_eval += args.eval_every_s
            if self.now() >= args.run_s:
                control.should_training_stop = True
            return control

    clock = Clock()
    config = GRPOConfig(
        output_dir=str(args.out.parent / f"{args.out.stem}-trl"),
        use_cpu=True,
        seed=args.seed,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        num_generations=args.group_size,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        beta=0.0,
        max_steps=steps_wanted,
        shuffle_dataset=False,  # the seed's problem stream, in order, like our actor
        save_strategy="no",
        logging_steps=1_000_000,
        report_to="none",
        disable_tqdm=True,
        **({"bf16": False} if args.float32 else {}),
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    startup_s = time.monotonic() - started
    trainer.train()
    steps = trainer.state.global_step
    train_s = clock.now()
    if clock.last_eval_step != steps:
        clock.evaluate(steps)
    write(
        {
            "type": "summary",
            "steps": steps,
            "samples": steps * args.batch_size,
            "train_s": train_s,
            "startup_s": startup_s,
            "threads": torch.get_num_threads(),
        }
    )
    out.close()


if __name__ == "__main__":
    main()
