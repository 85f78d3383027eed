"""User stages (filter, map) applied to a rollout group inside the process that runs them.

    chain = Chain.inside(cfg, "advantages")     # the stages placed `inside: advantages`, upstream first
    outcome = chain.apply(group)                # the group they leave, and the samples they dropped

A user's function, named by `fn: pkg.module:name` in the graph, with the stage's `options` as keyword
arguments:
    filter, level sample:  fn(sample, group, **options) -> str | None    a reason drops the sample
    filter, level group:   fn(group, **options) -> str | None            a reason drops the whole group
    map:                   fn(group, **options) -> RolloutGroup          the group to go on with
A drop's ledger reason is `<stage>:<reason>`, so `pipeline-rl report` shows which stage dropped what and
why. A function that raises, returns something else, or takes longer than the stage's `timeout_s` drops
its group with reason `<stage>:error` (the error goes to the dead letters, like a group the preprocessor
cannot convert): one bad group does not stop the run. A call past its deadline cannot be interrupted; its
thread is left to finish and the chain goes on in a new one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as CallTimeout
from dataclasses import dataclass, field

from pipeline_rl.ledger import STAGE_REASON
from pipeline_rl.messages import RolloutGroup
from pipeline_rl.references import resolve_callable
from pipeline_rl.stages.graph import NEEDS_FN, GraphConfig, StagePlacement, StageSpec, order, process_of

ERROR = "error"


@dataclass
class Outcome:
    """What a chain left of a group: the group (None: dropped whole), sample id -> ledger reason of the
    samples it dropped, and the error of a function that raised (the group is then dropped)."""

    group: RolloutGroup | None
    dropped: dict[str, str] = field(default_factory=dict)
    error: str | None = None


@dataclass
class Step:
    name: str
    spec: StageSpec
    fn: Callable


def resolve_stage_fn(name: str, spec: StageSpec) -> Callable:
    """The stage's function, checked against its options: ValueError naming the stage and the fix."""
    what = f"graph.stages.{name}.fn"
    fn = resolve_callable(spec.fn or "", what)
    leading = 2 if spec.kind == "filter" and spec.level == "sample" else 1
    try:
        inspect.signature(fn).bind(*([None] * leading), **spec.options)
    except TypeError as e:
        form = "(sample, group, **options)" if leading == 2 else "(group, **options)"
        raise ValueError(
            f"{what}={spec.fn!r} cannot take {form} with options {sorted(spec.options)}: {e} (fix the "
            f"function's parameters or graph.stages.{name}.options)"
        ) from None
    except ValueError:  # a builtin without a signature: it will be called and judged by its result
        pass
    return fn


class Chain:
    """The user stages one process applies to each group, upstream first."""

    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage")

    @classmethod
    def inside(cls, graph: GraphConfig, placement: dict[str, StagePlacement], host: str) -> Chain:
        """The stages that run in `host`'s process, before its own function (and `host` itself when it
        is a user stage with workers of its own)."""
        names = [
            n
            for n in order(graph)
            if graph.stages[n].kind in NEEDS_FN and process_of(graph, placement, n) == host
        ]
        return cls([Step(n, graph.stages[n], resolve_stage_fn(n, graph.stages[n])) for n in names])

    def apply(self, group: RolloutGroup) -> Outcome:
        dropped: dict[str, str] = {}
        for step in self.steps:
            call = self._calls.submit(self._apply_one, step, group, dropped.copy())
            try:
                group, dropped = call.result(timeout=step.spec.timeout_s)
            except Exception as e:  # noqa: BLE001 - the user's code: its group is dropped, the run goes on
                if isinstance(e, CallTimeout):
                    # The call cannot be stopped: leave its thread and go on in a new one.
                    self._calls.shutdown(wait=False)
                    self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage")
                    e = TimeoutError(f"no answer within timeout_s={step.spec.timeout_s}")
                reason = f"{step.name}:{ERROR}"
                dropped.update({s.sample_id: reason for s in group.samples if s.sample_id not in dropped})
                error = f"stage {step.name} ({step.spec.fn}): {type(e).__name__}: {e}"
                return Outcome(None, dropped, error)
            if not group.samples:
                return Outcome(None, dropped)
        return Outcome(group, dropped)

    @staticmethod
    def _apply_one(
        step: Step, group: RolloutGroup, dropped: dict[str, str]
    ) -> tuple[RolloutGroup, dict[str, str]]:
        spec, options = step.spec, step.spec.options
        if spec.kind == "map":
            out = step.fn(group, **options)
            if not isinstance(out, RolloutGroup):
                raise TypeError(f"a map returns a RolloutGroup, got {type(out).__name__}")
            if out.group_id != group.group_id or [s.sample_id for s in out.samples] != [
                s.sample_id for s in group.samples
            ]:
                raise ValueError(
                    "a map keeps the group's group_id and its samples' ids (a filter stage drops samples)"
                )
            return out, dropped
        if spec.level == "group":
            reason = _checked(step.name, step.fn(group, **options))
            if reason is None:
                return group, dropped
            dropped.update({s.sample_id: reason for s in group.samples})
            return group.model_copy(update={"samples": []}), dropped
        keep = []
        for sample in group.samples:
            reason = _checked(step.name, step.fn(sample, group, **options))
            if reason is None:
                keep.append(sample)
            else:
                dropped[sample.sample_id] = reason
        if len(keep) < len(group.samples):
            group = group.model_copy(update={"samples": keep})
        return group, dropped


def _checked(stage: str, reason: object) -> str | None:
    """The ledger reason of a filter's answer: None (kept), or `<stage>:<reason>`."""
    if reason is None:
        return None
    if not isinstance(reason, str) or not STAGE_REASON.fullmatch(f"{stage}:{reason}"):
        raise ValueError(f"a filter returns None or a reason of ASCII letters, digits and _, got {reason!r}")
    return f"{stage}:{reason}"
