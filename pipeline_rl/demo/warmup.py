"""Short supervised warm-up of the tiny model on a generated task, and greedy held-out accuracy.

    python -m pipeline_rl.demo.warmup --base artifacts/tiny-base --out artifacts/tiny-arith --steps 300

RL needs a policy that already answers in the right format some of the time; a model initialised at
random never earns a reward. The warm-up trains the tiny model for a few minutes on worked answers
(prompt tokens masked out). `answer_styles` sets how those answers are written: only `answer: N` is
what the prompt asks for and what the grader reads; a corpus that mostly writes `answer: +N` gives a
model that computes the answer but mostly does not write it the way the reward needs -
the situation RL is used for in practice, shrunk to minutes (docs/decisions.md, "The demo"). Result
and settings are written next to the model (warmup.json) and reused when nothing changed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path

from pydantic import BaseModel, Field, field_validator

from pipeline_rl.progress import Progress
from pipeline_rl.tasks import Problem, TaskConfig, arith_solution_text, make_task

# How a worked answer can be written. "answer" (`answer: 12`) is what the prompt asks for and what the
# grader reads; "signed" writes non-negative results with an explicit plus sign (`answer: +12`), which
# the grader does not accept as an integer. Negative results read the same in both styles.
ANSWER_STYLES = ("answer", "signed")


def styled_answer(problem: Problem, style: str, task=None) -> str:
    """The task's worked answer (`task.solution_text`, else arith's `answer: N`) in `style`; the
    signed style changes only the final `answer: `."""
    solution_text = getattr(task, "solution_text", None)
    canonical = solution_text(problem) if solution_text else arith_solution_text(problem)
    if style == "signed" and not problem.answer.startswith("-"):
        head, sep, tail = canonical.rpartition("answer: ")
        return head + sep + "+" + tail
    return canonical


class WarmupConfig(BaseModel):
    """Supervised warm-up recipe."""

    steps: int = Field(300, ge=0, description="Optimizer steps.")
    batch_size: int = Field(64, ge=1, description="Sequences per step.")
    learning_rate: float = Field(3e-3, gt=0, description="AdamW learning rate (cosine decay to 10%).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    seed: int = Field(0, description="Data and init seed.")
    eval_problems: int = Field(200, ge=1, description="Held-out problems for the accuracy figure.")
    eval_max_tokens: int = Field(16, ge=1, description="Tokens of a greedy answer in that measurement.")
    tool_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Multi-turn tasks: share of demonstrations that are whole tool-using episodes; the "
        "rest answer at once in `answer_styles` (a tiny model's guess at a product is wrong).",
    )
    answer_styles: dict[str, float] = Field(
        default_factory=lambda: {"answer": 1.0},
        description=f"Share of demonstrations written in each style of {list(ANSWER_STYLES)}; only "
        "'answer' is what the grader accepts.",
    )

    @field_validator("answer_styles")
    @classmethod
    def _known_styles(cls, styles: dict[str, float]) -> dict[str, float]:
        unknown = set(styles) - set(ANSWER_STYLES)
        if unknown or not styles or any(w < 0 for w in styles.values()) or sum(styles.values()) <= 0:
            raise ValueError(
                f"answer_styles={styles}: give non-negative weights (not all zero) to styles from "
                f"{list(ANSWER_STYLES)}"
            )
        return styles


def _encode(tokenizer, problem: Problem, answer_text: str | None) -> tuple[list[int], int]:
    prompt = list(
        tokenizer.apply_chat_template(
            problem.messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    if answer_text is None:
        return prompt, len(prompt)
    completion = tokenizer(answer_text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + completion, len(prompt)


def _encode_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """A whole multi-turn conversation and which of its tokens are trained: each assistant turn's
    content and its end-of-turn token, as an episode samples them (pipeline_rl/actor/episode.py)."""
    ids: list[int] = []
    trained: list[bool] = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        opened = list(
            tokenizer.apply_chat_template(
                messages[:k], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        assert opened[: len(ids)] == ids, "the chat template must only grow as the conversation does"
        trained += [False] * (len(opened) - len(ids))
        turn = tokenizer(message["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = opened + turn
        trained += [True] * len(turn)
    return ids, trained


def greedy_texts(model, tokenizer, problems: list[Problem], max_tokens: int) -> list[str]:
    """Greedy first answers (transformers generate), in the order of `problems`.

    Prompts are batched by length so that no padding is needed: left padding would shift the
    positions of a model that derives them from the sequence index.
    """
    import torch

    by_length: dict[int, list[tuple[int, list[int]]]] = {}
    for k, problem in enumerate(problems):
        prompt = _encode(tokenizer, problem, None)[0]
        by_length.setdefault(len(prompt), []).append((k, prompt))
    texts = [""] * len(problems)
    model.eval()
    bar = Progress("greedy answers", len(problems), unit="problem", stream=sys.stdout, quiet=True)
    for batch in by_length.values():
        ids = torch.tensor([prompt for _, prompt in batch])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        for i, (k, _) in enumerate(batch):
            texts[k] = tokenizer.decode(out[i, ids.shape[1] :], skip_special_tokens=True)
        bar.advance(len(batch))
    bar.close()
    return texts


def right_in_any_format(problem: Problem, text: str) -> bool:
    """The completion's last integer is the answer, whatever the answer style (`answer: +12` too)."""
    numbers = re.findall(r"-?\d+", text)
    return bool(numbers) and numbers[-1] == problem.answer


