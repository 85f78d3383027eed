"""The pipeline as a declared graph: stages, the topics they read and write, and where each runs.

    graph:                                   # conf/graph/grpo.yaml: today's pipeline
      name: grpo
      stages:
        generate:   {kind: generate, outputs: [rollouts]}
        advantages: {kind: advantages, inputs: [rollouts], outputs: [training_data]}
        train:      {kind: train_actor, inputs: [training_data]}

A stage has a kind (what it does) and reads and writes named topics: a topic between two processes is a
stream, one between two stages of the same process (a stage fused into another, the trainer's own stages)
is handed over in memory. Where each stage runs is declared apart from the graph: the builtin kinds run in
the processes their sections size (`actor.num_actors` actors generate, `num_preprocessors` preprocessors
compute advantages, the trainer trains), and a stage of a kind a user adds (a filter, a map) is
placed by `placement.stages.<name>`: its own `replicas` worker processes, or `inside: <stage>` inside that
stage's process, before its function. A user extends the graph with a function reference
(`fn: pkg.module:name`), never with a new kind.

Checked once at startup (`graph_problems`, called by RunConfig): stage and topic names, one `generate`,
one `advantages`, one `train_actor`, a function where the kind needs one, one writer and
one reader per topic, no input that nothing writes, no output that nothing reads, no cycle, and a
placement for every stage that needs one. Each message names the stage or topic and the fix.
Torch-free: config validation stays fast.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline_rl.references import is_reference

StageKind = Literal[
    "generate",  # the actors: sample answers on the inference servers and grade them (rule rewards)
    "filter",  # a user function that drops samples or groups, with a reason the ledger records
    "map",  # a user function that changes a group (its rewards, its metadata)
    "advantages",  # the preprocessors: advantages, packing into training samples
    "train_actor",  # the policy's optimizer step and weight push (the trainer)
]

# Which process runs a stage of each kind. "worker": a stage process of its own (placement.stages.<name>
# replicas), or fused into another stage's process (placement.stages.<name>.inside).
RUNTIME: dict[str, str] = {
    "generate": "actor",
    "advantages": "preprocessor",
    "filter": "worker",
    "map": "worker",
    "train_actor": "trainer",
}
NEEDS_FN = ("filter", "map")
EXACTLY_ONE = ("generate", "advantages", "train_actor")
# Topics of the run's own plumbing; a stage may not read or write them.
RESERVED_TOPICS = ("trainer_events", "stats", "dead_letter", "carried")
NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# Names the launcher gives processes and stream consumers (`<name><index>`; the preprocessors consume as
# `prep<index>`): a user stage's workers are named the same way, so its name may not be one of these, nor
# end in a digit (stage `short1`, worker 1 and stage `short`, worker 11 would both be `short11`).
PROCESS_NAMES = ("actor", "prep", "preprocessor", "server", "trainer", "redis")
# The streams the builtin stages' processes read and write: the actors write rollout groups to `rollouts`,
# the preprocessors write training packages to `training_data/<rank>`, which the trainer reads.
BUILTIN_OUTPUTS = {"generate": "rollouts", "advantages": "training_data"}
BUILTIN_INPUTS = {"train_actor": "training_data"}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StageSpec(_Section):
    """One stage of the graph: what it does and the topics it reads and writes."""

    kind: StageKind = Field(description="What the stage does (a builtin kind; see stages/graph.py).")
    inputs: list[str] = Field(default_factory=list, description="Topics the stage reads.")
    outputs: list[str] = Field(default_factory=list, description="Topics the stage writes.")
    fn: str | None = Field(
        None, description="filter/map: the user function, `pkg.module:name` (importable where the run runs)."
    )
    level: Literal["sample", "group"] = Field(
        "sample", description="filter: whether the function judges each sample or a whole group."
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Options passed to the stage's function, validated by it."
    )
    timeout_s: float = Field(
        60.0,
        gt=0,
        description="filter/map: longest one call may take; past it, its group is dropped as an error.",
    )


def _grpo_stages() -> dict[str, StageSpec]:
    return {
        "generate": StageSpec(kind="generate", outputs=["rollouts"]),
        "advantages": StageSpec(kind="advantages", inputs=["rollouts"], outputs=["training_data"]),
        "train": StageSpec(kind="train_actor", inputs=["training_data"]),
    }


class GraphConfig(_Section):
    """The stages of the pipeline and the topics between them (docs/graph.md). The default is GRPO's:
    generate -> advantages -> train, as conf/graph/grpo.yaml declares it."""

    name: str = Field("grpo", description="The graph's name, shown by --dry-run and in the run's status.")
    stages: dict[str, StageSpec] = Field(
        default_factory=_grpo_stages, description="Stage name -> what it does and what it reads and writes."
    )


class StagePlacement(_Section):
    """Where a stage of a user-added kind runs: its own worker processes, or inside another stage's."""

    replicas: int | None = Field(None, ge=1, description="Worker processes of the stage's own.")
    inside: str | None = Field(
        None, description="Run inside this stage's process, before its function (no stream between them)."
    )


