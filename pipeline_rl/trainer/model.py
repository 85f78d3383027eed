"""The trainer's model helpers, shared by every strategy and the driver loop.

Loading the Hugging Face model (float32 master weights), the LR schedule, the weight list the servers
hold (`WeightSpec`, and the same list as wire metadata: `weight_metas`), the check that our names match
the checkpoint the servers validate against, and a replica checksum.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch

from inference_shim.checkpoint_table import checkpoint_tensor_table
from inference_shim.protocol import TensorMeta
from pipeline_rl.config import TrainerConfig

# (HF checkpoint name, full shape, dtype) of every weight the servers hold, in push order.
WeightSpec = tuple[str, list[int], torch.dtype]


def load_hf_model(
    path: str | Path, device: torch.device, gradient_checkpointing: bool = False
) -> torch.nn.Module:
    """The causal LM in float32 (the trainer's master weights), SDPA attention, in train mode; with
    gradient_checkpointing, each block's activations are recomputed in the backward pass (the
    non-reentrant variant, which works under DDP, ZeRO and FSDP and with frozen inputs)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device).train()


def lr_lambda(tcfg: TrainerConfig) -> Callable[[int], float]:
    """Linear warmup over trainer.warmup_steps, then constant."""
    warmup = tcfg.warmup_steps
    return lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0


def weight_metas(specs: list[WeightSpec]) -> list[TensorMeta]:
    """The weights as the contract's TensorMeta, in the trainer's dtype (the push may cast later)."""
    return [TensorMeta(name=n, dtype=str(d).removeprefix("torch."), shape=s) for n, s, d in specs]


def check_names(specs: list[WeightSpec], model_path: str | Path) -> None:
    """Our weight names must be exactly the checkpoint's (the servers validate every update against it)."""
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


def params_checksum(module: torch.nn.Module) -> str:
    """SHA-256 over every parameter's name and bytes: equal on every rank iff the replicas are identical."""
    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
