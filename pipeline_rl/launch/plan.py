"""What one node of a run starts: its share of the processes, their cores and GPUs, argv and environment.

    share = local_share(cfg, roles)                       # one host: every process of `roles`
    share = cluster.node_share(spec, cfg, "b")            # several hosts: node b's part of the cluster file
    specs = plan(cfg, node_dir, share)                    # ProcessSpecs (ConfigError if GPUs do not fit)
    print_plan(cfg, specs, node_dir, status_port, share)

Indices are global: server i is `cfg.inference.urls[i]` whichever node starts it, and actor/preprocessor
i is `--index i` of `cfg.actor.num_actors` / `cfg.num_preprocessors`, so shards stay disjoint over
nodes. The trainer's ranks of a node are `trainer.num_processes / rendezvous.num_machines` (accelerate
splits them evenly over machines).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from inference_shim.cli import cpu_engine_env
from inference_shim.procs import LOOPBACK_HOSTS, free_port, serve_argv
from pipeline_rl.actor.rounds import lag_bound
from pipeline_rl.config import RunConfig
from pipeline_rl.launch.compose import ConfigError
from pipeline_rl.launch.processes import ProcessSpec
from pipeline_rl.launch.trainer_cmd import Rendezvous, trainer_command
from pipeline_rl.stages.graph import RUNTIME, describe, order, process_of
from pipeline_rl.streams.config import redact_url

PY = sys.executable
# The launch role of each kind of process a stage runs in ("stages": a user stage's own workers).
RUNTIME_ROLE = {"actor": "actors", "preprocessor": "preprocessors", "trainer": "trainer", "worker": "stages"}


def launch_roles(cfg: RunConfig) -> list[str]:
    """The roles a launch of `cfg` has, for --roles: Redis, the servers, then the graph's processes
    downstream first (the order they start in)."""
    roles = ["redis", "servers"]
    for name in reversed(order(cfg.graph)):
        host = process_of(cfg.graph, cfg.placement.stages, name)
        role = RUNTIME_ROLE[RUNTIME[cfg.graph.stages[host].kind]]
        if role not in roles:
            roles.append(role)
    return roles


@dataclass
class NodeShare:
    """The processes one node runs; indices into the run's servers, preprocessors and actors."""

    name: str = "local"
    servers: list[int] = field(default_factory=list)
    trainer: Rendezvous | None = None
    preprocessors: list[int] = field(default_factory=list)
    actors: list[int] = field(default_factory=list)
    stages: dict[str, list[int]] = field(default_factory=dict)  # user stage -> indices of its own workers
    redis: tuple[str, int | None] | None = None  # (bind address, port or None = free) of a Redis to start
    env: dict[str, str] = field(default_factory=dict)  # network settings every child of this node gets
    cores: list[int] | None = None  # None: this launcher's CPU affinity
    num_gpus: int | None = None  # None: placement.num_gpus, CUDA_VISIBLE_DEVICES or nvidia-smi
    evaluates: bool = False  # held-out evaluation before and after RL runs from this node
    cluster: bool = False  # part of a --cluster run (remote peers to wait for)

    def ranks(self, cfg: RunConfig) -> int:
        return cfg.trainer.num_processes // self.trainer.num_machines if self.trainer else 0

    def restrict(self, roles: set[str]) -> NodeShare:
        """Only the roles in `roles` (--roles on a cluster node: debugging)."""
        return NodeShare(
            self.name,
            self.servers if "servers" in roles else [],
            self.trainer if "trainer" in roles else None,
            self.preprocessors if "preprocessors" in roles else [],
            self.actors if "actors" in roles else [],
            self.stages if "stages" in roles else {},
            self.redis if "redis" in roles else None,
            self.env, self.cores, self.num_gpus, self.evaluates, self.cluster,
        )  # fmt: skip

    def holds_every_stream_client(self, cfg: RunConfig) -> bool:
        """This node runs the run's Redis (or a backend without one), every actor, every preprocessor and
        every trainer rank: it alone sees all of them stop, so it can snapshot where untrained samples
        wait, and it can restart the trainer without another node's ranks."""
        has_streams = self.redis is not None or cfg.streams.backend != "redis"
        return (
            has_streams
            and self.trainer is not None
            and self.trainer.num_machines == 1
            and len(self.actors) == cfg.actor.num_actors
            and len(self.preprocessors) == cfg.num_preprocessors
            and self.stages == stage_workers(cfg)
        )

    def roles(self) -> set[str]:
        present = {"servers": self.servers, "trainer": self.trainer, "redis": self.redis}
        present |= {"preprocessors": self.preprocessors, "actors": self.actors, "stages": self.stages}
        return {role for role, what in present.items() if what}


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host == "localhost" or host.startswith("127.") or host == "::1"


