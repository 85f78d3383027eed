"""Preprocessing math between the actor and the trainer: group advantages, dynamic sampling, turning a
RolloutGroup into TrainingSamples, packing them into micro-batches and spreading those over trainer ranks.

Torch-free (plain Python) so the preprocessor process stays light; the functions are pure and tested in
tests/test_preprocess_ops.py. docs/objectives.md explains the choices (baselines, truncation, padding).

Typical use, per optimizer step:
    samples = [s for g in groups for s in group_to_training_samples(g, cfg)]
    parts = assign_partitions(pack_micro_batches(samples, cfg.seq_length), num_ranks, cfg.replace_token_id)
    for rank, micro_batches in enumerate(parts): ...  # collate_micro_batch(mb) gives the flat arrays
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline_rl.ledger import FILTERED, TOO_LONG, UNTRAINABLE
from pipeline_rl.messages import RolloutGroup, Sample, TrainingSample

PADDING_PREFIX = "padding/"


class PreprocessConfig(BaseModel):
    """How rollouts become training data."""

    model_config = ConfigDict(extra="forbid")

    std_normalize: bool = Field(True, description="Divide group advantages by the group reward std.")
    std_eps: float = Field(1e-6, gt=0.0, description="Added to the std before dividing, against tiny stds.")
    leave_one_out: bool = Field(False, description="Baseline = mean reward of the OTHER samples (RLOO).")
    drop_all_equal_groups: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose rewards are all equal (zero signal)."
    )
    seq_length: int = Field(
        4096,
        gt=1,
        description="Max tokens per packed micro-batch (and per sample); in a run left unset: inference.max_model_len.",
    )
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="Sample longer than seq_length: keep its first seq_length tokens, or drop it."
    )
    vocab_size: int | None = Field(None, gt=0, description="Model vocabulary size; ids outside are replaced.")
    replace_token_id: int = Field(
        0, ge=0, description="Id put in place of out-of-vocab ids (and for padding)."
    )
    overlong_buffer_len: int = Field(
        0, ge=0, description="DAPO soft overlong punishment window in tokens before the limit; 0 = off."
    )
    max_completion_tokens: int | None = Field(
        None, gt=0, description="Completion token limit of the actor (needed by the overlong punishment)."
    )
    overlong_penalty_factor: float = Field(
        1.0, ge=0.0, description="Largest overlong penalty (reward units)."
    )

    @model_validator(mode="after")
    def _check(self) -> PreprocessConfig:
        if self.vocab_size is not None and self.replace_token_id >= self.vocab_size:
            raise ValueError(
                f"preprocess.replace_token_id={self.replace_token_id} is itself out of the vocabulary "
                f"(vocab_size={self.vocab_size}); pick an id below vocab_size, e.g. the pad or eos id."
            )
        if self.overlong_buffer_len > 0:
            if self.max_completion_tokens is None:
                raise ValueError(
                    "preprocess.overlong_buffer_len > 0 needs preprocess.max_completion_tokens (the actor's "
                    "max_tokens); set it or set overlong_buffer_len=0."
                )
            if self.overlong_buffer_len >= self.max_completion_tokens:
                raise ValueError(
                    f"preprocess.overlong_buffer_len={self.overlong_buffer_len} must be smaller than "
                    f"max_completion_tokens={self.max_completion_tokens}; DAPO uses about a quarter of it."
                )
        return self


def overlong_penalty(completion_length: int, cfg: PreprocessConfig) -> float:
    """DAPO's soft overlong punishment (<= 0) for a completion of this many tokens.

    0 up to L_max - L_buf; then falls linearly to -factor at L_max; -factor beyond.
    """
    if cfg.overlong_buffer_len == 0 or cfg.max_completion_tokens is None:
        return 0.0
    start = cfg.max_completion_tokens - cfg.overlong_buffer_len
    if completion_length <= start:
        return 0.0
    excess = min(completion_length - start, cfg.overlong_buffer_len)
    return -cfg.overlong_penalty_factor * excess / cfg.overlong_buffer_len


def group_advantages(rewards: Sequence[float], cfg: PreprocessConfig) -> list[float]:
    """Advantage of each sample in a group: reward minus a baseline, optionally over the group std.

    Baseline: the group mean, or with leave_one_out the mean of the other n-1 rewards (which equals
    n/(n-1) times the mean-baseline advantage). The std is the population std of the group's rewards.
    A group whose rewards are all equal (or a group of one) gets zeros: it carries no signal.
    """
    n = len(rewards)
    if n <= 1 or max(rewards) == min(rewards):
        return [0.0] * n
    total = math.fsum(rewards)
    mean = total / n
    if cfg.leave_one_out:
        advantages = [r - (total - r) / (n - 1) for r in rewards]
    else:
        advantages = [r - mean for r in rewards]
    if cfg.std_normalize:
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / n)
        advantages = [a / (std + cfg.std_eps) for a in advantages]
    return advantages


def _check_sample(sample: Sample) -> None:
    n = len(sample.completion_token_ids)
    if len(sample.completion_logprobs) != n:
        raise ValueError(
            f"sample {sample.sample_id}: {len(sample.completion_logprobs)} logprobs for {n} completion tokens"
        )
    mask = sample.completion_mask
    if mask is not None and (len(mask) != n or any(m not in (0, 1) for m in mask)):
        raise ValueError(f"sample {sample.sample_id}: completion_mask must hold one 0/1 per completion token")
    for span in sample.version_spans:
        if not 0 <= span.start <= span.end <= n:
            raise ValueError(
                f"sample {sample.sample_id}: version span {span} outside the {n} completion tokens"
            )


def _to_training_sample(
    sample: Sample, group: RolloutGroup, advantage: float, group_reward_mean: float, cfg: PreprocessConfig
) -> TrainingSample | str:
    """The sample ready for the trainer, or the ledger reason it is dropped (too_long, untrainable)."""
    _check_sample(sample)
    prompt, completion = sample.prompt_token_ids, sample.completion_token_ids
    p, c = len(prompt), len(completion)
    input_ids = list(prompt) + list(completion)
    model_tokens = sample.completion_mask or [1] * c  # environment tokens of an episode: 0, not trained
    labels_mask = [0] * p + list(model_tokens)
    if input_ids:
        labels_mask[0] = 0  # the first token has no context to be predicted from (and ends a packed neighbor)
    advantages = [0.0] * p + [advantage * m for m in model_tokens]
    old_logprobs = [0.0] * p + [
        lp * m for lp, m in zip(sample.completion_logprobs, model_tokens, strict=True)
    ]
    token_versions = [-1] * p + sample.token_versions()

    if cfg.vocab_size is not None:
        for i, tok in enumerate(input_ids):
            if not 0 <= tok < cfg.vocab_size:
                # The model cannot embed it: feed a valid id, and do not train on a token it cannot emit.
                input_ids[i] = cfg.replace_token_id
                labels_mask[i] = 0
                advantages[i] = 0.0
                old_logprobs[i] = 0.0

    if len(input_ids) > cfg.seq_length:
        if cfg.overlong == "drop":
            return TOO_LONG
        keep = cfg.seq_length
        input_ids, labels_mask, advantages = input_ids[:keep], labels_mask[:keep], advantages[:keep]
        old_logprobs, token_versions = old_logprobs[:keep], token_versions[:keep]
    if not any(labels_mask):
        # Nothing to train on: the prompt alone fills seq_length, or no completion id is in the vocabulary.
        return TOO_LONG if len(prompt) >= cfg.seq_length else UNTRAINABLE

    return TrainingSample(
        sample_id=sample.sample_id,
        group_id=group.group_id,
        input_ids=input_ids,
        labels_mask=labels_mask,
        advantages=advantages,
        old_logprobs=old_logprobs,
        token_versions=token_versions,
        reward=sample.reward,
        group_reward_mean=group_reward_mean,
        completion_length=c,
        finish_reason=sample.finish_reason,
    )


@dataclass
class ConvertedGroup:
    samples: list[TrainingSample]
    dropped: dict[str, str]  # sample_id -> ledger reason, for every sample of the group not in `samples`


def group_to_training_samples(group: RolloutGroup, cfg: PreprocessConfig) -> list[TrainingSample]:
    """TrainingSamples of one group, or [] when dynamic sampling drops it (convert_group says why)."""
    return convert_group(group, cfg).samples


def convert_group(group: RolloutGroup, cfg: PreprocessConfig) -> ConvertedGroup:
    """TrainingSamples of one group, and the reason for each sample left out (ValueError if malformed).

    input_ids are prompt + completion ids exactly as the server returned them. Rewards are shaped by the
    overlong punishment (if on) before advantages and before the all-equal test. Samples that end up with
    no trained token (overlong="drop", or a prompt that fills seq_length) are left out; the others keep
    the advantages computed over the whole group.
    """
    rewards = [s.reward + overlong_penalty(len(s.completion_token_ids), cfg) for s in group.samples]
    if cfg.drop_all_equal_groups and (not rewards or max(rewards) == min(rewards)):
        for sample in group.samples:
            _check_sample(sample)  # a malformed group is malformed, whatever its rewards
        return ConvertedGroup([], dict.fromkeys((s.sample_id for s in group.samples), FILTERED))
    advantages = group_advantages(rewards, cfg)
    reward_mean = math.fsum(s.reward for s in group.samples) / max(len(group.samples), 1)
    out = ConvertedGroup([], {})
    for sample, advantage in zip(group.samples, advantages, strict=True):
        ts = _to_training_sample(sample, group, advantage, reward_mean, cfg)
        if isinstance(ts, str):
            out.dropped[sample.sample_id] = ts
        else:
            out.samples.append(ts)
    return out


def pack_micro_batches(
    samples: Sequence[TrainingSample], seq_length: int, keep_groups: bool = False
) -> list[list[TrainingSample]]:
    """First-fit-decreasing packing into micro-batches of at most seq_length tokens in total.

    Every sample lands in exactly one micro-batch, whole (the loss needs each sequence in one piece).
    With keep_groups, the samples of a group (same group_id) are packed as one unit when they fit in one
    micro-batch together: the shared_prefix layout computes a prompt once per micro-batch, so a group
    spread over several pays for its prompt in each (docs/trainer.md, "Micro-batch layout"). A group too large for one
    micro-batch is packed sample by sample. Ties keep input order, so the packing is deterministic.
    """
    for sample in samples:
        if len(sample.input_ids) > seq_length:
            raise ValueError(
                f"sample {sample.sample_id} has {len(sample.input_ids)} tokens > seq_length={seq_length}; "
                "build samples with group_to_training_samples using the same seq_length"
            )
    units: list[list[TrainingSample]] = []
    if keep_groups:
        by_group: dict[str, list[TrainingSample]] = {}
        for sample in samples:
            by_group.setdefault(sample.group_id, []).append(sample)
        for members in by_group.values():
            fits = sum(len(s.input_ids) for s in members) <= seq_length
            units += [members] if fits else [[s] for s in members]
    else:
        units = [[s] for s in samples]
    order = sorted(units, key=lambda u: sum(len(s.input_ids) for s in u), reverse=True)
    bins: list[list[TrainingSample]] = []
    free: list[int] = []
    for unit in order:
        size = sum(len(s.input_ids) for s in unit)
        for i, room in enumerate(free):
            if size <= room:
                bins[i] += unit
                free[i] -= size
                break
        else:
            bins.append(list(unit))
            free.append(seq_length - size)
    return bins


def padding_sample(pad_token_id: int = 0) -> TrainingSample:
    """A one-token sample with nothing to train on: a padding micro-batch's forward contributes 0 loss."""
    return TrainingSample(
        sample_id=f"{PADDING_PREFIX}0",
        group_id=f"{PADDING_PREFIX}0",
        input_ids=[pad_token_id],
        labels_mask=[0],
        advantages=[0.0],
        old_logprobs=[0.0],
        token_versions=[-1],
        reward=0.0,
    )


