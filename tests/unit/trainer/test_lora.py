"""trainer.lora (pipeline_rl/trainer/lora.py and its use by the strategies and checkpoints), single rank,
in-process, on the tiny model: the adapter's names are peft's file names, a fresh adapter is the base
model, a saved adapter loads back with peft, a mismatched resume fails naming both settings, and one
DDP rank trains only the adapter and resumes from its checkpoint exactly. The two-rank runs of every
strategy: tests/integration/test_trainer_lora.py.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/unit/trainer/test_lora.py
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from support.training import hf_model, one_rank_package

from pipeline_rl.config import LoraConfig, RunConfig
from pipeline_rl.trainer import checkpoint, lora
from pipeline_rl.trainer.checkpoint import TrainerState
from pipeline_rl.trainer.model import load_policy, trained_parameters
from pipeline_rl.trainer.step import train_step
from pipeline_rl.trainer.strategies.ddp import DDPStrategy

CPU = torch.device("cpu")
IDS = torch.tensor([[1, 17, 40, 33, 8, 61, 12, 5]])


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _adapter(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in lora.adapter_parameters(model)}


def _with_lora(cfg: RunConfig, **settings) -> RunConfig:
    trainer = cfg.trainer.model_copy(update={"lora": LoraConfig(rank=4, alpha=8.0), **settings})
    return cfg.model_copy(update={"trainer": trainer})


def test_adapter_parameters_are_named_as_peft_saves_them(tiny_model, tmp_path):
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    model = lora.wrap(hf_model(tiny_model), LoraConfig(rank=4))
    params = lora.adapter_parameters(model)
    names = [name for name, _ in params]
    assert names == list(get_peft_model_state_dict(model))
    model.save_pretrained(tmp_path / "peft")
    saved = load_file(str(tmp_path / "peft" / lora.ADAPTER_WEIGHTS))
    assert {n: list(p.shape) for n, p in params} == {n: list(t.shape) for n, t in saved.items()}
    # Only the adapter trains: every targeted projection of every layer, A and B.
    assert all(p.requires_grad for _, p in params)
    assert len(names) == 2 * 7 * 2  # 2 layers x 7 default targets x (A, B)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


def test_adapter_parameters_are_the_tensors_the_servers_expect(tiny_model):
    """The adapter push is validated against the servers' own table (inference_shim adapter_table)."""
    from inference_shim.backends.common import adapter_table
    from inference_shim.checkpoint_table import checkpoint_tensor_table
    from inference_shim.protocol import AdapterSpec

    setting = LoraConfig(rank=4, target_modules=["q_proj", "k_proj", "down_proj"])
    params = lora.adapter_parameters(lora.wrap(hf_model(tiny_model), setting))
    expected = adapter_table(checkpoint_tensor_table(tiny_model), AdapterSpec(**lora.adapter_spec(setting)))
    assert {n: list(p.shape) for n, p in params} == {n: shape for n, (_, shape) in expected.items()}


def test_a_fresh_adapter_gives_the_base_models_logits_exactly(tiny_model):
    base = _logits(hf_model(tiny_model))
    model = lora.wrap(hf_model(tiny_model), LoraConfig(rank=4))
    assert torch.equal(_logits(model), base)  # B = 0: version 0 is the base model


def test_a_fresh_adapter_depends_on_the_seed_only(tiny_model):
    torch.manual_seed(1)
    first = _adapter(lora.wrap(hf_model(tiny_model), LoraConfig(rank=4), seed=3))
    torch.rand(1000)  # another rank may have drawn something else before
    state = torch.random.get_rng_state()
    again = _adapter(lora.wrap(hf_model(tiny_model), LoraConfig(rank=4), seed=3))
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's generator is left alone
    assert all(torch.equal(first[k], again[k]) for k in first)
    other = _adapter(lora.wrap(hf_model(tiny_model), LoraConfig(rank=4), seed=4))
    assert all(torch.equal(first[k], other[k]) == (".lora_B." in k) for k in first)  # B = 0 in both


