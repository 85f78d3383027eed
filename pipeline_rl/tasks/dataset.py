"""Dataset tasks: prompts and reference answers from a local dataset, graded with math-verify.

    task = DatasetTask(DatasetOptions(prompt_field="question", answer_format="gsm8k"), "/data/gsm8k.jsonl")
    task = make_task(DatasetOptions(prompt_field="problem"), config)     # task=dataset (config: TaskConfig)
    task = make_gsm8k(Gsm8kOptions(), config)                             # task=gsm8k: gsm8k's row format

Data: see data.py (JSON, JSONL, parquet, save_to_disk or a Hub-layout directory, offline). Each row
becomes one problem: the user message is `template` filled with the row's fields (by default the
prompt field and the instruction to answer in `\\boxed{}`), after an optional system prompt; the
reference answer is read from `answer_field` as `answer_format` says: `plain` (the text as is),
`gsm8k` (the text after `####`, commas removed, as in gsm8k's solutions) or `boxed` (the last
`\\boxed{}` of a worked solution). A row without a usable reference is skipped (and counted in a
warning). Field names are checked on the first rows at startup: a wrong name fails listing the fields
the data has. The completion is graded on its last `\\boxed{}` by math-verify (math_grading.py);
`task.reward` may score it instead.

Splits: the data's own `test` split when it has one; otherwise `test_size` rows of the train data,
chosen by a fixed seed (independent of the run seed), are held out as the test split. `train`
iterates forever, reshuffled per epoch; `test` is one pass in row order. A shard owns the rows with
`row % num_shards == shard_index`. `prompt_index` is `epoch * len(split) + row`, unique over a run.
"""

from __future__ import annotations

import logging
import random
import string
from collections.abc import Iterator
from itertools import count
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline_rl.tasks.base import Grade, Problem, Split, check_shard
from pipeline_rl.tasks.data import load_local_splits
from pipeline_rl.tasks.math_grading import final_boxed, grade_boxed_problem, last_boxed

if TYPE_CHECKING:
    from pipeline_rl.tasks.config import TaskConfig

logger = logging.getLogger(__name__)

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_HOLDOUT_SEED = 20240601  # fixed: the held-out test rows must not move with the run seed


class DatasetOptions(BaseModel):
    """`task=dataset`'s options (task.options.*): which fields hold the prompt and the answer."""

    model_config = ConfigDict(extra="forbid")

    prompt_field: str = Field(default="prompt", description="The row field holding the question.")
    answer_field: str = Field(default="answer", description="The row field holding the reference answer.")
    answer_format: Literal["plain", "gsm8k", "boxed"] = Field(
        default="plain",
        description="How the reference is read from answer_field: as is, after gsm8k's '####', or the last \\boxed{}.",
    )
    template: str = Field(
        default="{prompt}\n\n" + BOXED_INSTRUCTION.replace("{", "{{").replace("}", "}}"),
        description="The user message: {prompt} is the prompt field; any other {field} of the row may appear.",
    )
    system_prompt: str | None = Field(
        default=None, description="A system message before the user's, or none."
    )
    hub_repo: str | None = Field(
        default=None,
        description="With dataset_path unset: the dataset's Hub name, looked up in the local HF cache.",
    )
    metadata_fields: list[str] = Field(
        default_factory=list, description="Row fields copied into each problem's metadata (level, type, ...)."
    )

    @model_validator(mode="after")
    def _template(self) -> DatasetOptions:
        self.template_fields()  # a template that cannot be parsed fails here, at startup
        return self

    def template_fields(self) -> set[str]:
        """The row fields the template uses ({prompt} stands for prompt_field)."""
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(self.template) if name}
        except ValueError as e:
            raise ValueError(
                f"task.options.template cannot be formatted: {e} (write literal braces doubled)"
            ) from None
        return {self.prompt_field if f == "prompt" else f for f in fields}


def reference_answer(text: str, answer_format: str) -> str:
    """The reference answer a row's answer field holds, read as `answer_format` says ('' when none)."""
    if text is None:  # a column missing from some rows (parquet, datasets) reads as None
        return ""
    text = str(text)
    if answer_format == "gsm8k":
        return text.rsplit("####", 1)[-1].strip().replace(",", "")
    if answer_format == "boxed":
        return (last_boxed(text) or "").strip()
    return text.strip()


