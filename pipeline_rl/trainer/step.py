"""One optimizer step on one TrainingPackage: forward/backward of every micro-batch, then the step.

Packed micro-batches: a micro-batch is all its samples concatenated into one [1, T] row with
position_ids restarting at 0 for every sample and NO attention mask. Hugging Face models then build a
block-diagonal causal mask from the position ids (transformers' packed-sequence detection: a position
that does not follow its predecessor starts a new sequence), so no token attends across samples. The
result equals running every sample on its own (tests/test_trainer.py checks it against separate
forwards). The first token of every sample is never trained (labels_mask 0), so the logit at the end of
one sample that "predicts" the next sample's first token never counts.

Normalization: rl_loss gets the GLOBAL counts of the step (package.batch_samples / batch_tokens, over
all ranks) so the accumulated gradient equals the gradient of one big batch; every rank's loss is
multiplied by the world size because DDP, ZeRO and FSDP all average gradients over ranks.

Lag at train time (drop_stale, called by the loop before train_step on every rank): a sample whose
oldest trained token is more than actor.max_lag versions behind the weights in use is taken out of
the package. The trainer decides, not the preprocessor, because only the trainer knows the version a
batch is trained at (several preprocessors pack ahead; a resumed trainer goes back in versions), so the
bound holds by construction whatever the timing. The ranks then exchange what they took out, and every
rank lowers the package's GLOBAL counts by the same totals: the loss stays normalized over exactly the
samples/tokens trained. Micro-batches emptied by the filter become padding micro-batches, so every rank
still runs the same number of forward/backward passes (DDP's all-reduce would hang otherwise).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from pipeline_rl.messages import TrainingPackage, TrainingSample
from pipeline_rl.preprocess_ops import collate_micro_batch, is_padding, padding_sample
from pipeline_rl.trainer.dist import Comm
from pipeline_rl.trainer.losses import AlgoConfig, rl_loss, token_entropy, token_logprobs, trained_counts
from pipeline_rl.trainer.strategies import Strategy

# Token-mean metrics of rl_loss, combined over micro-batches and ranks weighted by trained tokens.
TOKEN_MEANS = ("ratio_mean", "logprob_mismatch", "clip_frac", "truncated_frac", "kl", "entropy")


@dataclass
class StepResult:
    metrics: dict[str, float]
    sample_ids: list[str]  # every real sample of the batch, all ranks
    samples: int
    groups: int
    tokens: int  # all tokens fed (prompt + completion, all ranks)
    trained_tokens: int
    timings: dict[str, float] = field(default_factory=dict)


class _Sums:
    """Per-rank sums over micro-batches, combined across ranks once per step."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.maxima: dict[str, float] = {}
        self.lse: dict[str, float] = {}  # log-sum-exp accumulators (ESS of huge ratios stays finite)

    def add(self, key: str, value: float) -> None:
        self.values[key] = self.values.get(key, 0.0) + value

    def max(self, key: str, value: float) -> None:
        self.maxima[key] = max(self.maxima.get(key, -math.inf), value)

    def logaddexp(self, key: str, value: float) -> None:
        self.lse[key] = float(
            torch.logaddexp(torch.tensor(self.lse.get(key, -math.inf)), torch.tensor(value))
        )


def oldest_version(sample: TrainingSample) -> int | None:
    """Oldest weight version among the sample's TRAINED tokens (None if none carries a version).

    The oldest, not the newest: a completion generated across weight updates mixes versions, and every
    trained token must be within the bound (its importance ratio is only as good as its own version).
    Only trained tokens: the loss and the lag metrics see only those; the prompt has no version.
    """
    versions = [v for v, m in zip(sample.token_versions, sample.labels_mask, strict=True) if m and v >= 0]
    return min(versions) if versions else None


@dataclass
class StaleDrop:
    package: TrainingPackage  # this rank's package without the stale samples, global counts lowered
    dropped_ids: list[str]  # every rank's stale sample ids (the same list on every rank)