def test_save_adapter_writes_a_peft_directory_that_loads_back_with_the_same_logits(tiny_model, tmp_path):
    from peft import PeftModel

    model = lora.wrap(
        hf_model(tiny_model), LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():
        for _, p in lora.adapter_parameters(model):
            p.add_(torch.randn_like(p) * 0.1)  # a trained adapter: B no longer zero
    out = lora.save_adapter(model, _adapter(model), tmp_path / "adapter", tiny_model)
    assert lora.is_adapter_dir(out) and not lora.is_adapter_dir(tiny_model)
    config = json.loads((out / lora.ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == str(tiny_model)
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (
        4,
        8,
        ["q_proj", "v_proj"],
    )
    assert model.peft_config[lora.ADAPTER_NAME].inference_mode is False  # the live model still trains

    loaded = PeftModel.from_pretrained(hf_model(tiny_model), str(out))
    assert torch.equal(_logits(loaded), _logits(model))
    assert not torch.equal(_logits(loaded), _logits(hf_model(tiny_model)))


def test_adapter_spec_and_a_resume_with_other_lora_settings_fails_naming_both(tiny_model, tmp_path):
    setting = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    assert lora.adapter_spec(setting) == {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
    model = lora.wrap(hf_model(tiny_model), setting)
    adapter = lora.save_adapter(model, _adapter(model), tmp_path / "adapter", tiny_model)
    lora.check_adapter(adapter, LoraConfig(rank=4, alpha=8.0, target_modules=["v_proj", "q_proj"]))

    with pytest.raises(ValueError, match="'rank': 4.*trainer.lora asks for.*'rank': 8"):
        lora.check_adapter(adapter, LoraConfig(rank=8, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match="'o_proj'"):
        lora.check_adapter(adapter, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "o_proj"]))

    full = RunConfig(run_dir=str(tmp_path / "run"), model_path=str(tiny_model))
    with pytest.raises(ValueError, match="holds a LoRA adapter .*'rank': 4.* trainer.lora is unset"):
        load_policy(full, adapter, CPU)
    hf_model(tiny_model).save_pretrained(tmp_path / "full")  # a full fine-tuning checkpoint's model/
    with pytest.raises(ValueError, match="holds full model weights .*'rank': 4"):
        load_policy(_with_lora(full), tmp_path / "full", CPU)
    on_adapter = full.model_copy(update={"model_path": str(adapter)})
    with pytest.raises(ValueError, match="is a peft adapter directory: set model_path to the base model"):
        load_policy(_with_lora(on_adapter), adapter, CPU)


def test_one_rank_trains_only_the_adapter_and_resumes_from_its_checkpoint_exactly(tiny_model, tmp_path):
    cfg, comm, package = one_rank_package(tiny_model, tmp_path, groups=1, seed=1)
    cfg = _with_lora(cfg, gradient_checkpointing=True)
    strategy = DDPStrategy(cfg, comm, cfg.model_path)
    names = [name for name, _ in trained_parameters(strategy.module, cfg)]
    assert [name for name, _, _ in strategy.weight_specs()] == names
    original = {n: p.detach().clone() for n, p in strategy.module.named_parameters()}
    for step in (1, 2):
        train_step(strategy, package, cfg.algo, step=step, temperature=1.0, comm=comm)
        if step == 1:
            first_step = _adapter(strategy.module)
    trainable = {n for n, p in strategy.module.named_parameters() if p.requires_grad}
    assert {n for n, p in strategy.module.named_parameters() if not torch.equal(p, original[n])} == trainable

    # Gradient checkpointing works under peft: without it the step gives the same adapter.
    plain = DDPStrategy(_with_lora(cfg, gradient_checkpointing=False), comm, cfg.model_path)
    train_step(plain, package, cfg.algo, step=1, temperature=1.0, comm=comm)
    assert all(torch.allclose(first_step[k], v, atol=1e-7) for k, v in _adapter(plain.module).items())

    path = checkpoint.save(
        cfg.run_dir,
        TrainerState(step=2, version=2),
        strategy,
        {"position": "p2"},
        comm,
        model_path=cfg.model_path,
        bucket_bytes=1 << 20,
        keep=2,
    )
    model_dir = path / "model"
    assert lora.is_adapter_dir(model_dir) and (model_dir / "tokenizer.json").exists()
    assert not (model_dir / "config.json").exists()  # the directory must not pass for a full model
    snapshot = checkpoint.save_snapshot(
        cfg.run_dir, 2, strategy, comm, model_path=cfg.model_path, bucket_bytes=1 << 20
    )
    assert lora.is_adapter_dir(snapshot)

    resumed = DDPStrategy(cfg, comm, model_dir)
    resumed.load_optimizer(path / "optimizer")
    assert all(
        torch.equal(a, b)
        for a, b in zip(_adapter(resumed.module).values(), _adapter(strategy.module).values(), strict=True)
    )
    for s in (strategy, resumed):
        train_step(s, package, cfg.algo, step=3, temperature=1.0, comm=comm)
    after, expected = _adapter(resumed.module), _adapter(strategy.module)
    assert all(torch.equal(after[k], expected[k]) for k in expected)  # optimizer and schedule restored
    base = {n: p for n, p in resumed.module.named_parameters() if not p.requires_grad}
    assert all(torch.equal(p, original[n]) for n, p in base.items())


def test_peft_is_imported_only_inside_lora_functions():
    """Full fine-tuning never imports peft: only pipeline_rl/trainer/lora.py names it, inside functions
    (and for type checking)."""
    trainer = Path(lora.__file__).parent
    for path in trainer.rglob("*.py"):
        tree = ast.parse(path.read_text())
        top_level = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        everywhere = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
        for node in everywhere:
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if any(n == "peft" or n.startswith("peft.") for n in names):
                assert path.name == "lora.py", f"{path} imports peft"
                assert node not in top_level, f"{path}:{node.lineno} imports peft at module level"