def single_host_env(cfg: RunConfig) -> dict[str, str]:
    """Environment that keeps the sockets of torch.distributed and vLLM on loopback for a one-node run.

    Without it gloo and vLLM bind the address the host name resolves to (a LAN address on most
    machines). A run whose servers are elsewhere (a server URL that is not loopback) keeps the caller's
    settings, and so does a caller who set these variables.
    """
    if not all(_loopback(u) for u in cfg.inference.urls):
        return {}
    wanted = {"GLOO_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": "127.0.0.1"}
    return {k: v for k, v in wanted.items() if k not in os.environ}


def parse_roles(arg: str | None, cfg: RunConfig) -> set[str]:
    """The roles --roles asks for (all of the run's when unset); ConfigError naming the run's roles."""
    allowed = launch_roles(cfg)
    if arg is None:
        return set(allowed)
    roles = {r.strip() for r in arg.split(",") if r.strip()}
    unknown = roles - set(allowed)
    if unknown:
        raise ConfigError(f"unknown roles {sorted(unknown)}; this run's roles: {', '.join(allowed)}")
    return roles


def stage_workers(cfg: RunConfig) -> dict[str, list[int]]:
    """User stage -> indices of its workers, for the stages with workers of their own."""
    return {
        name: list(range(where.replicas)) for name, where in cfg.placement.stages.items() if where.replicas
    }


def local_share(cfg: RunConfig, roles: set[str]) -> NodeShare:
    """The share of a one-host launch: every process of the roles asked for."""
    own_redis = "redis" in roles and cfg.streams.backend == "redis" and not cfg.streams.redis_url
    return NodeShare(
        servers=list(range(cfg.inference.num_servers)) if "servers" in roles else [],
        trainer=Rendezvous() if "trainer" in roles else None,
        preprocessors=list(range(cfg.num_preprocessors)) if "preprocessors" in roles else [],
        actors=list(range(cfg.actor.num_actors)) if "actors" in roles else [],
        stages=stage_workers(cfg) if "stages" in roles else {},
        redis=(cfg.streams.redis_bind, None) if own_redis else None,
        env=single_host_env(cfg),
        evaluates="servers" in roles and "actors" in roles,
    )


