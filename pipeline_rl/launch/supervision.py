"""Which of the launcher's processes come back after dying, when, and when the run gives up instead.

    delay = restart_delay(policy, restarts_so_far)   # seconds to wait, or None: the budget is spent
    sup = Supervisor(cfg.supervision)
    delay = sup.schedule("actor0", "actors", exit_code)   # raises BudgetSpent when nothing is left
    for name in sup.due(): ...restart it...               # each scheduled restart, once its wait is over

Restartable roles and their policies (`supervision.<field>` in the config): servers (`server`), the
trainer (`trainer`), actors (`actor`), preprocessors (`preprocessor`), the workers of the graph's user
stages (`stage`), the launcher's private Redis (`redis`). Each is restartable by design: a server comes
back with --await-weights (503 until the trainer's next push gives it the current weights; the trainer re-admits it at a step boundary), the
trainer resumes from its newest checkpoint (--resume; steps after it are redone, their samples come
again from the streams' committed positions), an actor draws a new incarnation (fresh sample ids), a
preprocessor or a stage worker gets its unacked entries back from its consumer group, Redis replays its append-only file.

The budget is per process (actor0 dying does not spend actor1's), counted over the whole run; the wait
doubles with each restart of that process, up to max_backoff_s, so a process that dies at once after
every start costs little before the run gives up. The supervisor only decides and counts; it never
sleeps, so the launcher's loop keeps watching everything else while a restart waits.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from inference_shim import procs
from pipeline_rl.config import RestartPolicy, SupervisionConfig

# role (as in the launch plan) -> field of SupervisionConfig holding its policy
POLICY_FIELD = {
    "servers": "server",
    "trainer": "trainer",
    "actors": "actor",
    "preprocessors": "preprocessor",
    "stages": "stage",
    "redis": "redis",
}
# Flag each role's restarted command gets (a server must not serve its start-up weights; the trainer
# continues from its checkpoint).
RESTART_FLAG = {"servers": "--await-weights", "trainer": "--resume"}


def restart_delay(policy: RestartPolicy, restarts: int) -> float | None:
    """Seconds to wait before restarting a process already restarted `restarts` times; None once
    the budget (max_restarts) is spent."""
    if restarts >= policy.max_restarts:
        return None
    # 2**restarts overflows to huge floats long before it matters; the cap keeps it finite.
    return min(policy.backoff_s * 2.0 ** min(restarts, 60), policy.max_backoff_s)


def describe_exit(code: int | None) -> str:
    """'1', or '-9 (SIGKILL)' for a process ended by a signal (Popen's negative return codes)."""
    if code is not None and code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


class BudgetSpent(RuntimeError):
    """A restartable process died once more than its policy allows; `detail` is the message after
    the process's name."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"{name} {detail}")
        self.detail = detail


class Supervisor:
    """Restart bookkeeping of one launcher: counts per process, pending restarts and their due times."""

    def __init__(self, cfg: SupervisionConfig) -> None:
        self.cfg = cfg
        self.restarts: dict[str, int] = {}  # process name -> restarts done
        self.roles: dict[str, str] = {}  # process name -> role, for the per-role counts
        self._due: dict[str, float] = {}  # process name -> monotonic time its restart is due

    def policy(self, role: str) -> RestartPolicy | None:
        """The role's policy; None for a role that is never restarted (servers, trainer)."""
        field = POLICY_FIELD.get(role)
        return None if field is None else getattr(self.cfg, field)

    def schedule(self, name: str, role: str, code: int | None, now: float | None = None) -> float:
        """Record that `name` died with `code`; return the wait before its restart, or raise BudgetSpent
        (with a message naming the process, its role, the exit code and the config field to raise)."""
        policy = self.policy(role)
        if policy is None:
            raise ValueError(f"{name} ({role}) is not restartable")
        done = self.restarts.get(name, 0)
        delay = restart_delay(policy, done)
        if delay is None:
            raise BudgetSpent(
                name,
                f"(role {role}) exited with code {describe_exit(code)} after {done} restart(s): "
                f"restart budget spent (supervision.{POLICY_FIELD[role]}.max_restarts={policy.max_restarts})",
            )
        self.roles[name] = role
        self._due[name] = (time.monotonic() if now is None else now) + delay
        return delay

    def pending(self, name: str) -> bool:
        return name in self._due

    def due(self, now: float | None = None) -> list[str]:
        """Names whose restart is due now; each is counted as restarted and leaves the pending set."""
        now = time.monotonic() if now is None else now
        names = [name for name, at in self._due.items() if at <= now]
        for name in names:
            self.take(name)
        return names

    def take(self, name: str) -> None:
        """Count the pending restart of `name` as done now, its wait cut short (the caller restarts it)."""
        del self._due[name]
        self.restarts[name] = self.restarts.get(name, 0) + 1

    def restarts_by_role(self) -> dict[str, int]:
        """Restarts per restartable role ({"servers": 0, "actors": 1, ...}), for /status."""
        counts = dict.fromkeys(POLICY_FIELD, 0)
        for name, n in self.restarts.items():
            counts[self.roles[name]] += n
        return counts


def restart_argv(role: str, argv: list[str]) -> list[str]:
    """The command of a restarted process of `role`: its first argv plus RESTART_FLAG[role], once."""
    flag = RESTART_FLAG.get(role)
    return argv if flag is None or flag in argv else [*argv, flag]


class RedisUnit:
    """The launcher's private Redis as a supervised process: the same name/role/poll/log as a Child."""

    name = "redis"

    def __init__(self, server) -> None:
        self.server = server  # a pipeline_rl.streams.RedisServer with a data_dir

    @property
    def role(self) -> str:
        return "redis"

    @property
    def log_path(self) -> Path:
        return self.server.log_path

    def poll(self) -> int | None:
        return self.server.returncode

    def log_tail(self, lines: int = 30) -> str:
        return procs.log_tail(self.log_path, lines)

    def last_error(self) -> str | None:
        """Redis's log has no lines of our logging's ERROR format: its tail says it all."""
        return None

    def restart(self) -> None:
        """Same port, same password, same data directory: clients reconnect (their calls retry for
        streams.retry_deadline_s) and find what the server had acknowledged."""
        self.server.start()