def stages_of_kind(graph: GraphConfig, kind: str) -> list[str]:
    return [name for name, s in graph.stages.items() if s.kind == kind]


def writers(graph: GraphConfig) -> dict[str, list[str]]:
    """Topic -> the stages that write it."""
    out: dict[str, list[str]] = {}
    for name, s in graph.stages.items():
        for topic in s.outputs:
            out.setdefault(topic, []).append(name)
    return out


def readers(graph: GraphConfig) -> dict[str, list[str]]:
    """Topic -> the stages that read it."""
    out: dict[str, list[str]] = {}
    for name, s in graph.stages.items():
        for topic in s.inputs:
            out.setdefault(topic, []).append(name)
    return out


def order(graph: GraphConfig) -> list[str]:
    """The stages upstream first (ties in declaration order). ValueError naming a cycle's stages if
    there is one."""
    written_by = writers(graph)
    upstream = {
        name: {w for topic in s.inputs for w in written_by.get(topic, []) if w != name}
        | ({name} if set(s.inputs) & set(s.outputs) else set())
        for name, s in graph.stages.items()
    }
    done: list[str] = []
    while len(done) < len(upstream):
        ready = [n for n, ups in upstream.items() if n not in done and ups <= set(done)]
        if not ready:
            left = [n for n in upstream if n not in done]
            raise ValueError(
                f"graph has a cycle among stages {', '.join(left)}: a stage's input may not "
                "depend on its own output; the weights flow back to `generate` by themselves"
            )
        done.extend(ready[:1])
    return done


def graph_problems(graph: GraphConfig, placement: dict[str, StagePlacement]) -> list[str]:
    """Every reason the graph cannot run as declared with this placement, each with its fix; [] when it
    can."""
    problems: list[str] = []
    stages = graph.stages
    for name, s in stages.items():
        if not NAME.match(name):
            problems.append(
                f"stage name {name!r}: use lower-case letters, digits and _, starting with a letter"
            )
        elif RUNTIME[s.kind] == "worker" and (name in PROCESS_NAMES or name[-1].isdigit()):
            problems.append(
                f"stage name {name!r}: its workers would be named like the launcher's processes "
                f"({', '.join(PROCESS_NAMES)}) or another stage's: rename it (no digit at the end)"
            )
        if s.kind in BUILTIN_INPUTS and s.inputs != [BUILTIN_INPUTS[s.kind]]:
            problems.append(
                f"stage {name!r} ({s.kind}) reads the run's {BUILTIN_INPUTS[s.kind]!r} stream: set its inputs to "
                f"[{BUILTIN_INPUTS[s.kind]}]"
            )
        if s.kind in BUILTIN_OUTPUTS and s.outputs != [BUILTIN_OUTPUTS[s.kind]]:
            problems.append(
                f"stage {name!r} ({s.kind}) writes the run's {BUILTIN_OUTPUTS[s.kind]!r} stream: set its outputs to "
                f"[{BUILTIN_OUTPUTS[s.kind]}]"
            )
    for kind in EXACTLY_ONE:
        found = stages_of_kind(graph, kind)
        if len(found) != 1:
            problems.append(
                f"the graph needs exactly one stage of kind {kind!r}, it has {len(found)}"
                + (f" ({', '.join(found)})" if found else "")
            )
    for name, s in stages.items():
        problems += _stage_problems(name, s)
    written_by, read_by = writers(graph), readers(graph)
    for topic in sorted(set(written_by) | set(read_by)):
        if topic in RESERVED_TOPICS:
            problems.append(
                f"topic {topic!r} is the run's own (reserved: {', '.join(RESERVED_TOPICS)}): rename it"
            )
        elif not NAME.match(topic):
            problems.append(f"topic name {topic!r}: use lower-case letters, digits and _")
        w, r = written_by.get(topic, []), read_by.get(topic, [])
        if len(w) > 1:
            problems.append(f"topic {topic!r} has {len(w)} writers ({', '.join(w)}): give each its own topic")
        if len(r) > 1:
            problems.append(
                f"topic {topic!r} has {len(r)} readers ({', '.join(r)}): a stream topic feeds one stage; "
                "chain the stages instead (one writes what the next reads)"
            )
        if r and not w:
            problems.append(
                f"stage {r[0]!r} reads {topic!r}, which no stage writes (written: "
                f"{', '.join(sorted(written_by)) or 'none'}): fix the input or add the stage that writes it"
            )
        if w and not r:
            problems.append(
                f"stage {w[0]!r} writes {topic!r}, which no stage reads: connect it to the next stage's inputs "
                "or remove it"
            )
    try:
        order(graph)
    except ValueError as e:
        problems.append(str(e))
    problems += _placement_problems(graph, placement)
    return problems


