"""RL objectives of the trainer: PipelineRL's simplified GRPO (default), PPO-clip, DAPO and AReaL's
decoupled PPO, with optional KL-to-reference (k3) and entropy terms and an optional per-token correction
for the versions a token's sampler was behind (lag_correction). docs/objectives.md has the formulas.

Everything here is a pure function of per-token tensors, so the objectives are tested on hand-worked
numbers (tests/unit/trainer/test_losses.py, test_decoupled.py) and the trainer only has to line tensors up:

    logits = model(input_ids).logits[:, :-1]                  # position t predicts token t+1
    new_lp = token_logprobs(logits, input_ids[:, 1:])
    loss, metrics = rl_loss(new_lp, old_lp[:, 1:], adv[:, 1:], mask[:, 1:], cfg,
                            seq_ids=seq_ids[:, 1:], num_sequences=..., num_tokens=...)

Normalization (cfg.normalize) of the per-token terms ℓ_t of an optimizer step with N sequences and N_tok
trained tokens; L_s is the trained tokens of sequence s:

    "sequences"      Σ_t ℓ_t / N                      PipelineRL's; default for grpo and ppo
    "sequence_mean"  (1/N) Σ_s (1/L_s) Σ_{t∈s} ℓ_t    the original GRPO's per-sequence mean
    "tokens"         Σ_t ℓ_t / N_tok                  DAPO's; default for dapo

Gradient accumulation: the loss of one micro-batch is its share of the loss of the whole
optimizer step. Pass `num_sequences` / `num_tokens` counted over EVERY micro-batch of the step (use
`trained_counts` on each and sum) and the accumulated gradient equals the gradient of one big batch.
Under DDP, which averages gradients over W ranks, multiply each rank's loss by W (the counts are the
counts of all ranks together). A sequence must never be split across micro-batches: "sequence_mean"
reads L_s from the micro-batch, and summed `trained_counts` would count the sequence twice.
"""

from __future__ import annotations

import math

import torch

from pipeline_rl.algo_config import AlgoConfig, Normalize  # AlgoConfig re-exported: it is torch-free

