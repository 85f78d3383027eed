"""The SLURM path (pipeline_rl/launch/slurm.py): nodelists, the exact commands for an allocation, the
token kept out of argv, and the generated script run by bash. srun, `ray` and `pipeline-rl` are
stand-ins here (a SLURM controller and a Ray cluster cannot run in a unit test): small scripts that log
their argv and environment; bash, the script's waits and its `--check-nodes` checker are real."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_rl.launch import slurm
from pipeline_rl.launch.cluster import public_secrets
from pipeline_rl.launch.slurm import (
    Step,
    active_nodes,
    allocation,
    object_store_bytes,
    parse_nodelist,
    ray_commands,
    ray_env,
    render_script,
    write_token,
)

ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[01-03]",
    "SLURMD_NODENAME": "gpu01",
    "SLURM_CPUS_ON_NODE": "32",
    "SLURM_GPUS_ON_NODE": "4",
    "SLURM_MEM_PER_NODE": "16000",
}
SRUN = ("srun", "--nodes=1", "--ntasks=1", "--overlap", "--export=ALL")
STORE = int(16000 * 2**20 * 0.3)  # 30% of SLURM_MEM_PER_NODE: under the 8 GiB cap


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("gpu01", ["gpu01"]),
        ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
        ("node[8-10]", ["node8", "node9", "node10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("a,b.cluster,c-1", ["a", "b.cluster", "c-1"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("x[5]", ["x5"]),
        (["gpu[01-02]", "cpu5"], ["gpu01", "gpu02", "cpu5"]),
    ],
)
def test_nodelist_expands_to_host_names_in_order(nodelist, hosts) -> None:
    assert parse_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "nodelist, why",
    [
        ("", "empty nodelist"),
        ("gpu[01-", "never closed"),
        ("gpu]01", "unbalanced"),
        ("gpu[[1]]", "nested"),
        ("gpu[03-01]", "runs backwards"),
        ("gpu[a-b]", "not N or N-M"),
        ("gpu[1-3:2]", "not N or N-M"),
        ("a,,b", "stray comma"),
        ("gpu 01", "not a host name"),
        ("gpu[01-02],gpu02", "gpu02 more than once"),
        ("n[0-999999]", "more than 100000 hosts"),
    ],
)
def test_a_bad_nodelist_is_refused_with_the_reason(nodelist, why) -> None:
    with pytest.raises(ValueError, match=why.replace("[", r"\[")):
        parse_nodelist(nodelist)


def test_the_head_is_the_node_the_batch_script_runs_on() -> None:
    alloc = allocation({**ENV, "SLURMD_NODENAME": "gpu02"})
    assert alloc.hosts == ("gpu02", "gpu01", "gpu03")
    assert (alloc.job_id, alloc.cpus_per_node, alloc.gpus_per_node, alloc.mem_per_node_mb) == (
        "4242",
        32,
        4,
        16000,
    )
    assert allocation({"SLURM_JOB_NODELIST": "b,a"}).hosts == ("b", "a")  # not on a node of it (salloc)
    with pytest.raises(ValueError, match="run inside sbatch/salloc"):
        allocation({})
    with pytest.raises(ValueError, match="SLURM_GPUS_ON_NODE='four' is not a count"):
        allocation({**ENV, "SLURM_GPUS_ON_NODE": "four"})


def test_the_object_store_is_capped() -> None:
    assert object_store_bytes(None) == 8 * 2**30
    assert object_store_bytes(1_000_000) == 8 * 2**30
    assert object_store_bytes(16000) == STORE
    assert object_store_bytes(None, cap_gb=2) == 2 * 2**30


def _steps(overrides=("run_dir=/shared/runs/r1", "--dry-run")) -> list[Step]:
    alloc = allocation(ENV)
    return ray_commands(
        alloc.hosts,
        "10.0.0.1",
        overrides,
        num_cpus=alloc.cpus_per_node,
        num_gpus=alloc.gpus_per_node,
        object_store=object_store_bytes(alloc.mem_per_node_mb),
        job_id=alloc.job_id,
    )


def test_commands_for_an_allocation_are_exactly_these() -> None:
    node = (f"--object-store-memory={STORE}", "--num-cpus=32", "--num-gpus=4")
    check = ("python", "-m", "pipeline_rl.launch.slurm", "--check-nodes")
    steps = _steps()
    assert [(s.kind, s.host, s.argv) for s in steps] == [
        ("start", "gpu01", (*SRUN, "--cpus-per-task=32", "-w", "gpu01", "ray", "start", "--head",
                            "--node-ip-address=10.0.0.1", "--port=6379", "--dashboard-host=10.0.0.1",
                            "--temp-dir=/tmp/ray-4242-gpu01", *node, "--disable-usage-stats", "--block")),
        ("wait", "gpu01", (*SRUN, "-w", "gpu01", *check, "1", "--address", "10.0.0.1:6379")),
        ("start", "gpu02", (*SRUN, "--cpus-per-task=32", "-w", "gpu02", "ray", "start", "--address=10.0.0.1:6379",
                            "--temp-dir=/tmp/ray-4242-gpu02", *node, "--disable-usage-stats", "--block")),
        ("start", "gpu03", (*SRUN, "--cpus-per-task=32", "-w", "gpu03", "ray", "start", "--address=10.0.0.1:6379",
                            "--temp-dir=/tmp/ray-4242-gpu03", *node, "--disable-usage-stats", "--block")),
        ("wait", "gpu01", (*SRUN, "-w", "gpu01", *check, "3", "--address", "10.0.0.1:6379")),
        ("run", "gpu01", (*SRUN, "--cpus-per-task=32", "-w", "gpu01", "pipeline-rl", "launch", "--ray",
                          "10.0.0.1:6379", "run_dir=/shared/runs/r1", "--dry-run")),
        # every node's Ray stops at exit, the workers first, the head (whose GCS they drain with) last
        ("stop", "gpu02", ()),
        ("stop", "gpu03", ()),
        ("stop", "gpu01", ()),
    ]  # fmt: skip
    assert [s.deadline_s for s in steps if s.kind == "wait"] == [
        slurm.HEAD_DEADLINE_S,
        slurm.NODES_DEADLINE_S,
    ]
    assert all(s.deadline_s == slurm.STOP_DEADLINE_S for s in steps if s.kind == "stop")


def test_one_node_has_no_worker_wait_and_ray_counts_what_it_is_not_told() -> None:
    steps = ray_commands(["solo"], "10.0.0.9", port=6380, temp_root="/scratch/")
    assert [(s.kind, s.host) for s in steps] == [
        ("start", "solo"),
        ("wait", "solo"),
        ("run", "solo"),
        ("stop", "solo"),
    ]
    assert steps[0].argv[:7] == (*SRUN, "-w", "solo")  # no --cpus-per-task: srun's own default
    assert "--temp-dir=/scratch/ray-local-solo" in steps[0].argv
    assert not any(a.startswith(("--num-cpus", "--num-gpus")) for a in steps[0].argv)
    assert steps[2].argv[-3:] == ("launch", "--ray", "10.0.0.9:6380")


def test_a_temp_dir_too_long_for_rays_sockets_is_refused() -> None:
    with pytest.raises(ValueError, match="shorter --temp-root"):
        ray_commands(["gpu01"], "10.0.0.1", temp_root="/scratch/a/rather/long/node/local/path")


def test_every_step_runs_with_token_auth_and_the_token_is_in_no_argv(tmp_path: Path) -> None:
    token_path = tmp_path / "state" / "ray_token"
    write_token(token_path)
    token = token_path.read_text()
    assert len(token) == 64
    assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(token_path.parent.stat().st_mode) == 0o700
    env = ray_env(str(token_path))
    assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
    steps = _steps()
    script = render_script(steps, env, bin_dir="/venv/bin")
    assert token not in script and all(token not in " ".join(s.argv) for s in steps)
    # exported before the first step; srun passes the whole environment on, even under sbatch --export=NONE
    assert script.index(f"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token_path}\n") < script.index(
        "srun "
    )
    assert all(s.argv[:5] == SRUN for s in steps if s.argv)
    assert ray_env("t", "ib0") == {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": "t",
        "GLOO_SOCKET_IFNAME": "ib0",
        "NCCL_SOCKET_IFNAME": "ib0",
    }


def test_overrides_that_would_put_a_secret_in_argv_are_refused(capsys) -> None:
    assert public_secrets(["run_dir=r", "streams.redis_url=redis://h:6379/0"]) == []
    assert public_secrets(
        ["inference.token=abc", "+inference.api_key=k", "streams.redis_url=redis://:pw@h/0"]
    ) == [
        "inference.token=... would be in argv: export PIPELINE_RL_TOKEN instead",
        "inference.api_key=... would be in argv: export PIPELINE_RL_API_KEY instead",
        "streams.redis_url holds a password: export PIPELINE_RL_REDIS_PASSWORD and give the URL without it",
    ]
    with pytest.raises(SystemExit, match="export PIPELINE_RL_TOKEN"):
        slurm.main(["--print", "--nodelist", "gpu01", "--head-ip", "10.0.0.1", "--", "inference.token=abc"])
    assert capsys.readouterr().out == ""


def test_print_shows_the_script_and_writes_nothing(tmp_path: Path, monkeypatch, capsys) -> None:
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    state = tmp_path / "state"
    slurm.main(["--print", "--head-ip", "10.0.0.1", "--state-dir", str(state), "--", "run_dir=/shared/runs/r1", "--dry-run"])  # fmt: skip
    token = state / "ray_token"
    expected = render_script(
        _steps(), ray_env(str(token)), bin_dir=str(Path(sys.executable).parent), remove_at_exit=[str(token)]
    )
    assert capsys.readouterr().out == expected
    assert not state.exists()


def test_run_writes_a_0600_token_and_the_script_then_hands_over_to_bash(tmp_path: Path, monkeypatch) -> None:
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    execs = []
    monkeypatch.setattr(slurm.os, "execvp", lambda file, argv: execs.append((file, argv)))
    state = tmp_path / "state"
    slurm.main(["--head-ip", "10.0.0.1", "--state-dir", str(state), "--", "run_dir=/shared/runs/r1"])
    script = state / "ray_job.sh"
    assert execs == [("bash", ["bash", str(script)])]
    assert stat.S_IMODE((state / "ray_token").stat().st_mode) == 0o600
    assert (state / "ray_token").read_text() not in script.read_text()
    assert f"rm -f -- {state / 'ray_token'}\n" in script.read_text()


def test_a_token_file_of_ones_own_must_be_private_and_is_kept(tmp_path: Path, monkeypatch) -> None:
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(slurm.os, "execvp", lambda file, argv: None)
    token = tmp_path / "mine"
    token.write_text("t")
    token.chmod(0o644)
    args = ["--head-ip", "10.0.0.1", "--state-dir", str(tmp_path / "s"), "--token-file", str(token)]
    with pytest.raises(SystemExit, match="chmod 600"):
        slurm.main(args)
    token.chmod(0o600)
    slurm.main(args)
    script = (tmp_path / "s" / "ray_job.sh").read_text()
    assert f"RAY_AUTH_TOKEN_PATH={token}\n" in script and "rm -f" not in script


def test_ifname_names_the_head_address_and_the_collectives_interface(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    slurm.main(["--print", "--ifname", "lo", "--state-dir", str(tmp_path), "--", "run_dir=r"])
    script = capsys.readouterr().out
    assert " ray start --head --node-ip-address=127.0.0.1 --port=6379 --dashboard-host=127.0.0.1 " in script
    assert " pipeline-rl launch --ray 127.0.0.1:6379 run_dir=r || exit $?\n" in script
    assert "GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo\n" in script
    monkeypatch.delenv("SLURMD_NODENAME")  # salloc's shell on a login node: the head is elsewhere
    with pytest.raises(SystemExit, match="not on the head gpu01: give --head-ip"):
        slurm.main(["--print", "--ifname", "lo", "--", "run_dir=r"])


STATUS = """======== Autoscaler status: 2026-01-01 00:00:00 ========
Node status
---------------------------------------------------------------
Active:
 1 node_9fb76a5d57
 1 node_cc7bc97222
