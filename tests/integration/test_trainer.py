"""Trainer units that run in this process: packed forwards, gradient accumulation with global counts,
the partition feed's agreement and checkpoint state (real Redis), checkpoints, the launch command, the
capture server (tests/integration/_capture.py) against the real WeightSender, and the weight group's
membership against real servers (SIGSTOP; the torch engine). Also the helpers the
slow trainer tests share (tests/test_trainer_dist.py, test_trainer_resume.py, test_trainer_e2e.py import
them from here).

Single-rank code paths run in-process (no torch.distributed: the trainer's Comm is then the identity);
multi-rank runs are in the slow files, launched with the real `accelerate launch` command.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from inference_shim.openai_protocol import VersionSpan
from pipeline_rl.config import RunConfig
from pipeline_rl.messages import RolloutGroup, Sample, TrainingPackage, TrainingSample
from pipeline_rl.paths import CONF_DIR
from pipeline_rl.preprocess_ops import assign_partitions, group_to_training_samples, pack_micro_batches
from pipeline_rl.streams import StreamsConfig, make_writer, training_partition
from pipeline_rl.tiny_model import build_tiny_model
from pipeline_rl.trainer import checkpoint
from pipeline_rl.trainer.dist import Comm
from pipeline_rl.trainer.feed import PartitionFeed, _choose
from pipeline_rl.trainer.launch_cmd import trainer_command
from pipeline_rl.trainer.step import drop_stale, forward_logprobs, micro_batch_tensors, train_step

ATTEMPTS = 4
CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------ helpers
@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def run_config(
    tmp_path: Path, redis_url: str, model_dir: Path, algo: str = "grpo", max_lag: int = 1000, **trainer
) -> RunConfig:
    """A small run: batches of 8 samples (2 groups of 4), micro-batches of <= 64 tokens.

    max_lag is wide by default: the synthetic groups are all version 0 and these tests fit fixed batches
    for several steps; the tests of the train-time lag filter set it."""
    streams = StreamsConfig(backend="redis", redis_url=redis_url, run_name=f"t{uuid.uuid4().hex[:10]}")
    return RunConfig(
        run_dir=str(tmp_path / "run"),
        model_path=str(model_dir),
        streams=streams,
        actor={"attempts": ATTEMPTS, "max_tokens": 8, "max_lag": max_lag},
        inference={"max_model_len": 32},
        preprocess={"seq_length": 64},
        algo={"name": algo},
        trainer={
            "batch_size": 8,
            "learning_rate": 1e-2,
            "data_timeout_s": 60,
            "push_timeout_s": 60,
            **trainer,
        },
    )


def write_config(cfg: RunConfig) -> str:
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    path = Path(cfg.run_dir) / "config.json"
    path.write_text(cfg.model_dump_json(indent=1))
    return str(path)


def _model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def make_groups(model_dir: Path, count: int, seed: int, prefix: str = "0") -> list[RolloutGroup]:
    """Groups whose sampler logprobs are the initial model's own (so importance ratios start at 1)."""
    rng = random.Random(seed)
    model = _model(model_dir)
    groups = []
    for g in range(count):
        prompt = [1] + [rng.randrange(4, 90) for _ in range(rng.randint(3, 10))]
        samples = []
        for i in range(ATTEMPTS):
            completion = [rng.randrange(4, 90) for _ in range(rng.randint(3, 8))]
            with torch.no_grad():
                logits = model(torch.tensor([prompt + completion])).logits[0].float()
            logp = torch.log_softmax(logits, -1)
            lps = [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(completion)]
            samples.append(
                Sample(
                    sample_id=f"{prefix}:{g}/{i}",
                    prompt_token_ids=prompt,
                    completion_token_ids=completion,
                    completion_logprobs=lps,
                    version_spans=[VersionSpan(version=0, start=0, end=len(completion))],
                    finish_reason="length",
                    reward=float(i % 2),  # half right, half wrong: every group carries signal
                )
            )
        groups.append(
            RolloutGroup(group_id=f"{prefix}:{g}", task="t", prompt_index=g, actor_id=0, samples=samples)
        )
    return groups