def _stage_problems(name: str, s: StageSpec) -> list[str]:
    problems = []
    if s.kind == "generate" and s.inputs:
        problems.append(
            f"stage {name!r} (generate) reads nothing: the prompts come from the task (remove inputs)"
        )
    if s.kind == "train_actor" and s.outputs:
        problems.append(
            f"stage {name!r} ({s.kind}) writes no topic: its weights flow back by themselves (remove outputs)"
        )
    if s.kind != "generate" and not s.inputs:
        problems.append(f"stage {name!r} ({s.kind}) reads no topic: give it inputs")
    if s.kind != "train_actor" and not s.outputs:
        problems.append(f"stage {name!r} ({s.kind}) writes no topic: give it outputs")
    if s.kind in NEEDS_FN:
        if not s.fn:
            problems.append(f"stage {name!r} ({s.kind}) needs fn: pkg.module:name (the function it applies)")
        elif not is_reference(s.fn):
            problems.append(f"stage {name!r}: fn {s.fn!r} is not pkg.module:name")
    elif s.fn:
        problems.append(f"stage {name!r}: fn is for filter and map stages; {s.kind} is builtin (remove fn)")
    if s.kind != "generate" and len(s.inputs) > 1:
        problems.append(f"stage {name!r} ({s.kind}) reads one topic: chain stages rather than join topics")
    if len(s.outputs) > 1:
        problems.append(f"stage {name!r} ({s.kind}) writes one topic")
    return problems


def _placement_problems(graph: GraphConfig, placement: dict[str, StagePlacement]) -> list[str]:
    problems = []
    stages = graph.stages
    for name, where in placement.items():
        if name not in stages:
            problems.append(
                f"placement.stages.{name}: no stage {name!r} in graph {graph.name!r} "
                f"(stages: {', '.join(stages)})"
            )
            continue
        runtime = RUNTIME[stages[name].kind]
        if runtime != "worker":
            problems.append(
                f"placement.stages.{name}: a {stages[name].kind} stage runs in the {runtime} processes, sized "
                f"by their own section (remove this placement)"
            )
        elif (where.replicas is None) == (where.inside is None):
            problems.append(
                f"placement.stages.{name}: set exactly one of replicas (own workers) and inside (a stage)"
            )
        elif where.inside is not None:
            problems += _fusion_problems(graph, placement, name, where.inside)
    for name, s in stages.items():
        if RUNTIME[s.kind] == "worker" and name not in placement:
            problems.append(
                f"stage {name!r} has no placement: add placement.stages.{name}={{replicas: 1}} (a worker of its "
                f"own) or {{inside: <the stage that reads its output>}} (inside that stage's process)"
            )
    return problems


