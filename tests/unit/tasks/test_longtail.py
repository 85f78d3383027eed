"""`longtail`: remainder's worked subtractions with most answers short and a tail of long ones."""

from __future__ import annotations

from itertools import islice

import pytest

from pipeline_rl.tasks import TaskConfig, make_task
from pipeline_rl.tasks.longtail import LongtailTask, answer_lengths, histogram_table, length_stats
from pipeline_rl.tasks.remainder import operands


def _take(task, n: int, **kwargs) -> list:
    return list(islice(task.problems(**kwargs), n))


@pytest.fixture(scope="module")
def recipe():
    from pipeline_rl.launch.compose import compose

    return compose(["recipe=demo-longtail", "model_path=unused"])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model

    # The demo's character tokenizer, whatever the model's size: a token per character.
    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec()))


def _count(tokenizer):
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_worked_answers_subtract_down_and_only_the_final_answer_is_graded():
    from pipeline_rl.demo.warmup import styled_answer

    task = make_task(TaskConfig(name="longtail"))
    assert task.name == "longtail"
    for problem in _take(task, 300, shard_index=0, num_shards=1, seed=0, split="train"):
        number, divisor = operands(problem.metadata["expr"])
        assert 2 <= divisor <= 19 and problem.metadata["steps"] == number // divisor
        assert number // divisor <= 2 or 20 <= number // divisor <= 30
        assert problem.messages[0]["content"].startswith(f"Subtract {divisor} from {number} until")
        solution = task.solution_text(problem)
        *lines, last = solution.split("\n")
        left = number
        for line in lines:
            assert line == f"{left}-{divisor}={left - divisor}"
            left -= divisor
        assert 0 <= left < divisor and last == f"answer: {left}" == f"answer: {problem.answer}"
        assert task.grade(problem, solution) == "correct"
        assert task.grade(problem, f"{lines[0]}\nanswer: {left + 1}") == "wrong"
        assert task.grade(problem, styled_answer(problem, "signed", task)) == "unparseable"
        assert task.grade(problem, solution.replace("answer:", "so")) == "unparseable"
        assert task.final_answer(solution) == problem.answer


def test_problems_are_deterministic_and_shards_partition_the_stream():
    a, b = LongtailTask(test_size=100), LongtailTask(test_size=100)
    assert _take(a, 40, shard_index=0, num_shards=1, seed=3, split="train") == _take(
        b, 40, shard_index=0, num_shards=1, seed=3, split="train"
    )
    assert _take(a, 40, shard_index=0, num_shards=1, seed=3, split="train") != _take(
        a, 40, shard_index=0, num_shards=1, seed=4, split="train"
    )
    whole = _take(a, 40, shard_index=0, num_shards=1, seed=3, split="train")
    halves = [_take(a, 20, shard_index=s, num_shards=2, seed=3, split="train") for s in (0, 1)]
    assert sorted(whole, key=lambda p: p.prompt_index) == sorted(
        halves[0] + halves[1], key=lambda p: p.prompt_index
    )
    # The test split is the same for every seed and every instance.
    assert list(a.problems(0, 1, 0, "test")) == list(b.problems(0, 1, 7, "test"))


def test_train_and_test_are_disjoint_and_keep_the_mixture(recipe):
    task = make_task(recipe.task)
    test = list(task.problems(0, 1, 0, "test"))
    exprs = {p.metadata["expr"] for p in test}
    assert len(test) == len(exprs) == recipe.task.test_size == 100
    train = _take(task, 4000, shard_index=0, num_shards=1, seed=1, split="train")
    assert not exprs & {p.metadata["expr"] for p in train}
    # Held-out draws are redrawn with their line count, so train keeps the configured share of long
    # problems although far more short ones are held out; the test split has it exactly.
    long_train = sum(p.metadata["steps"] >= 20 for p in train) / len(train)
    assert 0.18 < long_train < 0.22
    assert sum(p.metadata["steps"] >= 20 for p in test) == 20
    assert sum(p.metadata["steps"] >= 20 for p in test[:50]) == 10  # every prefix, the evaluators' too


@pytest.mark.parametrize("test_size", [100, 200])
def test_answer_lengths_have_a_long_tail(tokenizer, test_size):
    task = LongtailTask(test_size=test_size)
    count = _count(tokenizer)
    assert count("12-5=7") == 6  # a token per character
    stats = length_stats(answer_lengths(task, task.problems(0, 1, 0, "test"), count))
    assert stats["p50"] <= 25 and stats["ratio"] >= 10, stats
    train = _take(task, 2000, shard_index=0, num_shards=1, seed=0, split="train")
    assert length_stats(answer_lengths(task, train, count))["ratio"] >= 10


def test_length_stats_and_histogram():
    assert length_stats(range(1, 11)) == {"p50": 5, "p90": 9, "max": 10, "mean": 5.5, "ratio": 1.8}
    table = histogram_table([1, 2, 45], width=20).splitlines()
    assert table[2:] == [
        "| 0-19 | 2 | " + "#" * 67 + " |",
        "| 20-39 | 0 |  |",
        "| 40-59 | 1 | " + "#" * 33 + " |",
    ]


def test_the_recipes_longest_answer_fits_its_context(recipe, tokenizer):
    task = make_task(recipe.task)
    assert recipe.inference.max_model_len <= 512  # the long demo model's positions
    problems = list(task.problems(0, 1, 0, "test")) + _take(
        task, 1000, shard_index=0, num_shards=1, seed=0, split="train"
    )
    count = _count(tokenizer)
    for problem in problems:
        prompt = tokenizer.apply_chat_template(
            problem.messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert count(task.solution_text(problem)) + 1 <= recipe.actor.max_tokens  # + end of turn
        assert recipe.eval.max_tokens >= recipe.actor.max_tokens
        assert len(prompt) + recipe.actor.max_tokens <= recipe.inference.max_model_len


def test_options_are_checked_with_what_to_fix():
    with pytest.raises(ValueError, match="tail_min_steps"):
        TaskConfig(name="longtail", options={"short_steps": 5, "tail_min_steps": 4})
    with pytest.raises(ValueError, match="tail_share"):
        TaskConfig(name="longtail", options={"tail_share": 1.0})
    with pytest.raises(ValueError, match="test_size=300"):
        LongtailTask(max_divisor=3, test_size=300)  # a handful of distinct short problems
    with pytest.raises(ValueError, match="leaving train none"):
        LongtailTask(max_divisor=3, test_size=10)  # all 5 one-line problems held out