def build_packages(cfg: RunConfig, samples: list[TrainingSample], batch_id: str) -> list[TrainingPackage]:
    """What a preprocessor writes for one batch: one package per rank (the real packing functions)."""
    ranks = cfg.trainer.num_processes
    parts = assign_partitions(pack_micro_batches(samples, cfg.preprocess.seq_length), ranks)
    return [
        TrainingPackage(
            batch_id=batch_id,
            rank=r,
            num_ranks=ranks,
            micro_batches=parts[r],
            batch_samples=len(samples),
            batch_tokens=sum(sum(s.labels_mask) for s in samples),
            batch_groups=len({s.group_id for s in samples}),
            group_ids=sorted({s.group_id for s in samples}),
        )
        for r in range(ranks)
    ]


def fixed_batches(cfg: RunConfig, groups: list[RolloutGroup], repeats: int) -> list[list[TrainingPackage]]:
    """The same batch `repeats` times (sample ids made unique per repeat): a fixed batch to fit."""
    samples = [s for g in groups for s in group_to_training_samples(g, cfg.preprocess)]
    out = []
    for k in range(repeats):
        copy = [
            s.model_copy(update={"sample_id": f"{s.sample_id}#{k}", "group_id": f"{s.group_id}#{k}"})
            for s in samples
        ]
        out.append(build_packages(cfg, copy, f"fixed:{k}"))
    return out


def write_batches(cfg: RunConfig, batches: list[list[TrainingPackage]]) -> None:
    for packages in batches:
        for package in packages:
            make_writer(cfg.streams, training_partition(package.rank)).write(package)


def reference_training(cfg: RunConfig, batches: list[list[TrainingPackage]]) -> dict[str, torch.Tensor]:
    """The same steps on ONE rank in this process (every rank's micro-batches in one package)."""
    from pipeline_rl.trainer.strategies.ddp import DDPStrategy

    single = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"num_processes": 1})})
    comm = Comm(rank=0, world=1, local_rank=0, device=CPU)
    strategy = DDPStrategy(single, comm, cfg.model_path)
    for step, packages in enumerate(batches, start=1):
        merged = packages[0].model_copy(
            update={
                "rank": 0,
                "num_ranks": 1,
                "micro_batches": [mb for p in packages for mb in p.micro_batches],
            }
        )
        train_step(strategy, merged, cfg.algo, step=step, temperature=1.0, comm=comm)
    return {name: p.detach().clone() for name, p in strategy.module.named_parameters()}


def run_trainer(cfg: RunConfig, log_path: Path, timeout_s: float = 240) -> tuple[int, str]:
    """Run the exact launcher command to completion; returns (exit status, output)."""
    proc = start_trainer(cfg, log_path)
    try:
        proc.wait(timeout=timeout_s)
    finally:
        stop_trainer(proc)
    return proc.returncode, log_path.read_text(errors="replace")


