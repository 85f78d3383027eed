"""Where a `remainder` model's wrong answers go wrong: greedy held-out answers, first wrong line.

    .venv/bin/python scripts/diag/remainder_errors.py artifacts/tiny-remainder          # ~30 s, one core
    .venv/bin/python scripts/diag/remainder_errors.py runs/<run>/checkpoints/<step> --problems 200

Decodes the recipe's held-out problems greedily with HF `generate` (no server), then, for every answer
whose last number is not the remainder (in any format, `answer: +N` too), compares its lines with the
worked solution and names the first difference: `subtraction` (right operands, wrong result), `copy`
(the line does not start from the previous result), `lines` (every line right, too few or too many).
docs/decisions.md ("The long-answer task") quotes its output for the warmed-up model.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter


def first_wrong_line(got: list[str], want: list[str]) -> str:
    for mine, right in zip(got, want, strict=False):
        if mine != right:
            return "copy" if mine.split("-")[0] != right.split("-")[0] else "subtraction"
    return "lines"


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline_rl.launch.demo import RECIPES
    from pipeline_rl.sft_warmup import greedy_texts
    from pipeline_rl.tasks import held_out_problems, make_task

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model directory (HF format)")
    parser.add_argument("--problems", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=320)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    task = make_task(RECIPES["remainder"].task)
    problems = held_out_problems(task, args.problems)
    kinds: Counter[str] = Counter()
    # The same greedy answers, and "right in any format" rule, as the warm-up's report (sft_warmup).
    for problem, text in zip(
        problems, greedy_texts(model, tokenizer, problems, args.max_tokens), strict=True
    ):
        kinds[f"graded {task.grade(problem, text)}"] += 1
        numbers = re.findall(r"-?\d+", text)
        if numbers and numbers[-1] == problem.answer:
            kinds["right in any format"] += 1
            continue
        got = [line for line in text.split("\n") if "=" in line]
        want = task.solution_text(problem).split("\n")[:-1]  # the worked lines, without `answer: N`
        kinds[f"wrong: {first_wrong_line(got, want)}"] += 1
    for kind, count in sorted(kinds.items()):
        print(f"{kind:24} {count}")


if __name__ == "__main__":
    main()
