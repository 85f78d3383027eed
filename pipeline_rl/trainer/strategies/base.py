"""The interface every trainer strategy implements (how the model is spread over the trainer ranks).

One file per strategy beside this one (ddp.py, zero.py, fsdp.py); `make_strategy` in the package's
__init__ picks one by name. This module imports none of them. Each strategy owns the wrapped model, the
optimizer and the LR schedule, and answers the questions the driver loop and the weight push ask:

    s = make_strategy(cfg, comm, weights_dir)        # weights_dir: model_path, or a checkpoint's model/
                                                     # (with trainer.lora: its adapter, see load_policy)
    with s.micro_step(last=i == n - 1): s.backward(loss)    # every micro-batch of the package
    grad_norm = s.optimizer_step()                   # clip, step, schedule, zero grads
    specs = s.weight_specs()                         # HF names / full shapes, in push order (with
                                                     # trainer.lora: the adapter's, peft file names)
    tensors = s.gather(indices)                      # COLLECTIVE for sharded strategies: all ranks call
                                                     # it with the same indices; rank 0 gets full tensors

Why not accelerate's Accelerator object: on a CPU-only machine it cannot set up DeepSpeed (every rank
reports num_processes=1) or FSDP (only for GPU distributed types), measured with accelerate 1.15. So
`accelerate launch` starts the ranks (torchrun underneath) and each strategy builds its wrapper with the
library's own API (torch DDP, torch fully_shard, deepspeed.initialize): one code path on CPU and GPU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from inference_shim.protocol import plan_buckets
from pipeline_rl.config import RunConfig
from pipeline_rl.trainer.dist import Comm
from pipeline_rl.trainer.model import WeightSpec, check_names, trained_parameters, weight_metas


class Strategy(ABC):
    """A model + optimizer + schedule spread over the trainer ranks in one particular way."""

    name: str
    model: torch.nn.Module  # call forward on this (possibly wrapped)
    module: torch.nn.Module  # the Hugging Face module inside (with trainer.lora: the PeftModel around it)

    _params: list[tuple[str, torch.nn.Parameter]]  # what is trained, pushed and checkpointed

    def __init__(self, cfg: RunConfig, comm: Comm) -> None:
        self.cfg = cfg
        self.comm = comm

    def _track_parameters(self, weights_dir: str | Path) -> None:
        """Every strategy's last build step, on `self.module` as wrapped: the trained parameters under
        the servers' names (model.trained_parameters), checked against the checkpoint's names. An
        adapter has no full checkpoint to match: the servers check its names when it is pushed."""
        self._params = trained_parameters(self.module, self.cfg)
        if self.cfg.trainer.lora is None:
            check_names(self.weight_specs(), weights_dir)

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
        # The push's own bucket planner: here it only bounds how much is gathered at once (its 64-byte
        # alignment padding just makes a bucket close a little earlier).
        for bucket in plan_buckets(weight_metas(specs), bucket_bytes):
            indices = [slot.index for slot in bucket.slots]
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