__all__ = ["AlgoConfig", "rl_loss", "token_logprobs", "token_entropy", "trained_counts"]


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels[..., t] | logits[..., t, :]) in float32, shape of `labels`.

    The caller shifts (logits of position t score token t+1). Negative labels (e.g. -100 "ignore") get a
    finite placeholder value, which the loss mask must remove.
    """
    logits = logits.float()  # bf16 log-softmax over a large vocabulary loses the precision IS ratios need
    picked = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at every position, float32, shape logits.shape[:-1]."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    # -inf logits (banned tokens) have p = 0; replace them so 0 * -inf does not turn into NaN.
    finite = torch.where(torch.isfinite(logits), logits, torch.zeros_like(logits))
    return torch.logsumexp(logits, dim=-1) - (probs * finite).sum(dim=-1)


def _sequence_index(mask: torch.Tensor, seq_ids: torch.Tensor | None) -> torch.Tensor:
    """Compact per-token sequence index 0..S-1. Without seq_ids every row of the batch is one sequence."""
    if seq_ids is None:
        if mask.dim() == 1:
            return torch.zeros_like(mask, dtype=torch.long)
        rows = torch.arange(mask.shape[0], device=mask.device).view(-1, *([1] * (mask.dim() - 1)))
        return rows.expand_as(mask).contiguous()
    if seq_ids.shape != mask.shape:
        raise ValueError(
            f"seq_ids has shape {tuple(seq_ids.shape)}, mask {tuple(mask.shape)}; they must match"
        )
    return torch.unique(seq_ids, return_inverse=True)[1]


def trained_counts(mask: torch.Tensor, seq_ids: torch.Tensor | None = None) -> tuple[int, int]:
    """(sequences with at least one trained token, trained tokens) of one micro-batch.

    Sum these over every micro-batch (and rank) of an optimizer step to get `num_sequences`/`num_tokens`.
    """
    mask = mask.bool()
    seq = _sequence_index(mask, seq_ids)
    num_sequences = int(torch.unique(seq[mask]).numel())
    return num_sequences, int(mask.sum())


def _normalization_weights(
    mask: torch.Tensor,
    normalize: Normalize,
    seq_ids: torch.Tensor | None,
    num_sequences: int | None,
    num_tokens: int | None,
) -> torch.Tensor:
    """Per-token weight w_t such that loss = sum_t w_t * term_t (0 on untrained tokens).

    "sequences": 1/N_seq, "sequence_mean": 1/(L_s N_seq), "tokens": 1/N_tok (docs/objectives.md).
    """
    local_sequences, local_tokens = trained_counts(mask, seq_ids)
    maskf = mask.float()
    if normalize == "tokens":
        denom = local_tokens if num_tokens is None else num_tokens
        if denom < local_tokens:
            raise ValueError(
                f"num_tokens={num_tokens} is smaller than the {local_tokens} trained tokens of this "
                "micro-batch; it must count the trained tokens of the whole optimizer step"
            )
        return maskf / max(denom, 1)
    denom = local_sequences if num_sequences is None else num_sequences
    if denom < local_sequences:
        raise ValueError(
            f"num_sequences={num_sequences} is smaller than the {local_sequences} trained sequences of "
            "this micro-batch; it must count the trained sequences of the whole optimizer step"
        )
    if normalize == "sequences":
        return maskf / max(denom, 1)
    if normalize != "sequence_mean":
        raise ValueError(f"unknown normalization {normalize!r}; use sequences, sequence_mean or tokens")
    seq = _sequence_index(mask, seq_ids).reshape(-1)
    lengths = torch.zeros(int(seq.max()) + 1 if seq.numel() else 0, device=mask.device)
    lengths.index_add_(0, seq, maskf.reshape(-1))
    per_token = maskf.reshape(-1) / lengths.clamp(min=1.0)[seq] / max(denom, 1)
    return per_token.view_as(maskf)


def rl_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgoConfig,
    *,
    seq_ids: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    num_sequences: int | None = None,
    num_tokens: int | None = None,
    proximal_logprobs: torch.Tensor | None = None,
    token_lags: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The RL loss of one micro-batch (a scalar with a graph to `new_logprobs` and `entropy`) and metrics.

    All tensors are per token with one shape ([T] packed, or [B, T]); only `new_logprobs` and `entropy`
    carry gradients. `mask` is 1 on trained tokens; values elsewhere may be anything (even inf).
    `seq_ids` gives each token's sequence in a packed batch (any integers, equal within a sequence);
    without it each row is one sequence. `num_sequences` (denominator of "sequences" and
    "sequence_mean") and `num_tokens` (denominator of "tokens") are the counts of the whole optimizer
    step; None means this micro-batch's own counts.

    `proximal_logprobs` (decoupled only) are the proximal policy's; None means the trainer's weights at
    the start of the step, i.e. `new_logprobs.detach()`, which is what one optimizer step per batch gives.
    `token_lags` (needed by lag_correction=decay) is each token's versions behind the weights in use.

    Metrics are means over this micro-batch's trained tokens (0 when it has none); `num_tokens` and
    `num_sequences` in the dict are the local counts, for weighting when averaging over micro-batches.
    """
    shape = mask.shape
    for name, t in (
        ("new_logprobs", new_logprobs),
        ("old_logprobs", old_logprobs),
        ("advantages", advantages),
        ("proximal_logprobs", proximal_logprobs),
        ("token_lags", token_lags),
    ):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, mask {tuple(shape)}; they must match")
    if proximal_logprobs is not None and cfg.name != "decoupled":
        raise ValueError(f"proximal_logprobs only apply to algo.name=decoupled, not {cfg.name}")
    if cfg.lag_correction == "decay" and token_lags is None:
        raise ValueError(
            "algo.lag_correction=decay needs token_lags (each token's versions behind the trainer's "
            "weights); pass them or set algo.lag_correction=none"
        )
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("algo.kl_coef > 0 needs ref_logprobs; compute them or set algo.kl_coef=0")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("algo.entropy_coef > 0 needs per-token entropy; pass token_entropy(logits)")

    m = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=new_logprobs.device)
    # Untrained positions may hold padding garbage or -inf; zero them BEFORE exp so neither the value nor
    # the backward pass (which multiplies by exp(.)) can produce NaN. torch.where sends them zero gradient.
    new = torch.where(m, new_logprobs.float(), zero)
    old = torch.where(m, old_logprobs.detach().float(), zero)
    adv = torch.where(m, advantages.detach().float(), zero)
    log_ratio = new - old
    # exp(20) ~ 5e8 is far past any cap or clip; the clamp only keeps exp finite (0 * inf = NaN when A=0).
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    ratio_d = ratio.detach()

    truncated = clipped = behav_masked = torch.zeros_like(m)
    if cfg.name == "grpo":
        # REINFORCE with a truncated importance weight; the weight is a constant (no gradient through it).
        weight = ratio_d.clamp(max=cfg.is_cap)
        per_token = -weight * adv * new
        truncated = m & (ratio_d > cfg.is_cap)
    else:
        behav_weight = None
        if cfg.name == "decoupled":
            # The clip keeps the update near the proximal policy; the sampler's (behaviour) policy enters
            # only through a constant weight pi_prox / pi_behav, which AReaL zeroes above its cap.
            prox = new.detach()
            if proximal_logprobs is not None:
                prox = torch.where(m, proximal_logprobs.detach().float(), zero)
            behav_weight = torch.exp((prox - old).clamp(-20.0, 20.0))
            behav_masked = m & (behav_weight > cfg.behav_imp_weight_cap)
            behav_weight = torch.where(behav_masked, zero, behav_weight)
            ratio = torch.exp((new - prox).clamp(-20.0, 20.0))
            ratio_d = ratio.detach()
        low, high = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
        per_token = -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
        # Tokens whose gradient the clip removed: the ratio left the trust region in the direction the
        # advantage pushes it.
        clipped = m & (((adv > 0) & (ratio_d > high)) | ((adv < 0) & (ratio_d < low)))
        if behav_weight is not None:
            per_token = behav_weight * per_token
    if cfg.lag_correction == "decay":
        per_token = per_token * _lag_decay(token_lags, m, cfg.lag_decay)
    policy_per_token = per_token

    kl = None
    if ref_logprobs is not None:
        d = torch.where(m, ref_logprobs.detach().float(), zero) - new
        kl = torch.exp(d) - d - 1.0  # k3: unbiased for KL(new || ref), always >= 0
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl
    ent = None
    if entropy is not None:
        ent = torch.where(m, entropy.float(), zero)
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * ent

    # KL and entropy use the same normalization as the policy term, so accumulation stays exact.
    weights = _normalization_weights(m, cfg.normalize, seq_ids, num_sequences, num_tokens)
    loss = (weights * per_token).sum()

    local_sequences, local_tokens = trained_counts(m, seq_ids)
    policy_loss = (weights * policy_per_token.detach()).sum()
    metrics = _metrics(m, local_tokens, log_ratio.detach(), clipped, truncated, behav_masked, kl, ent)
    metrics["num_sequences"] = float(local_sequences)
    metrics["loss"], metrics["policy_loss"] = torch.stack([loss.detach(), policy_loss]).tolist()
    return loss, metrics


