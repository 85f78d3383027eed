"""`pipeline-rl launch --ray ADDRESS`: the whole job placed on a running Ray cluster.

    export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=/shared/ray/token   # as for every `ray start`
    pipeline-rl launch --ray 10.0.0.1:6379 run_dir=/shared/runs/r1 trainer.num_processes=8 inference.num_servers=4
    pipeline-rl launch --ray auto --dry-run ...                 # the placement per node; reserves nothing
    ray job submit --address http://10.0.0.1:8265 -- pipeline-rl launch --ray auto run_dir=/shared/runs/r1

One plan: this module only decides WHICH Ray node runs which share (trainer machines, servers, and the
light processes), writes that as an ordinary cluster file (pipeline_rl/launch/cluster.py) in the run
directory, and starts `pipeline-rl launch --cluster FILE --node NAME` on each node as a child of a
node-pinned Ray actor. Cores, GPUs, argv, environment, restarts and shutdown of every process are the
per-node launcher's, exactly as on a hand-run cluster or one host; each role is its own OS process
with its own command line, log and exit code.

Placement (`layout`): every trainer rank and every server takes one unit of the slot resource (GPU on
platform=gpu, CPU on platform=cpu, or --ray-resource NAME: a logical resource a CPU node advertises
with `ray start --resources`). Trainer ranks are packed --ray-ranks-per-node to a node (default: all
on one), one trainer machine per node, nodes taken head first then by address; each server goes to
the node with the most free slots left (spreading them, so a lost node takes as few as possible).
Redis, the preprocessors and the actors run beside trainer machine rank 0. The reservation is one
placement group with one bundle per node used, pinned by Ray's `node:<address>` resource, so a lost
node's bundle comes back when that node (its address) rejoins the cluster.

Secrets: the control-route token, the /v1 API key and the Redis password come from this process's
environment (PIPELINE_RL_TOKEN, ...) or are made here, and travel to each node as the argument of an
actor call (Ray's own channel, authenticated by its token), then into the node launcher's environment:
never in argv, never in a runtime_env (the dashboard shows both).

Faults: a node launcher that exits non-zero stops the job (as a child does on one host). A lost node
(its raylet and processes gone): servers-only, the run goes on (the trainer ejects its servers within
the push deadline) and, once the node is back in the cluster, its share starts again with --rejoin
(servers wait for the trainer's current weights); with trainer ranks or Redis, every other node stops,
and when the node is back (within --ray-rejoin-wait) every node starts again with trainer.resume=true:
the trainer from its newest checkpoint, Redis from its append-only file on the shared storage
(docs/several-hosts.md).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline_rl.config import RunConfig
from pipeline_rl.launch.cluster import API_KEY_ENV, CLUSTER_KEYS, REDIS_PASSWORD_ENV, TOKEN_ENV
from pipeline_rl.launch.compose import ConfigError, compose
from pipeline_rl.launch.plan import parse_roles
from pipeline_rl.launch.runner import TRAINER_FINISHED

RAY_NAMESPACE = "pipeline-rl"
RESERVE_TIMEOUT_S = 120.0  # the placement group: a cluster without room says so instead of hanging
STOP_GRACE_S = 60.0  # a node launcher's own shutdown (its children's stages) before Ray kills it
PIN = 0.001  # of the `node:<address>` resource: pins a bundle to its node without using it up


@dataclass
class RayNode:
    """A live Ray node as the layout sees it."""

    node_id: str
    address: str
    slots: float  # of the slot resource
    is_head: bool = False

    @property
    def name(self) -> str:
        """The node's name in the cluster file: stable for its address (a returning node keeps it)."""
        return "n" + self.address.replace(".", "-").replace(":", "-")


@dataclass
class NodeRoles:
    node: RayNode
    trainer_ranks: int = 0
    machine_rank: int | None = None
    servers: int = 0
    control: bool = False  # Redis, preprocessors, actors

    @property
    def slots(self) -> int:
        return self.trainer_ranks + self.servers