def is_padding(sample: TrainingSample) -> bool:
    """True for samples made by padding_sample (skip them when counting consumed samples)."""
    return sample.sample_id.startswith(PADDING_PREFIX)


def micro_batch_tokens(micro_batch: Sequence[TrainingSample]) -> int:
    return sum(len(s.input_ids) for s in micro_batch)


def assign_partitions(
    micro_batches: Sequence[list[TrainingSample]], num_partitions: int, pad_token_id: int = 0
) -> list[list[list[TrainingSample]]]:
    """Spread micro-batches over trainer ranks: balanced tokens, the SAME number of micro-batches each.

    DDP ranks must run the same number of forward/backward passes per optimizer step or the gradient
    all-reduce hangs, so every rank gets k = ceil(M / num_partitions) micro-batches. Greedy: largest
    micro-batch first, onto the least-loaded rank that still has fewer than k. When M is not a multiple
    of num_partitions, the short ranks are topped up with padding micro-batches ([padding_sample()],
    all-zero mask, zero loss and zero gradient) so the counts still match.
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    per_rank = math.ceil(len(micro_batches) / num_partitions)
    parts: list[list[list[TrainingSample]]] = [[] for _ in range(num_partitions)]
    loads = [0] * num_partitions
    for mb in sorted(micro_batches, key=micro_batch_tokens, reverse=True):
        rank = min((r for r in range(num_partitions) if len(parts[r]) < per_rank), key=lambda r: loads[r])
        parts[rank].append(mb)
        loads[rank] += micro_batch_tokens(mb)
    for part in parts:
        while len(part) < per_rank:
            part.append([padding_sample(pad_token_id)])
    return parts


@dataclass
class PackedBatch:
    """One micro-batch as flat per-token arrays (what the trainer turns into [1, T] tensors).

    position_ids restart at 0 for every sequence; seq_ids number the sequences 0.. (for rl_loss).
    Every sequence's first token has labels_mask 0, so the logit at the end of one sequence that
    "predicts" the next sequence's first token is never trained on.
    """

    input_ids: list[int] = field(default_factory=list)
    position_ids: list[int] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    labels_mask: list[int] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)


def collate_micro_batch(micro_batch: Sequence[TrainingSample]) -> PackedBatch:
    """Concatenate a micro-batch's samples into one packed sequence."""
    out = PackedBatch()
    for i, s in enumerate(micro_batch):
        n = len(s.input_ids)
        out.input_ids += s.input_ids
        out.position_ids += range(n)
        out.seq_ids += [i] * n
        out.labels_mask += s.labels_mask
        out.advantages += s.advantages
        out.old_logprobs += s.old_logprobs
        out.token_versions += s.token_versions
    return out
