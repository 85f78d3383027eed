"""How the model is spread over the trainer ranks: the interface every strategy implements, and the factory.

One file per strategy (ddp.py, zero.py, fsdp.py). Each one owns the wrapped model, the optimizer and the
LR schedule, and answers the questions the driver loop and the weight push ask:

    s = make_strategy(cfg, comm, weights_dir)        # weights_dir: model_path, or a checkpoint's model/
    with s.micro_step(last=i == n - 1): s.backward(loss)    # every micro-batch of the package
    grad_norm = s.optimizer_step()                   # clip, step, schedule, zero grads
    specs = s.weight_specs()                         # HF names / full shapes, in push order
    tensors = s.gather(indices)                      # COLLECTIVE for sharded strategies: all ranks call
                                                     # it with the same indices; rank 0 gets full tensors

Why not accelerate's Accelerator object: on a CPU-only machine it cannot set up DeepSpeed (every rank
reports num_processes=1) or FSDP (only for GPU distributed types), measured with accelerate 1.15. So
`accelerate launch` starts the ranks (torchrun underneath) and each strategy builds its wrapper with the
library's own API (torch DDP, torch fully_shard, deepspeed.initialize): one code path on CPU and GPU.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from pipeline_rl.config import RunConfig, TrainerConfig
from pipeline_rl.trainer.dist import Comm

# (HF checkpoint name, full shape, dtype) of every weight the servers hold, in push order.
WeightSpec = tuple[str, list[int], torch.dtype]


def load_hf_model(path: str | Path, device: torch.device) -> torch.nn.Module:
    """The causal LM in float32 (the trainer's master weights), SDPA attention, in train mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    return model.to(device).train()


def lr_lambda(tcfg: TrainerConfig):
    """Linear warmup over trainer.warmup_steps, then constant."""
    warmup = tcfg.warmup_steps
    return lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0


def check_names(specs: list[WeightSpec], model_path: str | Path) -> None:
    """Our weight names must be exactly the checkpoint's (the servers validate every update against it)."""
    from pipeline_rl.tiny_model import checkpoint_tensor_table

    try:
        table = checkpoint_tensor_table(model_path)
    except FileNotFoundError:
        return  # not a safetensors checkpoint: the servers' validation is the check
    ours = {name: shape for name, shape, _ in specs}
    missing, extra = sorted(set(table) - set(ours)), sorted(set(ours) - set(table))
    wrong = [n for n in ours if n in table and list(table[n][1]) != list(ours[n])]
    if missing or extra or wrong:
        raise RuntimeError(
            f"the trainer's weights do not match the checkpoint at {model_path}: missing {missing[:3]}, "
            f"extra {extra[:3]}, wrong shape {wrong[:3]}; the servers would refuse every update"
        )


class Strategy(ABC):
    """A model + optimizer + schedule spread over the trainer ranks in one particular way."""

    name: str
    model: torch.nn.Module  # call forward on this (possibly wrapped)
    module: torch.nn.Module  # the Hugging Face module inside (names, config, save_pretrained)

    def __init__(self, cfg: RunConfig, comm: Comm) -> None:
        self.cfg = cfg
        self.comm = comm

    @contextmanager
    def micro_step(self, last: bool) -> Iterator[None]:
        """Around forward+backward of one micro-batch; gradients are synchronized only when `last`."""
        yield

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    @abstractmethod
    def optimizer_step(self) -> float:
        """Clip, optimizer step, LR schedule step, zero grads. Returns the gradient norm before clipping."""

    @abstractmethod
    def lr(self) -> float: ...

    @abstractmethod
    def weight_specs(self) -> list[WeightSpec]: ...

    gather_is_collective: bool = False  # True: every rank must call gather() with the same indices

    @abstractmethod
    def gather(self, indices: list[int]) -> list[torch.Tensor] | None:
        """Full tensors of the weights at `indices` on rank 0 (None on the others)."""

    @abstractmethod
    def save_optimizer(self, directory: Path) -> None:
        """Optimizer + schedule state into `directory` (collective; each strategy picks its format)."""

    @abstractmethod
    def load_optimizer(self, directory: Path) -> None: ...

    def full_state_dict(self, bucket_bytes: int) -> dict[str, torch.Tensor] | None:
        """Every weight, full, on rank 0's CPU (None elsewhere); gathered bucket by bucket (collective)."""
        specs = self.weight_specs()
        state: dict[str, torch.Tensor] = {}
        for indices in _buckets(specs, bucket_bytes):
            tensors = self.gather(indices)
            if tensors is not None:
                for i, tensor in zip(indices, tensors, strict=True):
                    state[specs[i][0]] = tensor.detach().to("cpu", copy=True)
        return state if self.comm.is_main else None

    def replica_checksum(self) -> str | None:
        """Hash of this rank's full weights for replicated strategies (DDP), None for sharded ones."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the strategy holds."""


def params_checksum(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _buckets(specs: list[WeightSpec], bucket_bytes: int) -> list[list[int]]:
    out: list[list[int]] = [[]]
    used = 0
    for i, (_, shape, dtype) in enumerate(specs):
        size = torch.Size(shape).numel() * dtype.itemsize
        if out[-1] and used + size > bucket_bytes:
            out.append([])
            used = 0
        out[-1].append(i)
        used += size
    return [b for b in out if b]


def make_strategy(cfg: RunConfig, comm: Comm, weights_dir: str | Path) -> Strategy:
    """The strategy cfg.trainer.strategy names, with weights loaded from `weights_dir`."""
    name = cfg.trainer.strategy
    if name == "ddp":
        from pipeline_rl.trainer.ddp import DDPStrategy

        return DDPStrategy(cfg, comm, weights_dir)
    if name in ("deepspeed_zero2", "deepspeed_zero3"):
        from pipeline_rl.trainer.zero import DeepSpeedStrategy

        return DeepSpeedStrategy(cfg, comm, weights_dir, stage=2 if name.endswith("2") else 3)
    from pipeline_rl.trainer.fsdp import FSDPStrategy

    return FSDPStrategy(cfg, comm, weights_dir)