@dataclass
class RayOptions:
    address: str
    ranks_per_node: int | None = None
    resource: str | None = None  # None: GPU on platform=gpu, CPU on platform=cpu
    keep_serving: bool = False  # after training, the servers serve on until the job is stopped
    rejoin_wait_s: float = 600.0  # a lost trainer/Redis node: how long the job waits for it to return


def layout(nodes: list[RayNode], ranks: int, ranks_per_node: int | None, servers: int) -> list[NodeRoles]:
    """Which node runs what (see the module's docstring); ConfigError when the cluster cannot hold it."""
    per_node = ranks_per_node or ranks
    if per_node < 1 or ranks % per_node:
        raise ConfigError(
            f"--ray-ranks-per-node {per_node} does not divide trainer.num_processes={ranks}: accelerate "
            "starts the same number of ranks on every trainer machine"
        )
    order = sorted(nodes, key=lambda n: (not n.is_head, _address_key(n.address)))
    roles = {n.node_id: NodeRoles(n) for n in order}
    free = {n.node_id: int(n.slots) for n in order}
    machines = ranks // per_node
    trainer_nodes = [n for n in order if free[n.node_id] >= per_node][:machines]
    if len(trainer_nodes) < machines:
        have = {n.address: free[n.node_id] for n in order}
        raise ConfigError(
            f"{machines} trainer machine(s) of {per_node} rank(s) need {machines} node(s) with {per_node} "
            f"free slot(s) each; the cluster's nodes have {have}: add nodes, or change "
            "--ray-ranks-per-node / trainer.num_processes"
        )
    for k, node in enumerate(trainer_nodes):
        roles[node.node_id].trainer_ranks, roles[node.node_id].machine_rank = per_node, k
        free[node.node_id] -= per_node
    roles[trainer_nodes[0].node_id].control = True
    for _ in range(servers):
        best = max(order, key=lambda n: free[n.node_id])  # max() keeps the first of equals: head, address
        if free[best.node_id] < 1:
            raise ConfigError(
                f"{servers} server(s) and {ranks} trainer rank(s) need {servers + ranks} slots; the cluster "
                f"has {sum(int(n.slots) for n in nodes)}: add nodes or lower inference.num_servers"
            )
        roles[best.node_id].servers += 1
        free[best.node_id] -= 1
    used = [r for r in roles.values() if r.slots or r.control]
    return sorted(
        used, key=lambda r: (r.machine_rank is None, r.machine_rank or 0, _address_key(r.node.address))
    )


def _address_key(address: str) -> tuple:
    try:
        return (0, ipaddress.ip_address(address))
    except ValueError:
        return (1, address)


def cluster_file(roles: list[NodeRoles], probes: dict[str, dict], run_dir: str, cfg: RunConfig) -> dict:
    """The cluster file (as a dict) of a layout; `probes[node_id]`: that node's free ports and interface."""
    hosts = []
    rendezvous_port = None
    for r in roles:
        probe = probes[r.node.node_id]
        ports = list(probe["ports"])
        host = {
            "name": r.node.name,
            "address": r.node.address,
            "gpus": None,  # the node launcher's CUDA_VISIBLE_DEVICES: the GPUs Ray gave its actor
            "ifname": probe["ifname"],
            "trainer_ranks": r.trainer_ranks,
            "server_ports": [ports.pop() for _ in range(r.servers)],
        }
        if r.control:
            host.update(preprocessors=cfg.num_preprocessors, actors=cfg.actor.num_actors)
            if cfg.streams.backend == "redis":
                host["redis_port"] = ports.pop()
        if r.machine_rank == 0:
            rendezvous_port = ports.pop()
        hosts.append(host)
    return {
        "ifname": hosts[0]["ifname"],
        "run_dir": run_dir,
        "rendezvous_port": rendezvous_port,
        "hosts": hosts,
    }


