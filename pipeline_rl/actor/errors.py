"""Why an actor stops: every error it raises names what to check or change."""

from __future__ import annotations


class ActorError(RuntimeError):
    """The actor cannot go on; the message says what to check or change."""


class AllServersDown(ActorError):
    """No inference server answered /health for actor.all_servers_down_deadline_s."""


class TrainerStalled(ActorError):
    """Admission waited actor.trainer_wait_deadline_s without the trainer consuming anything."""
