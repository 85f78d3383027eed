"""The declared graph: the shipped one is today's pipeline, and every way a graph cannot run fails at
startup with a message that names the stage or topic and the fix."""

from __future__ import annotations

import pytest

from pipeline_rl.launch.compose import ConfigError, compose
from pipeline_rl.stages.graph import (
    GraphConfig,
    StagePlacement,
    StageSpec,
    describe,
    graph_problems,
    in_memory,
    order,
)


def config(*overrides: str):
    return compose(["model_path=/nonexistent/model", *overrides])


def graph(**stages: dict) -> GraphConfig:
    return GraphConfig(name="g", stages={name: StageSpec(**spec) for name, spec in stages.items()})


GRPO = {
    "generate": {"kind": "generate", "outputs": ["rollouts"]},
    "advantages": {"kind": "advantages", "inputs": ["rollouts"], "outputs": ["training_data"]},
    "train": {"kind": "train_actor", "inputs": ["training_data"]},
}
# The example of a user's stage: a filter between generation and advantages.
WITH_FILTER = {
    **GRPO,
    "short": {"kind": "filter", "fn": "my_pkg.filters:short", "inputs": ["rollouts"], "outputs": ["kept"]},
    "advantages": {"kind": "advantages", "inputs": ["kept"], "outputs": ["training_data"]},
}


def only_problem(g: GraphConfig, placement: dict | None = None) -> str:
    problems = graph_problems(g, {k: StagePlacement(**v) for k, v in (placement or {}).items()})
    assert len(problems) == 1, problems
    return problems[0]


def test_the_shipped_default_graph_is_todays_pipeline():
    cfg = config()
    assert cfg.graph == GraphConfig() == graph(**GRPO).model_copy(update={"name": "grpo"})
    assert order(cfg.graph) == ["generate", "advantages", "train"]
    assert graph_problems(cfg.graph, {}) == []
    # every shipped recipe composes under it
    for recipe in ("demo", "demo-calc", "demo-long", "demo-longtail"):
        assert config(f"recipe={recipe}").graph == cfg.graph


def test_a_cycle_fails_at_startup():
    cyclic = graph(
        generate={"kind": "generate", "outputs": ["rollouts"]},
        a={"kind": "map", "fn": "m:f", "inputs": ["rollouts_b"], "outputs": ["rollouts_a"]},
        b={"kind": "map", "fn": "m:f", "inputs": ["rollouts_a"], "outputs": ["rollouts_b"]},
        advantages={"kind": "advantages", "inputs": ["rollouts"], "outputs": ["training_data"]},
        train={"kind": "train_actor", "inputs": ["training_data"]},
    )
    assert "cycle among stages a, b" in only_problem(cyclic, {"a": {"replicas": 1}, "b": {"replicas": 1}})
    with pytest.raises(ConfigError, match="cycle among stages advantages"):
        config("graph.stages.advantages.inputs=[training_data]", "graph.stages.advantages.outputs=[training_data]",
               "graph.stages.train.inputs=[rollouts]")  # fmt: skip


def test_a_missing_input_and_an_unused_output_fail_at_startup():
    with pytest.raises(ConfigError, match="stage 'train' reads 'scored', which no stage writes") as e:
        config("graph.stages.train.inputs=[scored]")
    assert "stage 'advantages' writes 'training_data', which no stage reads" in str(e.value)
    g = graph(**{**WITH_FILTER, "advantages": {**GRPO["advantages"], "inputs": ["rollouts"]}})
    problems = graph_problems(g, {"short": StagePlacement(replicas=1)})
    assert (
        "stage 'short' writes 'kept', which no stage reads: connect it to the next stage's inputs or remove it"
        in problems
    )