def _probe_node(address: str, count: int) -> dict:
    """On a node: `count` free TCP ports of its address and the interface that holds the address."""
    import psutil

    from inference_shim.procs import free_port

    ports: list[int] = []
    while len(ports) < count:
        port = free_port(address)
        if port not in ports:
            ports.append(port)
    ifname = next(
        (
            name
            for name, addrs in psutil.net_if_addrs().items()
            if any(a.address.split("%")[0] == address for a in addrs)
        ),
        None,
    )
    return {"ports": ports, "ifname": ifname or "eth0", "hostname": socket.gethostname()}


class _NodeLauncher:
    """Runs one node's `pipeline-rl launch --cluster ... --node ...` as its child (a Ray actor)."""

    def __init__(self) -> None:
        self.proc = None

    def start(self, argv_tail: list[str], secrets: dict[str, str], log_path: str, cwd: str) -> int:
        from inference_shim.procs import start_child

        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # Ray's, not the plan's
        env.update(secrets, PYTHONUNBUFFERED="1")
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "pipeline_rl.cli", "launch", *argv_tail]
        # The driver's working directory where this node has it (relative paths then mean the same).
        self.proc = start_child(argv, env=env, log_path=log_path, cwd=cwd if Path(cwd).is_dir() else None)
        return self.proc.pid

    def wait(self) -> int:
        return self.proc.wait()

    def stop(self, grace_s: float) -> int | None:
        from inference_shim.procs import stop_process_tree

        if self.proc is not None:
            stop_process_tree(self.proc, grace_s=grace_s)
            return self.proc.returncode
        return None


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--ray needs Ray: pip install 'pipeline-rl[ray]' (the same Ray version as the cluster's)"
        ) from None
    return ray


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(overrides of the counts the cluster file sets, the rest), for the nodes' command lines."""
    topology, rest = [], []
    for override in overrides:
        key = override.partition("=")[0].strip().lstrip("+")
        (topology if key in CLUSTER_KEYS else rest).append(override)
    return topology, rest


