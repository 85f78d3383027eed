"""Trainer strategies: how the model, optimizer and schedule are spread over the trainer ranks.

    from pipeline_rl.trainer.strategies import make_strategy
    strategy = make_strategy(cfg, comm, weights_dir)     # the one cfg.trainer.strategy names

The interface is `base.Strategy` (its docstring has the call sequence); one file per strategy:
ddp.py (torch DDP), zero.py (DeepSpeed ZeRO-2/3), fsdp.py (torch FSDP2). Imports go one way only: every
strategy imports base, base imports none of them, and this module maps names to classes. DeepSpeed itself
is imported only when a ZeRO strategy is built.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pipeline_rl.config import RunConfig
from pipeline_rl.trainer.dist import Comm
from pipeline_rl.trainer.strategies.base import Strategy
from pipeline_rl.trainer.strategies.ddp import DDPStrategy
from pipeline_rl.trainer.strategies.fsdp import FSDPStrategy
from pipeline_rl.trainer.strategies.zero import Zero2Strategy, Zero3Strategy

# trainer.strategy -> the class that builds it (the names TrainerConfig.strategy allows).
STRATEGIES: dict[str, Callable[[RunConfig, Comm, str | Path], Strategy]] = {
    cls.name: cls for cls in (DDPStrategy, Zero2Strategy, Zero3Strategy, FSDPStrategy)
}

__all__ = ["STRATEGIES", "Strategy", "make_strategy"]


def make_strategy(cfg: RunConfig, comm: Comm, weights_dir: str | Path) -> Strategy:
    """The strategy cfg.trainer.strategy names, with weights loaded from `weights_dir`."""
    name = cfg.trainer.strategy
    if name not in STRATEGIES:
        raise ValueError(f"unknown trainer.strategy={name!r}; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[name](cfg, comm, weights_dir)