def greedy_accuracy(
    model, tokenizer, task, problems: list[Problem], max_tokens: int = 16, *, any_style: bool = False
) -> float:
    """Exact-match accuracy of greedy completions. any_style=True grades the last integer of the
    completion in any answer style (arith only): the arithmetic the model knows, whatever the format
    the grader demands."""
    correct = 0
    for problem, text in zip(problems, greedy_texts(model, tokenizer, problems, max_tokens), strict=True):
        if any_style:
            correct += right_in_any_format(problem, text)
        else:
            correct += task.grade(problem, text) == "correct"
    return correct / len(problems)


def first_turn_calls(model, tokenizer, task, problems: list[Problem], max_tokens: int) -> float:
    """Share of greedy first turns that are exactly the demonstration's tool call (multi-turn tasks)."""
    texts = greedy_texts(model, tokenizer, problems, max_tokens)
    return sum(
        text == task.demonstration(p)[1]["content"] for p, text in zip(problems, texts, strict=True)
    ) / len(problems)


def warm_up(base_dir: str | Path, out_dir: str | Path, task_cfg: TaskConfig, cfg: WarmupConfig) -> dict:
    """Train base_dir's model on canonical solutions, save to out_dir, return {'accuracy', 'seconds', ...}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # One thread on every machine: the thread count changes the order of floating-point sums, so the
    # warmed-up model (and the demo's starting point) would differ from box to box. On a 2-core box one
    # thread also measured 3-5x faster per step than two under load.
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    task = make_task(task_cfg)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.1 + 0.45 * (1 + math.cos(math.pi * step / max(1, cfg.steps)))
    )
    train = task.problems(shard_index=0, num_shards=1, seed=cfg.seed + 12345, split="train")
    style_rng = random.Random(cfg.seed)
    styles, weights = zip(*cfg.answer_styles.items(), strict=True)
    start = time.monotonic()
    model.train()
    losses = []
    demonstrate = getattr(task, "demonstration", None)  # multi-turn tasks: whole episodes
    bar = Progress(
        "warm-up",
        cfg.steps,
        every=25,
        line=lambda done, total, note: (
            f"  warm-up step {done}/{total}: {note} ({time.monotonic() - start:.0f}s)"
        ),
        stream=sys.stdout,
        unit="step",
    )
    for _ in range(cfg.steps):
        rows = []
        for _ in range(cfg.batch_size):
            problem = next(train)
            if demonstrate is not None and style_rng.random() < cfg.tool_share:
                rows.append(_encode_conversation(tokenizer, demonstrate(problem)))
                continue
            style = style_rng.choices(styles, weights)[0]
            seq, prompt_len = _encode(tokenizer, problem, styled_answer(problem, style, task))
            rows.append((seq, [False] * prompt_len + [True] * (len(seq) - prompt_len)))
        width = max(len(r[0]) for r in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (seq, trained) in enumerate(rows):
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, : len(seq)] = torch.where(torch.tensor(trained), torch.tensor(seq), -100)
            mask[i, : len(seq)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        recent = losses[-25:]
        bar.advance(note=f"loss {sum(recent) / len(recent):.3f}")
    bar.close()
    seconds = time.monotonic() - start
    test = list(task.problems(shard_index=0, num_shards=1, seed=cfg.seed, split="test"))[: cfg.eval_problems]
    # Single turn: the first answer only (a multi-turn task's episodes are measured by the launcher's
    # evaluation through a server; here, how often the first turn answers directly and right).
    accuracy = greedy_accuracy(model, tokenizer, task, test, max_tokens=cfg.eval_max_tokens)
    # The same completions graded on the number alone, whatever the style: how much of the arithmetic
    # the model knows, as opposed to what the reward accepts.
    number_accuracy = greedy_accuracy(model, tokenizer, task, test, cfg.eval_max_tokens, any_style=True)
    measured = {}
    if demonstrate is not None:
        measured["first_turn_calls"] = first_turn_calls(model, tokenizer, task, test, cfg.eval_max_tokens)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    for extra in ("generation_config.json", "tiny_model_spec.json"):
        if (Path(base_dir) / extra).exists():
            (out / extra).write_bytes((Path(base_dir) / extra).read_bytes())
    result = {
        "accuracy": accuracy,
        "number_accuracy": number_accuracy,
        "seconds": seconds,
        "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        **measured,
        "warmup": cfg.model_dump(),
        "task": task_cfg.model_dump(),
    }
    (out / "warmup.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-operand", type=int, default=99)
    parser.add_argument("--operators", default="+-")
    parser.add_argument("--eval-problems", type=int, default=200)
    args = parser.parse_args(argv)
    task_cfg = TaskConfig(
        name="arith", options={"max_operand": args.max_operand, "operators": args.operators}
    )
    cfg = WarmupConfig(
        steps=args.steps, batch_size=args.batch_size, learning_rate=args.lr, eval_problems=args.eval_problems
    )
    print(json.dumps(warm_up(args.base, args.out, task_cfg, cfg), indent=2))


if __name__ == "__main__":
    main()
