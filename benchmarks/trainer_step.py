"""trainer-step: where one optimizer step of the trainer goes, at the demo's sizes.

    python -m benchmarks trainer-step            # the demo's batch (128 samples, <= 12 completion tokens)
                                              # and a long-tail batch (64 samples, 20-300 tokens)
    python -m benchmarks trainer-step --quick    # small batches, 2 repeats: smoke test

The trainer's own `train_step` (pipeline_rl/trainer/step.py) on one rank, DDP strategy, the demo's
model (pipeline_rl/demo/main.py DEMO_MODEL) and the preprocessor's real packing
(`preprocess.seq_length` as pipeline_rl/conf/base.yaml sets it for every launch), with its phases (collate, forward, backward, optimizer)
as the step records them in trainer_metrics.jsonl. Variants, interleaved per repeat:

- `padded` / `packed`: `trainer.micro_batch_layout` (how the model sees a packed micro-batch);
- `padded bf16`: padded with `trainer.mixed_precision=bf16` (forward under bf16 autocast);
- `shared_prefix` (and with bf16): one row per group of samples with the same prompt in a micro-batch
  (`trainer.micro_batch_layout=shared_prefix`), packed as the preprocessor packs for that layout: each
  group that fits whole in one micro-batch, so its prompt is computed once (docs/trainer.md, "Micro-batch
  layout");
- `plain loop`: the ceiling: the same samples as ONE right-padded batch through the bare model, a
  token-sum policy-gradient loss, backward and an AdamW step, no micro-batching, metrics or
  distributed wrapper - what a single-process trainer such as TRL's does per step.

One thread (what the launcher gives the trainer on a 2-core box). No servers, no Redis.
"""

from __future__ import annotations

import random
import time

from benchmarks.common import (
    BenchContext,
    StealMeter,
    goal_line,
    markdown_table,
    median,
    publish,
    rotate,
    section,
)

PROMPT_TOKENS = (40, 60)  # the demo's chat-templated prompts are ~50 characters = tokens
SHAPES = {
    # name: (samples per step, completion length range, group size)
    "demo": (128, (1, 12), 8),
    "long-tail": (64, (20, 300), 8),
}
QUICK_SHAPES = {"demo": (32, (1, 12), 8), "long-tail": (16, (20, 120), 8)}
VARIANTS = ("padded", "padded bf16", "shared_prefix", "shared_prefix bf16", "packed", "plain loop")
# variant -> (trainer.micro_batch_layout, trainer.mixed_precision)
TRAINER_VARIANTS = {
    "padded": ("padded", "no"),
    "padded bf16": ("padded", "bf16"),
    "shared_prefix": ("shared_prefix", "no"),
    "shared_prefix bf16": ("shared_prefix", "bf16"),
    "packed": ("packed", "no"),
}
PHASES = ("collate_s", "forward_s", "backward_s", "batch_metrics_s", "optimizer_s")


def servers_needed(ctx: BenchContext) -> list:
    return []


