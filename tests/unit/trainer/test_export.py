"""`pipeline-rl export`: a LoRA checkpoint merged into its base computes what base + adapter computed,
the adapter comes out as peft wrote it, a full fine-tuning checkpoint is copied, and every bad input is
refused with one line. A tiny real model and a real peft adapter on CPU; the run directories are laid
out by hand as the trainer lays them out (pipeline_rl/trainer/checkpoint.py), with manifests that verify.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/unit/trainer/test_export.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pipeline_rl.cli import main as cli_main
from pipeline_rl.config import RunConfig
from pipeline_rl.export import ExportError, export
from pipeline_rl.trainer import checkpoint

peft = pytest.importorskip("peft")

TOKENS = torch.tensor([[3, 17, 42, 8, 60, 5, 29, 77, 11]])


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def _publish(run: Path, step: int, model_src: Path) -> Path:
    """RUN/checkpoints/step_<step> holding a copy of model_src as model/, with what verify() reads."""
    ckpt = checkpoint.checkpoints_root(run) / f"step_{step:08d}"
    shutil.copytree(model_src, ckpt / "model")
    (ckpt / checkpoint.STATE).write_text(json.dumps(asdict(checkpoint.TrainerState(step=step))))
    (ckpt / "feed_rank0.json").write_text("{}")
    files = {p.relative_to(ckpt).as_posix(): p.stat().st_size for p in ckpt.rglob("*") if p.is_file()}
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps({"step": step, "files": files}))
    return ckpt


def _new_run(path: Path, model_path: Path | str) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(
        RunConfig(run_dir=str(path), model_path=str(model_path)).model_dump_json()
    )
    return path


def _keys(path: Path) -> set[str]:
    with safe_open(path, framework="pt") as f:
        return set(f.keys())


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """A peft adapter on the tiny model with non-zero B (as a trainer saves it: the base's non-weight
    files copied next to it), and the logits of base + adapter."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype="auto")
    base_logits = _logits(base)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    out = tmp_path_factory.mktemp("adapter") / "adapter"
    model.save_pretrained(out)
    checkpoint.copy_tokenizer_files(tiny_model, out)
    logits = _logits(model)
    assert (logits - base_logits).abs().max() > 1e-2  # the adapter changes the model: the checks bite
    return out, logits


@pytest.fixture(scope="module")
def lora_run(tiny_model, adapter, tmp_path_factory) -> Path:
    """A run with two LoRA checkpoints (step 2 the newest), an unpublished step 3, and snapshot v2."""
    run = _new_run(tmp_path_factory.mktemp("runs") / "lora", tiny_model)
    _publish(run, 1, adapter[0])
    _publish(run, 2, adapter[0])
    (checkpoint.checkpoints_root(run) / "step_00000003").mkdir()  # no manifest: a crashed write
    shutil.copytree(adapter[0], run / "snapshots" / "v00000002")
    return run


def test_merged_export_computes_what_base_plus_adapter_computed(lora_run, adapter, tmp_path):
    out = tmp_path / "merged"
    out.mkdir()  # an empty OUT is taken
    result = export(lora_run, out, merged=True)
    assert result.kind == "merged" and result.model_dir == lora_run / "checkpoints/step_00000002/model"
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.dtype == torch.float32
    torch.testing.assert_close(_logits(merged), adapter[1], atol=1e-5, rtol=0)
    keys = _keys(out / "model.safetensors")
    assert result.tensors == len(keys) and not [k for k in keys if "lora" in k]
    assert result.bytes == sum(p.stat().st_size for p in out.iterdir())
    assert not (out / "adapter_config.json").exists()  # transformers would load OUT as an adapter
    assert AutoTokenizer.from_pretrained(out).encode("1+2=") == AutoTokenizer.from_pretrained(
        adapter[0]
    ).encode("1+2=")
    assert not out.with_name("merged.tmp").exists()


def test_adapter_export_loads_with_peft_on_the_base(tiny_model, lora_run, adapter, tmp_path):
    result = export(lora_run / "checkpoints" / "step_00000001", tmp_path / "a", merged=False)
    out = result.out
    assert result.kind == "adapter"
    assert _keys(out / "adapter_model.safetensors") == _keys(adapter[0] / "adapter_model.safetensors")
    assert not (out / "config.json").exists()  # an adapter, not a model
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    torch.testing.assert_close(
        _logits(peft.PeftModel.from_pretrained(base, out)), adapter[1], atol=1e-5, rtol=0
    )
    AutoTokenizer.from_pretrained(out)


