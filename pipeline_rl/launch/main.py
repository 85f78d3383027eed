"""`pipeline-rl launch [key=value ...] [--dry-run] [--roles ...] [--cluster FILE --node NAME]`: one
command runs a whole RL job, on one host or on each host of several.

    pipeline-rl launch                                   # pipeline_rl/conf/base.yaml defaults (CPU, tiny model)
    pipeline-rl launch trainer.max_steps=50 actor.num_actors=2 inference.num_servers=2
    pipeline-rl launch --dry-run                         # print the plan, start nothing
    pipeline-rl launch --roles servers inference.urls=[] # only some roles (debugging)
    pipeline-rl launch --dry-run platform=gpu placement.num_gpus=4 trainer.num_processes=2 inference.num_servers=2
    pipeline-rl launch --cluster pipeline_rl/conf/cluster/example.yaml --node node1   # on each host: its share
    pipeline-rl launch --cluster pipeline_rl/conf/cluster/example.yaml --dry-run      # every node's plan, anywhere

Order, supervision and shutdown: pipeline_rl/launch/runner.py. Planning (cores, GPUs, argv):
pipeline_rl/launch/plan.py. Several hosts (the cluster file, secrets from the environment):
pipeline_rl/launch/cluster.py. If any child dies, the launcher names it, prints the tail of its log,
stops the rest and exits non-zero. SIGINT/SIGTERM stop every process (engine workers included) within
seconds.

Exposure: every listener of a single-host run is on 127.0.0.1 (servers, Redis, the trainer's
rendezvous store and gloo sockets, vLLM's internal groups); on several hosts they bind the host's
cluster address named in the cluster file, never a wildcard, and ask an API key of /v1/* callers (one
made per run unless $PIPELINE_RL_API_KEY or inference.api_key gives it). Secrets (the control-route
token, the API key, the Redis password) live in <node dir>/secrets/ (0700; files 0600), reach children through
`load_run_config` or the child's environment, and never appear in argv, config.json, cmd/*.sh or logs.
Pass a token of your own as $PIPELINE_RL_TOKEN rather than inference.token=... (argv is public).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from inference_shim.procs import free_port
from pipeline_rl.launch.compose import ConfigError, compose
from pipeline_rl.launch.plan import (  # noqa: F401 - re-exported: the launcher's public names
    NodeShare,
    local_share,
    parse_roles,
    place_cores,
    place_gpus,
    plan,
    print_plan,
    resolve,
    single_host_env,
    visible_gpus,
)
from pipeline_rl.launch.preflight import with_model_length
from pipeline_rl.launch.runner import Launcher
from pipeline_rl.progress import quiet_library_bars


def _warn_public_secrets(overrides: list[str]) -> None:
    from pipeline_rl.launch.cluster import public_secrets

    for problem in public_secrets(overrides):
        print(f"warning: {problem} (argv is visible to every local user)", file=sys.stderr)


def _preflight(cfg, shares: list[NodeShare], dry_run: bool):
    """Exit, listing every problem, when a node's share of the run cannot start (launch/preflight.py);
    a dry run prints them and plans anyway (a plan may be made away from the checkpoint and the data).
    Returns the config with the checkpoint's length filled in where it can be read."""
    from pipeline_rl.launch.preflight import run_problems

    problems = [p for share in shares for p in run_problems(cfg, share)]
    problems = list(dict.fromkeys(problems))  # one line for what several nodes share
    if problems and not dry_run:
        sys.exit("error: this run cannot start:\n  - " + "\n  - ".join(problems))
    for problem in problems:
        print(f"warning: a launch would refuse to start: {problem}", file=sys.stderr)
    try:
        return with_model_length(cfg)
    except ConfigError as e:
        if not dry_run:
            raise
        print(f"warning: {e}", file=sys.stderr)
        return cfg


