"""One job over several hosts: the cluster file, and each node's share of the run.

    pipeline-rl launch --cluster pipeline_rl/conf/cluster/example.yaml --node node1 [key=value ...]   # on every host
    pipeline-rl launch --cluster pipeline_rl/conf/cluster/example.yaml --dry-run                       # whole plan, anywhere

The cluster file (YAML, `ClusterSpec` below) names the hosts and what runs on each. Every node composes
the SAME RunConfig from it (pipeline_rl/conf/base.yaml + the file's `overrides` + the command line's, which must be
the same on every node) and starts only its own share. How the processes find each other:
  * Redis binds its host's address at `redis_port`; URL redis://:<password>@<address>:<port>/0;
  * server i binds its host's address at its port, in file order: inference.urls[i];
  * trainer ranks: accelerate's multi-node launch, machine rank = order of the trainer hosts in the
    file, `--main_process_ip` = the first trainer host's address, port `rendezvous_port`;
  * the weight group's master address (trainer.weight_address) = that same host's address;
  * gloo (and NCCL) use the interface `ifname` on every host (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME).
Secrets come from the environment of every node: the operator exports the same PIPELINE_RL_TOKEN (the
servers' control-route token), PIPELINE_RL_API_KEY (their /v1/* key: servers on a cluster network never
serve generation unauthenticated) and PIPELINE_RL_REDIS_PASSWORD on each host (a scheduler's secret store,
`export` from a file only the operator reads). Why not a file in a shared run dir: it would require the
Redis node to start first and the others to wait for it, and a shared filesystem's permissions (NFS,
root squash, other hosts' root) are not ours to trust. Each node then writes them to its own 0600
secrets file as on one host. The run directory itself should be shared storage (checkpoints: every rank
writes its part; the ledger: every actor and preprocessor writes a file); each node keeps its own
config.json, cmd/, logs/ and secrets/ under <run_dir>/nodes/<node>/.
"""

from __future__ import annotations

import ipaddress
import re
import time
from pathlib import Path
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline_rl.config import RunConfig
from pipeline_rl.launch.compose import ConfigError, compose
from pipeline_rl.launch.plan import NodeShare, stage_workers
from pipeline_rl.launch.trainer_cmd import Rendezvous

TOKEN_ENV = "PIPELINE_RL_TOKEN"
API_KEY_ENV = "PIPELINE_RL_API_KEY"
REDIS_PASSWORD_ENV = "PIPELINE_RL_REDIS_PASSWORD"
# Set from the cluster file on every node; an override of one would make the nodes disagree.
CLUSTER_KEYS = (
    "inference.urls", "inference.num_servers", "inference.token", "inference.api_key", "trainer.num_processes",
    "trainer.weight_address", "actor.num_actors", "num_preprocessors", "streams.redis_url",
    "streams.redis_bind", "placement.num_gpus",
)  # fmt: skip


def public_secrets(overrides: list[str]) -> list[str]:
    """Why each key=value that puts a secret in argv (visible to every local user in ps) should go."""
    problems = []
    for override in overrides:
        key, _, value = override.partition("=")
        key = key.strip().lstrip("+~")
        if key in ("inference.token", "inference.api_key"):
            env_var = TOKEN_ENV if key == "inference.token" else API_KEY_ENV
            problems.append(f"{key}=... would be in argv: export {env_var} instead")
        elif key == "streams.redis_url" and urlsplit(value).password is not None:
            problems.append(
                f"{key} holds a password: export {REDIS_PASSWORD_ENV} and give the URL without it"
            )
    return problems


