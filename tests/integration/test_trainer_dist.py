"""Two trainer ranks over gloo, started with the real `accelerate launch` command (trainer_command):
DDP, DeepSpeed ZeRO-3 and FSDP2 fit a fixed batch and agree with a single-rank reference computed in this
process; DDP replicas stay bit-identical; ZeRO-3 and FSDP push exactly the parameters they gather.

Pushes go to a CaptureServer (tests/support/capture.py: the server with its capture backend): it
has no engine but joins the weight group as a real gloo peer with the contract's own receive code, so the bytes it holds are the
bytes the trainer broadcast. Training data is written straight to the partitions (packed with the real
preprocessing functions), so these tests do not depend on the preprocessor process.
"""

from __future__ import annotations

import pytest
import torch
from support.capture import CaptureServer
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

from pipeline_rl.trainer import checkpoint

pytestmark = pytest.mark.slow

STEPS = 4


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max(float((a[k].detach() - b[k].detach()).abs().max()) for k in a)


def _fit_fixed_batch(cfg, tiny_model, tmp_path):
    batches = fixed_batches(cfg, make_groups(tiny_model, 2, seed=5), STEPS)
    write_batches(cfg, batches)
    code, output = run_trainer(cfg, tmp_path / "trainer.log")
    assert code == 0, output[-4000:]
    metrics = read_jsonl(cfg.run_path / "trainer_metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["batch_id"] for m in metrics] == [f"fixed:{k}" for k in range(STEPS)]
    # PPO's clipped surrogate is a true objective on a fixed batch (GRPO's truncated-IS loss value is not:
    # its importance weight is a constant of the gradient but grows with the ratio).
    losses = [m["loss"] for m in metrics]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)) and losses[-1] < losses[0] - 0.05, (
        losses
    )
    assert metrics[0]["logprob_mismatch_max"] < 1e-4  # step 1 runs the sampler's weights
    return batches, metrics


def test_ddp_two_ranks_fit_a_fixed_batch_and_replicas_stay_identical(redis_server, tiny_model, tmp_path):
    cfg = run_config(
        tmp_path,
        redis_server.url,
        tiny_model,
        "ppo",
        num_processes=2,
        max_steps=STEPS,
        checkpoint_every=2,
        learning_rate=3e-4,
    )
    batches, _ = _fit_fixed_batch(cfg, tiny_model, tmp_path)

    root = checkpoint.checkpoints_root(cfg.run_dir)
    for step in (2, STEPS):
        state = checkpoint.read_state(root / f"step_{step:08d}")
        assert state.step == step and state.world_size == 2
        assert len(state.replica_checksums) == 2 and state.replica_checksums[0] == state.replica_checksums[1]
    # Two ranks (world-size loss scaling, global counts) == one rank on the whole batch.
    trained = load_weights(root / f"step_{STEPS:08d}" / "model")
    assert _max_diff(trained, reference_training(cfg, batches)) < 1e-5


@pytest.mark.parametrize("strategy", ["deepspeed_zero3", "fsdp"])
def test_sharded_two_ranks_push_exactly_the_parameters_they_gather(
    redis_server, tiny_model, tmp_path, strategy
):
    with CaptureServer(tiny_model) as capture:
        cfg = run_config(
            tmp_path,
            redis_server.url,
            tiny_model,
            "ppo",
            strategy=strategy,
            num_processes=2,
            max_steps=STEPS,
            learning_rate=3e-4,
        )
        cfg.inference.urls = [capture.url]
        batches, metrics = _fit_fixed_batch(cfg, tiny_model, tmp_path)
        assert [h["version"] for h in capture.history] == list(range(1, STEPS + 1))
        pushed = dict(capture.received)
    # With push_settle=background (the default here) a step's line describes the newest push that had
    # settled by then (push_version): the step's own, or the one before, which its push waited for; the
    # first line may come before any. What the step's own push held the trainer (weight_push_s) is the
    # request and the transfer, not the apply.
    assert all(m["weight_push_s"] > 0 for m in metrics)
    settled = [m for m in metrics if "push_version" in m]
    assert len(settled) >= STEPS - 1 and settled[0]["step"] <= 2, metrics
    assert all(m["step"] - 1 <= m["push_version"] <= m["step"] for m in settled)
    assert all(m["push_bytes"] > 0 and m["push_broadcast_s"] > 0 for m in settled)
    # The push's parts are each measured, and none exceeds the whole push (request to last result).
    parts = ("push_request_s", "push_broadcast_s", "push_max_receive_s", "push_max_apply_s")
    assert all(0 <= m[k] <= m["push_total_s"] for m in settled for k in parts)

    final = checkpoint.latest_checkpoint(cfg.run_dir)
    assert _max_diff(pushed, load_weights(final / "model")) == 0.0  # the checkpoint gathers the same way
    if strategy == "deepspeed_zero3":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # Independent of our gather: DeepSpeed's own consolidation of both ranks' fp32 master partitions.
        masters = get_fp32_state_dict_from_zero_checkpoint(str(final / "optimizer"), tag="zero")
        assert _max_diff(pushed, {k: masters[k] for k in pushed}) == 0.0
    # And the same training on one rank in this process (sharded reductions sum in another order).
    assert _max_diff(pushed, reference_training(cfg, batches)) < 1e-4
