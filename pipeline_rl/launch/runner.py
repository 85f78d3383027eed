"""The launcher's run of one node: start its share in order, supervise, stop everything, report.

    Launcher(cfg, node_dir, share).run(status_port)     # pipeline_rl/launch/main.py builds the arguments

Order, each step with a deadline: Redis (if this node runs it) -> run directory files (config.json,
secrets, command files, placement map) -> this node's servers (healthy) -> on several hosts, the peers
this node needs (Redis reachable, every server healthy) -> baseline evaluation (the evaluating node)
-> trainer ranks -> every server joined the weight group (nodes with a trainer or actors) ->
preprocessors -> actors -> supervise -> final evaluation -> stop everything -> summary + plots.

Supervision (pipeline_rl/launch/supervision.py): a dead server, trainer, actor or preprocessor
(non-zero code or a signal) and this node's private Redis (append-only file in <run_dir>/redis: a
restart keeps what it acknowledged) are restarted under `supervision.*` until their budget is spent; a
restarted server answers 503 until the trainer re-admits it and pushes the current weights, a restarted
trainer resumes from its checkpoint. Trainer ranks spread over several hosts are not restarted (ranks
all on one host are, by that host's launcher; the Ray launcher restarts every node). An
actor, preprocessor or server exiting 0 stops the run. `GET /status` counts restarts per role. A
resumed run (trainer.resume with a checkpoint) starts its servers with --await-weights too. Shutdown
stages, each one SIGTERM then SIGKILL at its deadline: actors, trainer (supervision.trainer_stop_s for
its last step, push and final checkpoint while the servers are up), preprocessors, servers, Redis.

When a node is done: a node with trainer ranks when its ranks exit 0; a node without, once the trainer
published its last version, except that servers keep serving until the launcher is stopped (SIGINT or
SIGTERM), so the final evaluation (and anyone else) can still use them. That holds for a cluster node
with trainer ranks AND servers too: its ranks' end stops its other processes and writes
TRAINER_FINISHED in its directory; its servers serve on. If a child dies for good, the
launcher names it, prints the tail of its log, stops the rest and exits non-zero. The node that runs
Redis keeps it up at the end until the other nodes' processes have disconnected (at most
REDIS_LINGER_S), so a trainer rank finishing its last step elsewhere still finds it.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import httpx

from inference_shim.procs import wait_healthy
from pipeline_rl.config import RunConfig, public_config, secret_fields
from pipeline_rl.eval.heldout import RunEvaluations
from pipeline_rl.fleet import SERVERS_STARTING_UNTIL_ENV, write_fleet
from pipeline_rl.launch.cluster import REDIS_LINGER_S, wait_other_clients_off
from pipeline_rl.launch.fleet_route import ServersChange
from pipeline_rl.launch.locations import snapshot_locations
from pipeline_rl.launch.monitor import record_servers_final
from pipeline_rl.launch.plan import NodeShare, plan, print_plan
from pipeline_rl.launch.processes import (
    Child,
    ChildFailed,
    ProcessSpec,
    stop_all,
    wait_all_healthy,
    write_command_file,
)
from pipeline_rl.launch.supervision import (
    BudgetSpent,
    RedisUnit,
    Supervisor,
    describe_exit,
    restart_argv,
)
from pipeline_rl.ledger import record_exit
from pipeline_rl.run_dir import has_checkpoint
from pipeline_rl.streams import StreamsUnavailable
from pipeline_rl.streams.config import redact_url
from pipeline_rl.streams.redis_server import write_private

# Written into a cluster node's directory when its trainer ranks ended and its servers serve on.
TRAINER_FINISHED = "trainer_finished"


class PeerMissing(RuntimeError):
    """A process on another node (Redis, a server) did not come up in time."""


class Launcher:
    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        share: NodeShare,
        progress_every_s: float = 10.0,
        rejoining: bool = False,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir  # this node's directory: the run directory itself on one host
        self.share = share
        self.roles = share.roles()
        self.progress_every_s = progress_every_s
        self.children: list[Child] = []
        self.redis = None
        self.monitor = None
        self.status_server = None
        self.stop_requested: str | None = None
        self.trainer_stopped_as_asked = False  # max_wall_s: SIGTERM, checkpoint, stop
        self.evals = RunEvaluations(cfg, run_dir, write_rows=self._write_rows)
        self.trackers = None  # pipeline_rl.tracking.hub.Trackers, on the node with the trainer
        self.monitor_closed = False
        self.supervisor = Supervisor(cfg.supervision)
        self.env: dict[str, str] = {}  # the children's base environment, kept for their restarts
        self.servers_change = ServersChange(self)
        # Resuming from a checkpoint, or a node returning to a running job: servers must not serve the
        # start-up weights before the trainer's restore push.
        self.resuming = rejoining or (cfg.trainer.resume and has_checkpoint(Path(cfg.run_dir)))

    def _on_signal(self, signum, _frame) -> None:
        self.stop_requested = signal.Signals(signum).name

    def run(self, status_port: int, env: dict[str, str]) -> int:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        started = time.time()
        self.env = env
        try:
            specs = self._prepare(env, status_port)
            by_role = {role: [s for s in specs if s.role == role] for role in ("servers", "trainer")}
            self._start(by_role["servers"], env)
            # The trainer's start-up (imports, model, optimizer) overlaps the engines'; it waits for the
            # servers itself before it forms the weight group. Not when it shares their GPUs: an engine
            # sizes its KV cache by the memory free while it starts.
            early = not self.cfg.placement.colocate
            if early:
                self._start(by_role["trainer"], {**env, SERVERS_STARTING_UNTIL_ENV: str(self._servers_due())})
            wait_all_healthy(self.children, self.cfg.inference.startup_timeout_s)
            self._wait_peers()
            if self._interrupted():
                return 130
            if self.share.evaluates and not self.resuming:  # resuming: servers wait for the trainer
                self.evals.evaluate("before")
            if not early:
                self._start(by_role["trainer"], env)
            if self.share.trainer or self.share.actors:
                self._wait_trainer_joined()
            self._start([s for s in specs if s.role in ("stages", "preprocessors", "actors")], env)
            code = self._supervise()
            if code == 0 and self.share.evaluates:
                self.evals.evaluate("after")
            if code == 0 and self.share.cluster and self.share.trainer and self.share.servers:
                code = self._serve_until_stopped()
            return code
        except ChildFailed as e:
            return self._fail(e.child, e.what)
        except PeerMissing as e:
            print(f"\nERROR: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            self._shutdown(started)

    def _prepare(self, env: dict, status_port: int) -> list[ProcessSpec]:
        from pipeline_rl.launch.monitor import RunMonitor, serve_status

        cfg = self.cfg
        if self.share.redis is not None:
            from redis.connection import parse_url

            from pipeline_rl.streams import RedisServer

            host, port = self.share.redis
            # Several hosts: address, port and password are the cluster's (in redis_url already).
            password = parse_url(cfg.streams.redis_url)["password"] if cfg.streams.redis_url else None
            self.redis = RedisServer(
                data_dir=self.run_dir / "redis", persist=True, host=host, port=port, password=password
            )
            if not self.resuming:  # a previous launch's streams are not this one's; a resumed run's are
                self.redis.discard_persisted()
            self.redis.start()
            if not cfg.streams.redis_url:
                streams = cfg.streams.model_copy(update={"redis_url": self.redis.url})
                cfg = cfg.model_copy(update={"streams": streams})
        # Secrets go to secrets/ (0700, files 0600); config.json and cmd/*.sh stay free of them.
        secrets_dir = self.run_dir / "secrets"
        secrets_dir.mkdir(exist_ok=True)
        secrets_dir.chmod(0o700)
        secrets_file = secrets_dir / "run.json"
        write_private(secrets_file, json.dumps(secret_fields(cfg), indent=2) + "\n")
        cfg = cfg.model_copy(update={"secrets_file": str(secrets_file)})
        self.cfg = cfg
        (self.run_dir / "config.json").write_text(public_config(cfg).model_dump_json(indent=2) + "\n")
        specs = plan(cfg, self.run_dir, self.share)
        if self.resuming:
            for spec in specs:
                if spec.role == "servers":
                    spec.argv = restart_argv("servers", spec.argv)
        (self.run_dir / "cmd").mkdir(exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        for spec in specs:
            write_command_file(spec, env, self.run_dir / "cmd" / f"{spec.name}.sh", secrets_dir)
        print_plan(cfg, specs, self.run_dir, status_port, self.share)
        if self.share.cluster and self.redis is None and cfg.streams.backend == "redis":
            self._wait_redis()  # the monitor reads the streams from the start
        if "trainer" in self.roles and cfg.tracking.enabled:
            from pipeline_rl.tracking.hub import Trackers

            self.trackers = Trackers.start(cfg, self.run_dir, resumed=self.resuming)
            names = ", ".join(sink.name for sink in self.trackers.sinks)
            print(f"tracking: {names} (files under {self.run_dir / 'tracking'})", flush=True)
        self.monitor = RunMonitor(cfg, self.run_dir, self.trackers)
        if self.share.trainer or not self.share.cluster:  # the node whose trainer follows fleet.json
            write_fleet(cfg.run_dir, cfg.inference.urls)  # the shared run directory
        self.status_server = serve_status(
            status_port, self._status, self.servers_change.handle, cfg.inference.token
        )
        (self.run_dir / "status_port").write_text(f"{status_port}\n")
        return specs

    def _write_rows(self, rows: list[dict]) -> None:
        self.monitor.record(rows)

    def _finish_tracking(self, summary: dict, plots: list[Path]) -> None:
        if self.trackers is not None:
            trackers, self.trackers = self.trackers, None
            trackers.finish(summary, plots)

    def _status(self) -> dict:
        status = self.monitor.status(self.children)
        trainer = status["latest_stats"].get("trainer", {})
        membership = ("servers_in_group", "servers_ejected_total", "servers_rejoined_total")
        return {
            **status,
            "restarts": self.supervisor.restarts_by_role(),
            "restarts_per_process": dict(self.supervisor.restarts),
            "weight_group": {k: trainer.get(k) for k in membership},  # as of the trainer's last step
            "job_servers": self.servers_change.urls(),
        }

    def _servers_due(self) -> float:
        """When (epoch seconds) every server must be up: the start-up deadline, twice on several hosts
        (another node's servers start when that node's launcher does)."""
        timeout_s = self.cfg.inference.startup_timeout_s
        return time.time() + (2 * timeout_s if self.share.cluster else timeout_s)

    def _wait_redis(self) -> None:
        import redis

        deadline = time.monotonic() + self.cfg.inference.startup_timeout_s
        client = redis.Redis.from_url(self.cfg.streams.redis_url, socket_timeout=2, socket_connect_timeout=2)
        try:
            while not self._interrupted():
                try:
                    client.ping()
                    return
                except redis.RedisError as e:
                    if time.monotonic() > deadline:
                        where = redact_url(self.cfg.streams.redis_url)
                        raise PeerMissing(f"Redis at {where} unreachable: {type(e).__name__}: {e}") from None
                time.sleep(0.5)
        finally:
            client.close()

    def _wait_peers(self) -> None:
        """Several hosts: a node whose processes use the servers waits until every server is healthy."""
        if not self.share.cluster or not (self.share.trainer or self.share.actors or self.share.evaluates):
            return
        deadline = time.monotonic() + self.cfg.inference.startup_timeout_s
        for url in self.cfg.inference.urls:
            if self._interrupted():
                return
            try:
                # A resumed run's servers await the trainer's restore push: up, not yet serving.
                wait_healthy(url, max(0.0, deadline - time.monotonic()), awaiting_ok=True)
            except TimeoutError:
                raise PeerMissing(f"server {url} (on another node) not healthy in time") from None
        print("every server of the run is healthy", flush=True)

    def _start(self, specs: list[ProcessSpec], env: dict) -> None:
        for spec in specs:
            child = Child(spec, self.run_dir / "logs" / f"{spec.name}.log")
            child.start(env)
            self.children.append(child)
            print(f"started {spec.name} (pid {child.proc.pid}), log: logs/{spec.name}.log", flush=True)

    def _wait_trainer_joined(self) -> None:
        """The trainer is up once every server reports a joined weight group (the trainer may be on
        another node: then only the deadline and the local children can fail the wait)."""
        slack = self.cfg.inference.startup_timeout_s if self.share.cluster else 0.0
        deadline = time.monotonic() + self.cfg.trainer.push_timeout_s + 120 + slack
        trainer = next((c for c in self.children if c.spec.role == "trainer"), None)
        while time.monotonic() < deadline:
            for child in self.children:
                if child.poll() is not None:
                    raise ChildFailed(
                        child, f"exited with code {child.poll()} before the weight group formed"
                    )
            if self._interrupted():
                return
            states = []
            # With the token: off loopback /debug/state answers the token holder only.
            auth = {"Authorization": f"Bearer {self.cfg.inference.token}"}
            for url in self.cfg.inference.urls:
                try:
                    answer = httpx.get(f"{url}/debug/state", headers=auth, timeout=2)
                    states.append(answer.raise_for_status().json().get("group"))
                except (httpx.HTTPError, ValueError):
                    states.append(None)
            if all(states):
                print("trainer joined the weight group of every server", flush=True)
                return
            time.sleep(0.5)
        if trainer is None:
            raise PeerMissing("the trainer (on another node) did not join the weight group of every server")
        raise ChildFailed(trainer, "did not join the weight group of every server in time")

    def _poll_streams(self) -> None:
        if self.redis is not None and not self.redis.running:
            return  # our Redis is down (a restart is pending): reading would only retry until it is back
        try:
            self.monitor.poll_streams()
        except Exception as e:
            if self.redis is not None and not self.redis.running:
                return  # it died during the read; the supervision loop restarts it
            if not self.share.cluster and not isinstance(e, StreamsUnavailable):
                raise
            # Unreachable for the monitor's few seconds (restarting, loading its file, or another node's
            # Redis gone at the end of a run): progress display only; the next poll reads on.
            print(f"(streams unreachable: {type(e).__name__}: {e})", flush=True)

    def _close_streams(self) -> None:
        """Close the monitor's readers and this process's Redis connections (the Redis node waits for
        every other node's connections to close before it stops)."""
        self.monitor.close()
        self.monitor_closed = True
        if self.cfg.streams.backend == "redis":
            from pipeline_rl.streams.redis_backend import redis_client

            # The streams layer shares one pool per process and URL; closing a reader leaves it open.
            redis_client(
                self.cfg.streams.redis_url, self.cfg.streams.op_timeout_s
            ).connection_pool.disconnect()

    def _supervise(self) -> int:
        last_progress = 0.0
        last_eval = time.monotonic()
        deadline = time.monotonic() + self.cfg.max_wall_s if self.cfg.max_wall_s else None
        trainer = next((c for c in self.children if c.spec.role == "trainer"), None)
        run_over = False
        while True:
            if self._interrupted():
                print(f"\n{self.stop_requested}: stopping every process", flush=True)
                return 0 if run_over else 130
            if trainer is not None and trainer.poll() == 0:
                self._poll_streams()
                print(f"trainer finished ({self.monitor.version} steps)", flush=True)
                record_servers_final(self.servers_change.urls(), self.run_dir, self.cfg.inference.api_key)
                return 0
            failed = self._check_processes()
            if failed is not None:
                return failed
            if deadline is not None and time.monotonic() > deadline and trainer is not None:
                print(
                    f"max_wall_s={self.cfg.max_wall_s:.0f} reached: asking the trainer to checkpoint and stop",
                    flush=True,
                )
                trainer.signal(signal.SIGTERM)
                if not trainer.wait(self.cfg.trainer.push_timeout_s + 60):
                    return self._fail(trainer, "did not stop after SIGTERM")
                # Stopped as asked (its launcher relays the SIGTERM and exits non-zero for it): as clean
                # an end as its last step.
                self.trainer_stopped_as_asked = True
                self._poll_streams()
                record_servers_final(self.servers_change.urls(), self.run_dir, self.cfg.inference.api_key)
                return 0
            if not run_over:
                self._poll_streams()
            if trainer is None and not run_over and self.monitor.version >= self.cfg.trainer.max_steps:
                run_over = True
                print(f"the trainer published its last version ({self.monitor.version})", flush=True)
                if not self.share.servers:
                    return 0
                # Stop reading the streams so that the Redis node can end; the servers stay up.
                self._close_streams()
                print("servers keep serving until this launcher is stopped (Ctrl-C / SIGTERM)", flush=True)
            self.servers_change.retire_removed()
            if self.cfg.eval.every_s and time.monotonic() - last_eval >= self.cfg.eval.every_s:
                if self.share.evaluates:
                    self.evals.start_periodic()
                last_eval = time.monotonic()
            if time.monotonic() - last_progress >= self.progress_every_s:
                self.monitor.poll_servers(self.servers_change.urls())
                print(self.monitor.progress_line(), flush=True)
                last_progress = time.monotonic()
            time.sleep(0.5)

    def _serve_until_stopped(self) -> int:
        """A cluster node with trainer ranks and servers: the training is over, the servers serve on
        (like a servers-only node's) until this launcher is stopped. TRAINER_FINISHED tells whoever
        watches the shared run directory (the Ray launcher) that this node's ranks are done."""
        (self.run_dir / TRAINER_FINISHED).write_text("0\n")
        rest = [c for c in self.children if c.spec.role not in ("servers", "trainer")]
        stop_all(rest, grace_s=self.cfg.supervision.trainer_stop_s)
        self.children = [c for c in self.children if c.spec.role == "servers"]
        self._close_streams()
        print("servers keep serving until this launcher is stopped (Ctrl-C / SIGTERM)", flush=True)
        while not self._interrupted():
            failed = self._check_processes()
            if failed is not None:
                return failed
            self.servers_change.retire_removed()
            time.sleep(0.5)
        print(f"\n{self.stop_requested}: stopping every process", flush=True)
        return 0

    def _check_processes(self) -> int | None:
        """Schedule the restart of each restartable process that died and perform those that are due;
        an exit code for the run when a process cannot be restarted (or its budget is spent)."""
        units = [*self.children, *([RedisUnit(self.redis)] if self.redis is not None else [])]
        for unit in units:
            code = unit.poll()
            if code is None or self.supervisor.pending(unit.name):
                continue
            self._record_exit(unit, code)
            if code == 0 or not self._restartable(unit):
                return self._fail(unit, f"exited with code {describe_exit(code)}")
            try:
                delay = self.supervisor.schedule(unit.name, unit.role, code)
            except BudgetSpent as e:
                return self._fail(unit, e.detail)
            print(
                f"{unit.name} exited with code {describe_exit(code)}: restarting it in {delay:.1f}s "
                f"(restart {self.supervisor.restarts.get(unit.name, 0) + 1} of "
                f"{self.supervisor.policy(unit.role).max_restarts})",
                flush=True,
            )
        by_name = {unit.name: unit for unit in units}
        for name in self.supervisor.due():
            unit = by_name.get(name)
            if unit is None:  # removed from the job while its restart waited
                continue
            if isinstance(unit, RedisUnit):
                if not self._restart_redis():
                    return self._fail(unit, "could not be restarted")
            else:
                unit.spec.argv = restart_argv(unit.role, unit.spec.argv)
                stop_all([unit], grace_s=1.0)  # whatever its leader left behind (engine processes, ranks)
                unit.start(self.env)
                print(f"restarted {name} (pid {unit.proc.pid}), log: logs/{name}.log", flush=True)
        return None

    def _record_exit(self, unit: Child | RedisUnit, code: int | None) -> None:
        """An unclean exit, for the ledger (its last generated group may be abandoned, not lost)."""
        proc = getattr(unit, "proc", None)
        if code != 0 and proc is not None and "trainer" in self.roles:
            record_exit(self.cfg.run_dir, unit.name, proc.pid, code)  # the shared run directory's ledger

    def _snapshot_locations(self) -> None:
        """Where the untrained samples wait, for the ledger's positive accounting: at a clean stop only
        (the trainer finished), with every producer and consumer stopped and the streams still up. A
        node of several cannot see the others' processes stop, so a cluster run's report says not
        established, unless this node runs Redis and every actor, preprocessor and trainer rank."""
        trainer = next((c for c in self.children if c.spec.role == "trainer"), None)
        finished = trainer is not None and (trainer.poll() == 0 or self.trainer_stopped_as_asked)
        if not finished or (self.share.cluster and not self.share.holds_every_stream_client(self.cfg)):
            return
        try:
            snapshot_locations(self.cfg, Path(self.cfg.run_dir))
        except Exception as e:  # the report says "not established"; the run's own result stands
            print(f"(could not snapshot where samples wait: {type(e).__name__}: {e})", file=sys.stderr)

    def _restartable(self, unit: Child | RedisUnit) -> bool:
        if self.supervisor.policy(unit.role) is None:
            return False
        # Trainer ranks on several hosts restart together or not at all: this node cannot do that alone.
        return not (unit.role == "trainer" and self.share.trainer and self.share.trainer.num_machines > 1)

    def _restart_redis(self) -> bool:
        try:
            RedisUnit(self.redis).restart()
        except (RuntimeError, OSError) as e:
            print(f"(redis restart failed: {e})", file=sys.stderr, flush=True)
            return False
        print(f"restarted redis on the same port ({self.redis.safe_url})", flush=True)
        return True

    def _interrupted(self) -> bool:
        return self.stop_requested is not None

    def _fail(self, child: Child | RedisUnit, what: str) -> int:
        try:
            log = child.log_path.relative_to(self.run_dir)
        except ValueError:
            log = child.log_path
        print(f"\nERROR: {child.name} {what}. Last lines of {log}:", file=sys.stderr)
        print(child.log_tail(), file=sys.stderr)
        reason = child.last_error()
        if reason is not None:  # repeated last: a wrapper's traceback may have pushed it out of the tail
            print(f"\n{child.name}'s last error: {reason}", file=sys.stderr)
        print(
            f"(stopping every other process; full logs in {self.run_dir / 'logs'})",
            file=sys.stderr,
            flush=True,
        )
        return 1

    def _shutdown(self, started: float) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if self.redis is not None and self.supervisor.pending("redis"):
            # The run ended while Redis waited for its restart: the children's graceful stop and the
            # last stats read need it, so the wait is cut short.
            self.supervisor.take("redis")
            self._restart_redis()
        sup = self.cfg.supervision
        # Actors first (nothing new to generate); the trainer while preprocessors and servers are still up
        # (its last step and push need them, then it checkpoints); Redis last (everyone writes to it).
        for role, grace_s in [
            ("actors", sup.stop_grace_s),
            ("trainer", sup.trainer_stop_s),
            ("stages", sup.stop_grace_s),
            ("preprocessors", sup.stop_grace_s),
            ("servers", sup.stop_grace_s),
        ]:
            stopping = [c for c in self.children if c.spec.role == role]
            running = [c for c in stopping if c.poll() is None]
            stop_all(stopping, grace_s=grace_s)
            for child in running:  # killed at the deadline, or died of the signal: an unclean exit
                self._record_exit(child, child.poll())
        self._snapshot_locations()
        if self.monitor is not None and not self.monitor_closed:
            try:
                self.monitor.poll_streams()
            except Exception as e:  # the report must not hide the run's own result
                print(f"(could not read the last stats: {e})", file=sys.stderr)
            self._close_streams()  # also our own Redis connections: the wait below counts the others
        if self.status_server is not None:
            self.status_server.shutdown()
        if self.redis is not None:
            if self.share.cluster and not self._interrupted():  # a stop request means now
                wait_other_clients_off(self.cfg.streams.redis_url, REDIS_LINGER_S)
            self.redis.stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            if self.monitor is not None and "trainer" in self.roles:
                self._report(started)
        finally:
            self._finish_tracking({}, [])  # a run without a report still closes its trackers

    def _report(self, started: float) -> None:
        from pipeline_rl.launch.report import make_plots, summarize

        extra = {"mode": self.cfg.mode}
        done = self.evals.results
        if "before" in done:
            extra["accuracy_before"] = done["before"]["accuracy"]
        if "after" in done:
            extra["accuracy_after"] = done["after"]["accuracy"]
            extra["final_weight_version"] = done["after"]["weight_version"]
        summary = summarize(self.run_dir, started, extra, shared_dir=Path(self.cfg.run_dir))
        plots = make_plots(self.run_dir, started)
        print("\n=== summary ===")
        print(json.dumps(summary, indent=2))
        print("plots: " + ", ".join(str(p) for p in plots))
        self._finish_tracking(summary, plots)
