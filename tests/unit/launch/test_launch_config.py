"""The launch plan without starting anything: config composition and validation, CPU and GPU placement,
the servers' argv and environment, secrets kept out of config.json, cluster files, and `pipeline-rl launch
--dry-run` (a subprocess that plans and exits)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_rl.launch.compose import ConfigError

REPO = Path(__file__).resolve().parents[3]


def config(*overrides: str):
    """A composed config with a (nonexistent) model: planning reads no checkpoint."""
    from pipeline_rl.launch.compose import compose

    return compose(["model_path=/nonexistent/model", *overrides])


def test_bad_config_value_fails_fast_with_allowed_values():
    for override, words in [
        ("trainer.strategy=zzz", ["trainer.strategy", "'ddp'", "'deepspeed_zero3'"]),
        ("trainer=nope", ["allowed values", "ddp", "deepspeed_zero2"]),
        ("actor.max_lagg=3", ["unknown key", "actor.max_lag"]),
        ("actor.attempts=0", ["actor.attempts", "greater than or equal to 1"]),
    ]:
        result = subprocess.run(
            [sys.executable, "-m", "pipeline_rl.cli", "launch", override],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode != 0
        for word in words:
            assert word in result.stderr, (override, result.stderr)


def test_dry_run_prints_the_placement_map(launch_model, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pipeline_rl.cli", "launch", "--dry-run", f"model_path={launch_model}", f"run_dir={tmp_path}",
         "inference.num_servers=2", "actor.num_actors=2"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for name in ("server0", "server1", "trainer", "preprocessor0", "actor0", "actor1", "status: curl"):
        assert name in result.stdout
    assert not (tmp_path / "logs").exists(), "a dry run starts nothing"
    if len(os.sched_getaffinity(0)) >= 2:  # the servers' cores are their workers' only
        assert "* the engine's worker only" in result.stdout, result.stdout


def test_switching_engine_changes_only_the_backend():

    vllm = config("platform=gpu", "inference=vllm").model_dump()
    sglang = config("platform=gpu", "inference=sglang").model_dump()
    assert vllm["inference"].pop("backend") == "vllm" and sglang["inference"].pop("backend") == "sglang"
    assert vllm == sglang


def test_every_task_file_is_a_valid_choice():
    """Each pipeline_rl/conf/task/ file composes into a validated RunConfig for the task it is named after, so
    `task=name` never fails at a user's launch for a file the repo ships (one naming an unknown task did)."""
    from pipeline_rl.launch.compose import group_options

    options = group_options("task")
    assert {"arith", "remainder", "calc"} <= set(options), options
    for option in options:
        assert config(f"task={option}").task.name == option, f"pipeline_rl/conf/task/{option}.yaml"


def test_the_long_task_groups_match_their_demo_recipes():
    """`task=calc` / `task=remainder` give the task and lengths `pipeline-rl demo --recipe ...` trains with."""
    from pipeline_rl.demo.main import RECIPES

    for name in ("calc", "remainder"):
        group, recipe = config(f"task={name}"), config(*RECIPES[name].overrides)
        assert group.task == recipe.task, name
        lengths = lambda c: (c.actor.max_tokens, c.inference.max_model_len, c.eval.max_tokens)  # noqa: E731
        assert lengths(group) == lengths(recipe), name


def test_sync_mode_is_the_same_run_without_overlap(tmp_path):
    from pipeline_rl.launch.plan import resolve

    cfg = resolve(config("mode=sync", "actor.attempts=4", "trainer.batch_size=16"), tmp_path, {"actors"})
    assert cfg.actor.max_lag == 0 and cfg.actor.max_buffered_groups == 4
    pipelined = resolve(config("actor.attempts=4", "trainer.batch_size=16"), tmp_path, {"actors"})
    assert pipelined.actor.max_lag == config().actor.max_lag