def drop_stale(
    package: TrainingPackage, *, version: int, max_lag: int, comm: Comm, pad_token_id: int = 0
) -> StaleDrop:
    """Take out samples more than `max_lag` versions older than `version` (collective: every rank, every
    step, whatever it finds, so ranks stay in lockstep). See the module docstring."""
    micro_batches: list[list[TrainingSample]] = []
    stale_ids: list[str] = []
    stale_tokens = 0
    for mb in package.micro_batches:
        kept = []
        for s in mb:
            oldest = None if is_padding(s) else oldest_version(s)
            if oldest is not None and version - oldest > max_lag:
                stale_ids.append(s.sample_id)
                stale_tokens += sum(s.labels_mask)
            else:
                kept.append(s)
        micro_batches.append(kept or [padding_sample(pad_token_id)])
    views = comm.all_gather_object({"ids": stale_ids, "tokens": stale_tokens})
    all_ids = [i for v in views for i in v["ids"]]
    if not all_ids:
        return StaleDrop(package, [])
    filtered = package.model_copy(
        update={
            "micro_batches": micro_batches,
            "batch_samples": package.batch_samples - len(all_ids),
            "batch_tokens": package.batch_tokens - sum(v["tokens"] for v in views),
        }
    )
    return StaleDrop(filtered, all_ids)


def forward_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float):
    """(logits[T-1, V], logprobs of tokens 1..T-1) of one packed [1, T] micro-batch."""
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    logits = out.logits[0, :-1].float() / temperature
    return logits, token_logprobs(logits, batch["input_ids"][0, 1:])


def micro_batch_tensors(micro_batch, device: torch.device) -> dict[str, torch.Tensor]:
    packed = collate_micro_batch(micro_batch)
    row = {"input_ids": packed.input_ids, "position_ids": packed.position_ids}
    out = {k: torch.tensor([v], dtype=torch.long, device=device) for k, v in row.items()}
    # Per-token fields aligned with logprobs: token t+1 is scored by position t, so drop the first.
    out["mask"] = torch.tensor(packed.labels_mask[1:], dtype=torch.bool, device=device)
    out["advantages"] = torch.tensor(packed.advantages[1:], dtype=torch.float32, device=device)
    out["old_logprobs"] = torch.tensor(packed.old_logprobs[1:], dtype=torch.float32, device=device)
    out["seq_ids"] = torch.tensor(packed.seq_ids[1:], dtype=torch.long, device=device)
    out["versions"] = torch.tensor(packed.token_versions[1:], dtype=torch.long, device=device)
    # Reference logprobs shipped with the samples are used only when every sample has them; otherwise
    # the trainer's frozen reference model scores the whole micro-batch.
    if micro_batch and all(s.ref_logprobs is not None for s in micro_batch):
        refs = [x for s in micro_batch for x in s.ref_logprobs]
        out["ref_logprobs"] = torch.tensor(refs[1:], dtype=torch.float32, device=device)
    return out


def train_step(
    strategy: Strategy,
    package: TrainingPackage,
    algo: AlgoConfig,
    *,
    step: int,
    temperature: float,
    comm: Comm,
    ref_model: torch.nn.Module | None = None,
) -> StepResult:
    """Forward/backward over the package's micro-batches and one optimizer step (collective).

    `step` is the step being taken (1-based): the weights in use are version step-1, which is what the
    lag of a trained token is measured against.
    """
    sums = _Sums()
    started = time.perf_counter()
    n = len(package.micro_batches)
    for i, micro_batch in enumerate(package.micro_batches):
        batch = micro_batch_tensors(micro_batch, comm.device)
        with strategy.micro_step(last=i == n - 1):
            logits, new_lp = forward_logprobs(strategy.model, batch, temperature)
            entropy = token_entropy(logits) if algo.entropy_coef > 0 else None
            ref = batch.get("ref_logprobs")
            if ref is None and ref_model is not None:
                with torch.no_grad():
                    ref = forward_logprobs(ref_model, batch, temperature)[1]
            loss, m = rl_loss(
                new_lp,
                batch["old_logprobs"],
                batch["advantages"],
                batch["mask"],
                algo,
                seq_ids=batch["seq_ids"],
                ref_logprobs=ref,
                entropy=entropy,
                num_sequences=package.batch_samples,
                num_tokens=package.batch_tokens,
            )
            strategy.backward(loss * comm.world)
        _accumulate(sums, m, new_lp.detach(), logits.detach(), batch, step, need_entropy=entropy is None)
    backward_done = time.perf_counter()
    grad_norm = strategy.optimizer_step()
    if not math.isfinite(grad_norm):
        raise FloatingPointError(
            f"step {step}: gradient norm is {grad_norm} (batch {package.batch_id}); lower "
            "trainer.learning_rate or check the data (old_logprobs / advantages) for non-finite values"
        )
    optimizer_done = time.perf_counter()

    real = [s for mb in package.micro_batches for s in mb if not is_padding(s)]
    for s in real:
        sums.add("reward_sum", s.reward)
    local = {"sums": sums.values, "maxima": sums.maxima, "lse": sums.lse, "ids": [s.sample_id for s in real]}
    local["sums"]["tokens"] = float(sum(len(s.input_ids) for s in real))
    views = comm.all_gather_object(local)
    metrics = _combine(views)
    metrics.update(grad_norm=grad_norm, lr=strategy.lr())
    if (
        int(metrics["samples"]) != package.batch_samples
        or int(metrics["trained_tokens"]) != package.batch_tokens
    ):
        raise RuntimeError(
            f"batch {package.batch_id}: the packages hold {int(metrics['samples'])} samples / "
            f"{int(metrics['trained_tokens'])} trained tokens but announce {package.batch_samples} / "
            f"{package.batch_tokens}; the loss normalization would be wrong (preprocessor bug)"
        )
    return StepResult(
        metrics=metrics,
        sample_ids=[i for v in views for i in v["ids"]],
        samples=package.batch_samples,
        groups=package.batch_groups,
        tokens=int(metrics.pop("tokens")),
        trained_tokens=package.batch_tokens,
        timings={
            "forward_backward_s": backward_done - started,
            "optimizer_s": optimizer_done - backward_done,
        },
    )


