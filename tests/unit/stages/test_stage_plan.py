"""The launcher runs the graph: its processes come from the stages (the shipped graph gives today's
processes, in today's order), a user stage with workers gets its own supervised processes, and a stage
function that cannot run is refused before anything starts."""

from __future__ import annotations

from pathlib import Path

from pipeline_rl.launch.compose import compose
from pipeline_rl.launch.plan import launch_roles, local_share, plan
from pipeline_rl.launch.preflight import stage_problems
from pipeline_rl.launch.supervision import POLICY_FIELD

FILTER = "graph.stages.short={kind: filter, fn: 'support.stage_fns:short_answers', inputs: [rollouts], outputs: [kept]}"


def config(*overrides: str):
    return compose(["model_path=/nonexistent/model", "inference.urls=[http://127.0.0.1:9]", *overrides])


def test_the_shipped_graph_plans_todays_processes_in_todays_order(tmp_path: Path):
    cfg = config("actor.num_actors=2", "num_preprocessors=2")
    assert launch_roles(cfg) == ["redis", "servers", "trainer", "preprocessors", "actors"]
    specs = plan(cfg, tmp_path, local_share(cfg, set(launch_roles(cfg))))
    assert [(s.name, s.role) for s in specs] == [
        ("server0", "servers"),
        ("trainer", "trainer"),
        ("preprocessor0", "preprocessors"),
        ("preprocessor1", "preprocessors"),
        ("actor0", "actors"),
        ("actor1", "actors"),
    ]
    assert specs[2].argv[-5:] == ["preprocess", "--config", str(tmp_path / "config.json"), "--index", "0"]
    assert specs[5].argv[-5:] == ["actor", "--config", str(tmp_path / "config.json"), "--index", "1"]


def test_a_user_stage_with_workers_gets_its_own_supervised_processes(tmp_path: Path):
    cfg = config(FILTER, "graph.stages.advantages.inputs=[kept]", "placement.stages.short={replicas: 2}")
    assert launch_roles(cfg) == ["redis", "servers", "trainer", "preprocessors", "stages", "actors"]
    specs = plan(cfg, tmp_path, local_share(cfg, set(launch_roles(cfg))))
    names = [s.name for s in specs]
    assert names == ["server0", "trainer", "preprocessor0", "short0", "short1", "actor0"]  # readers first
    short1 = specs[names.index("short1")]
    assert short1.role == "stages" and POLICY_FIELD["stages"] == "stage"
    assert short1.argv[-7:] == [
        "stage",
        "--config",
        str(tmp_path / "config.json"),
        "--stage",
        "short",
        "--index",
        "1",
    ]
    # inside the preprocessor instead: no process of its own
    cfg = config(
        FILTER, "graph.stages.advantages.inputs=[kept]", "placement.stages.short={inside: advantages}"
    )
    assert "stages" not in launch_roles(cfg)
    assert [s.name for s in plan(cfg, tmp_path, local_share(cfg, set(launch_roles(cfg))))] == [
        "server0",
        "trainer",
        "preprocessor0",
        "actor0",
    ]


def test_a_stage_function_that_cannot_run_is_refused_at_startup():
    cfg = config(FILTER, "graph.stages.advantages.inputs=[kept]", "placement.stages.short={replicas: 1}")
    assert stage_problems(cfg) == []  # tests/ is on sys.path here, as a user's package would be installed
    missing = config(
        FILTER.replace("support.stage_fns", "no_such_pkg.filters"),
        "graph.stages.advantages.inputs=[kept]",
        "placement.stages.short={replicas: 1}",
    )
    (problem,) = stage_problems(missing)
    assert "graph.stages.short.fn='no_such_pkg.filters:short_answers': cannot import no_such_pkg" in problem
    bad_option = config(
        FILTER.replace("outputs: [kept]", "outputs: [kept], options: {min_tokenz: 3}"),
        "graph.stages.advantages.inputs=[kept]",
        "placement.stages.short={replicas: 1}",
    )
    (problem,) = stage_problems(bad_option)
    assert "cannot take (sample, group, **options) with options ['min_tokenz']" in problem


def test_roles_are_the_runs_own():
    import pytest

    from pipeline_rl.launch.compose import ConfigError
    from pipeline_rl.launch.plan import parse_roles

    cfg = config()
    assert parse_roles(None, cfg) == {"redis", "servers", "trainer", "preprocessors", "actors"}
    assert parse_roles("servers, trainer", cfg) == {"servers", "trainer"}
    with pytest.raises(ConfigError, match=r"unknown roles \['stages'\]; this run's roles: redis, servers"):
        parse_roles("servers,stages", cfg)  # no stage with workers of its own in this run
    staged = config(FILTER, "graph.stages.advantages.inputs=[kept]", "placement.stages.short={replicas: 1}")
    assert parse_roles("stages", staged) == {"stages"}