def test_servers_run_the_shim_with_the_token_in_their_environment(tmp_path):
    from pipeline_rl.launch.plan import plan, resolve

    cfg = resolve(config("inference.num_servers=2"), tmp_path, {"servers"})
    specs = plan(cfg, tmp_path, {"servers"})
    assert [s.url for s in specs] == cfg.inference.urls
    for spec in specs:
        assert spec.argv[1:3] == ["-m", "inference_shim"] and str(spec.port) in spec.argv
        assert cfg.inference.token not in " ".join(spec.argv), "the token must not be visible in ps"
        assert spec.secret_env["PIPELINE_RL_TOKEN"] == cfg.inference.token
        assert spec.argv[spec.argv.index("--host") + 1] == "127.0.0.1", "the URL's address, not a wildcard"
        assert spec.env["GLOO_SOCKET_IFNAME"] == "lo" or "GLOO_SOCKET_IFNAME" in os.environ
    assert cfg.inference.api_key is None, "on loopback only, /v1/* stays open (plain curl)"


def test_a_server_bound_off_loopback_gets_a_generated_api_key_through_its_environment(tmp_path, monkeypatch):
    from pipeline_rl.launch.plan import plan, resolve

    monkeypatch.delenv("PIPELINE_RL_API_KEY", raising=False)
    cfg = resolve(config("inference.urls=[http://10.1.2.3:8001]"), tmp_path, {"servers"})
    key = cfg.inference.api_key
    assert key and len(key) >= 32 and key != cfg.inference.token
    (spec,) = plan(cfg, tmp_path, {"servers"})
    assert spec.secret_env["PIPELINE_RL_API_KEY"] == key and key not in " ".join(spec.argv)
    monkeypatch.setenv("PIPELINE_RL_API_KEY", "operator-key")  # an operator's own key wins
    assert (
        resolve(config("inference.urls=[http://10.1.2.3:8001]"), tmp_path).inference.api_key == "operator-key"
    )


def _gpu_cfg(gpus: int, ranks: int, servers: int, *extra: str):
    return config("platform=gpu", f"placement.num_gpus={gpus}", f"trainer.num_processes={ranks}",
                    f"inference.num_servers={servers}", *extra)  # fmt: skip


def test_gpu_plan_never_puts_a_server_on_a_trainer_gpu_unless_asked():
    from pipeline_rl.launch.compose import ConfigError
    from pipeline_rl.launch.plan import local_share, place_gpus, visible_gpus

    all_roles = {"servers", "trainer", "preprocessors", "actors"}

    def place(cfg, roles, gpus):
        return place_gpus(cfg, local_share(cfg, roles), gpus)

    cfg = _gpu_cfg(4, 2, 2)
    placement = place(cfg, all_roles, visible_gpus(cfg))
    assert placement == {"trainer": ["0", "1"], "server0": ["2"], "server1": ["3"]}
    # A node that runs only the servers gives them its GPUs from the first.
    assert place(cfg, {"servers"}, ["0", "1"]) == {"server0": ["0"], "server1": ["1"]}
    # The launcher's own CUDA_VISIBLE_DEVICES spelling is what the children get.
    assert place(cfg, all_roles, ["4", "5", "6", "7"])["server1"] == ["7"]

    with pytest.raises(ConfigError, match=r"need 4 GPUs.*has 3.*placement.colocate=true"):
        place(_gpu_cfg(3, 2, 2), all_roles, ["0", "1", "2"])
    with pytest.raises(ConfigError, match="lower trainer.num_processes .*to at most 1"):
        place(_gpu_cfg(1, 2, 1, "placement.colocate=true"), all_roles, ["0"])
    with pytest.raises(ConfigError, match="no visible GPU"):
        place(_gpu_cfg(0, 1, 1), all_roles, [])
    # Colocation is a mode: asked for, the servers wrap around onto the trainer's GPUs.
    shared = place(_gpu_cfg(3, 2, 2, "placement.colocate=true"), all_roles, ["0", "1", "2"])
    assert shared == {"trainer": ["0", "1"], "server0": ["2"], "server1": ["0"]}


def test_cpu_plan_splits_cores_unless_colocated():
    from dataclasses import replace

    from pipeline_rl.launch.plan import local_share, place_cores

    roles = {"servers", "trainer", "preprocessors", "actors"}

    def place(*overrides):
        cfg = config("inference.num_servers=2", *overrides)
        return place_cores(cfg, replace(local_share(cfg, roles), cores=[0, 1, 2, 3]))

    # By default the trainer and the engines' workers never share a core: pipelined, both work all the time.
    assert place() == {"trainer": [0, 1], "server0": [2], "server1": [3]}
    # Colocated (for mode=sync, one phase at a time): each phase gets the whole machine.
    together = place("mode=sync", "placement.colocate=true")
    assert together == {"trainer": [0, 1, 2, 3], "server0": [0, 1, 2, 3], "server1": [0, 1, 2, 3]}
    servers_only = place_cores(
        config("placement.colocate=true"), replace(local_share(config(), {"servers"}), cores=[0, 1])
    )
    assert servers_only == {"trainer": None, "server0": [0, 1]}


