"""trainer.lora on two ranks over gloo, on every strategy (DDP, ZeRO-2, ZeRO-3, FSDP2), started with the
real `accelerate launch` command: the trainer fits only the peft adapter, its checkpoints hold the
adapter, and a trainer resumed from a checkpoint takes exactly the step an uninterrupted one took.

Each test launches the trainer twice: two steps with a checkpoint after each, then (the step-2
checkpoint moved aside) a resume from step 1 that redoes step 2. With no inference.urls the trainer
pushes nothing (WeightPublisher.enabled is false); training data is written straight to the partitions.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/integration/test_trainer_lora.py
"""

from __future__ import annotations

import shutil

import pytest
import torch
from support.training import (
    fixed_batches,
    load_weights,
    make_groups,
    read_jsonl,
    reference_training,
    run_config,
    run_trainer,
    write_batches,
)

from pipeline_rl.trainer import checkpoint, lora
from pipeline_rl.trainer.model import load_policy, params_checksum, trained_parameters

pytestmark = pytest.mark.slow

STEPS = 2
LORA = {"rank": 4, "alpha": 8.0}
CPU = torch.device("cpu")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _bytes(directory) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp"])
def test_lora_trains_the_adapter_and_a_resumed_run_takes_the_same_step(
    redis_server, tiny_model, tmp_path, strategy
):
    cfg = run_config(
        tmp_path,
        redis_server.url,
        tiny_model,
        "ppo",
        strategy=strategy,
        num_processes=2,
        max_steps=STEPS,
        checkpoint_every=1,
        learning_rate=1e-3,
        lora=LORA,
    )
    batches = fixed_batches(cfg, make_groups(tiny_model, 2, seed=5), STEPS)
    write_batches(cfg, batches)
    code, output = run_trainer(cfg, tmp_path / "trainer1.log")
    assert code == 0, output[-4000:]
    root = checkpoint.checkpoints_root(cfg.run_dir)
    first = read_jsonl(cfg.run_path / "trainer_metrics.jsonl")
    assert [m["step"] for m in first] == [1, 2]
    assert first[0]["logprob_mismatch_max"] < 1e-4  # a fresh adapter is the sampler's (base) model

    # A checkpoint's model/ is a peft adapter directory; the base model is in none of its files.
    model_dir = root / f"step_{STEPS:08d}" / "model"
    assert lora.is_adapter_dir(model_dir) and not (model_dir / "config.json").exists()
    assert (model_dir / "tokenizer.json").exists()
    base_bytes = _bytes(tiny_model)
    assert _bytes(model_dir) + _bytes(model_dir.parent / "optimizer") < base_bytes
    uninterrupted = load_weights(model_dir)
    assert all(".lora_A." in k or ".lora_B." in k for k in uninterrupted)

    # Resume from step 1: step 2 again, with the restored adapter, optimizer state and schedule.
    shutil.move(root / f"step_{STEPS:08d}", tmp_path / "uninterrupted")
    cfg.trainer.resume = True
    code, output = run_trainer(cfg, tmp_path / "trainer2.log")
    assert code == 0, output[-4000:]
    assert "resuming from" in output and f"step_{1:08d}" in output
    second = read_jsonl(cfg.run_path / "trainer_metrics.jsonl")
    assert [m["step"] for m in second] == [1, 2]
    assert second[1]["loss"] == first[1]["loss"]  # step 2's forward: the restored adapter
    resumed = load_weights(model_dir)
    assert _max_diff(resumed, uninterrupted) == 0.0  # step 2's update: the restored optimizer state

    # The same two steps on one rank in this process (sharded reductions sum in another order).
    reference = reference_training(cfg, batches)
    assert _max_diff(resumed, reference) < 1e-5
    fresh = {n: p.detach() for n, p in trained_parameters(load_policy(cfg, cfg.model_path, CPU), cfg)}
    assert all(not torch.equal(resumed[k], fresh[k]) for k in fresh)  # every A and B moved
    if strategy == "ddp":
        # Every replica's every parameter: the original base weights, bit for bit, plus this adapter.
        state = checkpoint.read_state(root / f"step_{STEPS:08d}")
        expected = params_checksum(load_policy(cfg, model_dir, CPU))
        assert state.replica_checksums == [expected, expected]
