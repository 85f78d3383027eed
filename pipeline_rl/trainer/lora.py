"""LoRA in the trainer: the one place that uses peft (imported inside the functions, so full fine-tuning
never imports it).

    from pipeline_rl.trainer import lora
    model = lora.wrap(base_model, cfg.trainer.lora, seed=cfg.trainer.seed)  # fresh: B = 0, model == base
    model = lora.wrap(base_model, cfg.trainer.lora, adapter_dir)             # resume a saved adapter
    params = lora.adapter_parameters(model)       # [(wire name, trainable parameter)], push/checkpoint order
    lora.save_adapter(model, tensors, out_dir, base_model_path)   # a standard peft adapter directory

Names. A peft parameter is called e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.default
.weight`; peft's adapter_model.safetensors drops the adapter name segment (`.default`). The trainer uses
the file's names everywhere outside the module: they are the checkpoint's tensor names, the wire names of
the adapter push and the names the servers check an update against.

Every rank builds the same fresh adapter: peft draws A (kaiming-uniform) from torch's CPU generator, and
wrap() seeds a forked copy of it with `seed`, so the draw depends on nothing that ran before (sharded
strategies keep each rank's own slice of what it built, so the copies must agree).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipeline_rl.config import LoraConfig

if TYPE_CHECKING:
    from peft import PeftModel

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_NAME = "default"  # peft's name for the one adapter the trainer trains


def peft_config(lora: LoraConfig):
    """The peft LoraConfig for `lora` (a causal LM, no bias, peft's default initialization)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        task_type="CAUSAL_LM",
        r=lora.rank,
        # An integral alpha is written as an int: some loaders read lora_alpha as one.
        lora_alpha=int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
    )


def wrap(
    model: torch.nn.Module, lora: LoraConfig, adapter_dir: Path | None = None, *, seed: int = 0
) -> PeftModel:
    """`model` (frozen) with a trainable LoRA adapter: a fresh one (B = 0: the same function as `model`),
    or the one saved in `adapter_dir` (resume). Call before any DDP / DeepSpeed / FSDP wrapping."""
    from peft import PeftModel, get_peft_model

    if adapter_dir is not None:
        check_adapter(adapter_dir, lora)
        return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        return get_peft_model(model, peft_config(lora))


def wire_name(parameter_name: str) -> str:
    """The name peft writes in adapter_model.safetensors for a parameter: without the adapter segment."""
    return ".".join(part for part in parameter_name.split(".") if part != ADAPTER_NAME)


def adapter_parameters(peft_model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable adapter parameters under their file / wire names, in the module's order."""
    params = [(wire_name(n), p) for n, p in peft_model.named_parameters() if p.requires_grad]
    if not params:
        raise RuntimeError("the model has no trainable adapter parameter (is it wrapped by lora.wrap?)")
    return params


def save_adapter(
    peft_model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    out_dir: str | Path,
    base_model_path: str | Path,
) -> Path:
    """A peft adapter directory: adapter_config.json (base_model_name_or_path = base_model_path) and
    adapter_model.safetensors holding `tensors` (wire names, as adapter_parameters gives them). Loadable
    with PeftModel.from_pretrained and servable with vLLM's --lora-modules."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _unwrap(peft_model).peft_config[ADAPTER_NAME]
    saved = copy.deepcopy(config)  # the live config keeps inference_mode=False
    saved.base_model_name_or_path = str(base_model_path)
    saved.inference_mode = True  # as peft's own save_pretrained writes it
    saved.save_pretrained(str(out))
    contiguous = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    save_file(contiguous, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out


def is_adapter_dir(path: str | Path) -> bool:
    """Whether `path` is a peft adapter directory (it has adapter_config.json)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_spec(lora: LoraConfig) -> dict:
    """What a weight-update request says about the adapter: rank, alpha, target modules."""
    return {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules)}


def saved_spec(adapter_dir: str | Path) -> dict:
    """adapter_spec of the adapter saved in `adapter_dir` (read from its adapter_config.json)."""
    config = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    targets = config["target_modules"]
    return {
        "rank": config["r"],
        "alpha": float(config["lora_alpha"]),
        "target_modules": [targets] if isinstance(targets, str) else list(targets),
    }


def check_adapter(adapter_dir: str | Path, lora: LoraConfig) -> None:
    """The adapter in `adapter_dir` must be the one `lora` describes (rank, alpha, targets)."""
    saved, wanted = saved_spec(adapter_dir), adapter_spec(lora)
    same_targets = sorted(saved["target_modules"]) == sorted(wanted["target_modules"])
    if saved["rank"] != wanted["rank"] or saved["alpha"] != wanted["alpha"] or not same_targets:
        raise ValueError(
            f"the adapter in {adapter_dir} has {saved}, but trainer.lora asks for {wanted}: resume with the "
            "trainer.lora settings the checkpoint was written with"
        )


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The PeftModel inside DDP / DeepSpeed wrappers."""
    while not hasattr(model, "peft_config") and hasattr(model, "module"):
        model = model.module
    return model
