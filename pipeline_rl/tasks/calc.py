"""`calc`: multi-digit multiplication with a calculator tool, the multi-turn task.

A tiny model cannot multiply 3-digit numbers in its head; with the `calc` tool it only has to write the
call and copy the result. An episode (pipeline_rl/actor/episode.py):

    user       What is 482*37? Reply with answer: <integer>
    assistant  <tool_call>{"name": "calc", "arguments": {"expression": "482*37"}}</tool_call>
    tool       17834
    assistant  answer: 17834

The environment reads the Hermes-format call the tiny model's chat template defines, runs the tool in
its sandbox (pipeline_rl/tasks/sandbox.py) and answers with a `tool` message; a turn without a call ends
the episode, which is graded on its last `answer:`; a turn with neither a call nor an answer gets a
reminder of the format (a judge's message) until `episode_max_turns`. Whatever the model writes is an observation, never
an error: a malformed call, an unknown tool, a tool error or timeout each come back as a `tool` message
saying what was wrong (counted in `CalcEnvironment.faults`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from pipeline_rl.tasks import calculator
from pipeline_rl.tasks.arith import ArithTask, parse_answer
from pipeline_rl.tasks.base import Grade, Problem, Split
from pipeline_rl.tasks.sandbox import ToolSpec, check_sandbox, run_tool

if TYPE_CHECKING:
    from pipeline_rl.tasks.config import TaskConfig

TOOL_NAME = "calc"
NUDGE = "Reply with answer: <integer>, or call calc."
CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def tool_call_text(expression: str) -> str:
    arguments = json.dumps({"expression": expression})
    return f'<tool_call>{{"name": "{TOOL_NAME}", "arguments": {arguments}}}</tool_call>'


class CalcTask:
    """Problems of `ArithTask` with operators '*' (the prompt is the same), played as episodes."""

    name = "calc"
    worker_grade_fn = None
    multi_turn = True

    def __init__(
        self,
        max_operand: int = 999,
        test_size: int = 200,
        tool_timeout_s: float = 5.0,
        tool_network: str = "isolated",
    ) -> None:
        self.arith = ArithTask(num_operands=2, max_operand=max_operand, operators="*", test_size=test_size)
        self.tool = ToolSpec(
            path=Path(calculator.__file__), function="calc", timeout_s=tool_timeout_s, network=tool_network
        )
        check_sandbox(self.tool)  # at start, in preflight and every actor: never a silent fallback

    def problems(self, shard_index: int, num_shards: int, seed: int, split: Split) -> Iterator[Problem]:
        return self.arith.problems(shard_index, num_shards, seed, split)

    def grade(self, problem: Problem, completion_text: str) -> Grade:
        return self.arith.grade(problem, completion_text)

    def environment(self, problem: Problem) -> CalcEnvironment:
        return CalcEnvironment(problem, self.tool)

    def demonstration(self, problem: Problem) -> list[dict]:
        """The conversation of a perfect episode (for the supervised warm-up)."""
        return [
            *problem.messages,
            {"role": "assistant", "content": tool_call_text(problem.metadata["expr"])},
            {"role": "tool", "content": problem.answer},
            {"role": "assistant", "content": f"answer: {problem.answer}"},
        ]


class CalcEnvironment:
    """One episode of `calc` (the Environment protocol of pipeline_rl/actor/episode.py)."""

    def __init__(self, problem: Problem, tool: ToolSpec) -> None:
        self.problem = problem
        self.tool = tool
        self.calls = 0
        self.faults: list[str] = []  # malformed_call, unknown_tool, tool_error

    def messages(self) -> list[dict]:
        return self.problem.messages

    def tools(self) -> list[dict] | None:
        # The tiny model learns the one tool from the warm-up; listing it in the prompt would add ~150
        # characters (tokens) to every sequence.
        return None

    async def reply(self, model_text: str, finish_reason: str) -> list[dict] | None:
        match = CALL_RE.search(model_text)
        if match is not None:
            self.calls += 1
            return [{"role": "tool", "content": await self._call(match.group(1))}]
        if parse_answer(model_text) is not None:
            return None  # answered: the episode is over
        return [{"role": "user", "content": NUDGE}]  # neither: ask again (until max_turns)

    async def _call(self, body: str) -> str:
        try:
            call = json.loads(body)
            name, arguments = call["name"], call["arguments"]
            if not isinstance(arguments, dict):
                raise TypeError("arguments is not an object")
        except (ValueError, KeyError, TypeError) as e:
            self.faults.append("malformed_call")
            return f"error: malformed tool call ({type(e).__name__}); write {tool_call_text('1+2')}"
        if name != TOOL_NAME:
            self.faults.append("unknown_tool")
            return f"error: unknown tool {str(name)[:40]!r}; the only tool is {TOOL_NAME!r}"
        result = await run_tool(self.tool, arguments)
        if not result.ok:
            self.faults.append("tool_error")
        return result.output


class CalcOptions(BaseModel):
    """`task=calc`'s options (task.options.*)."""

    model_config = ConfigDict(extra="forbid")

    max_operand: int = Field(default=999, ge=10, description="Factors are drawn from 0..this.")


def make_task(options: CalcOptions, config: TaskConfig) -> CalcTask:
    return CalcTask(options.max_operand, config.test_size, config.tool_timeout_s, config.tool_network)
