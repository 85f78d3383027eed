"""The Ray launcher's placement (pipeline_rl/launch/ray_launch.py): which node runs what, and the
cluster file it hands to the per-node launcher. Pure functions: no Ray cluster here
(tests/integration/test_ray_cluster.py runs one)."""

from __future__ import annotations

import pytest

from pipeline_rl.launch.cluster import ClusterSpec, cluster_config, node_share
from pipeline_rl.launch.compose import ConfigError, compose
from pipeline_rl.launch.ray_launch import RayNode, cluster_file, layout, split_overrides


def _nodes(*slots: float) -> list[RayNode]:
    return [RayNode(f"id{k}", f"10.0.0.{k + 1}", s, is_head=k == 0) for k, s in enumerate(slots)]


def _summary(roles) -> list[tuple[str, int, int | None, int, bool]]:
    return [(r.node.address, r.trainer_ranks, r.machine_rank, r.servers, r.control) for r in roles]


def test_trainer_machines_go_first_head_first_then_servers_spread_over_the_most_free_slots():
    roles = layout(_nodes(1, 2, 1), ranks=2, ranks_per_node=1, servers=2)
    assert _summary(roles) == [
        ("10.0.0.1", 1, 0, 0, True),
        ("10.0.0.2", 1, 1, 1, False),
        ("10.0.0.3", 0, None, 1, False),
    ]


def test_ranks_are_packed_on_one_node_by_default_and_servers_go_where_most_slots_are_free():
    roles = layout(_nodes(8, 8), ranks=4, ranks_per_node=None, servers=6)
    assert _summary(roles) == [("10.0.0.1", 4, 0, 1, True), ("10.0.0.2", 0, None, 5, False)]


def test_the_head_is_not_needed_a_node_without_slots_runs_nothing():
    roles = layout(_nodes(0, 2, 2), ranks=2, ranks_per_node=2, servers=2)
    assert _summary(roles) == [("10.0.0.2", 2, 0, 0, True), ("10.0.0.3", 0, None, 2, False)]


@pytest.mark.parametrize(
    ("slots", "ranks", "per_node", "servers", "says"),
    [
        ((1, 1), 4, 2, 1, "2 trainer machine(s) of 2 rank(s)"),
        ((2, 2), 2, 1, 3, "3 server(s) and 2 trainer rank(s) need 5 slots"),
        ((4,), 3, 2, 0, "does not divide trainer.num_processes=3"),
    ],
)
def test_a_cluster_without_room_is_refused_with_what_to_change(slots, ranks, per_node, servers, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        layout(_nodes(*slots), ranks=ranks, ranks_per_node=per_node, servers=servers)


def test_the_cluster_file_of_a_layout_is_an_ordinary_cluster_file_on_the_same_plan(tmp_path):
    cfg = compose(["model_path=/models/m", "actor.num_actors=2", "num_preprocessors=1"])
    roles = layout(_nodes(1, 2, 1), ranks=2, ranks_per_node=1, servers=2)
    probes = {
        "id0": {"ports": [7001, 7002], "ifname": "eth0"},
        "id1": {"ports": [7101], "ifname": "ens5"},
        "id2": {"ports": [7201], "ifname": "eth0"},
    }
    data = cluster_file(roles, probes, str(tmp_path / "run"), cfg)
    spec = ClusterSpec.model_validate(data)
    hosts = {h.address: h for h in spec.hosts}
    assert hosts["10.0.0.1"].redis_port == 7002 and spec.rendezvous_port == 7001
    assert hosts["10.0.0.1"].actors == 2 and hosts["10.0.0.1"].preprocessors == 1
    assert hosts["10.0.0.2"].server_ports == [7101] and hosts["10.0.0.3"].server_ports == [7201]
    assert all(h.gpus is None for h in spec.hosts), "GPUs: the ones Ray gives each node's launcher"
    secrets = {"PIPELINE_RL_TOKEN": "t", "PIPELINE_RL_API_KEY": "k", "PIPELINE_RL_REDIS_PASSWORD": "p"}
    run = cluster_config(spec, ["model_path=/models/m"], secrets, need_secrets=True)
    assert run.trainer.num_processes == 2 and run.inference.num_servers == 2 and run.actor.num_actors == 2
    assert run.inference.urls == ["http://10.0.0.2:7101", "http://10.0.0.3:7201"]
    b = node_share(spec, run, hosts["10.0.0.2"].name)
    assert b.env["GLOO_SOCKET_IFNAME"] == "ens5", "a node's own interface"
    assert b.trainer.machine_rank == 1 and b.trainer.main_ip == "10.0.0.1" and b.servers == [0]


def test_the_counts_the_cluster_file_sets_are_taken_out_of_the_nodes_overrides():
    topology, rest = split_overrides(
        ["trainer.num_processes=2", "trainer.lr=1e-5", "inference.num_servers=4"]
    )
    assert topology == ["trainer.num_processes=2", "inference.num_servers=4"] and rest == ["trainer.lr=1e-5"]