class ClusterHost(BaseModel):
    """One host and the processes it runs."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Node name, given to --node on that host (letters, digits, -_).")
    address: str = Field(description="IP address of the host on the cluster network; its listeners bind it.")
    cores: int | None = Field(None, ge=1, description="CPU cores to place on (0..cores-1); unset: all.")
    gpus: int | None = Field(
        0,
        ge=0,
        description="GPUs of the host (platform=gpu); null: CUDA_VISIBLE_DEVICES or nvidia-smi there.",
    )
    ifname: str | None = Field(None, description="This host's cluster interface, if not the file's ifname.")
    redis_port: int | None = Field(None, ge=1, le=65535, description="This host runs the run's Redis here.")
    trainer_ranks: int = Field(0, ge=0, description="Trainer ranks here (same count on every trainer host).")
    preprocessors: int = Field(0, ge=0, description="Preprocessor processes here.")
    actors: int = Field(0, ge=0, description="Actor processes here.")
    server_ports: list[int] = Field(default_factory=list, description="One inference server per port.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}", v):
            raise ValueError(f"host name {v!r}: use letters, digits, '-' and '_' (it names a directory)")
        return v

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        try:
            ip = ipaddress.ip_address(v)
        except ValueError:
            raise ValueError(
                f"{v!r} is not an IP address: give the host's address on the cluster network (e.g. "
                "10.0.0.11); servers and Redis bind exactly this address"
            ) from None
        if ip.is_unspecified or ip.is_loopback:
            raise ValueError(
                f"{v}: a loopback or wildcard address cannot be reached from the other hosts (and a "
                "wildcard would expose every interface); give the host's cluster-network address"
            )
        return v

    @field_validator("server_ports")
    @classmethod
    def _ports(cls, v: list[int]) -> list[int]:
        if any(not 1 <= p <= 65535 for p in v) or len(set(v)) != len(v):
            raise ValueError(f"server_ports {v}: distinct ports between 1 and 65535")
        return v


class ClusterSpec(BaseModel):
    """The cluster file: hosts, their roles, and the few settings every node must agree on."""

    model_config = ConfigDict(extra="forbid")

    hosts: list[ClusterHost] = Field(min_length=1, description="Every host of the job.")
    ifname: str = Field("eth0", description="Network interface of the cluster network on every host.")
    run_dir: str | None = Field(None, description="Run directory, the same path on every host (shared).")
    rendezvous_port: int = Field(
        29500, ge=1, le=65535, description="Trainer rendezvous port on rank 0's host."
    )
    overrides: list[str] = Field(default_factory=list, description="key=value applied on every node.")

    @model_validator(mode="after")
    def _consistent(self) -> ClusterSpec:
        for what in ("name", "address"):
            values = [getattr(h, what) for h in self.hosts]
            dup = sorted({v for v in values if values.count(v) > 1})
            if dup:
                raise ValueError(f"hosts: {what} {dup[0]!r} appears more than once; each host needs its own")
        redis_hosts = [h.name for h in self.hosts if h.redis_port is not None]
        if len(redis_hosts) > 1:
            raise ValueError(f"hosts {redis_hosts} all set redis_port: one host runs the run's Redis")
        trainers = self.trainer_hosts
        if not trainers:
            raise ValueError("no host has trainer_ranks > 0: give the trainer host(s) trainer_ranks: N")
        if len({h.trainer_ranks for h in trainers}) > 1:
            counts = {h.name: h.trainer_ranks for h in trainers}
            raise ValueError(
                f"trainer_ranks differ between hosts {counts}: accelerate starts the same number of "
                "ranks on every machine; give every trainer host the same trainer_ranks"
            )
        for role in ("server_ports", "actors", "preprocessors"):
            if not any(getattr(h, role) for h in self.hosts):
                raise ValueError(f"no host runs {role.replace('_ports', 's')}: add {role}: to a host")
        for h in self.hosts:
            ports = list(h.server_ports) + ([h.redis_port] if h.redis_port else [])
            if h is trainers[0]:
                ports.append(self.rendezvous_port)
            dup = sorted({p for p in ports if ports.count(p) > 1})
            if dup:
                raise ValueError(f"host {h.name}: port {dup[0]} is used twice (servers, redis, rendezvous)")
        return self

    @property
    def trainer_hosts(self) -> list[ClusterHost]:
        """Hosts with trainer ranks, in machine-rank order (file order)."""
        return [h for h in self.hosts if h.trainer_ranks]

    def host(self, name: str) -> ClusterHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise ConfigError(
            f"--node {name!r} is not in the cluster file; its hosts: {[h.name for h in self.hosts]}"
        )

    def server_urls(self) -> list[str]:
        return [f"http://{_netloc(h.address, p)}" for h in self.hosts for p in h.server_ports]


def _netloc(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def load_cluster(path: str | Path) -> ClusterSpec:
    """The validated cluster file; ConfigError names the file, the entry and the fix."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read the cluster file {path}: {e}") from None
    try:
        return ClusterSpec.model_validate(data or {})
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = list(err["loc"])
            if len(loc) >= 2 and loc[0] == "hosts" and isinstance(loc[1], int):
                hosts = (data or {}).get("hosts") or []
                name = (
                    hosts[loc[1]].get("name")
                    if loc[1] < len(hosts) and isinstance(hosts[loc[1]], dict)
                    else None
                )
                loc[1] = f"{loc[1]}({name})" if name else loc[1]
            key = ".".join(str(p) for p in loc) or "(file)"
            message = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                message = "unknown key; see ClusterSpec/ClusterHost in pipeline_rl/launch/cluster.py"
            lines.append(f"  {key}: {message}")
        raise ConfigError(f"invalid cluster file {path}:\n" + "\n".join(lines)) from None


