"""Held-out accuracy of a model in this process: greedy Hugging Face `generate` of a task's test problems,
graded by the task. The one evaluator of the vs-TRL benchmark for both sides: TRL's run calls it between its
steps (benchmarks/trl_grpo.py, in TRL's venv: so this module needs only torch, transformers and
pipeline_rl.tasks), and ours evaluates the weight snapshots a run saved (trainer.snapshot_every_s) after
the run, so neither side's clock carries its evaluations.
"""

from __future__ import annotations

import json
from pathlib import Path


def held_out_accuracy(model, tokenizer, task, problems: list, max_tokens: int) -> float:
    """Share of `problems` whose greedy answer (at most max_tokens new tokens) the task grades correct.
    The tokenizer must pad on the left."""
    import torch

    was_training = model.training
    model.eval()
    texts = [
        tokenizer.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True)
        for p in problems
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        generated = model.generate(
            **batch,
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    answers = tokenizer.batch_decode(generated[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    model.train(was_training)
    return sum(task.grade(p, a) == "correct" for p, a in zip(problems, answers, strict=True)) / len(problems)


def evaluate_snapshots(run_dir: Path, task_cfg, num_problems: int, max_tokens: int) -> list[dict]:
    """Evaluate every weight snapshot of a finished run (run_dir/snapshots, oldest first) and append one
    {"type": "eval", "when": "snapshot", "time", "weight_version", "accuracy", ...} row per snapshot to
    run_dir/stats.jsonl, timed when the trainer saved it (right after pushing that version). Returns the
    rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline_rl.run_dir import SNAPSHOTS, read_snapshots
    from pipeline_rl.tasks import held_out_problems, make_task

    task = make_task(task_cfg)
    problems = held_out_problems(task, num_problems)
    snapshots = read_snapshots(run_dir)
    rows = []
    tokenizer = None
    for snap in snapshots:
        path = Path(run_dir) / SNAPSHOTS / snap["path"]
        if tokenizer is None:  # every snapshot carries the run's tokenizer files
            tokenizer = AutoTokenizer.from_pretrained(path)
            tokenizer.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(path)
        accuracy = held_out_accuracy(model, tokenizer, task, problems, max_tokens)
        rows.append(
            {
                "type": "eval",
                "when": "snapshot",
                "time": snap["time"],
                "weight_version": snap["version"],
                "accuracy": accuracy,
                "problems": len(problems),
            }
        )
    with (Path(run_dir) / "stats.jsonl").open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def evaluate_run(run_dir: Path) -> None:
    """Grade every weight snapshot a finished run saved (evaluate_snapshots, HF greedy on the
    run's held-out problems), appending eval rows timed when each was saved: after the run, so the
    evaluations neither take the run's cores nor its time. Then delete the graded weights. A run graded
    before is left as it is (its rows are in stats.jsonl; its weights are gone)."""
    import shutil

    from pipeline_rl.config import load_run_config
    from pipeline_rl.run_dir import SNAPSHOTS, read_snapshots

    graded = run_dir / SNAPSHOTS / "GRADED"
    if graded.exists():
        return
    cfg = load_run_config(run_dir / "config.json")
    evaluate_snapshots(run_dir, cfg.task, cfg.eval.num_problems, cfg.eval.max_tokens)
    graded.parent.mkdir(parents=True, exist_ok=True)  # a run may have saved no snapshot
    graded.touch()  # before the weights go: a second call must not grade what is half deleted
    # Graded: the eval rows in stats.jsonl are what the benches read. The weights (~100 MB a demo-size run
    # at one save every 3 s) go; the index stays, naming what was saved when.
    for snap in read_snapshots(run_dir):
        shutil.rmtree(run_dir / SNAPSHOTS / snap["path"])