Idle:
 1 node_0a1b2c3d4e
Pending:
 10.0.0.4: node_5f, launching
Recent failures:
 node_77: NodeTerminated (ip: 10.0.0.5)

Resources
---------------------------------------------------------------
Total Usage:
 0.0/96.0 CPU
"""


def test_ray_status_counts_active_and_idle_nodes() -> None:
    assert active_nodes(STATUS) == 3
    assert (
        active_nodes(
            "No cluster status. It may take a few seconds for the Ray internal services to start up."
        )
        == 0
    )
    assert active_nodes("Active:\n (no active nodes)\nPending:\n (no pending nodes)\n") == 0


def test_interface_ip_reads_the_interface() -> None:
    assert slurm.interface_ip("lo") == "127.0.0.1"
    with pytest.raises(ValueError, match="interface 'nosuch0' has no IPv4 address"):
        slurm.interface_ip("nosuch0")


# Stand-ins, in the script's PATH ahead of everything: srun logs the Ray variables and its argv, then
# runs the command here; `ray start` blocks like --block until SIGTERM, then logs "stopped HOST"; `ray
# status` lists $FAKE_NODES nodes; the driver exits $FAKE_DRIVER_RC.
FAKES = {
    "srun": """#!/usr/bin/env bash
echo "$RAY_AUTH_MODE $RAY_AUTH_TOKEN_PATH | $*" >> "$FAKE_LOG"
while [[ $1 == -* ]]; do [[ $1 == -w ]] && export FAKE_HOST=$2 && shift; shift; done
exec "$@"
""",
    "ray": """#!/usr/bin/env bash