def test_a_stage_without_placement_fails_and_one_placed_by_config_runs():
    with pytest.raises(ConfigError, match=r"stage 'short' has no placement: add placement.stages.short="):
        config(
            "graph.stages.short={kind: filter, fn: 'my_pkg.filters:short', inputs: [rollouts], outputs: [kept]}",
            "graph.stages.advantages.inputs=[kept]",
        )
    for where in ("{replicas: 2}", "{inside: advantages}"):
        cfg = config(
            "graph.stages.short={kind: filter, fn: 'my_pkg.filters:short', inputs: [rollouts], outputs: [kept]}",
            "graph.stages.advantages.inputs=[kept]",
            f"placement.stages.short={where}",
        )
        assert order(cfg.graph) == ["generate", "short", "advantages", "train"]
        assert in_memory(cfg.graph, cfg.placement.stages, "kept") == (where == "{inside: advantages}")
        assert not in_memory(cfg.graph, cfg.placement.stages, "rollouts")


def test_placement_must_name_a_placeable_stage_and_one_way():
    g = graph(**WITH_FILTER)
    assert "no stage 'shrot'" in only_problem(g, {"short": {"replicas": 1}, "shrot": {"replicas": 1}})
    assert "set exactly one of replicas" in only_problem(
        g, {"short": {"replicas": 1, "inside": "advantages"}}
    )
    assert "runs in the preprocessor processes" in only_problem(
        g, {"short": {"replicas": 1}, "advantages": {"replicas": 2}}
    )
    assert graph_problems(g, {"short": StagePlacement(inside="advantages")}) == []
    assert "not in a train_actor stage" in only_problem(g, {"short": {"inside": "train"}})
    assert "not in a generate stage" in only_problem(g, {"short": {"inside": "generate"}})
    tagged = graph(**{**WITH_FILTER, "tag": {"kind": "map", "fn": "m:tag", "inputs": ["kept"], "outputs": ["tagged"]},
                      "advantages": {**GRPO["advantages"], "inputs": ["tagged"]}})  # fmt: skip
    assert "what short writes (kept) must go to advantages, or to a stage inside it" in only_problem(
        tagged, {"short": {"inside": "advantages"}, "tag": {"replicas": 1}}
    )
    for short_inside in ("tag", "advantages"):  # a chain: each inside the next, or all inside the last
        placement = {"short": StagePlacement(inside=short_inside), "tag": StagePlacement(inside="advantages")}
        assert graph_problems(tagged, placement) == []
        assert in_memory(tagged, placement, "kept") and in_memory(tagged, placement, "tagged")


def test_topics_have_one_writer_and_one_stream_reader():
    two_writers = graph(**{**WITH_FILTER, "short": {**WITH_FILTER["short"], "outputs": ["rollouts"]}})
    problems = graph_problems(two_writers, {"short": StagePlacement(replicas=1)})
    assert any("topic 'rollouts' has 2 writers (generate, short)" in p for p in problems), problems
    two_readers = graph(**{**WITH_FILTER, "advantages": {**GRPO["advantages"]}})
    problems = graph_problems(two_readers, {"short": StagePlacement(replicas=1)})
    assert any("topic 'rollouts' has 2 readers (advantages, short)" in p for p in problems), problems


