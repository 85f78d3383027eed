"""The actor's admission gate: may one more group start now? Pure arithmetic, tested without servers.

Names (all counts are groups; docs/actor.md has the same table):
    G = trainer.batch_size / attempts        groups per optimizer step (weight version = steps done)
    A = actor.num_actors, B = actor.max_buffered_groups, L = actor.max_lag
    q = B if A == 1 else min(B // A, G*(L+1) // A, G*L // (A-1))   own share: most own groups in flight
    R = (A-1) * q                            worst case of the other actors' groups in flight
    W = rollouts.total_written() (+ own writes since it was read), F = own groups in flight
    V = latest published WeightVersionEvent.version, V_floor = min(V, start version of own in-flight)
    T = latest groups_consumed, D = sum over preprocessors of latest groups_dropped, C = T + D
    P = sum over preprocessors of latest samples_dropped (single samples dropped from groups that went
        on: a user filter's, or one too long) / attempts, in groups

Invariant. Start one more group only if
    F + 1 <= q
    W + F + R + 1 - C <= B                       (bounded buffer)
    W + F + R + 1 - D - P <= G * (V_floor + L + 1)   (lag)

Guarantees with one actor (R = 0), groups trained G per step in the order they were written:
  (1) Buffer: groups started (written or in flight) but not consumed never exceed B. Admission checks
      exactly this; afterwards a write moves a group from F to W (the sum is unchanged) and consumption
      only lowers it.
  (2) Lag: a group g started at published version V_g is trained at a step s with (s - 1) - V_g <= L.
      Proof: g's position among trained groups is k <= (groups written before g) + 1 - D. Every group
      written before g was started by the last admission before g was written; that admission had g
      (or an older group) in flight, so its V_floor <= V_g, and it allowed at most G*(V_floor + L + 1)
      groups. So k <= G*(V_g + L + 1) and s = ceil(k / G) <= V_g + L + 1. Every drop counted at that
      admission belongs to a group already written, i.e. one ahead of g, so subtracting D is sound.
      Counted in samples, the same argument holds with single drops: a step trains at least
      batch_size = G * attempts samples, and the samples dropped from groups ahead of g (P * attempts)
      do not take a place before it, so subtracting P is sound; without it, a filter that thins every
      group would make each step take more than G groups and the actors would wait for good.
      V_floor matters because groups finish out of order: without it, groups started later at a newer
      version could overtake g and push it past its bound.
V, C and D come from events published after the fact and W from an exact count: stale values only
make the gate stricter. The trainer enforces the lag bound again, exactly, when it trains a sample
(trainer/step.py drop_stale: too-stale samples are dropped there and their groups still count in
groups_consumed); this gate keeps such drops rare, it is not what the bound rests on. An entry acked
without being trained must be counted in D (preprocessor duplicates are), or W - C grows for good.

Several actors: an actor cannot see the others' groups in flight, so it reserves R (each other actor
holding its whole share q) and keeps F <= q; the buffer bound then holds across all actors. q keeps
R <= G*L (an actor with nothing in flight can start the last group of a step) and B - R >= G (the
trainer can fill a batch); configs that cannot satisfy both are rejected by GateLimits.from_config.
The lag bound does not cover another actor's OLD group in flight (docs/actor.md, "Several actors").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline_rl.actor.errors import ActorError
from pipeline_rl.config import RunConfig
from pipeline_rl.messages import PreprocessorProgress, WeightVersionEvent


@dataclass(frozen=True)
class GateLimits:
    groups_per_step: int  # G
    max_lag: int  # L
    max_buffered: int  # B
    own_quota: int  # q
    others_reserve: int  # R
    attempts: int = 1  # samples per group, to count single dropped samples (P) in groups

    @classmethod
    def from_config(cls, cfg: RunConfig) -> GateLimits:
        a = cfg.actor
        groups_per_step = cfg.trainer.batch_size // a.attempts
        n, b, lag = a.num_actors, a.max_buffered_groups, a.max_lag
        # Several actors split both budgets evenly; G*L // (n-1) keeps enough lag room for the last
        # group of a step even when every other actor holds its whole share (else: deadlock).
        quota = (
            b if n == 1 else min(b // n, groups_per_step * (lag + 1) // n, groups_per_step * lag // (n - 1))
        )
        if quota < 1:
            raise ActorError(
                f"{n} actors cannot share max_buffered_groups={b} with max_lag={lag} "
                f"({groups_per_step} groups per step): each actor must reserve room for the others' "
                "in-flight groups. Raise actor.max_lag / actor.max_buffered_groups or use one actor."
            )
        limits = cls(groups_per_step, lag, b, quota, (n - 1) * quota, a.attempts)
        if b - limits.others_reserve < groups_per_step:
            raise ActorError(
                f"actor.max_buffered_groups={b} leaves fewer than one optimizer step ({groups_per_step} "
                f"groups) to {n} actor(s): the trainer could never fill a batch. Raise it to at least "
                f"{groups_per_step * n}."
            )
        return limits


def gate_block(
    limits: GateLimits,
    *,
    written: int,
    in_flight: int,
    consumed: int,
    dropped: int,
    version_floor: int,
    samples_dropped: int = 0,
) -> Literal["lag", "buffer"] | None:
    """Why one more group may not start now (None: it may). See the module docstring for the rule."""
    started = written + in_flight + limits.others_reserve + 1  # including the new group
    thinned = samples_dropped / limits.attempts  # P
    if started - dropped - thinned > limits.groups_per_step * (version_floor + limits.max_lag + 1):
        return "lag"
    if in_flight + 1 > limits.own_quota or started - consumed > limits.max_buffered:
        return "buffer"
    return None


@dataclass
class TrainerProgress:
    """What trainer_events says: the latest version and consumption (dropped groups count as consumed)."""

    version: int = 0
    groups_trained: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    thinned: dict[str, int] = field(default_factory=dict)  # samples dropped from groups that went on
    servers: list[str] | None = None  # the servers that hold `version` (None: not said, every one)

    def apply(self, message: Any) -> None:
        # Latest, not max: a trainer restored from a checkpoint rewinds both, and re-reads what follows.
        if isinstance(message, WeightVersionEvent):
            self.version, self.groups_trained = message.version, message.groups_consumed
            self.servers = message.servers
        elif isinstance(message, PreprocessorProgress):
            self.dropped[message.preprocessor_id] = message.groups_dropped
            self.thinned[message.preprocessor_id] = message.samples_dropped

    @property
    def groups_dropped(self) -> int:
        return sum(self.dropped.values())

    @property
    def samples_dropped(self) -> int:
        return sum(self.thinned.values())

    @property
    def groups_consumed(self) -> int:
        return self.groups_trained + self.groups_dropped
