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
    from pipeline_rl.tasks import held_out_problems, make_task
    from pipeline_rl.tasks.remainder import subtraction_lines

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model directory (HF format)")
    parser.add_argument("--problems", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=320)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    task = make_task(RECIPES["remainder"].task)
    kinds: Counter[str] = Counter()
    for problem in held_out_problems(task, args.problems):
        ids = tokenizer.apply_chat_template(
            problem.messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False)
        text = tokenizer.decode(out[0][len(ids) :], skip_special_tokens=True)
        kinds[f"graded {task.grade(problem, text)}"] += 1
        divisor, number = map(
            int, re.match(r"Subtract (\d+) from (\d+)", problem.messages[-1]["content"]).groups()
        )
        numbers = re.findall(r"answer:\s*\+?(-?\d+)", text)
        if numbers and int(numbers[-1]) == number % divisor:
            kinds["right in any format"] += 1
            continue
        got = [line for line in text.split("\n") if "=" in line]
        kinds[f"wrong: {first_wrong_line(got, subtraction_lines(number, divisor))}"] += 1
    for kind, count in sorted(kinds.items()):
        print(f"{kind:24} {count}")


if __name__ == "__main__":
    main()
