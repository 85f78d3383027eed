"""The actor: turns this actor's shard of prompts into complete GRPO groups on the `rollouts` topic.

    pipeline-rl actor --config RUN/config.json --index 0          # what the launcher runs (main.py)
    summary = await run_actor(cfg, actor_index=0, max_groups=16)  # tests and tools

    gate.py     admission: may one more group start (lag and buffer invariant, with its proof)
    router.py   which server gets the next request; failover
    loop.py     the asyncio loop: admit, generate, grade, write one RolloutGroup; stats
    completions.py  a chat response as Completions (the contract extensions the actor needs)
    main.py     the process entry point (CLI)
    errors.py   ActorError and its subclasses

docs/actor.md explains all of it at length.
"""

from pipeline_rl.actor.completions import Completion, completions_of
from pipeline_rl.actor.errors import ActorError, AllServersDown, TrainerStalled
from pipeline_rl.actor.gate import GateLimits, TrainerProgress, gate_block
from pipeline_rl.actor.loop import ActorSummary, request_seed, run_actor
from pipeline_rl.actor.router import Router, Server

__all__ = [
    "ActorError",
    "ActorSummary",
    "AllServersDown",
    "Completion",
    "GateLimits",
    "Router",
    "Server",
    "TrainerProgress",
    "TrainerStalled",
    "completions_of",
    "gate_block",
    "request_seed",
    "run_actor",
]
