"""The trainer's model helpers, shared by every strategy and the driver loop.

Loading the Hugging Face model (float32 master weights) and the policy every strategy trains
(`load_policy`: the model, or with trainer.lora the base model with a peft adapter), the parameters a
strategy trains, pushes and checkpoints (`trained_parameters`), the LR schedule, the weight list the
servers hold (`WeightSpec`, and the same list as wire metadata: `weight_metas`), the check that our
names match the checkpoint the servers validate against, and a replica checksum.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch

from inference_shim.checkpoint_table import checkpoint_tensor_table
from inference_shim.protocol import TensorMeta
from pipeline_rl.config import RunConfig, TrainerConfig

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


def load_policy(cfg: RunConfig, weights_dir: str | Path, device: torch.device) -> torch.nn.Module:
    """The module a strategy trains (before any DDP / DeepSpeed / FSDP wrapping), from `weights_dir`:
    cfg.model_path at a fresh start, a checkpoint's model/ on resume.

    Without trainer.lora: the Hugging Face model in `weights_dir`. With it: the base model from
    cfg.model_path with a peft adapter, fresh at a fresh start, or the one in `weights_dir` when that is
    an adapter directory (a checkpoint written with trainer.lora). A checkpoint written with the other
    setting of trainer.lora raises, naming both."""
    from pipeline_rl.trainer import lora  # imports no peft itself; its functions do

    t = cfg.trainer
    if lora.is_adapter_dir(cfg.model_path):
        raise ValueError(
            f"model_path={cfg.model_path} is a peft adapter directory: set model_path to the base model "
            "(its adapter_config.json names it in base_model_name_or_path)"
        )
    adapter = lora.is_adapter_dir(weights_dir)
    if t.lora is None:
        if adapter:
            raise ValueError(
                f"{weights_dir} holds a LoRA adapter ({lora.saved_spec(weights_dir)}) but trainer.lora is "
                "unset (full fine-tuning): resume with the trainer.lora settings the checkpoint was written with"
            )
        return load_hf_model(weights_dir, device, t.gradient_checkpointing)
    if not adapter and Path(weights_dir).resolve() != Path(cfg.model_path).resolve():
        raise ValueError(
            f"{weights_dir} holds full model weights (written without trainer.lora) but trainer.lora asks "
            f"for an adapter ({lora.adapter_spec(t.lora)}): resume without trainer.lora, or start a new run"
        )
    base = load_hf_model(cfg.model_path, device, t.gradient_checkpointing)
    return lora.wrap(base, t.lora, Path(weights_dir) if adapter else None, seed=t.seed)


def trained_parameters(module: torch.nn.Module, cfg: RunConfig) -> list[tuple[str, torch.nn.Parameter]]:
    """What the optimizer steps, the push sends and a checkpoint holds, in that order, under the names
    the servers know: every parameter (HF names), or with trainer.lora the adapter's (peft file names)."""
    if cfg.trainer.lora is None:
        return list(module.named_parameters())
    from pipeline_rl.trainer import lora

    return lora.adapter_parameters(module)


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