def test_run_checkpoint_and_snapshot_arguments_name_the_right_model(lora_run, adapter, tmp_path):
    by_run = export(lora_run, tmp_path / "run", merged=False)
    assert by_run.model_dir == lora_run / "checkpoints" / "step_00000002" / "model"  # step 3 skipped
    by_step = export(lora_run / "checkpoints" / "step_00000001", tmp_path / "step", merged=False)
    assert by_step.model_dir == lora_run / "checkpoints" / "step_00000001" / "model"
    snapshot = lora_run / "snapshots" / "v00000002"
    by_snapshot = export(snapshot, tmp_path / "snap", merged=True)
    assert by_snapshot.model_dir == snapshot
    merged = AutoModelForCausalLM.from_pretrained(by_snapshot.out)
    torch.testing.assert_close(_logits(merged), adapter[1], atol=1e-5, rtol=0)
    with pytest.raises(ExportError, match="does not verify: no manifest.json"):
        export(lora_run / "checkpoints" / "step_00000003", tmp_path / "bad", merged=False)


def test_full_fine_tuning_is_copied_by_merged_and_refused_by_adapter(tiny_model, tmp_path):
    trained = tmp_path / "trained"
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01)
    model.save_pretrained(trained)
    checkpoint.copy_tokenizer_files(tiny_model, trained)
    run = _new_run(tmp_path / "run", tiny_model)
    ckpt = _publish(run, 4, trained)

    result = export(run, tmp_path / "out", merged=True, base=tmp_path / "ignored")
    assert result.kind == "copied" and result.base is None
    ours, theirs = load_file(result.out / "model.safetensors"), load_file(trained / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert sorted(p.name for p in result.out.iterdir()) == sorted(p.name for p in (ckpt / "model").iterdir())
    with pytest.raises(ExportError, match=r"this run trained every weight \(no trainer.lora\); use --merged"):
        export(run, tmp_path / "adapter", merged=False)
    assert not (tmp_path / "adapter").exists() and not (tmp_path / "adapter.tmp").exists()


def test_a_base_that_is_not_here_is_refused_naming_it_and_base_option(tiny_model, adapter, tmp_path):
    moved = tmp_path / "moved-adapter"
    shutil.copytree(adapter[0], moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "/elsewhere/base-model"
    (moved / "adapter_config.json").write_text(json.dumps(config))
    run = _new_run(tmp_path / "run", "/elsewhere/run-model")
    _publish(run, 1, moved)

    with pytest.raises(ExportError) as refused:
        export(run, tmp_path / "out", merged=True)
    message = str(refused.value)
    assert "/elsewhere/base-model" in message and "/elsewhere/run-model" in message
    assert "pass --base DIR" in message
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
    with pytest.raises(ExportError, match="--base /nowhere: no model there"):
        export(run, tmp_path / "out", merged=True, base="/nowhere")

    result = export(run, tmp_path / "out", merged=True, base=tiny_model)
    merged = AutoModelForCausalLM.from_pretrained(result.out)
    torch.testing.assert_close(_logits(merged), adapter[1], atol=1e-5, rtol=0)
    # --adapter with --base: the written adapter names the base given.
    written = export(run, tmp_path / "adapter", merged=False, base=tiny_model).out
    assert json.loads((written / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        tiny_model.resolve()
    )


def test_an_adapter_of_another_model_is_refused(tiny_model, lora_run, tmp_path):
    config = AutoConfig.from_pretrained(tiny_model)
    config.num_hidden_layers, config.layer_types = 1, config.layer_types[:1]
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "one-layer")
    with pytest.raises(ExportError, match="does not fit the base model.*pass --base DIR"):
        export(lora_run, tmp_path / "out", merged=True, base=tmp_path / "one-layer")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_bad_sources_and_outputs_are_refused(tiny_model, lora_run, tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists and is not an empty directory"):
        export(lora_run, taken, merged=True)
    assert (taken / "keep.txt").read_text() == "mine"
    empty_run = _new_run(tmp_path / "empty-run", tiny_model)
    (empty_run / "checkpoints").mkdir()
    with pytest.raises(ExportError, match="has no checkpoint yet"):
        export(empty_run, tmp_path / "out", merged=True)
    with pytest.raises(ExportError, match="is not a directory"):
        export(tmp_path / "missing", tmp_path / "out", merged=True)
    (tmp_path / "stuff").mkdir()
    with pytest.raises(ExportError, match="is neither a run directory"):
        export(tmp_path / "stuff", tmp_path / "out", merged=True)


def test_cli_writes_and_refuses_with_one_line(lora_run, tmp_path, capsys):
    out = tmp_path / "merged"
    cli_main(["export", str(lora_run), "--merged", str(out)])
    printed = capsys.readouterr().out.strip()
    assert printed.startswith(f"wrote {out}: ") and "tensors" in printed and "bytes" in printed

    with pytest.raises(SystemExit) as exited:
        cli_main(["export", str(lora_run)])  # neither --merged nor --adapter: argparse's usage error
    assert exited.value.code == 2
    with pytest.raises(SystemExit) as exited:
        cli_main(["export", str(lora_run), "--merged", "x", "--adapter", "y"])
    assert exited.value.code == 2

    refused = subprocess.run(
        [sys.executable, "-m", "pipeline_rl.cli", "export", str(lora_run), "--adapter", str(out)],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines() == [
        f"pipeline-rl export: {out} already exists and is not an empty directory: name a new OUT"
    ]