class RayJob:
    """The driver: reserve, start each node's share, watch, restart a returning servers node, stop."""

    def __init__(
        self, options: RayOptions, overrides: list[str], roles_arg: str | None, progress_every: float
    ) -> None:
        self.options = options
        self.overrides = overrides
        self.roles_arg = roles_arg
        self.progress_every = progress_every
        self.cfg = compose(overrides)
        parse_roles(roles_arg, self.cfg)  # a typo fails here, before any node is reserved
        self.ray = _ray()
        self.pg = None
        self.actors: dict[str, object] = {}  # node name -> actor handle
        self.waits: dict[object, str] = {}  # wait() ref -> node name
        self.lost: dict[str, float] = {}  # node name -> when it was lost
        self.stop_requested: str | None = None

    # -- planning --------------------------------------------------------------------------------------
    def resource(self) -> str:
        return self.options.resource or ("GPU" if self.cfg.platform == "gpu" else "CPU")

    def connect(self) -> None:
        ray = self.ray
        try:
            ray.init(
                address=self.options.address,
                namespace=RAY_NAMESPACE,
                log_to_driver=False,
                logging_level="WARNING",
                configure_logging=False,
            )
        except ConnectionError as e:
            raise ConfigError(
                f"cannot connect to the Ray cluster at {self.options.address}: {e} (is RAY_AUTH_MODE=token "
                "with RAY_AUTH_TOKEN_PATH set as on the cluster's nodes?)"
            ) from None

    def nodes(self) -> list[RayNode]:
        resource = self.resource()
        found = []
        for n in self.ray.nodes():
            if not n.get("Alive"):
                continue
            res = n.get("Resources", {})
            found.append(
                RayNode(
                    n["NodeID"],
                    n["NodeManagerAddress"],
                    float(res.get(resource, 0)),
                    "node:__internal_head__" in res,
                )
            )
        if not found:
            raise ConfigError(f"the Ray cluster at {self.options.address} has no live node")
        return found

    def plan(self) -> tuple[list[NodeRoles], dict, str, list[str]]:
        """(layout, cluster file dict, run directory, the nodes' overrides)."""
        cfg = self.cfg
        topology, node_overrides = split_overrides(self.overrides)
        run_dir = cfg.run_dir
        if run_dir == "runs/latest" and not cfg.trainer.resume:
            run_dir = f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir = str(Path(run_dir).resolve())
        node_overrides = [o for o in node_overrides if not o.startswith("run_dir=")]
        roles = layout(
            self.nodes(), cfg.trainer.num_processes, self.options.ranks_per_node, cfg.inference.num_servers
        )
        probes = {}
        for r in roles:
            need = r.servers + (1 if r.control else 0) + (1 if r.machine_rank == 0 else 0)
            probes[r.node.node_id] = self._on_node(r.node, _probe_node, r.node.address, max(need, 1))
        data = cluster_file(roles, probes, run_dir, cfg)
        if topology:
            print(f"(placed by Ray: {' '.join(topology)})", flush=True)
        return roles, data, run_dir, node_overrides

    def _on_node(self, node: RayNode, fn, *args):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        remote = self.ray.remote(num_cpus=0)(fn).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        )
        return self.ray.get(remote.remote(*args), timeout=60)

    # -- running ---------------------------------------------------------------------------------------
    def reserve(self, roles: list[NodeRoles]) -> None:
        from ray.util.placement_group import placement_group

        resource = self.resource()
        bundles = [{resource: float(max(r.slots, 1)), f"node:{r.node.address}": PIN} for r in roles]
        self.pg = placement_group(bundles, strategy="STRICT_SPREAD", name=f"pipeline-rl-{os.getpid()}")
        try:
            self.ray.get(self.pg.ready(), timeout=RESERVE_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            raise ConfigError(
                f"the Ray cluster did not grant {bundles} within {RESERVE_TIMEOUT_S:.0f}s (other jobs hold "
                "the resources?): `ray status` shows what is in use"
            ) from None

    def start_node(
        self, index: int, r: NodeRoles, cluster_path: Path, run_dir: str, node_overrides, rejoin: bool
    ):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resource = self.resource()
        slots = float(max(r.slots, 1))
        amounts = {"num_cpus": 0}
        if resource == "GPU":
            amounts["num_gpus"] = slots  # Ray sets the actor's CUDA_VISIBLE_DEVICES: the node's GPUs for us
        elif resource == "CPU":
            amounts["num_cpus"] = slots
        else:
            amounts["resources"] = {resource: slots}
        actor_cls = self.ray.remote(max_concurrency=4, max_restarts=0)(_NodeLauncher)
        actor = actor_cls.options(
            name=f"pipeline-rl-{r.node.name}-{os.getpid()}-{time.monotonic_ns()}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index),
            **amounts,
        ).remote()
        argv = ["--cluster", str(cluster_path), "--node", r.node.name]
        if self.roles_arg is not None:
            argv += ["--roles", self.roles_arg]
        argv += [
            "--progress-every",
            str(self.progress_every),
            *(["--rejoin"] if rejoin else []),
            *node_overrides,
        ]
        log = Path(run_dir) / "nodes" / r.node.name / "launcher.log"
        pid = self.ray.get(actor.start.remote(argv, self.secrets, str(log), os.getcwd()), timeout=120)
        self.actors[r.node.name] = actor
        self.waits[actor.wait.remote()] = r.node.name
        what = []
        if r.trainer_ranks:
            what.append(f"trainer machine {r.machine_rank} ({r.trainer_ranks} rank(s))")
        if r.servers:
            what.append(f"{r.servers} server(s)")
        if r.control:
            what.append("redis, preprocessors, actors")
        again = " again (rejoining)" if rejoin else ""
        print(
            f"node {r.node.name} ({r.node.address}){again}: {', '.join(what)}; pid {pid}, log {log}",
            flush=True,
        )

    def run(self, dry_run: bool) -> int | tuple[Path, list[str]]:
        """The job's exit code; with dry_run, (the cluster file it would use, the nodes' overrides)."""
        self.connect()
        roles, data, run_dir, node_overrides = self.plan()
        cluster_path = Path(run_dir) / "ray" / "cluster.yaml"
        if dry_run:  # main.py prints every node's plan from this file, as for a hand-run cluster file
            import tempfile

            print(
                f"Ray cluster {self.options.address}: {len(roles)} node(s) used, slots of {self.resource()}"
            )
            path = Path(tempfile.mkdtemp(prefix="pipeline-rl-ray-plan-")) / "cluster.yaml"
            path.write_text(yaml.safe_dump(data, sort_keys=False))
            return path, node_overrides
        cluster_path.parent.mkdir(parents=True, exist_ok=True)
        cluster_path.write_text(yaml.safe_dump(data, sort_keys=False))
        self.secrets = self._secrets()
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        self.reserve(roles)
        print(f"Ray placement group reserved: cluster file {cluster_path}", flush=True)
        try:
            for index, r in enumerate(roles):
                self.start_node(index, r, cluster_path, run_dir, node_overrides, rejoin=False)
            return self._watch(roles, cluster_path, run_dir, node_overrides)
        finally:
            self._stop_all()

    def _secrets(self) -> dict[str, str]:
        import secrets as random

        made = {
            TOKEN_ENV: random.token_hex(16),
            API_KEY_ENV: random.token_hex(16),
            REDIS_PASSWORD_ENV: random.token_hex(16),
        }
        return {name: os.environ.get(name) or value for name, value in made.items()}

    def _on_signal(self, signum, _frame) -> None:
        self.stop_requested = signal.Signals(signum).name

    def _watch(self, roles: list[NodeRoles], cluster_path: Path, run_dir: str, node_overrides) -> int:
        ray = self.ray
        by_name = {r.node.name: (i, r) for i, r in enumerate(roles)}
        trainer_nodes = {r.node.name for r in roles if r.trainer_ranks}
        finished: set[str] = set()
        serving_said = False
        while True:
            finished |= {
                n for n in trainer_nodes if (Path(run_dir) / "nodes" / n / TRAINER_FINISHED).exists()
            }
            done = trainer_nodes <= finished
            if self.stop_requested:
                print(f"\n{self.stop_requested}: stopping every node", flush=True)
                return 0 if done else 130
            if done and not self.options.keep_serving:
                print("the trainer finished: stopping the other nodes", flush=True)
                return 0
            if done and not serving_said:
                serving_said = True
                print("the trainer finished; the servers keep serving until this job is stopped", flush=True)
            ready, _ = ray.wait(list(self.waits), num_returns=1, timeout=1.0)
            for ref in ready:
                name = self.waits.pop(ref)
                index, r = by_name[name]
                try:
                    code = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                    self.actors.pop(name, None)
                    if r.trainer_ranks or r.control:
                        if not self._await_core_node(name, index, r, run_dir, type(e).__name__):
                            return 1
                        # Everything starts again, resuming: the trainer from its newest checkpoint,
                        # Redis from its append-only file (this run's streams), servers awaiting weights.
                        if "trainer.resume=true" not in node_overrides:
                            node_overrides = [*node_overrides, "trainer.resume=true"]
                        finished.clear()
                        self.lost.clear()
                        for i, again in enumerate(roles):
                            self.start_node(i, again, cluster_path, run_dir, node_overrides, rejoin=False)
                        break
                    print(
                        f"node {name} ({r.node.address}) lost: the trainer ejects its server(s) at its next "
                        "push; its share starts again when the node rejoins the Ray cluster",
                        flush=True,
                    )
                    self.lost[name] = time.monotonic()
                    continue
                self.actors.pop(name, None)
                if code == 0 and name in trainer_nodes:
                    finished.add(name)
                    continue
                log = Path(run_dir) / "nodes" / name / "launcher.log"
                from inference_shim.procs import log_tail

                print(
                    f"\nERROR: node {name}'s launcher exited with code {code}; stopping the job. Its log "
                    f"({log}) ends:\n{log_tail(log, 30)}",
                    file=sys.stderr,
                    flush=True,
                )
                return code or 1
            for name in list(self.lost):
                index, r = by_name[name]
                if not self._bundle_back(index):
                    continue
                try:
                    self.start_node(index, r, cluster_path, run_dir, node_overrides, rejoin=True)
                    del self.lost[name]
                except Exception as e:  # the node went again, or Ray is not ready there yet: try later
                    print(
                        f"(node {name}: starting its share again failed: {type(e).__name__}: {e})", flush=True
                    )

    def _await_core_node(self, name: str, index: int, r: NodeRoles, run_dir: str, why: str) -> bool:
        """A node with trainer ranks or Redis was lost: stop every other node, then wait (at most
        options.rejoin_wait_s) for it to rejoin the Ray cluster. False: it did not; the job stops."""
        print(
            f"node {name} ({r.node.address}) lost with the trainer or Redis ({why}): stopping every other "
            f"node; the job resumes from its newest checkpoint when {name} rejoins the Ray cluster "
            f"(waiting up to {self.options.rejoin_wait_s:.0f}s)",
            flush=True,
        )
        self._stop_nodes()
        deadline = time.monotonic() + self.options.rejoin_wait_s
        while not self._bundle_back(index):
            if self.stop_requested or time.monotonic() > deadline:
                print(
                    f"\nERROR: node {name} did not rejoin; the job stops with its last checkpoint. Resume "
                    f"it with the same command and trainer.resume=true run_dir={run_dir}",
                    file=sys.stderr,
                    flush=True,
                )
                return False
            time.sleep(1.0)
        return True

    def _bundle_back(self, index: int) -> bool:
        """The lost node's bundle is placed again on a live node (its address rejoined the cluster)."""
        from ray.util import placement_group_table

        node_id = placement_group_table(self.pg).get("bundles_to_node_id", {}).get(index)
        alive = {n["NodeID"] for n in self.ray.nodes() if n.get("Alive")}
        return node_id is not None and node_id in alive

    def _stop_nodes(self) -> None:
        """Every node launcher stops its own children in its own stages."""
        ray = self.ray
        stops = {name: actor.stop.remote(STOP_GRACE_S) for name, actor in self.actors.items()}
        for name, ref in stops.items():
            try:
                ray.get(ref, timeout=STOP_GRACE_S + 30)
            except Exception as e:  # a node lost meanwhile: nothing of it is left to stop
                print(f"(node {name}: {type(e).__name__} while stopping)", flush=True)
        for actor in self.actors.values():
            ray.kill(actor)
        self.actors.clear()
        self.waits.clear()

    def _stop_all(self) -> None:
        """The nodes, then the reservation."""
        self._stop_nodes()
        if self.pg is not None:
            from ray.util import remove_placement_group

            remove_placement_group(self.pg)
            self.pg = None


def ray_main(args: argparse.Namespace) -> tuple[Path, list[str]]:
    """Run the job and exit; a dry run returns (cluster file, overrides) for main.py to print."""
    options = RayOptions(
        args.ray,
        args.ray_ranks_per_node,
        args.ray_resource,
        keep_serving=args.keep_serving,
        rejoin_wait_s=args.ray_rejoin_wait,
    )
    try:
        outcome = RayJob(options, args.overrides, args.roles, args.progress_every).run(args.dry_run)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if isinstance(outcome, int):
        sys.exit(outcome)
    return outcome