def _accumulate(sums: _Sums, m: dict, new_lp, logits, batch, step: int, need_entropy: bool) -> None:
    mask = batch["mask"]
    n_seq, n_tok = trained_counts(mask, batch["seq_ids"])
    sums.add("loss", m["loss"])
    sums.add("policy_loss", m["policy_loss"])
    sums.add("samples", n_seq)
    sums.add("trained_tokens", n_tok)
    if n_tok == 0:
        return
    if need_entropy:  # entropy is a metric even when it is not in the loss
        with torch.no_grad():
            m["entropy"] = float(token_entropy(logits)[mask].double().mean())
    for key in TOKEN_MEANS:
        if key in m:
            sums.add(f"{key}_x_tokens", m[key] * n_tok)
    log_ratio = (new_lp - batch["old_logprobs"])[mask].double()
    sums.logaddexp("lse_w", float(torch.logsumexp(log_ratio, 0)))
    sums.logaddexp("lse_w2", float(torch.logsumexp(2 * log_ratio, 0)))
    sums.max("mismatch_max", float(log_ratio.abs().max()))
    lag = (step - 1) - batch["versions"][mask]
    sums.add("lag_sum", float(lag.sum()))
    sums.max("lag_max", float(lag.max()))
    sums.max("neg_lag_min", float(-lag.min()))


def _combine(views: list[dict]) -> dict[str, float]:
    """Global metrics of the step from every rank's sums (the same result on every rank)."""
    total: dict[str, float] = {}
    maxima: dict[str, float] = {}
    for v in views:
        for k, x in v["sums"].items():
            total[k] = total.get(k, 0.0) + x
        for k, x in v["maxima"].items():
            maxima[k] = max(maxima.get(k, -math.inf), x)
    tokens = total.get("trained_tokens", 0.0)
    out = {
        "loss": total.get("loss", 0.0),
        "policy_loss": total.get("policy_loss", 0.0),
        "samples": total.get("samples", 0.0),
        "trained_tokens": tokens,
        "tokens": total.get("tokens", 0.0),
        "reward": total.get("reward_sum", 0.0) / max(total.get("samples", 0.0), 1.0),
    }
    for key in TOKEN_MEANS:
        if f"{key}_x_tokens" in total:
            out[key] = total[f"{key}_x_tokens"] / max(tokens, 1.0)
    if tokens:
        lse = {
            k: torch.logsumexp(torch.tensor([v["lse"].get(k, -math.inf) for v in views]), 0)
            for k in ("lse_w", "lse_w2")
        }
        out["ess"] = float(torch.exp(2 * lse["lse_w"] - lse["lse_w2"] - math.log(tokens)))
        out["logprob_mismatch_max"] = maxima["mismatch_max"]
        out["lag_mean"] = total["lag_sum"] / tokens
        out["lag_max"] = maxima["lag_max"]
        out["lag_min"] = 0.0 - maxima["neg_lag_min"]  # 0.0 - x: never -0.0 in the logs
    return out