def _one_host_plan(tmp_path: Path, *overrides: str):
    """The resolved config and the processes (by name) of a one-host launch on cores 0 and 1."""
    from dataclasses import replace

    from pipeline_rl.launch.plan import local_share, plan, resolve

    roles = {"servers", "trainer", "preprocessors", "actors"}
    cfg = resolve(config(*overrides), tmp_path, roles)
    specs = plan(cfg, tmp_path, replace(local_share(cfg, roles), cores=[0, 1]))
    return cfg, {s.name: s for s in specs}


def test_a_cpu_vllm_server_binds_only_its_worker_to_its_cores(tmp_path):
    def specs(*overrides):
        return _one_host_plan(tmp_path, *overrides)[1]

    default = specs()
    server, trainer = default["server0"], default["trainer"]
    # vLLM's worker is bound by vLLM itself; the shim's API and engine core float (no taskset).
    assert server.cores == [1] and server.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert server.full_argv()[0] != "taskset", server.full_argv()
    assert trainer.full_argv()[:3] == ["taskset", "-c", "0"]
    # Asked for, or for an engine that binds nothing itself (torch; vLLM on GPU), the whole server is pinned.
    for overrides in (
        ["placement.pin_whole_server=true"],
        ["inference.backend=torch"],
        ["platform=gpu", "placement.num_gpus=2"],
    ):
        assert specs(*overrides)["server0"].full_argv()[:3] == ["taskset", "-c", "1"], overrides


def test_pipelined_servers_keep_in_flight_kv_after_an_update_and_sync_servers_recompute(tmp_path):
    def kv_flag(*overrides):
        cfg, specs = _one_host_plan(tmp_path, *overrides)
        argv = specs["server0"].argv
        return cfg.inference.kv_after_update, argv[argv.index("--kv-after-update") + 1]

    # Unset, the policy follows the mode (docs/decisions.md#kv-after-an-update), and the server is told the same.
    assert kv_flag() == ("keep", "keep")
    assert kv_flag("mode=sync") == ("recompute", "recompute")
    # Named, it is what the user asked for, in either mode.
    assert kv_flag("inference.kv_after_update=recompute") == ("recompute", "recompute")
    assert kv_flag("mode=sync", "inference.kv_after_update=keep") == ("keep", "keep")


def test_pipelined_trainers_settle_pushes_in_the_background_and_sync_trainers_wait():
    from pipeline_rl.launch.compose import ConfigError

    assert config().trainer.push_settle == "background"
    assert config("mode=sync").trainer.push_settle == "wait"
    assert config("trainer.push_settle=wait").trainer.push_settle == "wait"
    # A sync round must generate with the new weights: its push cannot go on without them.
    with pytest.raises(ConfigError, match="push_settle=background needs mode=pipeline"):
        config("mode=sync", "trainer.push_settle=background")


