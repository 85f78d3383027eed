"""`pipeline-rl launch [key=value ...] [--dry-run] [--roles ...]`: one command runs a whole RL job.

    pipeline-rl launch                                   # conf/base.yaml defaults (CPU, tiny model)
    pipeline-rl launch trainer.max_steps=50 actor.num_actors=2 inference.num_servers=2
    pipeline-rl launch --dry-run                         # print the plan, start nothing
    pipeline-rl launch --roles servers inference.urls=[] # only some roles (debugging, multi-node)
    pipeline-rl launch --dry-run platform=gpu placement.num_gpus=4 trainer.num_processes=2 inference.num_servers=2

Order, each step with a deadline: resolve + validate config -> run directory (config.json, command
files, placement map) -> Redis (private unless streams.redis_url) -> inference servers (healthy) ->
baseline evaluation -> trainer ranks (joined the weight group of every server) -> preprocessors ->
actors -> supervise until the trainer finishes (or max_wall_s) -> final evaluation -> stop everything
-> summary + plots. If any child dies, the launcher names it, prints the tail of its log, stops the
rest and exits non-zero. SIGINT/SIGTERM stop every process (engine workers included) within seconds.

Exposure: every listener of a single-host run is on 127.0.0.1 (servers, Redis, the trainer's
rendezvous store and gloo sockets, vLLM's internal groups). Secrets (the control-route token, the
Redis password) live in <run_dir>/secrets/ (0700; files 0600), reach children through
`load_run_config` or the child's environment, and never appear in argv, config.json, cmd/*.sh or logs.
Pass a token of your own as $PIPELINE_RL_TOKEN rather than inference.token=... (argv is public).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from inference_shim.procs import free_port, serve_argv
from pipeline_rl.config import RunConfig, public_config, secret_fields
from pipeline_rl.launch.compose import ConfigError, compose
from pipeline_rl.launch.processes import (
    Child,
    ChildFailed,
    ProcessSpec,
    stop_all,
    wait_all_healthy,
    write_command_file,
)
from pipeline_rl.streams.config import redact_url
from pipeline_rl.streams.redis_server import write_private

ROLES = ("redis", "servers", "trainer", "preprocessors", "actors")
PY = sys.executable


# ----------------------------------------------------------------------------------------------------
# Planning
# ----------------------------------------------------------------------------------------------------
def place_cores(cfg: RunConfig) -> dict[str, list[int] | None]:
    """CPU placement: engines and trainer ranks on separate cores where possible.

    The trainer takes the first ceil(n/2) cores (at least one), the servers share the rest (each its own
    slice when there are enough); light processes (actors, preprocessors, redis) float. On a GPU box the
    same split applies to host threads while CUDA_VISIBLE_DEVICES picks the devices.
    """
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return {"trainer": None, **{f"server{i}": None for i in range(cfg.inference.num_servers)}}
    trainer_cores = cores[: max(1, len(cores) // 2)]
    server_pool = cores[len(trainer_cores) :]
    n = cfg.inference.num_servers
    placement: dict[str, list[int] | None] = {"trainer": trainer_cores}
    for i in range(n):
        if len(server_pool) >= n:
            share = len(server_pool) // n
            placement[f"server{i}"] = server_pool[i * share : (i + 1) * share]
        else:
            placement[f"server{i}"] = server_pool
    return placement


def visible_gpus(cfg: RunConfig) -> list[str]:
    """The GPUs this node may use: placement.num_gpus, else CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`."""
    if cfg.placement.num_gpus is not None:
        return [str(i) for i in range(cfg.placement.num_gpus)]
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


def place_gpus(cfg: RunConfig, roles: set[str], gpus: list[str]) -> dict[str, list[str]]:
    """GPU map of this node: trainer ranks on the first GPUs, then one GPU per server, all disjoint.

    Only the roles this node runs count (a servers-only node gives server i the i-th GPU). Fewer GPUs
    than trainer ranks + servers is a ConfigError saying what to change, unless placement.colocate
    lets the servers wrap around onto the trainer's GPUs (then they share memory with it).
    """
    ranks = cfg.trainer.num_processes if "trainer" in roles else 0
    servers = cfg.inference.num_servers if "servers" in roles else 0
    if ranks + servers == 0:
        return {}
    if not gpus:
        raise ConfigError(
            "platform=gpu but this node has no visible GPU (CUDA_VISIBLE_DEVICES, nvidia-smi -L): use "
            "platform=cpu, or set placement.num_gpus=N to plan for N GPUs (e.g. with --dry-run)"
        )
    if ranks > len(gpus):
        raise ConfigError(
            f"trainer.num_processes={ranks} needs {ranks} GPUs, this node has {len(gpus)}: "
            f"lower trainer.num_processes to at most {len(gpus)}"
        )
    if ranks + servers > len(gpus) and not cfg.placement.colocate:
        raise ConfigError(
            f"{ranks} trainer rank(s) + {servers} server(s) need {ranks + servers} GPUs for one each, this "
            f"node has {len(gpus)}: lower trainer.num_processes or inference.num_servers, or set "
            "placement.colocate=true to let servers share the trainer's GPUs"
        )
    placement = {"trainer": gpus[:ranks]} if ranks else {}
    for i in range(servers):
        placement[f"server{i}"] = [gpus[(ranks + i) % len(gpus)]]
    return placement


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host == "localhost" or host.startswith("127.") or host == "::1"


def single_host_env(cfg: RunConfig) -> dict[str, str]:
    """Environment that keeps the sockets of torch.distributed and vLLM on loopback for a one-node run.

    Without it gloo and vLLM bind the address the host name resolves to (a LAN address on most
    machines). Multi-node runs (a server URL that is not loopback) keep the caller's settings, and so
    does a caller who set these variables.
    """
    if not all(_loopback(u) for u in cfg.inference.urls):
        return {}
    wanted = {"GLOO_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": "127.0.0.1"}
    return {k: v for k, v in wanted.items() if k not in os.environ}


def plan(cfg: RunConfig, run_dir: Path, roles: set[str]) -> list[ProcessSpec]:
    """The processes of this node, with their argv, environment, cores and GPUs (ConfigError if the
    GPUs do not fit)."""
    from pipeline_rl.trainer.launch_cmd import trainer_command

    config_path = str(run_dir / "config.json")
    placement = place_cores(cfg)
    on_gpu = cfg.inference.weight_transport == "nccl"
    gpu_map = place_gpus(cfg, roles, visible_gpus(cfg)) if on_gpu else {}
    local = single_host_env(cfg)
    specs: list[ProcessSpec] = []
    if "servers" in roles:
        for i, url in enumerate(cfg.inference.urls):
            host, port = urlsplit(url).hostname, urlsplit(url).port
            cores = placement.get(f"server{i}")
            env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))} if cores else {}
            env.update(local)
            gpus = gpu_map.get(f"server{i}")
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            engine = ["--dtype", cfg.inference.dtype, "--max-model-len", str(cfg.inference.max_model_len)]
            engine += ["--max-num-seqs", str(cfg.inference.max_num_seqs), "--seed", str(cfg.seed + i)]
            engine += ["--kv-after-update", cfg.inference.kv_after_update]
            # The server listens on exactly the address of its URL, never on every interface.
            argv = serve_argv(cfg.model_path, port, host=host, backend=cfg.inference.backend, extra=engine)
            # The token travels in the environment, not in argv, where any user could read it with ps.
            secret_env = {"PIPELINE_RL_TOKEN": cfg.inference.token or ""}
            specs.append(ProcessSpec(f"server{i}", "servers", argv, env, cores, port, url, gpus, secret_env))
    if "trainer" in roles:
        cores = placement.get("trainer")
        env = {"OMP_NUM_THREADS": str(len(cores))} if cores else {}
        env.update(local)
        gpus = gpu_map.get("trainer")
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        argv = trainer_command(cfg, config_path)
        specs.append(ProcessSpec("trainer", "trainer", argv, env, cores, gpus=gpus))
    if "preprocessors" in roles:
        for i in range(cfg.num_preprocessors):
            argv = [PY, "-m", "pipeline_rl.cli", "preprocess", "--config", config_path, "--index", str(i)]
            specs.append(ProcessSpec(f"preprocessor{i}", "preprocessors", argv, {"OMP_NUM_THREADS": "1"}))
    if "actors" in roles:
        for i in range(cfg.actor.num_actors):
            argv = [PY, "-m", "pipeline_rl.cli", "actor", "--config", config_path, "--index", str(i)]
            specs.append(ProcessSpec(f"actor{i}", "actors", argv, {"OMP_NUM_THREADS": "1"}))
    return specs


def resolve(cfg: RunConfig, run_dir: Path, roles: set[str]) -> RunConfig:
    """Fill in what only the launcher knows: run dir, server URLs, token, sync-mode limits."""
    updates: dict = {"run_dir": str(run_dir)}
    inference = cfg.inference.model_copy()
    if not inference.urls:
        inference.urls = [f"http://127.0.0.1:{free_port()}" for _ in range(inference.num_servers)]
    elif len(inference.urls) != inference.num_servers:
        inference.num_servers = len(inference.urls)
    # $PIPELINE_RL_TOKEN before a generated one: a token given as inference.token=... sits in argv.
    inference.token = inference.token or os.environ.get("PIPELINE_RL_TOKEN") or secrets.token_hex(16)
    updates["inference"] = inference
    if cfg.streams.backend == "files" and cfg.streams.files_dir is None:
        updates["streams"] = cfg.streams.model_copy(update={"files_dir": run_dir / "streams"})
    if cfg.mode == "sync":
        # Conventional RL with the same components: generate exactly one step's groups with the
        # current weights, train on them, push, repeat — no overlap between generation and training.
        groups_per_step = cfg.trainer.batch_size // cfg.actor.attempts
        updates["actor"] = cfg.actor.model_copy(update={"max_lag": 0, "max_buffered_groups": groups_per_step})
    return cfg.model_copy(update=updates)


def print_plan(cfg: RunConfig, specs: list[ProcessSpec], run_dir: Path, status_port: int | None) -> None:
    print(f"run directory: {run_dir}")
    print(
        f"mode: {cfg.mode}   model: {cfg.model_path}   streams: {cfg.streams.backend}   engine: {cfg.inference.backend}"
    )
    print(f"{'process':<16}{'role':<15}{'cores':<10}{'gpus':<8}{'port':<8}command")
    if cfg.streams.backend == "redis":
        where = redact_url(cfg.streams.redis_url) if cfg.streams.redis_url else "private redis-server"
        print(f"{'redis':<16}{'redis':<15}{'-':<10}{'-':<8}{'-':<8}{where}")
    for spec in specs:
        cores = ",".join(map(str, spec.cores)) if spec.cores else "-"
        gpus = ",".join(spec.gpus) if spec.gpus else "-"
        print(f"{spec.name:<16}{spec.role:<15}{cores:<10}{gpus:<8}{spec.port or '-'!s:<8}cmd/{spec.name}.sh")
    if status_port:
        print(f"status: curl -s http://127.0.0.1:{status_port}/status")


# ----------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------
class Launcher:
    def __init__(
        self, cfg: RunConfig, run_dir: Path, roles: set[str], progress_every_s: float = 10.0
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.roles = roles
        self.progress_every_s = progress_every_s
        self.children: list[Child] = []
        self.redis = None
        self.monitor = None
        self.status_server = None
        self.stop_requested: str | None = None
        self.evals: dict = {}
        self._eval_thread = None

    def _on_signal(self, signum, _frame) -> None:
        self.stop_requested = signal.Signals(signum).name

    def run(self, status_port: int) -> int:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        started = time.time()
        env = dict(os.environ)
        try:
            specs = self._prepare(env, status_port)
            by_role = {role: [s for s in specs if s.role == role] for role in ROLES}
            self._start(by_role["servers"], env)
            wait_all_healthy(self.children, self.cfg.inference.startup_timeout_s)
            if self._interrupted():
                return 130
            if by_role["servers"] and by_role["actors"]:
                self._evaluate("before")
            self._start(by_role["trainer"], env)
            if by_role["trainer"]:
                self._wait_trainer_joined()
            self._start(by_role["preprocessors"] + by_role["actors"], env)
            code = self._supervise()
            if code == 0 and by_role["servers"] and by_role["actors"]:
                self._evaluate("after")
            return code
        except ChildFailed as e:
            return self._fail(e.child, str(e))
        finally:
            self._shutdown(started)

    def _prepare(self, env: dict, status_port: int) -> list[ProcessSpec]:
        from pipeline_rl.launch.monitor import RunMonitor, serve_status

        cfg = self.cfg
        if "redis" in self.roles and cfg.streams.backend == "redis" and not cfg.streams.redis_url:
            from pipeline_rl.streams import RedisServer

            self.redis = RedisServer(data_dir=self.run_dir / "redis", host=cfg.streams.redis_bind).start()
            cfg = cfg.model_copy(
                update={"streams": cfg.streams.model_copy(update={"redis_url": self.redis.url})}
            )
        # Secrets go to secrets/ (0700, files 0600); config.json and cmd/*.sh stay free of them.
        secrets_dir = self.run_dir / "secrets"
        secrets_dir.mkdir(exist_ok=True)
        secrets_dir.chmod(0o700)
        secrets_file = secrets_dir / "run.json"
        write_private(secrets_file, json.dumps(secret_fields(cfg), indent=2) + "\n")
        cfg = cfg.model_copy(update={"secrets_file": str(secrets_file)})
        self.cfg = cfg
        (self.run_dir / "config.json").write_text(public_config(cfg).model_dump_json(indent=2) + "\n")
        specs = plan(cfg, self.run_dir, self.roles)
        (self.run_dir / "cmd").mkdir(exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        for spec in specs:
            write_command_file(spec, env, self.run_dir / "cmd" / f"{spec.name}.sh", secrets_dir)
        print_plan(cfg, specs, self.run_dir, status_port)
        self.monitor = RunMonitor(cfg, self.run_dir)
        self.status_server = serve_status(status_port, lambda: self.monitor.status(self.children))
        return specs

    def _start(self, specs: list[ProcessSpec], env: dict) -> None:
        for spec in specs:
            child = Child(spec, self.run_dir / "logs" / f"{spec.name}.log")
            child.start(env)
            self.children.append(child)
            print(f"started {spec.name} (pid {child.proc.pid}), log: logs/{spec.name}.log", flush=True)

    def _wait_trainer_joined(self) -> None:
        """The trainer is up once every server reports a joined weight group."""
        deadline = time.monotonic() + self.cfg.trainer.push_timeout_s + 120
        trainer = next(c for c in self.children if c.spec.role == "trainer")
        while time.monotonic() < deadline:
            if trainer.poll() is not None:
                raise ChildFailed(
                    trainer, f"exited with code {trainer.poll()} before joining the weight group"
                )
            if self._interrupted():
                return
            states = []
            for url in self.cfg.inference.urls:
                try:
                    states.append(httpx.get(f"{url}/debug/state", timeout=2).json().get("group"))
                except (httpx.HTTPError, ValueError):
                    states.append(None)
            if all(states):
                print("trainer joined the weight group of every server", flush=True)
                return
            time.sleep(0.5)
        raise ChildFailed(trainer, "did not join the weight group of every server in time")

    def _periodic_eval(self) -> None:
        """eval.every_s > 0: evaluate in a background thread; results land in stats.jsonl as type 'eval'."""
        import threading

        from pipeline_rl.launch.evaluate import evaluate_server

        def run() -> None:
            try:
                result = evaluate_server(
                    self.cfg.inference.urls[0],
                    self.cfg.task,
                    self.cfg.eval.num_problems,
                    self.cfg.eval.max_tokens,
                    token=self.cfg.inference.token,
                )
            except Exception as e:  # a failed evaluation is reported, the run goes on
                print(f"(periodic evaluation failed: {e})", flush=True)
                return
            self._record_eval(result, "periodic")

        if self._eval_thread is None or not self._eval_thread.is_alive():
            self._eval_thread = threading.Thread(target=run, name="periodic-eval", daemon=True)
            self._eval_thread.start()

    def _supervise(self) -> int:
        last_progress = 0.0
        last_eval = time.monotonic()
        deadline = time.monotonic() + self.cfg.max_wall_s if self.cfg.max_wall_s else None
        trainer = next((c for c in self.children if c.spec.role == "trainer"), None)
        while True:
            if self._interrupted():
                print(f"\n{self.stop_requested}: stopping every process", flush=True)
                return 130
            for child in self.children:
                code = child.poll()
                if code is None:
                    continue
                if child is trainer and code == 0:
                    self.monitor.poll_streams()
                    print(f"trainer finished ({self.monitor.version} steps)", flush=True)
                    return 0
                return self._fail(child, f"exited with code {code}")
            if deadline is not None and time.monotonic() > deadline and trainer is not None:
                print(
                    f"max_wall_s={self.cfg.max_wall_s:.0f} reached: asking the trainer to checkpoint and stop",
                    flush=True,
                )
                trainer.signal(signal.SIGTERM)
                if not trainer.wait(self.cfg.trainer.push_timeout_s + 60):
                    return self._fail(trainer, "did not stop after SIGTERM")
                self.monitor.poll_streams()
                return 0
            self.monitor.poll_streams()
            if self.cfg.eval.every_s and time.monotonic() - last_eval >= self.cfg.eval.every_s:
                self._periodic_eval()
                last_eval = time.monotonic()
            if time.monotonic() - last_progress >= self.progress_every_s:
                self.monitor.poll_servers(self.cfg.inference.urls)
                print(self.monitor.progress_line(), flush=True)
                last_progress = time.monotonic()
            time.sleep(0.5)

    def _interrupted(self) -> bool:
        return self.stop_requested is not None

    def _fail(self, child: Child, what: str) -> int:
        print(f"\nERROR: {child.name} {what}. Last lines of logs/{child.name}.log:", file=sys.stderr)
        print(child.log_tail(), file=sys.stderr)
        print(
            f"(stopping every other process; full logs in {self.run_dir / 'logs'})",
            file=sys.stderr,
            flush=True,
        )
        return 1

    def _record_eval(self, result: dict, when: str) -> None:
        """Append an evaluation to stats.jsonl, where the report's plots and the benchmarks read it."""
        row = {"type": "eval", "time": time.time(), "when": when, **result}
        with (self.run_dir / "stats.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")

    def _evaluate(self, when: str) -> None:
        from pipeline_rl.launch.evaluate import evaluate_server

        result = evaluate_server(
            self.cfg.inference.urls[0],
            self.cfg.task,
            self.cfg.eval.num_problems,
            self.cfg.eval.max_tokens,
            token=self.cfg.inference.token,
        )
        self.evals[when] = result
        self._record_eval(result, when)
        print(
            f"held-out accuracy {when} RL: {result['accuracy']:.1%} (weight version {result['weight_version']})",
            flush=True,
        )

    def _shutdown(self, started: float) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        order = ["actors", "preprocessors", "trainer", "servers"]
        stop_all(sorted(self.children, key=lambda c: order.index(c.spec.role)), grace_s=10.0)
        if self.monitor is not None:
            try:
                self.monitor.poll_streams()
            except Exception as e:  # the report must not hide the run's own result
                print(f"(could not read the last stats: {e})", file=sys.stderr)
            self.monitor.close()
        if self.status_server is not None:
            self.status_server.shutdown()
        if self.redis is not None:
            self.redis.stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.monitor is not None and "trainer" in self.roles:
            self._report(started)

    def _report(self, started: float) -> None:
        from pipeline_rl.launch.report import make_plots, summarize

        extra = {"mode": self.cfg.mode}
        if "before" in self.evals:
            extra["accuracy_before"] = self.evals["before"]["accuracy"]
        if "after" in self.evals:
            extra["accuracy_after"] = self.evals["after"]["accuracy"]
            extra["final_weight_version"] = self.evals["after"]["weight_version"]
        summary = summarize(self.run_dir, started, extra)
        plots = make_plots(self.run_dir, started)
        print("\n=== summary ===")
        print(json.dumps(summary, indent=2))
        print("plots: " + ", ".join(str(p) for p in plots))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pipeline-rl launch", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="key=value or group=name (conf/)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--roles", default=",".join(ROLES), help=f"subset of {','.join(ROLES)}")
    parser.add_argument("--status-port", type=int, default=0, help="port of GET /status (0 = free port)")
    parser.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines")
    args = parser.parse_args(argv)
    roles = {r.strip() for r in args.roles.split(",") if r.strip()}
    unknown = roles - set(ROLES)
    if unknown:
        sys.exit(f"error: unknown roles {sorted(unknown)}; allowed: {', '.join(ROLES)}")
    try:
        cfg = compose(args.overrides)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    for override in args.overrides:
        key, _, value = override.partition("=")
        if key == "inference.token" or (key == "streams.redis_url" and redact_url(value) != value):
            hint = " (export PIPELINE_RL_TOKEN instead)" if key == "inference.token" else ""
            print(
                f"warning: {key} on the command line is visible to every local user (ps){hint}",
                file=sys.stderr,
            )
    if not cfg.trainer.resume and cfg.run_dir == "runs/latest":
        cfg = cfg.model_copy(update={"run_dir": f"runs/{time.strftime('%Y%m%d-%H%M%S')}"})
    run_dir = Path(cfg.run_dir).resolve()
    cfg = resolve(cfg, run_dir, roles)
    if not Path(cfg.model_path).exists() and ("servers" in roles or "trainer" in roles):
        sys.exit(
            f"error: model_path {cfg.model_path!r} does not exist (run `make demo` once, or point model_path at a HF model dir)"
        )
    status_port = args.status_port or free_port()
    try:
        specs = plan(cfg, run_dir, roles)  # GPU placement errors surface here, before anything starts
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if args.dry_run:
        print_plan(cfg, specs, run_dir, status_port)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    sys.exit(Launcher(cfg, run_dir, roles, args.progress_every).run(status_port))


if __name__ == "__main__":
    main()