case $1 in
  start)
    [[ $* == *--head* && -n ${FAKE_HEAD_FAILS:-} ]] && exit 1
    trap 'kill "$child"; echo "stopped $FAKE_HOST" >> "$FAKE_LOG"; exit 0' TERM
    sleep 30 & child=$!
    wait "$child" ;;
  status) printf 'Node status\\nActive:\\n'; for ((i = 0; i < FAKE_NODES; i++)); do echo " 1 node_$i"; done ;;
esac
""",
    "pipeline-rl": """#!/usr/bin/env bash
exit "$FAKE_DRIVER_RC"
""",
    "python": f"""#!/bin/sh
exec {sys.executable} "$@"
""",
}


def _run_script(tmp_path: Path, nodes: int, driver_rc: int = 0, deadline_s: int = 30, **env: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in FAKES.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    token = tmp_path / "state" / "ray_token"
    write_token(token)
    steps = [
        s if s.kind != "wait" else Step(s.kind, s.host, s.argv, s.what, deadline_s, s.hint) for s in _steps()
    ]
    script = tmp_path / "job.sh"
    script.write_text(render_script(steps, ray_env(str(token)), bin_dir=str(bin_dir), poll_s=0.05, remove_at_exit=[str(token)]))  # fmt: skip
    log = tmp_path / "log"
    run_env = {
        **os.environ,
        "FAKE_LOG": str(log),
        "FAKE_NODES": str(nodes),
        "FAKE_DRIVER_RC": str(driver_rc),
        **env,
    }
    proc = subprocess.run(["bash", str(script)], env=run_env, capture_output=True, text=True, timeout=10)
    return proc, log.read_text().splitlines(), token


def _logged(step: Step, token: Path) -> str:
    return f"token {token} | {' '.join(step.argv[1:])}"


def test_the_script_starts_waits_runs_the_driver_and_stops_every_node(tmp_path: Path) -> None:
    proc, log, token = _run_script(tmp_path, nodes=3, driver_rc=3)
    steps = _steps()
    assert proc.returncode == 3, proc.stderr  # the driver's exit status is the job's
    # srun saw RAY_AUTH_MODE=token and the token's path for every step; the waits and the driver ran in
    # order (each `ray start` runs in the background, so where it lands among them is not fixed)
    assert [line for line in log if " ray start " not in line] == [
        *(_logged(s, token) for s in steps if s.kind in ("wait", "run")),
        # the workers' Ray got SIGTERM (through srun) and ended before the head's
        *sorted(["stopped gpu02", "stopped gpu03"], key=log.index),
        "stopped gpu01",
    ]
    assert sorted(line for line in log if " ray start " in line) == sorted(
        _logged(s, token) for s in steps if s.kind == "start"
    )
    assert proc.stderr.splitlines() == [
        "== start the Ray head on gpu01 at 10.0.0.1:6379",
        "== wait for the Ray head at 10.0.0.1:6379",
        "== start a Ray worker on gpu02",
        "== start a Ray worker on gpu03",
        "== wait for all 3 Ray nodes",
        "== run pipeline-rl on Ray at 10.0.0.1:6379",
        "== stop Ray on every node",
    ]
    assert not token.exists()  # removed once Ray is down


def test_a_wait_past_its_deadline_says_what_to_do_and_still_stops_every_node(tmp_path: Path) -> None:
    proc, log, token = _run_script(tmp_path, nodes=2, deadline_s=0)
    assert proc.returncode == 1
    assert (
        "error: wait for all 3 Ray nodes: gave up after 0s. A worker that cannot reach 10.0.0.1:6379"
        in proc.stderr
    )
    assert "The last check said: 2 of 3 Ray nodes up" in proc.stderr
    assert not any("pipeline-rl" in line for line in log)  # no driver
    assert proc.stderr.rstrip().endswith("== stop Ray on every node")
    assert sorted(line for line in log if line.startswith("stopped")) == [
        f"stopped gpu0{i}" for i in (1, 2, 3)
    ]
    assert not token.exists()


def test_a_ray_start_that_ends_fails_the_wait_at_once(tmp_path: Path) -> None:
    proc, log, _ = _run_script(tmp_path, nodes=0, FAKE_HEAD_FAILS="1")
    assert proc.returncode == 1
    assert "error: wait for the Ray head at 10.0.0.1:6379: a `ray start` step ended; its output above says why" in proc.stderr  # fmt: skip
    assert not any("pipeline-rl" in line for line in log)