def place_cores(cfg: RunConfig, share: NodeShare) -> dict[str, list[int] | None]:
    """CPU placement: engines and trainer ranks on separate cores where possible.

    The trainer takes the first ceil(n/2) cores (at least one; all of them on a node without servers),
    the node's servers share the rest (each its own slice when there are enough); light processes
    (actors, preprocessors, redis) float, and so do a vLLM-CPU server's HTTP and scheduler processes
    (only its worker is bound to the server's slice, unless placement.pin_whole_server). On a GPU box
    the same split applies to host threads while CUDA_VISIBLE_DEVICES picks the devices.

    placement.colocate=true gives the trainer and every server all the node's cores (the trainer's
    torch threads and each engine's OpenMP threads span the machine): what a synchronous run wants,
    where only one of them works at a time (verl's hybrid engine, TRL).
    """
    cores = share.cores if share.cores is not None else sorted(os.sched_getaffinity(0))
    servers = [f"server{i}" for i in share.servers]
    if len(cores) < 2:
        return {"trainer": None, **{name: None for name in servers}}
    if cfg.placement.colocate:
        return {"trainer": cores if share.trainer else None, **{name: cores for name in servers}}
    if not servers:
        return {"trainer": cores}
    trainer_cores = cores[: max(1, len(cores) // 2)] if share.trainer else []
    pool = cores[len(trainer_cores) :]
    placement: dict[str, list[int] | None] = {"trainer": trainer_cores or None}
    for k, name in enumerate(servers):
        share_n = len(pool) // len(servers)
        placement[name] = pool[k * share_n : (k + 1) * share_n] if share_n else pool
    return placement


def visible_gpus(cfg: RunConfig, share: NodeShare | None = None) -> list[str]:
    """The GPUs this node may use: the cluster file's count, placement.num_gpus, else
    CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`."""
    count = share.num_gpus if share is not None and share.num_gpus is not None else cfg.placement.num_gpus
    if count is not None:
        return [str(i) for i in range(count)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        # Entries may be indices or UUIDs; children get the same spelling, so a restricted launcher
        # (CUDA_VISIBLE_DEVICES=2,3) hands out GPUs 2 and 3, not 0 and 1.
        return [g.strip() for g in visible.split(",") if g.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def place_gpus(cfg: RunConfig, share: NodeShare, gpus: list[str]) -> dict[str, list[str]]:
    """GPU map of this node: its trainer ranks on the first GPUs, then one GPU per server, all disjoint.

    Only this node's processes count (a servers-only node gives its first server the first GPU).
    Fewer GPUs than trainer ranks + servers is a ConfigError saying what to change, unless
    placement.colocate lets the servers wrap around onto the trainer's GPUs (sharing its memory).
    """
    ranks, servers = share.ranks(cfg), len(share.servers)
    if ranks + servers == 0:
        return {}
    where = f"node {share.name}" if share.cluster else "this node"
    if not gpus:
        raise ConfigError(
            f"platform=gpu but {where} has no visible GPU (CUDA_VISIBLE_DEVICES, nvidia-smi -L): use "
            "platform=cpu, or set placement.num_gpus=N (gpus: N in a cluster file) to plan for N GPUs"
        )
    if ranks > len(gpus):
        raise ConfigError(
            f"{ranks} trainer rank(s) on {where} need {ranks} GPUs, it has {len(gpus)}: "
            f"lower trainer.num_processes (trainer_ranks in a cluster file) to at most {len(gpus)}"
        )
    if ranks + servers > len(gpus) and not cfg.placement.colocate:
        raise ConfigError(
            f"{ranks} trainer rank(s) + {servers} server(s) need {ranks + servers} GPUs for one each, "
            f"{where} has {len(gpus)}: lower trainer.num_processes or inference.num_servers (or move "
            "servers to another host), or set placement.colocate=true to let servers share the "
            "trainer's GPUs"
        )
    placement = {"trainer": gpus[:ranks]} if ranks else {}
    for k, i in enumerate(share.servers):
        placement[f"server{i}"] = [gpus[(ranks + k) % len(gpus)]]
    return placement


def plan(cfg: RunConfig, run_dir: Path, share: NodeShare | set[str]) -> list[ProcessSpec]:
    """The processes of this node (`share`, or the roles of a one-host launch), with their argv,
    environment, cores and GPUs; ConfigError if the GPUs do not fit. `run_dir` holds config.json."""
    if not isinstance(share, NodeShare):
        share = local_share(cfg, share)
    config_path = str(run_dir / "config.json")
    # A CPU run's processes get the CPU engine environment (explicit settings of the launcher's win); a
    # GPU run's get nothing of it (its KV cache is GPU memory, and it may fetch from the hub).
    platform_env = cpu_engine_env() if cfg.platform == "cpu" else {}
    placement = place_cores(cfg, share)
    on_gpu = cfg.inference.weight_transport == "nccl"
    gpu_map = place_gpus(cfg, share, visible_gpus(cfg, share)) if on_gpu else {}
    specs: list[ProcessSpec] = []
    for i in share.servers:
        url = cfg.inference.urls[i]
        host, port = urlsplit(url).hostname, urlsplit(url).port
        cores = placement.get(f"server{i}")
        env = (
            {**platform_env, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}
            if cores
            else {**platform_env}
        )
        env.update(share.env)
        gpus = gpu_map.get(f"server{i}")
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        engine = ["--dtype", cfg.inference.dtype, "--max-num-seqs", str(cfg.inference.max_num_seqs)]
        if cfg.inference.max_model_len is not None:  # unset: the server reads the checkpoint's own
            engine += ["--max-model-len", str(cfg.inference.max_model_len)]
        engine += ["--seed", str(cfg.seed + i), "--kv-after-update", cfg.inference.kv_after_update]
        engine += ["--update-mode", cfg.inference.update_mode]
        if cfg.inference.update_mode == "drain":
            engine += ["--drain-timeout-s", str(cfg.inference.drain_timeout_s)]
        if on_gpu and cfg.inference.backend == "vllm":
            engine += ["--gpu-memory-utilization", str(cfg.inference.gpu_memory_utilization)]
        if cfg.trainer.lora is not None:  # the servers take the trainer's adapter, in memory
            engine += ["--lora-max-rank", str(cfg.trainer.lora.rank)]
        # The server listens on exactly the address of its URL, never on every interface.
        argv = serve_argv(cfg.model_path, port, host=host, backend=cfg.inference.backend, extra=engine)
        # The token travels in the environment, not in argv, where any user could read it with ps.
        secret_env = {
            "PIPELINE_RL_TOKEN": cfg.inference.token or "",
            "PIPELINE_RL_API_KEY": cfg.inference.api_key or "",
        }
        # vLLM-CPU binds its worker (the model's compute) to these cores itself; its API and scheduler
        # processes (about as much CPU as the model's forward at the demo's size: `python -m benchmarks
        # engine-profile`) then run on the trainer's core too while it waits (docs/decisions.md, Launcher).
        binds_itself = cfg.inference.backend == "vllm" and not on_gpu and not cfg.placement.pin_whole_server
        specs.append(
            ProcessSpec(
                f"server{i}",
                "servers",
                argv,
                env,
                cores,
                taskset=not binds_itself,
                port=port,
                url=url,
                gpus=gpus,
                secret_env=secret_env,
            )
        )
    if share.trainer is not None:
        cores = placement.get("trainer")
        env = {**platform_env, "OMP_NUM_THREADS": str(len(cores))} if cores else {**platform_env}
        env.update(share.env)
        gpus = gpu_map.get("trainer")
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        argv = trainer_command(cfg, config_path, share.trainer)
        port = int(argv[argv.index("--main_process_port") + 1])
        specs.append(ProcessSpec("trainer", "trainer", argv, env, cores, port=port, gpus=gpus))
    # The graph's other processes, downstream first: the order they start in, so that a stage's reader
    # is up before its writer.
    for name in reversed(order(cfg.graph)):
        runtime = RUNTIME[cfg.graph.stages[name].kind]
        if runtime == "actor":
            processes = [(f"actor{i}", ["actor", "--index", str(i)]) for i in share.actors]
        elif runtime == "preprocessor":
            processes = [(f"preprocessor{i}", ["preprocess", "--index", str(i)]) for i in share.preprocessors]
        elif runtime == "worker":
            indices = share.stages.get(name, [])
            processes = [(f"{name}{i}", ["stage", "--stage", name, "--index", str(i)]) for i in indices]
        else:  # the trainer's stages run in the trainer, planned above
            continue
        for process, command in processes:
            argv = [PY, "-m", "pipeline_rl.cli", command[0], "--config", config_path, *command[1:]]
            env = {**platform_env, "OMP_NUM_THREADS": "1", **share.env}
            specs.append(ProcessSpec(process, RUNTIME_ROLE[runtime], argv, env))
    return specs


def resolve(cfg: RunConfig, run_dir: Path, roles: set[str] | None = None) -> RunConfig:
    """Fill in what only the launcher knows: run dir, server URLs, token, sync-mode limits."""
    updates: dict = {"run_dir": str(run_dir)}
    inference = cfg.inference.model_copy()
    if not inference.urls:
        inference.urls = [f"http://127.0.0.1:{free_port()}" for _ in range(inference.num_servers)]
    elif len(inference.urls) != inference.num_servers:
        inference.num_servers = len(inference.urls)
    # $PIPELINE_RL_TOKEN before a generated one: a token given as inference.token=... sits in argv.
    inference.token = inference.token or os.environ.get("PIPELINE_RL_TOKEN") or secrets.token_hex(16)
    # The same for the /v1/* key, made only when a server binds beyond loopback: a one-box run stays
    # curl-able without one (docs/decisions.md, Exposure).
    inference.api_key = inference.api_key or os.environ.get("PIPELINE_RL_API_KEY") or None
    if inference.api_key is None and any(urlsplit(u).hostname not in LOOPBACK_HOSTS for u in inference.urls):
        inference.api_key = secrets.token_hex(16)
    updates["inference"] = inference
    if cfg.streams.backend == "files" and cfg.streams.files_dir is None:
        updates["streams"] = cfg.streams.model_copy(update={"files_dir": run_dir / "streams"})
    if cfg.mode == "sync":
        # Conventional RL with the same components: generate exactly one step's groups with the
        # current weights, train on them, push, repeat — no overlap between generation and training.
        # Partial rollouts (actor.round_tokens): a round holds two steps' worth of groups, so that it
        # need not wait for its longest answers, and an answer runs in several rounds, so it trains
        # some versions late (rounds.lag_bound).
        a, groups_per_step = cfg.actor, cfg.trainer.batch_size // cfg.actor.attempts
        if a.round_tokens is None:
            update = {"max_lag": 0, "max_buffered_groups": groups_per_step}
        else:
            buffered = 2 * groups_per_step
            lag = lag_bound(_longest_answer(cfg), a.round_tokens, groups_per_step, buffered)
            update = {"max_lag": lag, "max_buffered_groups": buffered}
        updates["actor"] = a.model_copy(update=update)
    return cfg.model_copy(update=updates)


def _longest_answer(cfg: RunConfig) -> int:
    """The most model tokens one sample can have: actor.max_tokens, or a multi-turn task's episode
    budget (its turns' tokens together)."""
    from pipeline_rl.tasks import make_task

    multi_turn = getattr(make_task(cfg.task), "multi_turn", False)
    return max(cfg.actor.max_tokens, cfg.task.episode_token_budget) if multi_turn else cfg.actor.max_tokens


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8": a 96-core placement still fits its column."""
    parts, start = [], None
    for k, i in enumerate(ids):
        start = i if start is None else start
        if k + 1 == len(ids) or ids[k + 1] != i + 1:
            parts.append(str(i) if start == i else f"{start}-{i}" if i > start + 1 else f"{start},{i}")
            start = None
    return ",".join(parts)


def stage_processes(cfg: RunConfig, share: NodeShare) -> dict[str, str]:
    """Stage -> the processes of this node that run it, as --dry-run shows them."""

    def names(prefix: str, indices: list[int]) -> str:
        return f"{prefix}{_ranges(indices)}" if indices else "(another node)"

    placement = cfg.placement.stages
    out = {}
    for name in cfg.graph.stages:
        host = process_of(cfg.graph, placement, name)
        runtime = RUNTIME[cfg.graph.stages[host].kind]
        if runtime == "actor":
            out[name] = names("actor", share.actors)
        elif runtime == "preprocessor":
            out[name] = names("preprocessor", share.preprocessors)
        elif runtime == "trainer":
            out[name] = f"trainer ({share.ranks(cfg)} rank(s))" if share.trainer else "(another node)"
        else:
            out[name] = names(host, share.stages.get(host, []))
        if host != name:
            out[name] += f", inside {host}"
    return out


def print_plan(
    cfg: RunConfig, specs: list[ProcessSpec], run_dir: Path, status_port: int | None, share: NodeShare
) -> None:
    """The placement map of one node: which process, which cores/GPUs, which port."""
    title = f"node {share.name}: " if share.cluster else ""
    print(f"{title}run directory: {run_dir}")
    print(
        f"mode: {cfg.mode}   model: {cfg.model_path}   streams: {cfg.streams.backend}   engine: {cfg.inference.backend}"
    )
    if share.cluster and share.trainer is not None:
        r = share.trainer
        print(f"trainer: machine rank {r.machine_rank} of {r.num_machines}, rendezvous {r.main_ip}:{r.port}")
    t, i = cfg.trainer, cfg.inference
    memory = [f"{t.strategy}, {t.num_processes} rank(s)", f"mixed precision {t.mixed_precision}"]
    memory += ["activation checkpointing" if t.gradient_checkpointing else "no activation checkpointing"]
    memory += [f"micro-batches of {cfg.preprocess.seq_length} tokens"]
    length = i.max_model_len if i.max_model_len is not None else "the checkpoint's"
    engine = [
        f"{i.num_servers} server(s)",
        f"max_model_len {length}",
        f"max_num_seqs {i.max_num_seqs}",
        i.dtype,
    ]
    if cfg.platform == "gpu" and i.backend == "vllm":
        engine += [f"gpu_memory_utilization {i.gpu_memory_utilization}"]
    print(f"memory: trainer {', '.join(memory)}; engine {', '.join(engine)}")
    print(f"graph: {cfg.graph.name}, objective {cfg.algo.name} (stages upstream first)")
    for line in describe(cfg.graph, cfg.placement.stages, stage_processes(cfg, share)):
        print(line)
    print(f"{'process':<16}{'role':<15}{'cores':<10} {'gpus':<9}{'port':<8}command")
    if share.redis is not None:
        where = redact_url(cfg.streams.redis_url) if cfg.streams.redis_url else "private redis-server"
        print(f"{'redis':<16}{'redis':<15}{'-':<10} {'-':<9}{share.redis[1] or '-'!s:<8}{where}")
    worker_bound = False  # a server whose worker alone is bound to the cores shown (plan())
    for spec in specs:
        cores = _ranges(spec.cores) if spec.cores else "-"
        if spec.cores and not spec.taskset:
            cores, worker_bound = cores + "*", True
        gpus = ",".join(spec.gpus) if spec.gpus else "-"
        if spec.gpus and all(g.isdigit() for g in spec.gpus):
            gpus = _ranges([int(g) for g in spec.gpus])
        where = spec.url if spec.url and share.cluster else f"cmd/{spec.name}.sh"
        print(f"{spec.name:<16}{spec.role:<15}{cores:<10} {gpus:<9}{spec.port or '-'!s:<8}{where}")
    if worker_bound:
        print(
            "* the engine's worker only; the server's HTTP and scheduler processes float (placement.pin_whole_server)"
        )
    if status_port:
        print(f"status: curl -s http://127.0.0.1:{status_port}/status")