def cluster_config(
    spec: ClusterSpec, overrides: list[str], env: dict[str, str], need_secrets: bool
) -> RunConfig:
    """The run's RunConfig, identical on every node: base + the file's overrides + `overrides`, with
    the topology of the file filled in. need_secrets: the token and Redis password must be in `env`."""
    for override in [*spec.overrides, *overrides]:
        key = override.partition("=")[0].strip().lstrip("+")
        if key in CLUSTER_KEYS:
            raise ConfigError(
                f"{key} is set by the cluster file (hosts, their ports and counts) on every node: "
                f"remove {override!r} and change the cluster file instead"
            )
    cfg = compose([*spec.overrides, *overrides])
    run_dir = next((o.partition("=")[2] for o in reversed(overrides) if o.startswith("run_dir=")), None)
    run_dir = run_dir or spec.run_dir
    if not run_dir:
        raise ConfigError(
            "no run directory: set run_dir: in the cluster file, or run_dir=... (same on every node)"
        )
    token, api_key, password = env.get(TOKEN_ENV), env.get(API_KEY_ENV), env.get(REDIS_PASSWORD_ENV)
    uses_redis = cfg.streams.backend == "redis"
    redis_host = next((h for h in spec.hosts if h.redis_port is not None), None)
    if uses_redis and redis_host is None:
        raise ConfigError("streams=redis but no host sets redis_port: give one host redis_port: 6390")
    if not uses_redis and redis_host is not None:
        raise ConfigError(f"streams={cfg.streams.backend}: remove redis_port from host {redis_host.name}")
    if need_secrets:
        missing = [
            name
            for name, v in (
                (TOKEN_ENV, token),
                (API_KEY_ENV, api_key),
                (REDIS_PASSWORD_ENV, password or not uses_redis),
            )
            if not v
        ]
        if missing:
            raise ConfigError(
                f"{', '.join(missing[:-1])}{' and ' if len(missing) > 1 else ''}{missing[-1]} must be set on every node, with the same value everywhere (e.g. "
                "generated once with `openssl rand -hex 24` and handed out by your scheduler's secrets)"
            )
    rank0 = spec.trainer_hosts[0]
    streams = cfg.streams
    if redis_host is not None:
        auth = f":{password}@" if password else ""
        url = f"redis://{auth}{_netloc(redis_host.address, redis_host.redis_port)}/0"
        streams = streams.model_copy(update={"redis_url": url, "redis_bind": redis_host.address})
    elif streams.backend == "files" and streams.files_dir is None:
        streams = streams.model_copy(update={"files_dir": Path(run_dir) / "streams"})
    urls = spec.server_urls()
    data = cfg.model_dump()
    data.update(
        run_dir=str(Path(run_dir).resolve()), num_preprocessors=sum(h.preprocessors for h in spec.hosts)
    )
    data["streams"] = streams.model_dump()
    data["inference"].update(urls=urls, num_servers=len(urls), token=token, api_key=api_key)
    data["actor"]["num_actors"] = sum(h.actors for h in spec.hosts)
    data["trainer"].update(
        num_processes=sum(h.trainer_ranks for h in spec.trainer_hosts), weight_address=rank0.address
    )
    if cfg.mode == "sync":
        data["actor"].update(max_lag=0, max_buffered_groups=cfg.trainer.batch_size // cfg.actor.attempts)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"the cluster file and the config disagree: {e}") from None


def node_share(spec: ClusterSpec, cfg: RunConfig, name: str) -> NodeShare:
    """What node `name` starts (global indices, see pipeline_rl/launch/plan.py)."""
    host = spec.host(name)
    trainers = spec.trainer_hosts
    counters = {"servers": 0, "preprocessors": 0, "actors": 0}
    mine: dict[str, list[int]] = {}
    for h in spec.hosts:
        for role, count in (
            ("servers", len(h.server_ports)),
            ("preprocessors", h.preprocessors),
            ("actors", h.actors),
        ):
            if h is host:
                mine[role] = list(range(counters[role], counters[role] + count))
            counters[role] += count
    rendezvous = None
    if host.trainer_ranks:
        rendezvous = Rendezvous(
            num_machines=len(trainers),
            machine_rank=trainers.index(host),
            main_ip=trainers[0].address,
            port=spec.rendezvous_port,
        )
    # gloo picks its interface from the host name otherwise (often not the cluster network), NCCL too.
    ifname = host.ifname or spec.ifname
    env = {"GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname}
    return NodeShare(
        name=name,
        servers=mine["servers"],
        trainer=rendezvous,
        preprocessors=mine["preprocessors"],
        actors=mine["actors"],
        # A user stage's own workers run beside the first preprocessor (stream consumers alike).
        stages=stage_workers(cfg) if 0 in mine["preprocessors"] else {},
        redis=(host.address, host.redis_port) if host.redis_port is not None else None,
        env=env,
        cores=list(range(host.cores)) if host.cores else None,
        num_gpus=host.gpus if cfg.inference.weight_transport == "nccl" else None,
        # From machine rank 0: it outlives the trainer, and the servers keep serving until stopped.
        evaluates=rendezvous is not None and rendezvous.machine_rank == 0,
        cluster=True,
    )


# The node that runs Redis keeps it up this long at the end for the other nodes' last calls.
REDIS_LINGER_S = 60.0


def wait_other_clients_off(redis_url: str, linger_s: float) -> None:
    """Keep Redis up while processes of other nodes still use it (a trainer rank's last step)."""
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=2)
    deadline = time.monotonic() + linger_s
    try:
        me = client.client_id()
        others = [c for c in client.client_list() if int(c["id"]) != me]
        if others:
            print(f"waiting for {len(others)} Redis client(s) of other nodes to finish", flush=True)
        while others and time.monotonic() < deadline:
            time.sleep(0.5)
            others = [c for c in client.client_list() if int(c["id"]) != me]
        if others:
            where = ", ".join(sorted({c.get("addr", "?").rsplit(":", 1)[0] for c in others}))
            print(f"(stopping Redis with {len(others)} client(s) still connected from {where})", flush=True)
    except redis.RedisError as e:
        print(f"(could not list Redis clients: {e})", flush=True)
    finally:
        client.close()
