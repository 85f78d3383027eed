"""Trainer inputs and runs for tests: a small RunConfig, rollout groups whose sampler logprobs are the
model's own, the packages a preprocessor writes, fixed batches to fit, and the exact launcher command
of the trainer ranks run to completion.

Single-rank code paths run in-process (no torch.distributed: the trainer's Comm is then the identity);
multi-rank runs use the real `accelerate launch` command (run_trainer).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import uuid
from collections import defaultdict
from pathlib import Path

import torch

from inference_shim.openai_protocol import VersionSpan
from inference_shim.procs import stop_process_tree
from pipeline_rl.config import RunConfig
from pipeline_rl.launch.trainer_cmd import trainer_command
from pipeline_rl.messages import RolloutGroup, Sample, TrainingPackage, TrainingSample
from pipeline_rl.preprocess.ops import assign_partitions, group_to_training_samples, pack_micro_batches
from pipeline_rl.streams import StreamsConfig, make_reader, make_writer, training_partition
from pipeline_rl.trainer.dist import Comm
from pipeline_rl.trainer.step import train_step

ATTEMPTS = 4
CPU = torch.device("cpu")


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


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def make_groups(model_dir: Path, count: int, seed: int, prefix: str = "0") -> list[RolloutGroup]:
    """Groups whose sampler logprobs are the initial model's own (so importance ratios start at 1)."""
    rng = random.Random(seed)
    model = hf_model(model_dir)
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
    """The same steps on ONE rank in this process (every rank's micro-batches in one package); returns
    the trained weights under the servers' names (with trainer.lora: the adapter's)."""
    from pipeline_rl.trainer.model import trained_parameters
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
    return {name: p.detach().clone() for name, p in trained_parameters(strategy.module, cfg)}


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
    stop_process_tree(proc, grace_s=20)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def one_rank_package(tiny_model: Path, tmp_path: Path, groups: int, seed: int):
    """A run config, a one-rank Comm and the package a preprocessor writes for `groups` groups."""
    cfg = run_config(tmp_path, "redis://unused:1/0", tiny_model)
    samples = [
        s
        for g in make_groups(tiny_model, groups, seed=seed)
        for s in group_to_training_samples(g, cfg.preprocess)
    ]
    [package] = build_packages(cfg, samples, "b")
    return cfg, Comm(rank=0, world=1, local_rank=0, device=CPU), package


class TrainerWrapper(torch.nn.Module):
    """What DDP and DeepSpeed do to the model: the HF model becomes `.module`, without its `.config`."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, **kwargs):
        return self.module(**kwargs)


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


def read_all(cfg: RunConfig, topic: str) -> list:
    """Every message of `topic` so far (a fresh reader, from the start)."""
    reader = make_reader(cfg.streams, topic)
    out = []
    while entries := reader.read(count=500, block_s=0.0):
        out += [e.message for e in entries]
    return out


def packages_by_batch(cfg: RunConfig) -> dict[str, dict[int, TrainingPackage]]:
    """The training packages of every rank's partition by batch id (each batch on a rank once)."""
    batches: dict[str, dict[int, TrainingPackage]] = defaultdict(dict)
    for rank in range(cfg.trainer.num_processes):
        for package in read_all(cfg, training_partition(rank)):
            assert package.rank == rank and package.num_ranks == cfg.trainer.num_processes
            assert rank not in batches[package.batch_id], f"{package.batch_id} twice on rank {rank}"
            batches[package.batch_id][rank] = package
    return batches