def start_trainer(cfg: RunConfig, log_path: Path) -> subprocess.Popen:
    argv = trainer_command(cfg, write_config(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop_trainer(proc: subprocess.Popen) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from _servers import stop_process_tree

    stop_process_tree(proc, grace_s=20)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _one_rank_package(tiny_model: Path, tmp_path: Path, groups: int, seed: int):
    """A run config, a one-rank Comm and the package a preprocessor writes for `groups` groups."""
    cfg = run_config(tmp_path, "redis://unused:1/0", tiny_model)
    samples = [
        s
        for g in make_groups(tiny_model, groups, seed=seed)
        for s in group_to_training_samples(g, cfg.preprocess)
    ]
    [package] = build_packages(cfg, samples, "b")
    return cfg, Comm(rank=0, world=1, local_rank=0, device=CPU), package


class _Wrapper(torch.nn.Module):
    """What DDP and DeepSpeed do to the model: the HF model becomes `.module`, without its `.config`."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, **kwargs):
        return self.module(**kwargs)


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
    model = _model(tiny_model)
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
        wrapped = forward_logprobs(_Wrapper(model), micro_batch_tensors(micro_batch, CPU), 1.0, layout)[1]
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
    assert custom_mask_form(_Wrapper(_model(tiny_model))) == "bool"
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

    cfg, comm, package = _one_rank_package(tiny_model, tmp_path, groups=3, seed=5)
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
    model = _model(tiny_model)
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


def test_feed_takes_complete_batches_in_order_and_resumes_exactly(redis_server, tiny_model, tmp_path):
    cfg = run_config(tmp_path, redis_server.url, tiny_model)
    comm = Comm(rank=0, world=1, local_rank=0, device=CPU)
    samples = [
        s for g in make_groups(tiny_model, 2, seed=2) for s in group_to_training_samples(g, cfg.preprocess)
    ]
    batches = [build_packages(cfg, samples, f"prep{k % 2}:{k}") for k in range(4)]  # two preprocessors
    write_batches(cfg, batches[:3])
    feed = PartitionFeed(cfg.streams, comm)
    never = lambda: False  # noqa: E731
    assert feed.next_package(5, never).batch_id == "prep0:0"
    feed._read(block_s=0.0)  # prep1:1 and prep0:2 are now buffered, read but untrained
    state = json.loads(json.dumps(feed.state()))  # what a checkpoint holds
    assert [p["batch_id"] for p in state["buffered"]] == ["prep1:1", "prep0:2"]
    feed.commit(state["position"])

    write_batches(cfg, batches[3:])
    resumed = PartitionFeed(cfg.streams, comm, start_after=state["position"], buffered=state["buffered"])
    assert [resumed.next_package(5, never).batch_id for _ in range(3)] == ["prep1:1", "prep0:2", "prep1:3"]
    assert resumed.next_package(5, lambda: True) is None  # a stop request wins over waiting
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="trainer.data_timeout_s"):
        resumed.next_package(0.5, never)
    assert time.monotonic() - start < 5


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

    cfg, comm, package = _one_rank_package(tiny_model, tmp_path, groups=2, seed=3)
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


def test_weight_snapshots_hold_each_versions_weights_and_are_evaluated_after_the_run(tiny_model, tmp_path):
    """trainer.snapshot_every_s: save_snapshot writes a loadable model of that version and an index row;
    bench.greedy_eval grades every snapshot afterwards and appends its eval rows to stats.jsonl."""
    from pipeline_rl.bench.greedy_eval import evaluate_snapshots
    from pipeline_rl.tasks import TaskConfig
    from pipeline_rl.trainer.strategies.ddp import DDPStrategy

    cfg, comm, package = _one_rank_package(tiny_model, tmp_path, groups=2, seed=4)
    strategy = DDPStrategy(cfg, comm, tiny_model)
    for version in (1, 2):
        train_step(strategy, package, cfg.algo, step=version, temperature=1.0, comm=comm)
        checkpoint.save_snapshot(
            cfg.run_dir, version, strategy, comm, model_path=tiny_model, bucket_bytes=1 << 20
        )
    rows = checkpoint.read_snapshots(cfg.run_dir)
    assert [r["version"] for r in rows] == [1, 2] and rows[0]["time"] <= rows[1]["time"]
    saved = _model(Path(cfg.run_dir) / checkpoint.SNAPSHOTS / rows[1]["path"])
    for (name, a), (_, b) in zip(strategy.module.named_parameters(), saved.named_parameters(), strict=True):
        assert torch.equal(a, b), name  # the latest version, not the initial weights
    assert not (Path(cfg.run_dir) / checkpoint.SNAPSHOTS / "v00000002.tmp").exists()

    evals = evaluate_snapshots(Path(cfg.run_dir), TaskConfig(name="arith"), num_problems=5, max_tokens=4)
    assert [(e["weight_version"], e["time"], e["problems"]) for e in evals] == [
        (r["version"], r["time"], 5) for r in rows
    ]
    assert all(0.0 <= e["accuracy"] <= 1.0 for e in evals)
    stats = [json.loads(line) for line in (Path(cfg.run_dir) / "stats.jsonl").read_text().splitlines()]
    assert [r for r in stats if r.get("when") == "snapshot"] == evals


def test_evaluate_run_grades_each_snapshot_once_and_deletes_its_weights(tiny_model, tmp_path):
    """bench.pipeline_vs_sync.evaluate_run: one eval row per snapshot, the weights deleted after grading,
    and a second call on the same run changes nothing (the weights it would need are gone)."""
    from pipeline_rl.bench.pipeline_vs_sync import evaluate_run
    from pipeline_rl.trainer.strategies.ddp import DDPStrategy

    cfg, comm, package = _one_rank_package(tiny_model, tmp_path, groups=2, seed=5)
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"num_problems": 5, "max_tokens": 4})})
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json())
    strategy = DDPStrategy(cfg, comm, tiny_model)
    for version in (1, 2):
        train_step(strategy, package, cfg.algo, step=version, temperature=1.0, comm=comm)
        checkpoint.save_snapshot(
            run_dir, version, strategy, comm, model_path=tiny_model, bucket_bytes=1 << 20
        )

    def eval_rows() -> list[dict]:
        lines = (run_dir / "stats.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r.get("when") == "snapshot"]

    evaluate_run(run_dir)
    assert [r["weight_version"] for r in eval_rows()] == [1, 2]
    assert not any(
        (run_dir / checkpoint.SNAPSHOTS / r["path"]).exists() for r in checkpoint.read_snapshots(run_dir)
    )
    evaluate_run(run_dir)  # it raised here before: the graded weights were gone
    assert [r["weight_version"] for r in eval_rows()] == [1, 2]


def test_truncate_jsonl_keeps_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    checkpoint.truncate_jsonl(path, 2)
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]


def test_capture_server_receives_pushes_and_refuses_stale_versions(tiny_model):
    from _capture import CaptureServer

    from inference_shim.weight_sender import WeightPushError, WeightSender

    named = list(_model(tiny_model).named_parameters())
    with CaptureServer(tiny_model) as capture:
        sender = WeightSender([capture.url], backend="gloo", timeout_s=30)
        sender.connect()
        try:
            sender.push_tensors(1, named)
            with pytest.raises(WeightPushError, match="stale_version") as raised:
                sender.push_tensors(1, named)
            assert raised.value.servers == [capture.url]
            sender.push_tensors(1, named, restore=True)  # a resumed trainer may go back
        finally:
            sender.close()
        assert [h["version"] for h in capture.history] == [1, 1] and capture.history[1]["restore"]
        assert all(torch.equal(capture.received[n], p.detach()) for n, p in named)


def test_an_unreachable_server_stops_the_trainer_at_connect_with_its_url(tiny_model, tmp_path):
    from inference_shim.weight_sender import WeightPushError
    from pipeline_rl.trainer.strategies.ddp import DDPStrategy
    from pipeline_rl.trainer.weights import WeightPublisher

    sys.path.insert(0, str(Path(__file__).parent))
    from _servers import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nobody listens here
    cfg = run_config(tmp_path, "redis://unused:1/0", tiny_model, push_timeout_s=5)
    cfg.inference.urls = [dead]
    # With ejection on (the default) the trainer waits up to startup_timeout_s for a server to come up
    # (a restart takes that long), then stops with each server's reason; with it off it stops at once.
    cfg.inference.startup_timeout_s = 3
    comm = Comm(rank=0, world=1, local_rank=0, device=CPU)
    for eject in (True, False):
        cfg.trainer.eject_failed_servers = eject
        publisher = WeightPublisher(cfg, DDPStrategy(cfg, comm, tiny_model), comm)
        start = time.monotonic()
        with pytest.raises(WeightPushError, match="unreachable") as raised:
            publisher.connect()
        assert raised.value.servers == [dead] and dead in str(raised.value)
        assert time.monotonic() - start < 30


def test_a_server_that_missed_a_resumed_trainers_restore_push_rejoins(tiny_model, tmp_path):
    """A trainer pushes version 12 and dies; its successor resumes from an older checkpoint (version 8)
    while one server is SIGSTOPped, so only the other gets the restore push. The stopped server comes back
    still serving version 12: at the next push it rejoins and must take version 9 (the first push to a
    re-formed group is a restore), not refuse it as stale and stop the trainer. Real servers (the torch
    engine: the same contract, quick to start); versions are what is checked, the weights are the same."""
    from _servers import SERVER_START_S, start_server, stop_process_tree, wait_healthy

    from inference_shim.procs import signal_group
    from inference_shim.weight_sender import WeightPushError
    from pipeline_rl.bench.servers import served_version
    from pipeline_rl.trainer.strategies.ddp import DDPStrategy
    from pipeline_rl.trainer.weights import WeightPublisher

    started = [start_server(tiny_model, tmp_path / f"server{i}.log", backend="torch") for i in range(2)]
    publishers: list[WeightPublisher] = []
    try:
        for i, (url, proc) in enumerate(started):
            wait_healthy(url, SERVER_START_S, proc, tmp_path / f"server{i}.log")
        urls = [url for url, _ in started]
        # push_timeout_s also bounds how long connect waits on the stopped server
        cfg = run_config(tmp_path, "redis://unused:1/0", tiny_model, push_timeout_s=3, rejoin_check_s=0.1)
        cfg.inference.urls = urls
        comm = Comm(rank=0, world=1, local_rank=0, device=CPU)

        def publisher() -> WeightPublisher:
            publishers.append(WeightPublisher(cfg, DDPStrategy(cfg, comm, tiny_model), comm))
            return publishers[-1]

        def served() -> list[int]:
            return [served_version([url]) for url in urls]

        dead_trainer = publisher()
        dead_trainer.connect()
        dead_trainer.push(12)
        dead_trainer.close()
        assert served() == [12, 12]

        stopped = started[1][1]
        signal_group(stopped, signal.SIGSTOP)
        try:
            resumed = publisher()
            resumed.connect()  # the stopped server cannot answer: the group forms without it
            assert resumed.members == urls[:1]
            resumed.push(8, restore=True)
        finally:
            signal_group(stopped, signal.SIGCONT)
        assert served() == [8, 12]
        resumed._next_rejoin_check = 0.0  # the next push looks for returning servers
        resumed.push(9)  # the returning server is admitted first, then gets version 9
        assert resumed.members == urls and resumed.rejoined_total == 1
        assert served() == [9, 9]
        resumed.push(10)
        with pytest.raises(WeightPushError, match="stale_version"):  # ordinary pushes check again
            resumed.push(10)
        assert served() == [10, 10]
    finally:
        for p in publishers:
            p.close()
        for _, proc in started:
            stop_process_tree(proc)


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


def with_versions(group: RolloutGroup, versions: list[list[tuple[int, int]]]) -> RolloutGroup:
    """The group with each sample's tokens attributed to versions: [(version, tokens), ...] per sample
    (the last span runs to the end of the completion)."""
    samples = []
    for sample, spans in zip(group.samples, versions, strict=True):
        n, start, out = len(sample.completion_token_ids), 0, []
        for k, (version, length) in enumerate(spans):
            end = n if k == len(spans) - 1 else min(start + length, n)
            out.append(VersionSpan(version=version, start=start, end=end))
            start = end
        samples.append(sample.model_copy(update={"version_spans": out}))
    return group.model_copy(update={"samples": samples})


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