class DatasetTask:
    """Problems from a local dataset's rows; graded on the completion's last \\boxed{} by math-verify."""

    worker_grade_fn = staticmethod(grade_boxed_problem)

    def __init__(
        self,
        options: DatasetOptions,
        dataset_path: str | None,
        test_size: int = 500,
        name: str = "dataset",
        fallback_answer_field: str | None = None,
    ):
        self.name = name
        self.options = options
        self.fallback_answer_field = fallback_answer_field  # math: `answer`, else the solution's last box
        raw = load_local_splits(dataset_path, options.hub_repo, name)
        self._check_fields(raw)
        train = self._examples(raw["train"])
        if "test" in raw:
            test = self._examples(raw["test"])
        else:
            if test_size >= len(train):
                raise ValueError(
                    f"{name}: test_size={test_size} leaves no train rows out of {len(train)}: lower "
                    "task.test_size or provide data with a test split"
                )
            held = set(random.Random(_HOLDOUT_SEED).sample(range(len(train)), test_size))
            test = [ex for i, ex in enumerate(train) if i in held]
            train = [ex for i, ex in enumerate(train) if i not in held]
        if not train or not test:
            raise ValueError(f"{name}: no usable rows in the {'train' if not train else 'test'} split")
        self._splits: dict[str, list[tuple[str, str, dict[str, Any]]]] = {"train": train, "test": test}

    def _check_fields(self, raw: dict[str, list[dict[str, Any]]]) -> None:
        o = self.options
        wanted = o.template_fields() | {o.answer_field}  # metadata fields are copied where present
        if self.fallback_answer_field:
            wanted -= {o.answer_field}  # either field may hold the answer
        for split, rows in raw.items():
            have = set().union(*(row.keys() for row in rows[:100])) if rows else set()
            missing = sorted(wanted - have)
            if (
                self.fallback_answer_field
                and rows
                and not have & {o.answer_field, self.fallback_answer_field}
            ):
                missing.append(f"{o.answer_field} or {self.fallback_answer_field}")
            if missing:
                raise ValueError(
                    f"{self.name}: the {split} rows have no field {', '.join(map(repr, missing))}; they have "
                    f"{', '.join(map(repr, sorted(have)))}: set task.options.prompt_field / answer_field (or "
                    "the template) to the fields that hold the question and the answer"
                )

    def _example(self, row: dict[str, Any]) -> tuple[str, str, dict[str, Any]] | None:
        o = self.options
        answer = reference_answer(row.get(o.answer_field, ""), o.answer_format)
        if not answer and self.fallback_answer_field:
            answer = reference_answer(row.get(self.fallback_answer_field, ""), "boxed")
        if not answer:
            return None
        values = {**{k: v for k, v in row.items() if isinstance(k, str)}, "prompt": row[o.prompt_field]}
        question = o.template.format(**values)
        metadata = {key: row[key] for key in o.metadata_fields if key in row}
        return question, answer, metadata

    def _examples(self, rows: list[dict[str, Any]]) -> list[tuple[str, str, dict[str, Any]]]:
        examples = [ex for row in rows if (ex := self._example(row)) is not None]
        if len(examples) < len(rows):
            logger.warning(
                "%s: skipped %d rows without a usable answer", self.name, len(rows) - len(examples)
            )
        return examples

    def num_problems(self, split: Split) -> int:
        return len(self._splits[split])

    def _problem(self, index: int, row: int, split: Split, epoch: int) -> Problem:
        question, answer, metadata = self._splits[split][row]
        messages = (
            [{"role": "system", "content": self.options.system_prompt}] if self.options.system_prompt else []
        )
        return Problem(
            prompt_index=index,
            messages=[*messages, {"role": "user", "content": question}],
            answer=answer,
            metadata={**metadata, "split": split, "row": row, "epoch": epoch},
        )

    def problems(self, shard_index: int, num_shards: int, seed: int, split: Split) -> Iterator[Problem]:
        check_shard(shard_index, num_shards)
        size = len(self._splits[split])
        rows = list(range(shard_index, size, num_shards))
        if not rows:
            raise ValueError(
                f"{self.name} {split}: shard {shard_index} of {num_shards} is empty ({size} rows)"
            )
        if split == "test":
            for row in rows:
                yield self._problem(row, row, split, epoch=0)
            return
        for epoch in count():
            order = rows[:]
            random.Random(f"{self.name}:{seed}:{shard_index}:{epoch}").shuffle(order)
            for row in order:
                yield self._problem(epoch * size + row, row, split, epoch)

    def grade(self, problem: Problem, completion_text: str) -> Grade:
        return grade_boxed_problem(problem, completion_text)

    def final_answer(self, completion_text: str) -> str | None:
        """The answer a completion gives (its last box, normalized), for majority votes."""
        return final_boxed(completion_text)


def make_task(options: DatasetOptions, config: TaskConfig) -> DatasetTask:
    return DatasetTask(options, config.dataset_path, config.test_size)


class Gsm8kOptions(BaseModel):
    """`task=gsm8k`: gsm8k's rows (`question`, `answer` ending in `#### <number>`)."""

    model_config = ConfigDict(extra="forbid")

    system_prompt: str | None = Field(
        default=None, description="A system message before the user's, or none."
    )


def make_gsm8k(options: Gsm8kOptions, config: TaskConfig) -> DatasetTask:
    dataset = DatasetOptions(
        prompt_field="question",
        answer_field="answer",
        answer_format="gsm8k",
        system_prompt=options.system_prompt,
        hub_repo="openai/gsm8k",
    )
    return DatasetTask(dataset, config.dataset_path, config.test_size, name="gsm8k")


class MathOptions(Gsm8kOptions):
    """`task=math`: MATH's rows (`problem`, and `answer` or a `solution` with a final \\boxed{})."""


def make_math(options: MathOptions, config: TaskConfig) -> DatasetTask:
    dataset = DatasetOptions(
        prompt_field="problem",
        answer_field="answer",
        system_prompt=options.system_prompt,
        hub_repo="DigitalLearningGmbH/MATH-lighteval",
        metadata_fields=["level", "type", "subject"],
    )
    task = DatasetTask(
        dataset, config.dataset_path, config.test_size, name="math", fallback_answer_field="solution"
    )
    return task
