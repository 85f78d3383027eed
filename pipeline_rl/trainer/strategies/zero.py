"""DeepSpeed ZeRO-2 / ZeRO-3 through `deepspeed.initialize` (CPU over gloo, or GPU over nccl).

The ZeRO settings come from pipeline_rl/conf/deepspeed/zero{2,3}.json (or the file `accelerate launch
--deepspeed_config_file` names). The fields the trainer owns are filled from TrainerConfig and must not
be in the file: batch sizes (micro-batch 1, accumulation 1, train_batch_size = world size, as DeepSpeed
requires train_batch_size = micro x accumulation x world), gradient clipping and the optimizer (torch's
AdamW, "torch_adam": true, which runs on CPU where DeepSpeed's fused/CPU Adam kernels are not built).

Gradient accumulation over a package's variable number of micro-batches: accumulation is 1 in the config
and the trainer marks the boundary itself (set_gradient_accumulation_boundary(last)), so DeepSpeed steps
exactly once per package and never rescales the loss (the loss is already normalized for the step).

Weight push: ZeRO-3 parameters are partitioned; gather() runs deepspeed.zero.GatheredParameters over one
bucket's parameters on every rank and rank 0 copies the full tensors out. ZeRO-2 keeps full parameters
on every rank, so rank 0 reads its own. Optimizer/scheduler state: DeepSpeed's own sharded checkpoint
(with trainer.lora: of the adapter only; the frozen base is left out of it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from pipeline_rl.config import RunConfig
from pipeline_rl.paths import CONF_DIR
from pipeline_rl.trainer.dist import Comm
from pipeline_rl.trainer.model import WeightSpec, load_policy, lr_lambda, trained_parameters
from pipeline_rl.trainer.strategies.base import Strategy

TRAINER_OWNED = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer",
    "scheduler",
)
CHECKPOINT_TAG = "zero"


def deepspeed_config(cfg: RunConfig, world: int, stage: int) -> dict:
    """The DeepSpeed config: the JSON file's ZeRO settings plus the fields the trainer owns."""
    path = Path(
        os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or CONF_DIR / "deepspeed" / f"zero{stage}.json"
    )
    if not path.is_absolute() and not path.exists():
        path = CONF_DIR / path  # accelerate passes the YAML's path as written (relative to pipeline_rl/conf/)
    config = json.loads(path.read_text())
    clash = [key for key in TRAINER_OWNED if key in config]
    if clash:
        raise ValueError(f"{path} sets {clash}: remove them, the trainer fills them from trainer.* settings")
    found = config.get("zero_optimization", {}).get("stage")
    if found != stage:
        raise ValueError(
            f"{path} has zero_optimization.stage={found} but trainer.strategy asks for ZeRO-{stage}"
        )
    t = cfg.trainer
    config.update(
        train_micro_batch_size_per_gpu=1,
        gradient_accumulation_steps=1,
        train_batch_size=world,
        gradient_clipping=t.max_grad_norm,
        optimizer={
            "type": "AdamW",
            "params": {
                "lr": t.learning_rate,
                "betas": list(t.betas),
                "weight_decay": t.weight_decay,
                "torch_adam": True,
            },
        },
    )
    config.setdefault("steps_per_print", 10**9)  # our own metrics replace DeepSpeed's periodic prints
    return config


SHARED_MEMORY_OP = "deepspeed_shm_comm"


def skip_shared_memory_op() -> None:
    """Keep DeepSpeed's CPU backend from compiling its shared-memory all-reduce op.

    DeepSpeed's torch communication backend builds that C++ op (a JIT compile: minutes on a machine that
    has not built it, and a compiler it needs) whenever the op's probe says it can, but only its
    inference tensor parallelism calls it (`inference_all_reduce`); ZeRO's collectives are
    torch.distributed's. Marking the op unavailable in DeepSpeed's table of compatible ops (a module-level
    dict it keeps and reads) skips the build and changes nothing the trainer runs."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHARED_MEMORY_OP] = False


class DeepSpeedStrategy(Strategy):
    """Both ZeRO stages; the two subclasses below only fix `stage` (and the name the config uses)."""

    stage: int

    def __init__(self, cfg: RunConfig, comm: Comm, weights_dir: str | Path) -> None:
        super().__init__(cfg, comm)
        import deepspeed

        stage = self.stage
        self.gather_is_collective = stage == 3
        if comm.device.type == "cpu":
            skip_shared_memory_op()
        # Reuses the default group init_comm created (DeepSpeed notices it is initialized).
        deepspeed.init_distributed(dist_backend="nccl" if comm.device.type == "cuda" else "gloo")
        module = load_policy(cfg, weights_dir, comm.device)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module,
            model_parameters=[p for _, p in trained_parameters(module, cfg)],
            config=deepspeed_config(cfg, comm.world, stage),
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(
                optimizer, lr_lambda(cfg.trainer)
            ),
        )
        self.model = self.engine
        self.module = self.engine.module
        self._track_parameters(weights_dir)

    @contextmanager
    def micro_step(self, last: bool) -> Iterator[None]:
        self.engine.set_gradient_accumulation_boundary(last)
        yield

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def optimizer_step(self) -> float:
        self.engine.step()  # clip, step, LR schedule, zero grads (at the boundary we set)
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def weight_specs(self) -> list[WeightSpec]:
        # ZeRO-3 parameters are empty shards outside a gather; ds_shape is the full shape.
        return [(n, list(getattr(p, "ds_shape", p.shape)), p.dtype) for n, p in self._params]

    def gather(self, indices: list[int]) -> list[torch.Tensor] | None:
        params = [self._params[i][1] for i in indices]
        if self.stage != 3:
            return [p.detach() for p in params] if self.comm.is_main else None
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            # Copies: the shards are released when the context exits, before the bytes are sent.
            return [p.detach().clone() for p in params] if self.comm.is_main else None

    def save_optimizer(self, directory: Path) -> None:
        # With trainer.lora the frozen base stays out: the checkpoint's model/ holds the adapter, and
        # the base is cfg.model_path.
        self.engine.save_checkpoint(
            str(directory),
            tag=CHECKPOINT_TAG,
            save_latest=False,
            exclude_frozen_parameters=self.cfg.trainer.lora is not None,
        )

    def load_optimizer(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(
            str(directory),
            tag=CHECKPOINT_TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            load_module_strict=self.cfg.trainer.lora is None,  # lora: the frozen base is not in it
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint '{CHECKPOINT_TAG}' in {directory}")


class Zero2Strategy(DeepSpeedStrategy):
    name = "deepspeed_zero2"
    stage = 2


class Zero3Strategy(DeepSpeedStrategy):
    name = "deepspeed_zero3"
    stage = 3