def _groups(shape: tuple, vocab: int, seed: int):
    """RolloutGroups of the shape's sizes with random tokens and half-right rewards."""
    from inference_shim.openai_protocol import VersionSpan
    from pipeline_rl.messages import RolloutGroup, Sample

    samples_per_step, (low, high), group_size = shape
    rng = random.Random(seed)
    groups = []
    for g in range(samples_per_step // group_size):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(*PROMPT_TOKENS))]
        samples = []
        for i in range(group_size):
            n = rng.randint(low, high)
            samples.append(
                Sample(
                    sample_id=f"{g}/{i}",
                    prompt_token_ids=prompt,
                    completion_token_ids=[rng.randrange(4, vocab) for _ in range(n)],
                    completion_logprobs=[-rng.random() * 3 for _ in range(n)],
                    version_spans=[VersionSpan(version=0, start=0, end=n)],
                    finish_reason="length",
                    reward=float(i % 2),
                )
            )
        groups.append(
            RolloutGroup(group_id=str(g), task="bench", prompt_index=g, actor_id=0, samples=samples)
        )
    return groups


def _package(cfg, groups, keep_groups: bool):
    from pipeline_rl.messages import TrainingPackage
    from pipeline_rl.preprocess.ops import assign_partitions, group_to_training_samples, pack_micro_batches

    samples = [s for g in groups for s in group_to_training_samples(g, cfg.preprocess)]
    packed = pack_micro_batches(samples, cfg.preprocess.seq_length, keep_groups)
    [micro_batches] = assign_partitions(packed, 1)
    return TrainingPackage(
        batch_id="bench",
        rank=0,
        num_ranks=1,
        micro_batches=micro_batches,
        batch_samples=len(samples),
        batch_tokens=sum(sum(s.labels_mask) for s in samples),
        batch_groups=len(groups),
        group_ids=[g.group_id for g in groups],
    )


def _plain_step(model, optimizer, package) -> float:
    """The ceiling: one padded batch of all the step's samples, bare model, AdamW."""
    import torch

    samples = [s for mb in package.micro_batches for s in mb]
    width = max(len(s.input_ids) for s in samples)
    ids = torch.zeros((len(samples), width), dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    trained = torch.zeros((len(samples), width - 1))
    advantages = torch.zeros((len(samples), width - 1))
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        ids[i, :n] = torch.tensor(s.input_ids)
        mask[i, :n] = 1
        trained[i, : n - 1] = torch.tensor(s.labels_mask[1:], dtype=torch.float32)
        advantages[i, : n - 1] = torch.tensor(s.advantages[1:])
    started = time.perf_counter()
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    loss = -(logprobs * advantages * trained).sum() / len(samples)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return time.perf_counter() - started


def run(ctx: BenchContext) -> dict:
    import torch

    from pipeline_rl.demo.main import DEMO_MODEL
    from pipeline_rl.demo.tiny_model import build_tiny_model
    from pipeline_rl.launch.compose import compose
    from pipeline_rl.trainer.dist import Comm
    from pipeline_rl.trainer.model import load_hf_model
    from pipeline_rl.trainer.step import train_step
    from pipeline_rl.trainer.strategies.ddp import DDPStrategy

    torch.set_num_threads(ctx.trainer_threads())
    steal = StealMeter()
    model_dir = build_tiny_model(ctx.out_dir / "trainer-step-model", DEMO_MODEL)
    vocab = _vocab(model_dir)
    shapes = QUICK_SHAPES if ctx.quick else SHAPES
    cpu = torch.device("cpu")
    comm = Comm(rank=0, world=1, local_rank=0, device=cpu)
    times: dict[tuple[str, str], list[float]] = {}
    phases: dict[tuple[str, str], dict[str, list[float]]] = {}
    packages, configs = {}, {}
    for name, shape in shapes.items():
        # The launcher's own configuration (pipeline_rl/conf/base.yaml), so the packing is what a launch packs.
        cfg = compose(
            [f"model_path={model_dir}", f"trainer.batch_size={shape[0]}", "trainer.learning_rate=1e-4"]
        )
        configs[name] = cfg
        groups = _groups(shape, vocab, seed=1)
        # The preprocessor keeps groups whole for the shared_prefix layout only (preprocess.py).
        for variant in VARIANTS:
            keep_groups = TRAINER_VARIANTS.get(variant, ("", ""))[0] == "shared_prefix"
            packages[(name, variant)] = _package(cfg, groups, keep_groups)
    strategies = {}
    for variant, (layout, precision) in TRAINER_VARIANTS.items():
        cfg = configs["demo"].model_copy(deep=True)
        cfg.trainer.micro_batch_layout = layout
        cfg.trainer.mixed_precision = precision
        strategies[variant] = DDPStrategy(cfg, comm, model_dir)
    plain = load_hf_model(model_dir, cpu)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    for name in shapes:  # one untimed step each: first-call allocations
        _plain_step(plain, plain_optimizer, packages[(name, "plain loop")])
        for variant, strategy in strategies.items():
            layout, precision = TRAINER_VARIANTS[variant]
            train_step(
                strategy,
                packages[(name, variant)],
                configs[name].algo,
                step=1,
                temperature=1.0,
                comm=comm,
                layout=layout,
                mixed_precision=precision,
            )
    for rep in range(ctx.repeats):
        ctx.log(f"trainer-step: repeat {rep + 1}/{ctx.repeats}")
        for name in shapes:
            for variant in rotate(VARIANTS, rep):
                package = packages[(name, variant)]
                if variant == "plain loop":
                    seconds = _plain_step(plain, plain_optimizer, package)
                else:
                    layout, precision = TRAINER_VARIANTS[variant]
                    started = time.perf_counter()
                    result = train_step(
                        strategies[variant],
                        package,
                        configs[name].algo,
                        step=2 + rep,
                        temperature=1.0,
                        comm=comm,
                        layout=layout,
                        mixed_precision=precision,
                    )
                    seconds = time.perf_counter() - started
                    for phase in PHASES:
                        phases.setdefault((name, variant), {}).setdefault(phase, []).append(
                            result.timings[phase]
                        )
                times.setdefault((name, variant), []).append(seconds)
    rows, summary = [], []
    for name in shapes:
        ceiling = median(times[(name, "plain loop")])
        for variant in VARIANTS:
            package = packages[(name, variant)]
            samples = package.batch_samples
            tokens = sum(len(s.input_ids) for mb in package.micro_batches for s in mb)
            step_s = median(times[(name, variant)])
            got = {p: median(v) for p, v in phases.get((name, variant), {}).items()}
            summary.append({"shape": name, "variant": variant, "step_s": step_s, **got})
            rows.append(
                [
                    name,
                    f"{samples} / {tokens}",
                    len(package.micro_batches),
                    _model_rows(package, variant),
                    variant,
                    step_s,
                    f"{ceiling / step_s:.2f}",
                    *(got.get(p) for p in ("collate_s", "forward_s", "backward_s", "optimizer_s")),
                ]
            )
    table = markdown_table(
        [
            "batch",
            "samples / tokens",
            "micro-batches",
            "model rows",
            "variant",
            "step s",
            "plain loop / step",
            "collate s",
            "forward s",
            "backward s",
            "optimizer s",
        ],
        rows,
    )
    demo = {r["variant"]: r["step_s"] for r in summary if r["shape"] == "demo"}
    goals = [
        goal_line(
            "the trainer's step within 1.25x of a plain single-process loop on the same samples (demo batch)",
            demo["padded"] <= 1.25 * demo["plain loop"],
            f"padded {demo['padded']:.3f} s, packed {demo['packed']:.3f} s, plain loop "
            f"{demo['plain loop']:.3f} s (medians); padded with bf16 autocast {demo['padded bf16']:.3f} s; "
            f"shared_prefix {demo['shared_prefix']:.3f} s, with bf16 {demo['shared_prefix bf16']:.3f} s.",
        )
    ]
    intro = (
        f"Medians of {ctx.repeats} interleaved repeats, one process, {ctx.trainer_threads()} torch thread(s), "
        "the demo's model (~1M parameters, 4 layers, character vocabulary), `preprocess.seq_length` "
        f"{configs['demo'].preprocess.seq_length} (pipeline_rl/conf/base.yaml, as every launch). "
        "`model rows`: the rows the model runs per step. `step s` is `train_step` end to end (collate, "
        "forward, backward, the metrics, the optimizer step); the phase columns are what the step records in `trainer_metrics.jsonl`. `plain loop`: "
        "the same samples as one padded batch through the bare model with a token-sum loss and AdamW: the "
        "floor of any trainer that runs every sample's prompt; `shared_prefix` runs a group's prompt once "
        "when the group fits in one micro-batch (the preprocessor then packs it whole, so the prompt is not "
        "repeated in several micro-batches): less work "
        "than that floor where answers are short (demo), while long answers make long rows whose dense "
        "attention costs more (long-tail)."
    )
    markdown = section(ctx, "trainer-step", intro, [table], goals, (), steal.percent())
    publish(ctx, "trainer-step", markdown)
    data = {"summary": summary, "times": {f"{k[0]}/{k[1]}": v for k, v in times.items()}}
    ctx.save_json("trainer-step", data)
    return data


def _model_rows(package, variant: str) -> int:
    """How many rows the model runs for the step: one per sample (padded, plain loop), one per micro-batch
    (packed), one per set of samples sharing a prompt in a micro-batch (shared_prefix, as the step finds
    them)."""
    import torch

    from pipeline_rl.trainer.step import micro_batch_tensors

    layout = TRAINER_VARIANTS.get(variant, ("padded", ""))[0]
    if layout == "packed":
        return len(package.micro_batches)
    if layout == "padded":
        return package.batch_samples
    cpu = torch.device("cpu")
    return sum(micro_batch_tensors(mb, cpu)["prefix_groups"].unique().numel() for mb in package.micro_batches)


def _vocab(model_dir) -> int:
    import json

    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
