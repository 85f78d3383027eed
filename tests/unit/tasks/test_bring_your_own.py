"""A user's own task, data and reward, brought by reference without editing the library: a task factory
`pkg.module:function` whose first parameter's model validates its options; a dataset task reading the
user's field names (a wrong name fails listing the fields the data has); a reward `pkg.module:function`
run in real grading worker processes, where every way it can fail (raises, hangs past the timeout,
returns NaN, None or text) gives a reason instead of stopping anything."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from pydantic import ValidationError

from pipeline_rl.tasks import Grader, TaskConfig, compute_reward, make_task
from pipeline_rl.tasks.reward import RewardConfig


def test_a_task_of_the_users_own_is_built_from_its_reference_with_its_own_options():
    cfg = TaskConfig(name="support.rewards:count_task", options={"up_to": 7}, test_size=3)
    assert cfg.options == {"up_to": 7}
    task = make_task(cfg)
    problems = list(task.problems(0, 1, 0, "test"))
    assert [p.answer for p in problems] == ["1", "2", "3"]
    assert task.grade(problems[1], "1 2") == "correct" and task.grade(problems[1], "one") == "unparseable"
    assert TaskConfig(name="support.rewards:count_task").options == {"up_to": 5}  # the model's defaults
    with pytest.raises(
        ValidationError, match=r"task.options.up_to: Input should be less than or equal to 50"
    ):
        TaskConfig(name="support.rewards:count_task", options={"up_to": 99})
    with pytest.raises(ValidationError, match=r"task.options.upto: Extra inputs.*its options: up_to"):
        TaskConfig(name="support.rewards:count_task", options={"upto": 3})


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("no_such_pkg.tasks:make", ["cannot import no_such_pkg.tasks", "PYTHONPATH"]),
        ("support.rewards:nothing_here", ["support.rewards has no 'nothing_here'"]),
        ("support.rewards:untyped_factory", ["annotate its first parameter"]),
        ("gsm9k", ["neither a built-in task", "gsm8k", "pkg.module:function"]),
    ],
)
def test_a_bad_task_reference_fails_at_startup_saying_what_to_do(name, words):
    with pytest.raises(ValidationError) as raised:
        TaskConfig(name=name)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


def test_a_bad_reward_reference_fails_at_startup():
    with pytest.raises(
        ValidationError, match="task.reward='support.rewards:nope': support.rewards has no 'nope'"
    ):
        TaskConfig(reward="support.rewards:nope")
    with pytest.raises(ValidationError, match="is not a reference"):
        TaskConfig(reward="digit_share")


def _rows(n: int) -> list[dict]:
    return [
        {"q": f"What is {i} + {i}?", "solution": f"Twice {i}. #### {2 * i}", "level": i % 3} for i in range(n)
    ]


def test_a_dataset_task_reads_the_users_fields_template_and_system_prompt(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(12)))
    options = {
        "prompt_field": "q",
        "answer_field": "solution",
        "answer_format": "gsm8k",
        "template": "Question (level {level}): {prompt}",
        "system_prompt": "Answer in \\boxed{}.",
        "metadata_fields": ["level"],
    }
    task = make_task(TaskConfig(name="dataset", dataset_path=str(path), options=options, test_size=4))
    test = list(task.problems(0, 1, 0, "test"))
    assert len(test) == 4 and task.num_problems("train") == 8
    first = test[0]
    assert first.messages[0] == {"role": "system", "content": "Answer in \\boxed{}."}
    assert (
        first.messages[1]["content"].startswith("Question (level ")
        and "What is" in first.messages[1]["content"]
    )
    assert first.answer == str(2 * int(first.messages[1]["content"].split("What is ")[1].split(" ")[0]))
    assert "level" in first.metadata
    assert task.grade(first, f"so \\boxed{{{first.answer}}}") == "correct"
    assert task.final_answer("x \\boxed{ 4 }") == "4"


def test_wrong_field_names_fail_listing_the_fields_the_data_has(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(6)))
    with pytest.raises(ValueError) as raised:
        make_task(TaskConfig(name="dataset", dataset_path=str(path), options={"prompt_field": "question"}))
    message = str(raised.value)
    assert "no field 'answer', 'question'" in message and "'level', 'q', 'solution'" in message, message


def test_gsm8k_reads_its_real_row_format(tmp_path):
    rows = [
        {
            "question": f"Tom has {i} apples and buys {i}. How many?",
            "answer": f"{i}+{i}={2 * i}\n#### {2 * i:,}",
        }
        for i in range(600, 612)
    ]
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = make_task(TaskConfig(name="gsm8k", dataset_path=str(path), test_size=2))
    problem = next(task.problems(0, 1, 0, "test"))
    assert problem.answer.isdigit() and "," not in problem.answer  # `#### 1,200` reads 1200
    assert problem.messages[-1]["content"].endswith("put your final answer within \\boxed{}.")
    with Grader.from_config(task, TaskConfig(name="gsm8k", dataset_path=str(path), test_size=2)) as grader:
        assert grader.grade(problem, f"The total is \\boxed{{{problem.answer}}}.") == "correct"  # math-verify


def _judge(reward: str, texts: list[str], timeout_s: float = 20.0) -> list:
    task = make_task(TaskConfig())
    problem = next(task.problems(0, 1, 0, "test"))
    with Grader(task, timeout_s=timeout_s, num_workers=2, reward=reward) as grader:

        async def run():
            return await asyncio.gather(*(grader.judge_async(problem, t) for t in texts))

        return asyncio.run(run())


def test_a_reward_by_reference_scores_in_worker_processes_sync_or_async():
    for reward in ("support.rewards:digit_share", "support.rewards:async_digit_share"):
        judged = _judge(reward, ["answer: 12", "no digits"])
        assert [j.score for j in judged] == [0.2, 0.0] and all(j.error is None for j in judged)
        assert judged[0].grade in ("correct", "wrong", "unparseable")  # the task still grades
    # The score takes the table's place; the length shaping applies on top.
    assert compute_reward(
        "unparseable", "length", 10, 12, RewardConfig(length_penalty=0.25), score=0.2
    ) == pytest.approx(-0.05)


@pytest.mark.parametrize(
    ("reward", "reason"),
    [
        ("support.rewards:raises", "raised RuntimeError: the reward service is down"),
        ("support.rewards:not_a_number", "returned inf, not a finite number"),
        ("support.rewards:returns_none", "returned NoneType 'None', not a float"),
        ("support.rewards:returns_text", "returned str '0.5', not a float"),
    ],
)
def test_a_reward_that_fails_gives_the_reason_and_stops_nothing(reward, reason):
    (judged,) = _judge(reward, ["answer: 1"])
    assert judged.score is None and reason in judged.error and reward in judged.error, judged.error


def test_a_reward_that_hangs_is_cut_at_its_timeout_and_the_next_call_is_served():
    started = time.monotonic()
    hung, ok = _judge("support.rewards:hangs", ["answer: 1", "answer: 2"], timeout_s=2.0)
    assert "ran past task.grade_timeout_s=2 s" in hung.error and "ran past" in ok.error
    assert time.monotonic() - started < 30, "a hung reward must cost its timeout, not the hang"
    (fine,) = _judge("support.rewards:digit_share", ["12"], timeout_s=2.0)
    assert fine.score == 1.0