def _cluster_main(args: argparse.Namespace, status_port: int) -> None:
    from pipeline_rl.launch.cluster import REDIS_PASSWORD_ENV, cluster_config, load_cluster, node_share

    if not args.dry_run and not args.node:
        sys.exit("error: --cluster needs --node NAME (this host's name in the file), or --dry-run")
    try:
        spec = load_cluster(args.cluster)
        cfg = cluster_config(spec, args.overrides, dict(os.environ), need_secrets=not args.dry_run)
        roles = parse_roles(args.roles, cfg)
        names = [args.node] if args.node and not args.dry_run else [h.name for h in spec.hosts]
        shares = {name: node_share(spec, cfg, name).restrict(roles) for name in names}
        cfg = _preflight(cfg, list(shares.values()), args.dry_run)
        plans = {name: plan(cfg, Path(cfg.run_dir) / "nodes" / name, share) for name, share in shares.items()}
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if args.dry_run:
        print(f"cluster {args.cluster}: {len(spec.hosts)} host(s), interface {spec.ifname}")
        for name, share in shares.items():
            host = spec.host(name)
            print(
                f"\n== node {name} ({host.address}, cores {host.cores or 'all'}, gpus {'visible' if host.gpus is None else host.gpus}) =="
            )
            print_plan(cfg, plans[name], Path(cfg.run_dir) / "nodes" / name, None, share)
        return
    share = shares[args.node]
    node_dir = Path(cfg.run_dir) / "nodes" / args.node
    node_dir.mkdir(parents=True, exist_ok=True)
    # The Redis password reaches children inside redis_url (secrets file), not through the environment.
    # Every child writes to a log file: Hugging Face's bars there would be carriage-return noise.
    env = quiet_library_bars({k: v for k, v in os.environ.items() if k != REDIS_PASSWORD_ENV})
    launcher = Launcher(cfg, node_dir, share, args.progress_every, rejoining=args.rejoin)
    sys.exit(launcher.run(status_port, env))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pipeline-rl launch", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="key=value or group=name (pipeline_rl/conf/)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument(
        "--roles",
        default=None,
        help="only these roles, comma-separated (debugging): redis, servers, and the processes of the graph's "
        "stages (actors, preprocessors, trainer, stages); --dry-run lists a run's. Default: all",
    )
    parser.add_argument("--status-port", type=int, default=0, help="port of GET /status (0 = free port)")
    parser.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines")
    parser.add_argument("--cluster", default=None, help="cluster file (YAML): the hosts and their roles")
    parser.add_argument("--node", default=None, help="with --cluster: this host's name in the file")
    parser.add_argument(
        "--rejoin", action="store_true", help="with --node: this node returns to a running job (servers wait)"
    )
    parser.add_argument(
        "--ray", default=None, metavar="ADDRESS", help="place the job on this Ray cluster (or auto)"
    )
    parser.add_argument(
        "--ray-ranks-per-node", type=int, default=None, help="with --ray: trainer ranks per node"
    )
    parser.add_argument(
        "--ray-resource",
        default=None,
        help="with --ray: the slot resource (default GPU, or CPU on platform=cpu)",
    )
    parser.add_argument(
        "--ray-rejoin-wait",
        type=float,
        default=600.0,
        help="with --ray: seconds to wait for a lost trainer/Redis node to return before stopping",
    )
    parser.add_argument(
        "--keep-serving",
        action="store_true",
        help="with --ray: servers serve on after training, until stopped",
    )
    args = parser.parse_intermixed_args(argv)  # options may follow the key=value overrides
    _warn_public_secrets(args.overrides)
    if args.ray:
        if args.cluster or args.node:
            sys.exit("error: --ray places the job itself: drop --cluster/--node")
        import shutil

        from pipeline_rl.launch.ray_launch import ray_main

        args.cluster, args.overrides = ray_main(args)  # only a dry run returns: print its plan
        try:
            _cluster_main(args, 0)
        finally:
            shutil.rmtree(Path(args.cluster).parent, ignore_errors=True)
        return
    status_port = args.status_port or free_port()
    if args.cluster:
        _cluster_main(args, status_port)
        return
    if args.node or args.rejoin:
        sys.exit("error: --node and --rejoin need --cluster FILE")
    try:
        cfg = compose(args.overrides)
        if not cfg.trainer.resume and cfg.run_dir == "runs/latest":
            cfg = cfg.model_copy(update={"run_dir": f"runs/{time.strftime('%Y%m%d-%H%M%S')}"})
        run_dir = Path(cfg.run_dir).resolve()
        roles = parse_roles(args.roles, cfg)
        cfg = resolve(_preflight(cfg, [local_share(cfg, roles)], args.dry_run), run_dir, roles)
        share = local_share(cfg, roles)
        specs = plan(cfg, run_dir, share)  # GPU placement errors surface here, before anything starts
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if args.dry_run:
        print_plan(cfg, specs, run_dir, status_port, share)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    sys.exit(Launcher(cfg, run_dir, share, args.progress_every).run(status_port, dict(os.environ)))


if __name__ == "__main__":
    main()
