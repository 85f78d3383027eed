"""The trainer's step in this process, on the tiny model: packed and shared-prefix forwards against
separate ones, gradient accumulation with global counts, bf16 autocast, the KL to the initial policy,
samples dropped at train time for their lag, the ranks' agreement on a batch, the DeepSpeed config,
checkpoints and the trainer's own command line, and a server that cannot be reached."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
from support.training import (
    ATTEMPTS,
    CPU,
    TrainerWrapper,
    build_packages,
    hf_model,
    make_groups,
    one_rank_package,
    read_jsonl,
    run_config,
    with_versions,
)

from pipeline_rl.algo_config import AlgoConfig
from pipeline_rl.launch.trainer_cmd import trainer_command
from pipeline_rl.paths import CONF_DIR
from pipeline_rl.preprocess.ops import group_to_training_samples
from pipeline_rl.trainer import checkpoint
from pipeline_rl.trainer.dist import Comm
from pipeline_rl.trainer.feed import _choose
from pipeline_rl.trainer.step import drop_stale, forward_logprobs, micro_batch_tensors, train_step


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prefix"])
def test_packed_micro_batch_logprobs_equal_separate_forwards(tiny_model, tmp_path, layout):
    cfg = run_config(tmp_path, "redis://unused:1/0", tiny_model)
    samples = [
        s for g in make_groups(tiny_model, 2, seed=0) for s in group_to_training_samples(g, cfg.preprocess)
    ]
    micro_batch = samples[:5]
    assert len({len(s.input_ids) for s in micro_batch}) > 1  # padded rows of different lengths
    assert micro_batch_tensors(micro_batch, CPU)["prefix_groups"].tolist() == [0, 0, 0, 0, 4]  # 2 prompts
    model = hf_model(tiny_model)
    with torch.no_grad():
        _, packed = forward_logprobs(model, micro_batch_tensors(micro_batch, CPU), 1.0, layout)
        separate = [
            forward_logprobs(model, micro_batch_tensors([s], CPU), 1.0, "packed")[1] for s in micro_batch
        ]
    # Packed row: sample k's tokens 1.. follow the one junction position, whose logprob is never trained.
    expected, offset = [], 0
    mask = micro_batch_tensors(micro_batch, CPU)["mask"]
    for s, lp in zip(micro_batch, separate, strict=True):
        n = len(s.input_ids)
        expected.append(packed[offset : offset + n - 1])
        assert torch.allclose(packed[offset : offset + n - 1], lp, atol=1e-5), "a sample saw its neighbour"
        offset += n
    assert not mask[[sum(len(s.input_ids) for s in micro_batch[: k + 1]) - 1 for k in range(4)]].any()
    # Sampler logprobs came from the same model: trainer and sampler agree on every trained token.
    old = micro_batch_tensors(micro_batch, CPU)["old_logprobs"]
    assert (packed - old)[mask].abs().max() < 1e-4
    # The trainer's model is wrapped (DDP, DeepSpeed: the HF model is `.module`): same result through one.
    with torch.no_grad():
        wrapped = forward_logprobs(TrainerWrapper(model), micro_batch_tensors(micro_batch, CPU), 1.0, layout)[
            1
        ]
    assert torch.equal(wrapped, packed)


def test_accumulated_micro_batches_give_the_gradient_of_one_big_batch(tiny_model, tmp_path):
    from pipeline_rl.trainer.strategies.ddp import DDPStrategy

    cfg = run_config(tmp_path, "redis://unused:1/0", tiny_model)
    samples = [
        s for g in make_groups(tiny_model, 2, seed=1) for s in group_to_training_samples(g, cfg.preprocess)
    ]
    [small] = build_packages(cfg, samples, "b")  # seq_length 64: several micro-batches
    one = small.model_copy(update={"micro_batches": [[s for mb in small.micro_batches for s in mb]]})
    assert len(small.micro_batches) >= 2
    comm = Comm(rank=0, world=1, local_rank=0, device=CPU)
    results, weights = [], []
    for package in (small, one):
        strategy = DDPStrategy(cfg, comm, tiny_model)
        # Plain SGD: Adam's first step is ~lr * sign(g) and would amplify float noise in near-zero grads.
        strategy.optimizer = torch.optim.SGD(strategy.module.parameters(), lr=1.0)
        strategy.scheduler = torch.optim.lr_scheduler.LambdaLR(strategy.optimizer, lambda _: 1.0)
        results.append(train_step(strategy, package, cfg.algo, step=1, temperature=1.0, comm=comm))
        weights.append({n: p.detach().clone() for n, p in strategy.module.named_parameters()})
    assert results[0].metrics["loss"] == pytest.approx(results[1].metrics["loss"], abs=1e-6)
    assert results[0].metrics["grad_norm"] == pytest.approx(results[1].metrics["grad_norm"], rel=1e-4)
    for name in weights[0]:
        assert torch.allclose(weights[0][name], weights[1][name], atol=1e-6), name
    m = results[0].metrics
    assert m["samples"] == 8 and m["trained_tokens"] == small.batch_tokens
    assert m["logprob_mismatch"] < 1e-4 and m["ess"] == pytest.approx(1.0, abs=1e-4)  # on-policy data
    assert (m["lag_min"], m["lag_max"]) == (0, 0) and 0 < m["entropy"] < 5
    assert sorted(results[0].sample_ids) == sorted(s.sample_id for s in samples)


def test_shared_prefix_layout_under_eager_attention_and_refused_without_custom_masks(tiny_model, tmp_path):
    """sdpa takes the layout's mask as booleans, eager as an additive one (same logprobs as padded); a
    kernel that takes no custom mask is refused by custom_mask_form, which the trainer calls at start."""
    from transformers import AutoModelForCausalLM

    from pipeline_rl.trainer.step import custom_mask_form

    cfg = run_config(tmp_path, "redis://unused:1/0", tiny_model)
    samples = [
        s for g in make_groups(tiny_model, 2, seed=6) for s in group_to_training_samples(g, cfg.preprocess)
    ]
    batch = micro_batch_tensors(samples, CPU)
    assert custom_mask_form(TrainerWrapper(hf_model(tiny_model))) == "bool"
    eager = AutoModelForCausalLM.from_pretrained(str(tiny_model), attn_implementation="eager").eval()
    assert custom_mask_form(eager) == "additive"
    with torch.no_grad():
        shared = forward_logprobs(eager, batch, 1.0, "shared_prefix")[1]
        padded = forward_logprobs(eager, batch, 1.0, "padded")[1]
    assert torch.allclose(shared[batch["mask"]], padded[batch["mask"]], atol=1e-5)
    eager.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="micro_batch_layout=padded"):
        custom_mask_form(eager)


def test_shared_prefix_layout_gives_the_padded_layouts_loss_and_gradient(tiny_model, tmp_path):
    """The prompt computed once per group and its gradient summed over the members: the same step as one
    row per sample."""
    from pipeline_rl.trainer.strategies.ddp import DDPStrategy

    cfg, comm, package = one_rank_package(tiny_model, tmp_path, groups=3, seed=5)
    results, weights = [], []
    for layout in ("padded", "shared_prefix"):
        strategy = DDPStrategy(cfg, comm, tiny_model)
        strategy.optimizer = torch.optim.SGD(strategy.module.parameters(), lr=1.0)
        strategy.scheduler = torch.optim.lr_scheduler.LambdaLR(strategy.optimizer, lambda _: 1.0)
        results.append(
            train_step(strategy, package, cfg.algo, step=1, temperature=1.0, comm=comm, layout=layout)
        )
        weights.append({n: p.detach().clone() for n, p in strategy.module.named_parameters()})
    assert results[0].metrics["loss"] == pytest.approx(results[1].metrics["loss"], abs=1e-6)
    assert results[0].metrics["grad_norm"] == pytest.approx(results[1].metrics["grad_norm"], rel=1e-4)
    for name in weights[0]:
        assert torch.allclose(weights[0][name], weights[1][name], atol=1e-6), name
    assert results[1].metrics["entropy"] == pytest.approx(results[0].metrics["entropy"], rel=1e-4)


def test_bf16_mixed_precision_keeps_float32_weights_and_grads_and_close_logprobs(tiny_model, tmp_path):
    """trainer.mixed_precision=bf16: the forward runs in bf16 (logprobs differ from float32 by bf16
    rounding, not more), while logprobs, weights, gradients and the step stay float32."""
    from pipeline_rl.trainer.strategies.ddp import DDPStrategy

    cfg = run_config(tmp_path, "redis://unused:1/0", tiny_model)
    samples = [
        s for g in make_groups(tiny_model, 2, seed=2) for s in group_to_training_samples(g, cfg.preprocess)
    ]
    batch = micro_batch_tensors(samples[:6], CPU)
    model = hf_model(tiny_model)
    with torch.no_grad():
        _, full = forward_logprobs(model, batch, 1.0, "padded", "no")
        _, half = forward_logprobs(model, batch, 1.0, "padded", "bf16")
    assert half.dtype == torch.float32
    gap = (full - half)[batch["mask"]].abs()
    assert 0 < gap.max() < 0.1, f"bf16 logprobs off by {gap.max():.4f}"  # really bf16, and close

    [package] = build_packages(cfg, samples, "b")
    comm = Comm(rank=0, world=1, local_rank=0, device=CPU)
    metrics = {}
    for precision in ("no", "bf16"):
        strategy = DDPStrategy(cfg, comm, tiny_model)
        before = {n: p.detach().clone() for n, p in strategy.module.named_parameters()}
        result = train_step(
            strategy, package, cfg.algo, step=1, temperature=1.0, comm=comm, mixed_precision=precision
        )
        metrics[precision] = result.metrics
        params = dict(strategy.module.named_parameters())
        assert {p.dtype for p in params.values()} == {torch.float32}
        assert {type(v) for state in strategy.optimizer.state.values() for v in state.values()} == {
            torch.Tensor
        }
        assert {
            v.dtype for st in strategy.optimizer.state.values() for k, v in st.items() if k != "step"
        } == {torch.float32}
        assert any(not torch.equal(before[n], p) for n, p in params.items()), "the step changed nothing"
    assert metrics["bf16"]["loss"] == pytest.approx(metrics["no"]["loss"], abs=0.05)
    assert metrics["bf16"]["grad_norm"] == pytest.approx(metrics["no"]["grad_norm"], rel=0.1)
    assert metrics["bf16"]["logprob_mismatch"] > metrics["no"]["logprob_mismatch"]  # the sampler was float32


def test_ranks_agree_on_the_first_batch_every_rank_holds():
    views = [
        {"batches": [("a", 2), ("b", 1), ("c", 3)]},  # rank 0's arrival order decides
        {"batches": [("c", 3), ("b", 1)]},  # "a" not here yet (torn or late)
    ]
    assert _choose(views) == "b"
    assert _choose([{"batches": [("a", 1)]}, {"batches": []}]) is None
    with pytest.raises(RuntimeError, match="micro-batches"):
        _choose([{"batches": [("a", 1)]}, {"batches": [("a", 2)]}])


def test_trainer_command_contract(tiny_model, tmp_path):
    for strategy in ("ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp"):
        cfg = run_config(tmp_path, "redis://unused:1/0", tiny_model, strategy=strategy, num_processes=2)
        argv = trainer_command(cfg, "/x/config.json")
        assert argv[:3] == [sys.executable, "-m", "pipeline_rl.launch.trainer_agent"]
        assert argv[argv.index("--config_file") + 1] == str(CONF_DIR / "accelerate" / f"{strategy}.yaml")
        assert argv[argv.index("--num_processes") + 1] == "2"
        assert 0 < int(argv[argv.index("--main_process_port") + 1]) < 65536
        assert argv[-5:] == ["-m", "pipeline_rl.cli", "train", "--config", "/x/config.json"]
        assert Path(argv[argv.index("--config_file") + 1]).is_file()
        if strategy.startswith("deepspeed"):
            assert Path(argv[argv.index("--deepspeed_config_file") + 1]).is_file()


def test_deepspeed_config_takes_zero_settings_from_json_and_the_rest_from_trainer(
    tiny_model, tmp_path, monkeypatch
):
    from pipeline_rl.trainer.strategies.zero import deepspeed_config

    cfg = run_config(
        tmp_path, "redis://unused:1/0", tiny_model, strategy="deepspeed_zero3", max_grad_norm=0.5
    )
    config = deepspeed_config(cfg, world=2, stage=3)
    assert config["zero_optimization"]["stage"] == 3
    assert (
        config["train_batch_size"],
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
    ) == (2, 1, 1)
    assert config["gradient_clipping"] == 0.5 and config["optimizer"]["params"]["torch_adam"] is True
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_batch_size": 8}))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(bad))
    with pytest.raises(ValueError, match="train_batch_size"):
        deepspeed_config(cfg, world=2, stage=3)


def test_checkpoints_are_atomic_pruned_and_restore_weights_and_optimizer(tiny_model, tmp_path):
    from pipeline_rl.trainer.strategies.ddp import DDPStrategy

    cfg, comm, package = one_rank_package(tiny_model, tmp_path, groups=2, seed=3)
    strategy = DDPStrategy(cfg, comm, tiny_model)
    for step in (1, 2, 3):
        train_step(strategy, package, cfg.algo, step=step, temperature=1.0, comm=comm)
        state = checkpoint.TrainerState(step=step, version=step, samples_consumed=8 * step)
        checkpoint.save(
            cfg.run_dir,
            state,
            strategy,
            {"position": f"p{step}"},
            comm,
            model_path=tiny_model,
            bucket_bytes=1 << 20,
            keep=2,
        )
    root = checkpoint.checkpoints_root(cfg.run_dir)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000003"]
    (root / "step_00000009.tmp").mkdir()  # a crash in the middle of writing step 9
    latest = checkpoint.latest_checkpoint(cfg.run_dir)
    assert latest.name == "step_00000003" and checkpoint.read_state(latest).samples_consumed == 24
    assert checkpoint.read_feed_state(latest, 0) == {"position": "p3"}
    assert (latest / "model" / "tokenizer.json").is_file() and (latest / "model" / "config.json").is_file()

    restored = DDPStrategy(cfg, comm, latest / "model")
    restored.load_optimizer(latest / "optimizer")
    for (name, a), (_, b) in zip(
        strategy.module.named_parameters(), restored.module.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    # Same optimizer state: one more identical step keeps them identical.
    train_step(strategy, package, cfg.algo, step=4, temperature=1.0, comm=comm)
    train_step(restored, package, cfg.algo, step=4, temperature=1.0, comm=comm)
    assert all(
        torch.equal(a, b)
        for a, b in zip(strategy.module.parameters(), restored.module.parameters(), strict=True)
    )


def test_truncate_jsonl_keeps_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    checkpoint.truncate_jsonl(path, 2)
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]


def test_an_unreachable_server_stops_the_trainer_at_connect_with_its_url(tiny_model, tmp_path):
    from inference_shim.procs import free_port
    from inference_shim.weight_sender import WeightPushError
    from pipeline_rl.trainer.strategies.ddp import DDPStrategy
    from pipeline_rl.trainer.weights import WeightPublisher

    dead = f"http://127.0.0.1:{free_port()}"  # nobody listens here
    cfg = run_config(tmp_path, "redis://unused:1/0", tiny_model, push_timeout_s=5)
    cfg.inference.urls = [dead]
    # With ejection on (the default) the trainer waits up to startup_timeout_s for a server to come up
    # (a restart takes that long), then stops with each server's reason; with it off it stops at once.
    cfg.inference.startup_timeout_s = 1
    comm = Comm(rank=0, world=1, local_rank=0, device=CPU)
    for eject in (True, False):
        cfg.trainer.eject_failed_servers = eject
        publisher = WeightPublisher(cfg, DDPStrategy(cfg, comm, tiny_model), comm)
        start = time.monotonic()
        with pytest.raises(WeightPushError, match="unreachable") as raised:
            publisher.connect()
        assert raised.value.servers == [dead] and dead in str(raised.value)
        assert time.monotonic() - start < 30


def test_kl_to_the_frozen_initial_policy_starts_at_zero_and_grows(tiny_model, tmp_path):
    from pipeline_rl.trainer.loop import _reference_model
    from pipeline_rl.trainer.strategies.ddp import DDPStrategy

    cfg = run_config(tmp_path, "redis://unused:1/0", tiny_model)
    cfg.algo.kl_coef = 0.1
    comm = Comm(rank=0, world=1, local_rank=0, device=CPU)
    samples = [
        s for g in make_groups(tiny_model, 2, seed=4) for s in group_to_training_samples(g, cfg.preprocess)
    ]
    [package] = build_packages(cfg, samples, "b")
    strategy, reference = DDPStrategy(cfg, comm, tiny_model), _reference_model(cfg, comm)
    first = train_step(strategy, package, cfg.algo, step=1, temperature=1.0, comm=comm, ref_model=reference)
    second = train_step(strategy, package, cfg.algo, step=2, temperature=1.0, comm=comm, ref_model=reference)
    assert first.metrics["kl"] < 1e-9 < second.metrics["kl"]
    assert not any(p.requires_grad for p in reference.parameters())


def test_samples_older_than_max_lag_are_dropped_at_train_time_with_exact_counts(tiny_model, tmp_path):
    """At step 2 (weights of version 1) with max_lag=0, a sample with ANY trained token of version 0 is
    dropped; the rest trains exactly as a batch of only them would (counts, gradient, weights)."""
    cfg = run_config(tmp_path, "redis://unused:1/0", tiny_model, max_lag=0)
    comm = Comm(rank=0, world=1, local_rank=0, device=CPU)
    fresh, old = make_groups(tiny_model, 2, seed=11, prefix="s")
    fresh = with_versions(fresh, [[(1, 0)], [(1, 0)], [(0, 2), (1, 0)], [(1, 0)]])  # /2 starts at v0
    old = with_versions(old, [[(0, 0)]] * ATTEMPTS)
    samples = [s for g in (fresh, old) for s in group_to_training_samples(g, cfg.preprocess)]
    [package] = build_packages(cfg, samples, "mixed")

    dropped = drop_stale(package, version=1, max_lag=0, comm=comm)
    expected = {"s:0/2", *(f"s:1/{i}" for i in range(ATTEMPTS))}
    assert set(dropped.dropped_ids) == expected
    kept = [s for s in samples if s.sample_id not in expected]
    p = dropped.package
    assert len(p.micro_batches) == len(package.micro_batches)  # same micro-steps on every rank
    assert (p.batch_samples, p.batch_tokens) == (len(kept), sum(sum(s.labels_mask) for s in kept))
    assert drop_stale(package, version=1, max_lag=1, comm=comm).dropped_ids == []  # lag 1 is allowed

    from pipeline_rl.trainer.strategies.ddp import DDPStrategy

    [reference] = build_packages(cfg, kept, "kept")
    results, weights = [], []
    for pkg in (p, reference):
        strategy = DDPStrategy(cfg, comm, tiny_model)
        # Plain SGD: Adam's first step is ~lr * sign(g) and would amplify float noise in near-zero grads.
        strategy.optimizer = torch.optim.SGD(strategy.module.parameters(), lr=1.0)
        strategy.scheduler = torch.optim.lr_scheduler.LambdaLR(strategy.optimizer, lambda _: 1.0)
        results.append(train_step(strategy, pkg, cfg.algo, step=2, temperature=1.0, comm=comm))
        weights.append({n: w.detach().clone() for n, w in strategy.module.named_parameters()})
    result = results[0]
    assert (result.samples, result.trained_tokens) == (p.batch_samples, p.batch_tokens)
    assert sorted(result.sample_ids) == sorted(s.sample_id for s in kept)
    assert result.metrics["lag_max"] == 0.0  # the bound holds on every trained token
    assert result.metrics["loss"] == pytest.approx(results[1].metrics["loss"], abs=1e-6)
    assert result.metrics["grad_norm"] == pytest.approx(results[1].metrics["grad_norm"], rel=1e-4)
    for name in weights[0]:
        assert torch.allclose(weights[0][name], weights[1][name], atol=1e-6), name


def test_activation_checkpointing_gives_the_same_loss_and_gradient(tiny_model, tmp_path):
    """trainer.gradient_checkpointing recomputes activations in the backward pass: the step's loss and
    every gradient are those of the plain model (float32, so to rounding)."""
    from pipeline_rl.trainer.strategies.ddp import DDPStrategy

    grads = []
    for checkpointing in (False, True):
        cfg = run_config(tmp_path, "redis://unused:1/0", tiny_model, gradient_checkpointing=checkpointing)
        samples = [
            s
            for g in make_groups(tiny_model, 2, seed=3)
            for s in group_to_training_samples(g, cfg.preprocess)
        ]
        [package] = build_packages(cfg, samples, "b")
        comm = Comm(rank=0, world=1, local_rank=0, device=CPU)
        strategy = DDPStrategy(cfg, comm, tiny_model)
        assert strategy.module.is_gradient_checkpointing == checkpointing
        strategy.optimizer_step = lambda: 0.0  # keep the gradients: compare them, not the update
        result = train_step(strategy, package, cfg.algo, step=1, temperature=1.0, comm=comm)
        grads.append(
            (result.metrics["loss"], {n: p.grad.clone() for n, p in strategy.module.named_parameters()})
        )
    (loss_plain, plain), (loss_ckpt, ckpt) = grads
    assert loss_ckpt == pytest.approx(loss_plain, rel=1e-6)
    for name, g in plain.items():
        assert torch.allclose(g, ckpt[name], atol=1e-6, rtol=1e-5), name


def test_lag_decay_weighs_tokens_by_their_version_behind_the_step(tiny_model, tmp_path):
    """algo.lag_correction=decay in the trainer: lag = (step - 1) - version per token, the same lag the
    lag_* metrics report. The groups are sampled by version 0: trained at step 3 (lag 2) the policy loss is
    lag_decay ** 2 times the uncorrected one; at step 1 (lag 0) it is the uncorrected one."""
    from pipeline_rl.trainer.strategies.ddp import DDPStrategy

    cfg, comm, package = one_rank_package(tiny_model, tmp_path, groups=2, seed=7)

    def step_metrics(algo: AlgoConfig, step: int) -> dict[str, float]:
        strategy = DDPStrategy(cfg, comm, tiny_model)
        strategy.optimizer_step = lambda: 0.0  # the loss is what is compared; the update would cost time
        return train_step(strategy, package, algo, step=step, temperature=1.0, comm=comm).metrics

    decay = AlgoConfig(lag_correction="decay", lag_decay=0.5)
    plain, at_3, at_1 = step_metrics(AlgoConfig(), 3), step_metrics(decay, 3), step_metrics(decay, 1)
    assert abs(plain["policy_loss"]) > 1e-4
    assert (at_3["lag_mean"], at_1["lag_mean"]) == (2.0, 0.0)
    assert at_3["policy_loss"] == pytest.approx(0.25 * plain["policy_loss"], rel=1e-5)
    assert at_1["policy_loss"] == pytest.approx(plain["policy_loss"], rel=1e-6)


def test_decoupled_trains_with_grpos_gradient_when_no_weight_reaches_the_cap(tiny_model, tmp_path):
    """One optimizer step per batch makes the proximal policy the trainer's own weights: with sampler
    logprobs from the same model (weights near 1, far below the cap) and the same normalization, decoupled
    and grpo give the same gradient, and the clip never binds."""
    from pipeline_rl.trainer.strategies.ddp import DDPStrategy

    cfg, comm, package = one_rank_package(tiny_model, tmp_path, groups=2, seed=8)
    grads, metrics = [], []
    for algo in (AlgoConfig(name="decoupled"), AlgoConfig(normalize="tokens")):
        strategy = DDPStrategy(cfg, comm, tiny_model)
        strategy.optimizer_step = lambda: 0.0  # keep the gradients: compare them, not the update
        metrics.append(train_step(strategy, package, algo, step=1, temperature=1.0, comm=comm).metrics)
        grads.append({n: p.grad.clone() for n, p in strategy.module.named_parameters()})
    assert (metrics[0]["clip_frac"], metrics[0]["behav_masked_frac"]) == (0.0, 0.0)
    assert max(g.abs().max() for g in grads[1].values()) > 1e-4
    for name, g in grads[1].items():
        assert torch.allclose(grads[0][name], g, atol=1e-7, rtol=1e-5), name


def test_mixed_version_tokens_counts_the_trained_tokens_of_answers_across_an_update():
    import torch

    from pipeline_rl.trainer.step import mixed_version_tokens

    # Sequence 7: versions 3,3,4 (an update mid-answer); sequence 2: all 4; sequence 9: one token.
    versions = torch.tensor([3, 3, 4, 4, 4, 5])
    seq_ids = torch.tensor([7, 7, 7, 2, 2, 9])
    assert mixed_version_tokens(versions, seq_ids) == 3
    assert mixed_version_tokens(torch.tensor([1, 1, 1]), torch.tensor([0, 0, 1])) == 0
    assert mixed_version_tokens(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long)) == 0