def _fusion_problems(
    graph: GraphConfig, placement: dict[str, StagePlacement], name: str, target: str
) -> list[str]:
    """A stage runs inside `target` when what it writes reaches `target` only through stages that run
    there too: the process then reads the first one's input and hands the rest over in memory."""
    stages = graph.stages
    if target not in stages:
        return [f"placement.stages.{name}.inside: no stage {target!r} (stages: {', '.join(stages)})"]
    if RUNTIME[stages[target].kind] not in ("worker", "preprocessor"):
        return [
            f"placement.stages.{name}.inside={target}: a stage runs inside a preprocessor or another worker "
            f"stage, not in a {stages[target].kind} stage"
        ]
    next_stages = readers(graph).get(stages[name].outputs[0], []) if stages[name].outputs else []
    if len(next_stages) != 1 or (
        next_stages[0] != target and process_of(graph, placement, next_stages[0]) != target
    ):
        return [
            f"placement.stages.{name}.inside={target}: what {name} writes ({', '.join(stages[name].outputs)}) "
            f"must go to {target}, or to a stage inside it, so that they run as one"
        ]
    return []


def process_of(graph: GraphConfig, placement: dict[str, StagePlacement], name: str) -> str:
    """The stage whose process runs `name` (itself unless fused: followed through `inside` links)."""
    seen = {name}
    while (
        (where := placement.get(name)) is not None and where.inside is not None and where.inside not in seen
    ):
        name = where.inside
        seen.add(name)
    return name


def host_input(graph: GraphConfig, placement: dict[str, StagePlacement], host: str) -> str:
    """The topic a stage's process reads: the input of the first stage that runs in it (the upstream-most
    of those placed inside it, else its own)."""
    first = next(n for n in order(graph) if process_of(graph, placement, n) == host)
    return graph.stages[first].inputs[0]


def stream_consumers(graph: GraphConfig, placement: dict[str, StagePlacement]) -> list[tuple[str, str]]:
    """(stage, topic) of every process outside the trainer that consumes a stream: the advantages stage
    (the preprocessors) and each user stage with workers of its own, upstream first."""
    hosts = [n for n in order(graph) if process_of(graph, placement, n) == n]
    return [
        (n, host_input(graph, placement, n))
        for n in hosts
        if RUNTIME[graph.stages[n].kind] in ("preprocessor", "worker")
    ]


def in_memory(graph: GraphConfig, placement: dict[str, StagePlacement], topic: str) -> bool:
    """Whether a topic passes in memory (its writers and readers share one process) rather than as a
    stream."""
    ends = writers(graph).get(topic, []) + readers(graph).get(topic, [])
    return len(ends) > 1 and len({_process(graph, placement, n) for n in ends}) == 1


def _process(graph: GraphConfig, placement: dict[str, StagePlacement], name: str) -> str:
    """The process a stage runs in: "trainer" for every trainer stage, else the stage it is fused into
    (or itself)."""
    host = process_of(graph, placement, name)
    return "trainer" if RUNTIME[graph.stages[host].kind] == "trainer" else host


def describe(graph: GraphConfig, placement: dict[str, StagePlacement], runs_in: dict[str, str]) -> list[str]:
    """The graph as --dry-run prints it: one line per stage, upstream first, with what it reads and
    writes (a `~` marks a topic handed over in memory) and where it runs (`runs_in`: stage -> text)."""
    lines = [f"  {'stage':<16}{'kind':<14}{'reads':<22}{'writes':<22}runs in"]
    for name in order(graph):
        s = graph.stages[name]

        def topics(names: list[str]) -> str:
            return ", ".join(t + ("~" if in_memory(graph, placement, t) else "") for t in names) or "-"

        lines.append(f"  {name:<16}{s.kind:<14}{topics(s.inputs):<22}{topics(s.outputs):<22}{runs_in[name]}")
    if any(in_memory(graph, placement, t) for t in writers(graph)):
        lines.append("  ~ handed over in memory (both stages in one process); other topics are streams")
    return lines