def test_dry_run_shows_the_gpu_map_and_config_errors_say_what_to_change(launch_model, tmp_path):
    base = [sys.executable, "-m", "pipeline_rl.cli", "launch", "--dry-run", f"model_path={launch_model}",
            f"run_dir={tmp_path}", "platform=gpu", "trainer=fsdp", "trainer.num_processes=2",
            "inference.num_servers=2"]  # fmt: skip
    ok = subprocess.run([*base, "placement.num_gpus=4"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    rows = {line.split()[0]: line.split() for line in ok.stdout.splitlines() if line.split()}
    assert rows["trainer"][3] == "0,1" and rows["server0"][3] == "2" and rows["server1"][3] == "3"
    bad = subprocess.run(
        [*base, "placement.num_gpus=3"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode != 0 and "placement.colocate=true" in bad.stderr, bad.stderr


def test_secrets_stay_out_of_config_json_and_children_still_get_them(tmp_path):
    """config.json names the 0600 secrets file; load_run_config (what every child calls) merges it."""
    from pipeline_rl.config import load_run_config
    from pipeline_rl.launch.plan import local_share, resolve
    from pipeline_rl.launch.processes import ProcessSpec
    from pipeline_rl.launch.runner import Launcher

    overrides = ("streams.redis_url=redis://:s3cret@127.0.0.1:7/0", "inference.api_key=v1-k3y-secret")
    cfg = resolve(config(*overrides), tmp_path, {"servers"})
    launcher = Launcher(cfg, tmp_path, local_share(cfg, {"servers"}))
    launcher.run_dir.mkdir(exist_ok=True)
    specs = launcher._prepare({"PATH": os.environ["PATH"]}, status_port=0)
    launcher.status_server.shutdown()
    launcher.monitor.close()
    public = (tmp_path / "config.json").read_text()
    assert cfg.inference.token not in public and "s3cret" not in public and "v1-k3y-secret" not in public
    assert (tmp_path / "secrets").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "secrets" / "run.json").stat().st_mode & 0o777 == 0o600
    loaded = load_run_config(tmp_path / "config.json")
    assert loaded.inference.token == cfg.inference.token
    assert loaded.inference.api_key == "v1-k3y-secret", "actors and evaluations read the key from secrets/"
    assert loaded.streams.redis_url == "redis://:s3cret@127.0.0.1:7/0"
    for spec in specs:
        assert isinstance(spec, ProcessSpec)
        script = tmp_path / "cmd" / f"{spec.name}.sh"
        assert script.stat().st_mode & 0o777 == 0o700 and cfg.inference.token not in script.read_text()
        assert f"source {tmp_path / 'secrets' / spec.name}.env" in script.read_text()
        assert (tmp_path / "secrets" / f"{spec.name}.env").stat().st_mode & 0o777 == 0o600


CLUSTER = {
    "run_dir": "/tmp/prl-cluster-plan",
    "overrides": ["model_path=/nonexistent/model"],
    "hosts": [
        {"name": "a", "address": "10.9.0.1", "redis_port": 6390, "trainer_ranks": 2, "preprocessors": 1},
        {"name": "b", "address": "10.9.0.2", "trainer_ranks": 2, "actors": 2},
        {"name": "c", "address": "10.9.0.3", "server_ports": [8001, 8002], "actors": 1},
    ],
}


def test_cluster_file_gives_each_node_its_share_and_the_same_config(tmp_path):
    import yaml

    from pipeline_rl.launch.cluster import cluster_config, load_cluster, node_share
    from pipeline_rl.launch.plan import plan

    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(CLUSTER))
    spec = load_cluster(path)
    env = {
        "PIPELINE_RL_TOKEN": "t" * 20,
        "PIPELINE_RL_API_KEY": "k" * 20,
        "PIPELINE_RL_REDIS_PASSWORD": "p" * 20,
    }
    cfg = cluster_config(spec, ["trainer.max_steps=3"], env, need_secrets=True)
    assert cfg.inference.api_key == "k" * 20
    assert cfg.inference.urls == ["http://10.9.0.3:8001", "http://10.9.0.3:8002"]
    assert cfg.streams.redis_url == f"redis://:{'p' * 20}@10.9.0.1:6390/0"
    assert cfg.trainer.num_processes == 4 and cfg.trainer.weight_address == "10.9.0.1"
    assert (cfg.actor.num_actors, cfg.num_preprocessors) == (3, 1)

    a, b, c = (node_share(spec, cfg, n) for n in "abc")
    assert a.redis == ("10.9.0.1", 6390) and b.redis is None and a.evaluates and not b.evaluates
    assert (b.actors, c.actors, c.servers) == ([0, 1], [2], [0, 1])
    trainer = next(s for s in plan(cfg, tmp_path, b) if s.role == "trainer").argv
    flags = {k: trainer[trainer.index(k) + 1] for k in ("--num_processes", "--num_machines", "--machine_rank", "--main_process_ip", "--main_process_port")}  # fmt: skip
    assert flags == {"--num_processes": "4", "--num_machines": "2", "--machine_rank": "1",
                     "--main_process_ip": "10.9.0.1", "--main_process_port": "29500"}  # fmt: skip
    servers = [s for s in plan(cfg, tmp_path, c) if s.role == "servers"]
    assert [s.argv[s.argv.index("--host") + 1] for s in servers] == ["10.9.0.3", "10.9.0.3"]
    assert all(s.env["GLOO_SOCKET_IFNAME"] == "eth0" for s in servers)
    # The key reaches the servers through the environment, never argv or a command file.
    assert all(s.secret_env["PIPELINE_RL_API_KEY"] == "k" * 20 and "k" * 20 not in s.argv for s in servers)

    with pytest.raises(
        ConfigError, match="PIPELINE_RL_TOKEN, PIPELINE_RL_API_KEY and PIPELINE_RL_REDIS_PASSWORD must be set"
    ):
        cluster_config(spec, [], {}, need_secrets=True)
    with pytest.raises(ConfigError, match="set by the cluster file"):
        cluster_config(spec, ["actor.num_actors=5"], env, need_secrets=True)


def test_only_a_node_with_every_stream_client_snapshots_locations_and_restarts_the_trainer(tmp_path):
    """A node sees every producer and consumer stop (the location snapshot) and can restart the trainer
    alone only when it runs Redis, every actor, every preprocessor and every trainer rank."""
    import yaml

    from pipeline_rl.launch.cluster import cluster_config, load_cluster, node_share

    env = {
        name: "s" * 20 for name in ("PIPELINE_RL_TOKEN", "PIPELINE_RL_API_KEY", "PIPELINE_RL_REDIS_PASSWORD")
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(CLUSTER))
    spec = load_cluster(path)
    cfg = cluster_config(spec, [], env, need_secrets=True)
    assert not any(node_share(spec, cfg, n).holds_every_stream_client(cfg) for n in "abc")
    soak_layout = {**CLUSTER, "hosts": [
        {"name": "a", "address": "10.9.0.1", "redis_port": 6390, "trainer_ranks": 1, "preprocessors": 1, "actors": 1},
        {"name": "b", "address": "10.9.0.2", "server_ports": [8001, 8002]},
    ]}  # fmt: skip
    path.write_text(yaml.safe_dump(soak_layout))
    spec = load_cluster(path)
    cfg = cluster_config(spec, [], env, need_secrets=True)
    a, b = (node_share(spec, cfg, n) for n in "ab")
    assert a.holds_every_stream_client(cfg) and not b.holds_every_stream_client(cfg)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda c: c["hosts"][1].update(trainer_ranks=1), ["trainer_ranks differ", "same trainer_ranks"]),
        (
            lambda c: c["hosts"][2].update(address="0.0.0.0"),
            ["hosts.2(c).address", "cluster-network address"],
        ),
        (lambda c: c["hosts"][2].update(address="node3"), ["not an IP address"]),
        (lambda c: c["hosts"][1].update(redis_port=6390), ["one host runs the run's Redis"]),
        (lambda c: c["hosts"][2].update(server_ports=[]), ["no host runs servers"]),
        (lambda c: c["hosts"][0].update(gpu=1), ["hosts.0(a).gpu", "unknown key"]),
    ],
)
def test_bad_cluster_file_says_what_to_fix(tmp_path, change, words):
    import copy

    import yaml

    cluster = copy.deepcopy(CLUSTER)
    change(cluster)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    result = subprocess.run(
        [sys.executable, "-m", "pipeline_rl.cli", "launch", "--cluster", str(path), "--dry-run"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0
    for word in words:
        assert word in result.stderr, (word, result.stderr)


def test_cluster_dry_run_prints_every_node_from_any_node(tmp_path):
    import yaml

    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(CLUSTER))
    result = subprocess.run(
        [sys.executable, "-m", "pipeline_rl.cli", "launch", "--cluster", str(path), "--dry-run"],
        cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "PIPELINE_RL_TOKEN": ""},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for text in ("== node a (10.9.0.1", "== node b", "== node c", "machine rank 1 of 2",
                 "http://10.9.0.3:8002", "redis://10.9.0.1:6390/0", "actor2"):  # fmt: skip
        assert text in result.stdout, (text, result.stdout)
    assert not Path(CLUSTER["run_dir"]).exists(), "a dry run creates nothing"