def _lag_decay(token_lags: torch.Tensor, m: torch.Tensor, decay: float) -> torch.Tensor:
    """decay ** lag_t per trained token, 1 elsewhere: a constant factor (no gradient) on the policy term."""
    lags = torch.where(m, token_lags.detach().float(), torch.zeros((), device=m.device))
    if bool((lags < 0).any()):
        raise ValueError(
            "token_lags holds a negative lag on a trained token: a token sampled by weights newer than "
            "the trainer's (drop_stale takes such samples out before the step)"
        )
    return decay**lags


def _metrics(
    m: torch.Tensor,
    n: int,
    log_ratio: torch.Tensor,
    clipped: torch.Tensor,
    truncated: torch.Tensor,
    behav_masked: torch.Tensor,
    kl: torch.Tensor | None,
    ent: torch.Tensor | None,
) -> dict[str, float]:
    """Token means over the n trained tokens, read back from the device in one transfer."""
    names = ["ratio_mean", "ess", "logprob_mismatch", "clip_frac", "truncated_frac", "behav_masked_frac"]
    names += ["kl"] * (kl is not None) + ["entropy"] * (ent is not None)
    if n == 0:
        return {"num_tokens": 0.0, **dict.fromkeys(names, 0.0)}
    lr = log_ratio[m].double()
    # ESS of the raw ratios w = exp(lr): (sum w)^2 / (n sum w^2), in log space so huge ratios stay finite.
    log_ess = 2 * torch.logsumexp(lr, 0) - torch.logsumexp(2 * lr, 0) - math.log(n)
    values = [lr.exp().mean(), log_ess.exp(), lr.abs().mean()]
    values += [clipped.sum() / n, truncated.sum() / n, behav_masked.sum() / n]
    values += [t.detach()[m].double().mean() for t in (kl, ent) if t is not None]
    return {"num_tokens": float(n), **dict(zip(names, torch.stack(values).tolist(), strict=True))}
