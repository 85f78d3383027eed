"""Tasks, grading and rewards (pipeline_rl/tasks). No network: datasets are written to tmp_path.

    .venv/bin/python -m pytest -q tests/test_tasks.py

Grading tests use real math-verify in real worker processes; the slow-grading tests inject
`_sleepy_grade` (below) through the same pool path, or use an input math-verify cannot finish.
Workers unpickle `_sleepy_grade` by importing this module, which pytest's default (prepend) import
mode makes importable.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from itertools import islice
from pathlib import Path

import datasets
import huggingface_hub.constants
import pytest
from pydantic import ValidationError

from pipeline_rl.tasks import (
    ARITH_ALPHABET,
    ArithTask,
    Grader,
    Problem,
    RewardConfig,
    TaskConfig,
    arith_solution_text,
    compute_reward,
    make_task,
)
from pipeline_rl.tasks.arith import evaluate
from pipeline_rl.tasks.data import DatasetNotFoundError
from pipeline_rl.tasks.dataset import DatasetTask
from pipeline_rl.tasks.math_grading import last_boxed
from pipeline_rl.tasks.pool import WorkerError


def _sleepy_grade(problem: Problem, completion_text: str) -> str:
    """A deliberately slow grader: sleeps `float(completion_text)` seconds (runs in a pool worker)."""
    time.sleep(float(completion_text))
    return "correct"


def _problem(answer: str) -> Problem:
    return Problem(prompt_index=0, messages=[{"role": "user", "content": "?"}], answer=answer)


def _take(task, n: int, **kwargs) -> list[Problem]:
    return list(islice(task.problems(**kwargs), n))


# ---------------------------------------------------------------- arith


@pytest.mark.parametrize(
    ("text", "grade"),
    [
        ("answer: -9", "correct"),
        ("answer:-9", "correct"),
        ("3-12 is negative.\nanswer: -9 (done)", "correct"),
        ("answer: -9.", "correct"),
        ("answer: 4 no wait answer: -9", "correct"),
        ("answer: 9", "wrong"),
        ("answer: -90", "wrong"),
        ("answer: -9 no wait answer: 4", "wrong"),
        ("-9", "unparseable"),
        ("Answer: -9", "unparseable"),
        ("answer: -9.5", "unparseable"),
        ("answer: +9", "unparseable"),
        ("answer: minus nine", "unparseable"),
        ("", "unparseable"),
    ],
)
def test_arith_grading_is_exact(text, grade):
    assert ArithTask().grade(_problem("-9"), text) == grade


def test_arith_evaluate_respects_precedence():
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([2, 3, 4, 1], ["-", "*", "-"]) == -11
    task = ArithTask(num_operands=4, max_operand=12, operators="+-*")
    for problem in _take(task, 200, shard_index=0, num_shards=1, seed=3, split="train"):
        assert int(problem.answer) == eval(problem.metadata["expr"])  # our own generated digits and + - *


def test_arith_prompt_and_solution_format():
    task = ArithTask()
    problem = _take(task, 1, shard_index=0, num_shards=1, seed=0, split="train")[0]
    expr = problem.metadata["expr"]
    assert problem.messages == [{"role": "user", "content": f"What is {expr}? Reply with answer: <integer>"}]
    assert arith_solution_text(problem) == f"answer: {problem.answer}"


def test_arith_shards_are_disjoint_deterministic_and_independent_of_shard_count():
    task = ArithTask()
    shards = [_take(task, 100, shard_index=s, num_shards=3, seed=7, split="train") for s in range(3)]
    indices = [p.prompt_index for shard in shards for p in shard]
    assert sorted(indices) == list(range(300))
    again = _take(task, 100, shard_index=1, num_shards=3, seed=7, split="train")
    assert again == shards[1]
    other_seed = _take(task, 100, shard_index=1, num_shards=3, seed=8, split="train")
    assert [p.metadata["expr"] for p in other_seed] != [p.metadata["expr"] for p in shards[1]]
    single = _take(task, 300, shard_index=0, num_shards=1, seed=7, split="train")
    assert {p.prompt_index: p.metadata["expr"] for p in single} == {
        p.prompt_index: p.metadata["expr"] for shard in shards for p in shard
    }
    with pytest.raises(ValueError, match="shard_index"):
        next(task.problems(shard_index=3, num_shards=3, seed=0, split="train"))


def test_arith_test_split_is_fixed_and_disjoint_from_train():
    # A small space (200 expressions), so train would hit test expressions often if it did not skip them.
    task = ArithTask(num_operands=2, max_operand=9, operators="+-", test_size=50)
    test = [p for s in range(2) for p in task.problems(shard_index=s, num_shards=2, seed=0, split="test")]
    assert sorted(p.prompt_index for p in test) == list(range(50))
    test_exprs = {p.metadata["expr"] for p in test}
    assert len(test_exprs) == 50
    for seed in (0, 1):
        train = _take(task, 2000, shard_index=0, num_shards=1, seed=seed, split="train")
        assert not test_exprs & {p.metadata["expr"] for p in train}
    # The test set depends on the difficulty only, not on the seed or the instance.
    assert [p.metadata["expr"] for p in ArithTask(2, 9, "+-", 50).problems(0, 1, 123, "test")] == [
        p.metadata["expr"] for p in task.problems(0, 1, 0, "test")
    ]


def test_arith_solutions_grade_correct_and_alphabet_covers_everything():
    assert set(ARITH_ALPHABET) <= {chr(c) for c in range(32, 127)}  # the tiny tokenizer's printable ASCII
    for task in (ArithTask(), ArithTask(num_operands=3, max_operand=999, operators="+-*")):
        problems = _take(task, 300, shard_index=0, num_shards=1, seed=0, split="train")
        problems += list(task.problems(shard_index=0, num_shards=1, seed=0, split="test"))
        assert any(int(p.answer) < 0 for p in problems)
        for problem in problems:
            solution = arith_solution_text(problem)
            assert task.grade(problem, solution) == "correct"
            text = "".join(m["content"] for m in problem.messages) + solution
            assert set(text) <= set(ARITH_ALPHABET), set(text) - set(ARITH_ALPHABET)


def test_warmup_answer_styles_differ_only_in_what_the_grader_accepts():
    from pipeline_rl.demo.warmup import ANSWER_STYLES, WarmupConfig, styled_answer

    task = ArithTask(max_operand=29, operators="+-")
    problems = _take(task, 300, shard_index=0, num_shards=1, seed=0, split="train")
    assert any(p.answer.startswith("-") for p in problems) and any(p.answer != "0" for p in problems)
    for problem in problems:
        plain, signed = styled_answer(problem, "answer"), styled_answer(problem, "signed")
        assert plain == arith_solution_text(problem) and task.grade(problem, plain) == "correct"
        if problem.answer.startswith("-"):
            assert signed == plain  # a negative result reads the same in both styles
        else:
            assert signed == f"answer: +{problem.answer}" and task.grade(problem, signed) == "unparseable"
        assert set(signed) <= set(ARITH_ALPHABET)
    assert set(ANSWER_STYLES) == {"answer", "signed"}
    for bad in ({}, {"answer": -1.0}, {"answer": 0.0}, {"boxed": 1.0}):
        with pytest.raises(ValueError, match="answer_styles"):
            WarmupConfig(answer_styles=bad)


def test_task_config_validates_arith_difficulty():
    assert isinstance(make_task(TaskConfig()), ArithTask)
    with pytest.raises(ValueError, match="test_size"):  # the whole difficulty is checked as the task is built
        make_task(TaskConfig(options={"max_operand": 3}, test_size=100))
    with pytest.raises(ValueError, match="task.options.operators"):
        make_task(TaskConfig(options={"operators": "+/"}))
    with pytest.raises(ValidationError):
        TaskConfig(nme="arith")  # typos are errors, not ignored
    with pytest.raises(ValidationError, match="task.options.max_operandd: Extra inputs"):
        TaskConfig(options={"max_operandd": 3})  # the task's own model checks its options
    with pytest.raises(ValidationError, match="task.arith_max_operand is now task.options.max_operand"):
        TaskConfig(arith_max_operand=3)


# ---------------------------------------------------------------- math grading


@pytest.fixture(scope="module")
def math_task(tmp_path_factory) -> DatasetTask:
    path = tmp_path_factory.mktemp("math") / "math.jsonl"
    rows = [{"problem": f"What is {i}/2?", "solution": f"$\\boxed{{\\frac{{{i}}}{{2}}}}$"} for i in range(3)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return make_task(TaskConfig(name="math", dataset_path=str(path), test_size=1))


@pytest.fixture(scope="module")
def math_grader(math_task):
    with Grader(math_task, timeout_s=30.0, num_workers=2) as grader:
        yield grader


@pytest.mark.parametrize(
    ("gold", "text", "grade"),
    [
        ("1/2", "so the answer is \\boxed{0.5}.", "correct"),
        ("0.5", "\\boxed{\\frac{1}{2}}", "correct"),
        ("\\frac{1}{2}", "\\boxed{0.50}", "correct"),
        ("\\frac12", "\\boxed{1/2}", "correct"),
        ("\\{1,2\\}", "\\boxed{\\{2, 1\\}}", "correct"),
        ("18", "first \\boxed{3}, then \\boxed{18}", "correct"),
        ("1/2", "\\boxed{0.51}", "wrong"),
        ("1/2", "\\boxed{2}", "wrong"),
        ("18", "\\boxed{18} no, \\boxed{17}", "wrong"),
        ("1/2", "the answer is 0.5", "unparseable"),
        ("1/2", "\\boxed{}", "unparseable"),
        ("1/2", "\\boxed{0.5", "unparseable"),
    ],
)
def test_math_grading_accepts_equivalent_answers(math_grader, gold, text, grade):
    assert math_grader.grade(_problem(gold), text) == grade


def test_last_boxed_handles_nesting_and_escaped_braces():
    assert last_boxed("\\boxed{\\frac{1}{\\sqrt{2}}} and \\boxed{\\{1\\}}") == "\\{1\\}"
    assert last_boxed("\\boxed 5$ or \\fbox{6}") == "6"
    assert last_boxed("\\boxed{1} \\boxed{2") == "1"
    assert last_boxed("nothing") is None


def test_math_grading_times_out_and_replaces_the_worker(math_task):
    timeout_s = 1.0
    with Grader(math_task, timeout_s=timeout_s, num_workers=1) as grader:
        problem = _problem("1")
        assert grader.grade(problem, "\\boxed{1.0}") == "correct"  # worker started and warm
        (pid,) = grader.worker_pids()
        start = time.monotonic()
        # Parses at once, but comparing 9^(9^(9^9)) with 1 never finishes (sympy, inside C).
        assert grader.grade(problem, "\\boxed{9^{9^{9^{9}}}}") == "unparseable"
        assert time.monotonic() - start < 10 * timeout_s
        assert grader.stats()["grade_timeouts"] == 1
        assert grader.grade(problem, "\\boxed{2}") == "wrong"  # the pool works afterwards ...
        assert grader.worker_pids() != [pid]  # ... with a new worker process


def test_async_grading_does_not_block_the_event_loop(math_task):
    with Grader(math_task, timeout_s=1.0, num_workers=1, grade_fn=_sleepy_grade) as grader:
        assert grader.grade(_problem("x"), "0") == "correct"  # wait for the worker to start
        with pytest.raises(WorkerError, match="could not convert"):
            grader.grade(_problem("x"), "not a number")  # errors in the grading function propagate

        async def main() -> tuple[str, str, int]:
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            tick_task = asyncio.create_task(ticker())
            slow = await grader.grade_async(_problem("x"), "0.3")  # finishes in time
            stuck = await grader.grade_async(_problem("x"), "60")  # killed at the timeout
            tick_task.cancel()
            return slow, stuck, ticks

        start = time.monotonic()
        slow, stuck, ticks = asyncio.run(main())
        assert (slow, stuck) == ("correct", "unparseable")
        assert time.monotonic() - start < 10  # the 60 s grade did not run to the end
        assert ticks >= 20  # ~130 expected in 1.3 s; a blocked loop would tick about twice


def test_arith_grades_inline_through_the_same_api():
    task = ArithTask()
    problem = _take(task, 1, shard_index=0, num_shards=1, seed=0, split="train")[0]
    with Grader(task) as grader:
        assert grader.worker_pids() == []
        assert grader.grade(problem, arith_solution_text(problem)) == "correct"
        assert asyncio.run(grader.grade_async(problem, "answer: x")) == "unparseable"


# ---------------------------------------------------------------- gsm8k / math data


def _gsm8k_rows(n: int) -> list[dict[str, str]]:
    return [
        {"question": f"Tom has {i} apples. How many?", "answer": f"He has {i}.\n#### {i},000"}
        for i in range(n)
    ]


def test_gsm8k_loads_jsonl_and_holds_out_a_test_split(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _gsm8k_rows(10)))
    task = make_task(TaskConfig(name="gsm8k", dataset_path=str(path), test_size=3))
    test = list(task.problems(shard_index=0, num_shards=1, seed=0, split="test"))
    train = _take(task, 7, shard_index=0, num_shards=1, seed=0, split="train")
    assert len(test) == 3
    assert sorted(p.answer for p in test + train) == sorted(f"{i}000" for i in range(10))
    assert "\\boxed{}" in train[0].messages[0]["content"]
    assert task.grade(train[0], f"\\boxed{{{train[0].answer}}}") == "correct"
    # Train iterates forever, reshuffled per epoch, with prompt indices unique over the run.
    shard = _take(task, 21, shard_index=1, num_shards=2, seed=0, split="train")
    assert Counter(p.metadata["row"] for p in shard) == {1: 7, 3: 7, 5: 7}
    assert len({p.prompt_index for p in shard}) == 21


def test_math_loads_parquet_and_extracts_boxed_answers(tmp_path):
    rows = [  # `answer`, when present, wins over the solution's last box
        {"problem": "Half of one?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "answer": None},
        {"problem": "Two plus two?", "solution": "First \\boxed{3}, no: $\\boxed{4}$", "answer": None},
        {"problem": "No answer here", "solution": "unboxed 7", "answer": None},  # skipped
        {"problem": "Given answer", "solution": "", "answer": "x^2"},
    ]
    rows = [{**row, "level": f"Level {i}"} for i, row in enumerate(rows)]
    path = tmp_path / "math.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    task = make_task(TaskConfig(name="math", dataset_path=str(path), test_size=1))
    problems = _take(task, 2, shard_index=0, num_shards=1, seed=0, split="train")
    problems += list(task.problems(shard_index=0, num_shards=1, seed=0, split="test"))
    assert sorted(p.answer for p in problems) == ["4", "\\frac{1}{2}", "x^2"]
    assert all(p.metadata["level"].startswith("Level") for p in problems)


def test_save_to_disk_dataset_dict_keeps_its_test_split(tmp_path):
    rows = _gsm8k_rows(6)
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:4]), "test": datasets.Dataset.from_list(rows[4:])}
    ).save_to_disk(str(tmp_path / "gsm8k"))
    task = make_task(TaskConfig(name="gsm8k", dataset_path=str(tmp_path / "gsm8k")))
    test = list(task.problems(shard_index=0, num_shards=1, seed=0, split="test"))
    assert [p.answer for p in test] == ["4000", "5000"]


def test_hub_cache_snapshot_is_used_without_network(tmp_path, monkeypatch):
    # The layout huggingface_hub writes for `openai/gsm8k`: refs/main names the snapshot to use.
    repo = tmp_path / "datasets--openai--gsm8k"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    data_dir = repo / "snapshots" / "0123abcd" / "main"
    data_dir.mkdir(parents=True)
    rows = _gsm8k_rows(5)
    datasets.Dataset.from_list(rows[:3]).to_parquet(str(data_dir / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list(rows[3:]).to_parquet(str(data_dir / "test-00000-of-00001.parquet"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    task = make_task(TaskConfig(name="gsm8k"))
    assert len(list(task.problems(shard_index=0, num_shards=1, seed=0, split="test"))) == 2


def test_missing_data_gives_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(DatasetNotFoundError, match="dataset_path"):
        make_task(TaskConfig(name="gsm8k", dataset_path=str(tmp_path / "missing.jsonl")))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(DatasetNotFoundError, match="task.dataset_path.*DigitalLearningGmbH/MATH-lighteval"):
        make_task(TaskConfig(name="math"))


# ---------------------------------------------------------------- rewards


def test_reward_table_defaults():
    cfg = RewardConfig()
    assert compute_reward("correct", "stop", 10, 100, cfg) == 1.0
    assert compute_reward("wrong", "stop", 10, 100, cfg) == 0.0
    assert compute_reward("unparseable", "stop", 10, 100, cfg) == -0.5
    assert compute_reward("unparseable", "length", 100, 100, cfg) == -0.5  # no length shaping by default


def test_overlong_and_truncation_penalties():
    cfg = RewardConfig(overlong_buffer=100, overlong_penalty=1.0, length_penalty=0.25)
    # Penalty starts after 500 - 100 = 400 tokens and reaches 1.0 at 500.
    assert compute_reward("correct", "stop", 400, 500, cfg) == 1.0
    assert compute_reward("correct", "stop", 450, 500, cfg) == pytest.approx(0.5)
    assert compute_reward("correct", "stop", 475, 500, cfg) == pytest.approx(0.25)
    assert compute_reward("wrong", "length", 500, 500, cfg) == pytest.approx(-1.25)
    assert compute_reward("wrong", "length", 520, 500, cfg) == pytest.approx(-1.25)  # capped at the buffer
    half = RewardConfig(overlong_buffer=10, overlong_penalty=0.5)
    assert compute_reward("unparseable", "stop", 98, 100, half) == pytest.approx(-0.5 - 0.4)
    with pytest.raises(ValueError, match="overlong_buffer"):
        compute_reward("correct", "stop", 1, 100, RewardConfig(overlong_buffer=100))


def test_a_calc_demonstration_trains_only_the_models_turns():
    from pipeline_rl.demo.tiny_model import build_tokenizer
    from pipeline_rl.demo.warmup import _encode_conversation
    from pipeline_rl.tasks.calc import CalcTask

    tokenizer = build_tokenizer()
    task = CalcTask(max_operand=99, test_size=10)
    problem = next(task.problems(0, 1, seed=0, split="train"))
    ids, trained = _encode_conversation(tokenizer, task.demonstration(problem))
    assert ids == tokenizer.apply_chat_template(task.demonstration(problem), return_dict=False)[:-1]
    model_text = tokenizer.decode([t for t, keep in zip(ids, trained, strict=True) if keep])
    expr = problem.metadata["expr"]
    call = '<tool_call>{"name": "calc", "arguments": {"expression": "' + expr + '"}}</tool_call>'
    assert model_text == f"{call}<|im_end|>answer: {problem.answer}<|im_end|>"


def test_the_calc_environment_turns_every_bad_call_into_an_observation():
    import asyncio

    from pipeline_rl.tasks.calc import NUDGE, CalcTask, tool_call_text

    task = CalcTask(max_operand=99, test_size=10, tool_timeout_s=2)
    problem = next(task.problems(0, 1, seed=0, split="train"))
    env = task.environment(problem)

    def reply(text: str):
        return asyncio.run(env.reply(text, "stop"))

    assert reply(tool_call_text(problem.metadata["expr"])) == [{"role": "tool", "content": problem.answer}]
    assert reply('<tool_call>{"name": "calc", "argu')[0]["content"].startswith("error: malformed tool call")
    assert (
        "unknown tool 'sh'" in reply('<tool_call>{"name": "sh", "arguments": {}}</tool_call>')[0]["content"]
    )
    assert "not integer arithmetic" in reply(tool_call_text("open('x')"))[0]["content"]
    assert "did not finish" in reply(tool_call_text("9**9**9"))[0]["content"]
    assert reply("I think it is big") == [{"role": "user", "content": NUDGE}]
    assert reply(f"answer: {problem.answer}") is None
    assert env.calls == 5 and env.faults == ["malformed_call", "unknown_tool", "tool_error", "tool_error"]


def test_remainder_worked_answers_subtract_down_and_lengths_have_a_long_tail():
    from pipeline_rl.demo.warmup import styled_answer
    from pipeline_rl.tasks.remainder import RemainderTask, subtraction_lines

    assert subtraction_lines(23, 7) == ["23-7=16", "16-7=9", "9-7=2"]
    assert subtraction_lines(7, 7) == ["7-7=0"]
    task = RemainderTask(max_steps=30, max_divisor=9)
    problems = _take(task, 2000, shard_index=0, num_shards=1, seed=0, split="train")
    lengths = []
    for problem in problems:
        number, divisor = (int(x) for x in problem.metadata["expr"].split(" mod "))
        assert 2 <= divisor <= 9 and 1 <= number // divisor <= 30 == task.max_steps
        assert problem.messages[0]["content"].startswith(
            f"Subtract {divisor} from {number} until less than {divisor} is left."
        )
        solution = task.solution_text(problem)
        lines = solution.split("\n")
        assert len(lines) == number // divisor + 1 and lines[-1] == f"answer: {number % divisor}"
        left = number
        for line in lines[:-1]:
            # every line is a true subtraction from the previous line's result
            assert line == f"{left}-{divisor}={left - divisor}"
            left -= divisor
        assert 0 <= left < divisor
        assert task.grade(problem, solution) == "correct"
        signed = styled_answer(problem, "signed", task)
        assert signed.rsplit("\n", 1)[0] == solution.rsplit("\n", 1)[0]  # only the final line differs
        assert signed.endswith(f"answer: +{left}") and task.grade(problem, signed) == "unparseable"
        assert set(solution) <= {chr(c) for c in range(32, 127)} | {"\n"}  # the tiny tokenizer's characters
        lengths.append(len(solution))
    lengths.sort()
    # Character tokenizer: tokens = characters. Log-uniform line counts: most answers short, a long tail.
    assert lengths[0] <= 20 and lengths[-1] >= 250
    assert lengths[len(lengths) // 2] < 100 < lengths[int(0.9 * len(lengths))]
    assert task.grade(problems[0], "no number here") == "unparseable"
    assert task.grade(problems[0], f"answer: {int(problems[0].answer) + 1}") == "wrong"


def test_remainder_splits_are_disjoint_and_the_config_says_what_to_fix():
    from pipeline_rl.tasks.remainder import RemainderTask

    task = make_task(TaskConfig(name="remainder", options={"max_steps": 10}, test_size=100))
    test = {p.metadata["expr"] for p in task.problems(0, 1, 0, "test")}
    assert len(test) == 100
    train = _take(task, 3000, shard_index=0, num_shards=1, seed=1, split="train")
    assert not test & {p.metadata["expr"] for p in train}
    assert _take(task, 50, shard_index=1, num_shards=2, seed=1, split="train") == _take(
        task, 50, shard_index=1, num_shards=2, seed=1, split="train"
    )
    with pytest.raises(ValueError, match="test_size=500"):
        RemainderTask(max_steps=1, max_divisor=3, test_size=500)  # only 5 distinct problems
    with pytest.raises(ValueError, match="greater than or equal to 2"):
        TaskConfig(name="remainder", options={"max_divisor": 1})


@pytest.mark.parametrize("name", ["arith", "calc", "remainder"])
def test_every_demo_recipe_composes_and_its_longest_answer_fits_the_context(name, tmp_path):
    from transformers import AutoTokenizer

    from pipeline_rl.demo.main import RECIPES
    from pipeline_rl.demo.tiny_model import build_tiny_model
    from pipeline_rl.launch.compose import compose

    recipe = RECIPES[name]
    cfg = compose(["model_path=unused", *recipe.overrides])
    assert cfg.task == recipe.task.model_copy(update={"test_size": cfg.task.test_size})
    assert cfg.inference.max_model_len <= recipe.model.max_position_embeddings
    if name == "calc":
        return  # episodes: the token budget, not one answer, bounds the context (test_episodes.py)
    task = make_task(cfg.task)
    problems = _take(task, 500, shard_index=0, num_shards=1, seed=0, split="train")
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "model", recipe.model))
    for problem in problems:
        prompt = tokenizer.apply_chat_template(
            problem.messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        solution = getattr(task, "solution_text", None)
        answer = solution(problem) if solution else f"answer: {problem.answer}"
        answer_tokens = len(tokenizer(answer, add_special_tokens=False)["input_ids"]) + 1  # + end of turn
        assert answer_tokens <= cfg.actor.max_tokens, (problem.metadata, answer_tokens)
        assert len(prompt) + cfg.actor.max_tokens <= cfg.inference.max_model_len, problem.metadata


def test_the_demo_notes_a_warm_up_far_below_the_recorded_runs(capsys) -> None:
    """A warm-up that learned much less arithmetic than the recorded runs is named, with what it means
    for RL; one at the recorded level is not."""
    from pipeline_rl.demo.main import RECIPES, _note_if_below_recorded

    recorded = RECIPES["arith"].recorded_number_accuracy
    _note_if_below_recorded(RECIPES["arith"], {"accuracy": 0.0, "number_accuracy": 0.525})
    note = capsys.readouterr().out
    assert "52.5%" in note and f"{recorded:.1%} or more" in note and "lower held-out accuracy" in note
    _note_if_below_recorded(RECIPES["arith"], {"accuracy": 0.0, "number_accuracy": recorded})
    _note_if_below_recorded(RECIPES["calc"], {"accuracy": 0.0, "first_turn_calls": 0.3})
    assert capsys.readouterr().out == ""


def test_the_demos_warm_up_figure_is_the_lowest_of_the_recorded_runs() -> None:
    """The figure the demo's note compares with is the lowest warm-up of the runs recorded in
    benchmarks/results/demo.json (`python -m benchmarks demo`), whose range the README quotes."""
    import json

    from pipeline_rl.demo.main import RECIPES

    record = json.loads(
        (Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "demo.json").read_text()
    )
    (table,) = record["tables"]
    column = table["headers"].index("warm-up: sum right / graded")
    lowest = min(float(row[column].split("%")[0]) for row in table["rows"]) / 100
    assert RECIPES["arith"].recorded_number_accuracy == pytest.approx(lowest)
