"""DDP: every rank holds the whole model and optimizer; gradients are all-reduced (averaged) once per step.

The default on CPU (gloo). Gradient accumulation runs the package's micro-batches under `no_sync()`
except the last, so there is one all-reduce per optimizer step. The weight push reads rank 0's own
parameters (no collective). Optimizer and scheduler state are saved by rank 0 with torch.save.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from pipeline_rl.config import RunConfig
from pipeline_rl.trainer.dist import Comm
from pipeline_rl.trainer.model import WeightSpec, load_policy, lr_lambda, params_checksum
from pipeline_rl.trainer.strategies.base import Strategy


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(self, cfg: RunConfig, comm: Comm, weights_dir: str | Path) -> None:
        super().__init__(cfg, comm)
        t = cfg.trainer
        self.module = load_policy(cfg, weights_dir, comm.device)
        # DDP broadcasts rank 0's weights at construction: every replica starts bit-identical.
        self.model = (
            DistributedDataParallel(
                self.module, device_ids=[comm.local_rank] if comm.device.type == "cuda" else None
            )
            if comm.distributed
            else self.module
        )
        self._track_parameters(weights_dir)
        self.optimizer = torch.optim.AdamW(
            [p for _, p in self._params], lr=t.learning_rate, betas=t.betas, weight_decay=t.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(t))

    @contextmanager
    def micro_step(self, last: bool) -> Iterator[None]:
        sync = last or not isinstance(self.model, DistributedDataParallel)
        with nullcontext() if sync else self.model.no_sync():
            yield

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.trainer.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def weight_specs(self) -> list[WeightSpec]:
        return [(name, list(p.shape), p.dtype) for name, p in self._params]

    def gather(self, indices: list[int]) -> list[torch.Tensor] | None:
        if not self.comm.is_main:
            return None
        return [self._params[i][1].detach() for i in indices]

    def save_optimizer(self, directory: Path) -> None:
        if self.comm.is_main:
            directory.mkdir(parents=True, exist_ok=True)
            torch.save(
                {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                directory / "optimizer.pt",
            )

    def load_optimizer(self, directory: Path) -> None:
        # Every rank loads the same file: replicas must hold identical optimizer state.
        state = torch.load(directory / "optimizer.pt", map_location=self.comm.device, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def replica_checksum(self) -> str | None:
        return params_checksum(self.module)
