"""FSDP2 (torch.distributed.fsdp.fully_shard): parameters, gradients and optimizer state sharded per rank.

Each decoder layer (the model's `_no_split_modules` classes) is one FSDP unit, the root holds the rest
(embeddings, final norm, a tied LM head). Works over gloo on CPU with torch 2.13 (tested with 2 ranks)
and over nccl on GPU. Gradient accumulation: set_requires_gradient_sync(last) so the reduce-scatter runs
once per package. Weight push: DTensor.full_tensor() per parameter of a bucket on every rank (an
all-gather), rank 0 keeps the result. Optimizer state is saved as a full state dict by rank 0; on
resume every rank reads it and keeps its shards (torch.distributed.checkpoint.state_dict). With
trainer.lora the frozen base is sharded like the rest; only the adapter has gradients and optimizer state.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from pipeline_rl.config import RunConfig
from pipeline_rl.trainer.dist import Comm
from pipeline_rl.trainer.model import WeightSpec, load_policy, lr_lambda
from pipeline_rl.trainer.strategies.base import Strategy


class FSDPStrategy(Strategy):
    name = "fsdp"

    def __init__(self, cfg: RunConfig, comm: Comm, weights_dir: str | Path) -> None:
        super().__init__(cfg, comm)
        t = cfg.trainer
        if os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() in ("1", "true", "yes"):
            raise ValueError(
                "FSDP_CPU_RAM_EFFICIENT_LOADING is on (fsdp_cpu_ram_efficient_loading in the accelerate "
                "config): transformers then loads weights on rank 0 only and the other ranks would train "
                "garbage; set it to false in pipeline_rl/conf/accelerate/fsdp.yaml"
            )
        module = load_policy(cfg, weights_dir, comm.device)
        self.sharded = comm.distributed
        if self.sharded:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(comm.device.type, (comm.world,))
            units = set(getattr(module, "_no_split_modules", None) or [])
            for layer in [m for m in module.modules() if type(m).__name__ in units]:
                fully_shard(layer, mesh=mesh)
            fully_shard(module, mesh=mesh)
        self.model = self.module = module
        self.gather_is_collective = self.sharded
        self._track_parameters(weights_dir)
        self.optimizer = torch.optim.AdamW(
            [p for _, p in self._params], lr=t.learning_rate, betas=t.betas, weight_decay=t.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(t))

    @contextmanager
    def micro_step(self, last: bool) -> Iterator[None]:
        if self.sharded:
            self.module.set_requires_gradient_sync(last)
        yield

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.trainer.max_grad_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def weight_specs(self) -> list[WeightSpec]:
        return [(name, list(p.shape), p.dtype) for name, p in self._params]  # DTensor shape is global

    def gather(self, indices: list[int]) -> list[torch.Tensor] | None:
        params = [self._params[i][1] for i in indices]
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in params]
        return [t.detach() for t in full] if self.comm.is_main else None

    def save_optimizer(self, directory: Path) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(self.module, self.optimizer, options=options)  # collective
        if self.comm.is_main:
            directory.mkdir(parents=True, exist_ok=True)
            torch.save(
                {"optimizer": state, "scheduler": self.scheduler.state_dict()}, directory / "optimizer.pt"
            )

    def load_optimizer(self, directory: Path) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        # Every rank reads the full state and keeps its shards (simple; a rank holds the full state briefly).
        state = torch.load(directory / "optimizer.pt", map_location="cpu", weights_only=True)
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(
            self.module, self.optimizer, optim_state_dict=state["optimizer"], options=options
        )
        self.scheduler.load_state_dict(state["scheduler"])