def test_kinds_need_what_they_use():
    assert "needs exactly one stage of kind 'advantages', it has 0" in " ".join(
        graph_problems(
            graph(generate=GRPO["generate"], train={"kind": "train_actor", "inputs": ["rollouts"]}), {}
        )
    )
    no_fn = graph(**{**WITH_FILTER, "short": {**WITH_FILTER["short"], "fn": None}})
    assert "needs fn: pkg.module:name" in only_problem(no_fn, {"short": {"replicas": 1}})
    bad_fn = graph(**{**WITH_FILTER, "short": {**WITH_FILTER["short"], "fn": "my_pkg.filters.short"}})
    assert "is not pkg.module:name" in only_problem(bad_fn, {"short": {"replicas": 1}})
    joined = graph(**{**GRPO, "advantages": {**GRPO["advantages"], "inputs": ["rollouts", "more"]},
                     "gen2": {"kind": "map", "fn": "m:f", "inputs": ["rollouts"], "outputs": ["more"]}})  # fmt: skip
    assert any(
        "reads one topic: chain stages" in p
        for p in graph_problems(joined, {"gen2": StagePlacement(replicas=1)})
    )
    reserved = graph(**{**WITH_FILTER, "short": {**WITH_FILTER["short"], "outputs": ["stats"]},
                       "advantages": {**GRPO["advantages"], "inputs": ["stats"]}})  # fmt: skip
    assert "topic 'stats' is the run's own" in only_problem(reserved, {"short": {"replicas": 1}})
    renamed = graph(**{**GRPO, "generate": {"kind": "generate", "outputs": ["samples"]},
                      "advantages": {**GRPO["advantages"], "inputs": ["samples"]}})  # fmt: skip
    assert "stage 'generate' (generate) writes the run's 'rollouts' stream" in only_problem(renamed)
    clash = graph(**{**WITH_FILTER, "actor": WITH_FILTER["short"]})
    clash.stages.pop("short")
    assert "stage name 'actor': its workers would be named like" in only_problem(
        clash, {"actor": {"replicas": 1}}
    )
    for name in ("prep", "short1"):  # the preprocessors consume as prep<i>; short1 + 1 = short + 11
        renamed = graph(**{**GRPO, name: WITH_FILTER["short"], "advantages": WITH_FILTER["advantages"]})
        assert f"stage name {name!r}: its workers would be named like" in only_problem(
            renamed, {name: {"replicas": 1}}
        )
    behind = graph(**{**GRPO, "late": {"kind": "map", "fn": "m:f", "inputs": ["training_data"], "outputs": ["late_data"]},
                     "train": {"kind": "train_actor", "inputs": ["late_data"]}})  # fmt: skip
    assert "stage 'train' (train_actor) reads the run's 'training_data' stream" in " ".join(
        graph_problems(behind, {"late": StagePlacement(replicas=1)})
    )


def test_describe_prints_each_stage_upstream_first_with_where_it_runs():
    g = graph(**WITH_FILTER)
    placement = {"short": StagePlacement(inside="advantages")}
    runs_in = {
        "generate": "actor0",
        "short": "preprocessor0",
        "advantages": "preprocessor0",
        "train": "trainer",
    }
    lines = describe(g, placement, runs_in)
    assert lines[0].split() == ["stage", "kind", "reads", "writes", "runs", "in"]
    assert [line.split()[0] for line in lines[1:5]] == ["generate", "short", "advantages", "train"]
    assert lines[2].split() == ["short", "filter", "rollouts", "kept~", "preprocessor0"]
    assert lines[-1].startswith("  ~ handed over in memory")


def test_the_docs_recipe_adds_a_stage_by_merging_into_the_shipped_graph(tmp_path):
    """docs/graph.md's example: a recipe file adds a filter and points the shipped advantages stage at it."""
    recipe = tmp_path / "my-recipe.yaml"
    recipe.write_text(
        "graph:\n"
        "  stages:\n"
        '    short: {kind: filter, fn: "my_pkg.filters:short_answers", options: {min_tokens: 3},\n'
        "            inputs: [rollouts], outputs: [kept]}\n"
        "    advantages: {inputs: [kept]}\n"
        "placement:\n"
        "  stages:\n"
        "    short: {inside: advantages}\n"
    )
    cfg = config(f"recipe={recipe}")
    assert order(cfg.graph) == ["generate", "short", "advantages", "train"]
    assert cfg.graph.stages["advantages"].outputs == ["training_data"]  # the rest of the shipped stage
    assert cfg.graph.stages["short"].options == {"min_tokens": 3}


def test_sync_mode_refuses_a_filter_that_drops_single_samples():
    """A sync round generates exactly one step's groups; samples dropped from a group cannot be replaced,
    so the step would never fill. A group filter frees the group's place and is fine."""
    sample_filter = "graph.stages.short={kind: filter, fn: 'm:f', inputs: [rollouts], outputs: [kept]}"
    placed = ("graph.stages.advantages.inputs=[kept]", "placement.stages.short={inside: advantages}")
    with pytest.raises(
        ConfigError, match="stage 'short' drops single samples, which mode=sync cannot refill"
    ):
        config("mode=sync", sample_filter, *placed)
    config("mode=sync", sample_filter.replace("kind: filter", "kind: filter, level: group"), *placed)
    config(sample_filter, *placed)  # pipelined: the actors keep generating
