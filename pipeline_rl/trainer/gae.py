"""Generalized advantage estimation (GAE) over the trainer's packed micro-batch, for PPO with a critic.

Pure functions of per-token tensors, tested against plain per-token loops (tests/unit/trainer/test_gae.py);
docs/objectives.md has the formulas. Not wired into the trainer yet.

Layout (trainer/step.py: micro_batch_tensors). A micro-batch is its samples concatenated into one row;
`seq_ids` numbers them 0..n-1 in micro-batch order (preprocess/ops.py: collate_micro_batch), and every
per-token tensor is shifted by one: position t holds what concerns token t+1, which the logit of
position t scores. `mask` (labels_mask) is 1 on the tokens the policy sampled and is trained on; it is 0
on the prompt, on every sample's first token, on out-of-vocabulary ids and, inside a multi-turn episode,
on the tokens the environment added between turns. `values[t]` is the critic's output at the same
position as that logit: the value of the state just before the trained token is emitted.

    rewards = terminal_rewards(torch.tensor([s.reward for s in micro_batch]), batch["mask"], batch["seq_ids"])
    advantages, returns = gae(rewards, values, batch["mask"], batch["seq_ids"], gamma, lam)

The time steps of GAE are a sequence's trained tokens, in order: an environment gap is not a step (the
policy acted at neither end of it), so the recursion links consecutive trained tokens across it. The
value after a sequence's last trained token is 0: the episode ends there (a truncated sample is trained
as if it ended where it was cut, as the preprocessor's advantages already treat it).
"""

from __future__ import annotations

import math

import torch

from pipeline_rl.trainer.losses import _sequence_index

__all__ = ["gae", "terminal_rewards"]


def terminal_rewards(
    sequence_rewards: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token rewards (shape of `mask`): each sequence's reward on its last trained token, 0 elsewhere.

    `sequence_rewards[k]` is the reward of the sequence whose seq_id is k (without seq_ids: of row k). The
    last trained token of a sequence is its highest position with mask 1: trailing environment tokens of an
    episode (the environment's reply to the final turn) are not it. A sequence with no trained token gets
    nothing: it is not trained.
    """
    m = mask.bool()
    if seq_ids is not None and seq_ids.shape != m.shape:
        raise ValueError(f"seq_ids has shape {tuple(seq_ids.shape)}, mask {tuple(m.shape)}; they must match")
    seq = (seq_ids if seq_ids is not None else _sequence_index(m, None)).reshape(-1)
    pos = m.reshape(-1).nonzero().squeeze(1)
    out = torch.zeros(m.numel(), dtype=sequence_rewards.dtype, device=m.device)
    if pos.numel() == 0:
        return out.view(m.shape)
    trained_seq = seq[pos]
    n = sequence_rewards.shape[0]
    if int(trained_seq.min()) < 0 or int(trained_seq.max()) >= n:
        raise ValueError(
            f"a trained token has seq_id {int(trained_seq.max())} (or below 0) but there are {n} sequence "
            "rewards; pass one reward per sequence of the micro-batch, indexed by seq_id"
        )
    last = torch.full((n,), -1, dtype=torch.long, device=m.device).scatter_reduce(0, trained_seq, pos, "amax")
    has = last >= 0
    out[last[has]] = sequence_rewards.to(m.device)[has]
    return out.view(m.shape)


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor | None,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of every trained token, 0 elsewhere; shape of `mask`, no gradient.

    For the trained positions p_1 < ... < p_L of one sequence (same seq_id, mask 1; without seq_ids each
    row is a sequence), with V(p_{L+1}) = 0:

        delta_k = r(p_k) + gamma * V(p_{k+1}) - V(p_k)
        A(p_k)  = delta_k + gamma * lam * A(p_{k+1}),      A(p_{L+1}) = 0
        R(p_k)  = A(p_k) + V(p_k)                           (the critic's target)

    With gamma = lam = 1 and a terminal reward R_s, A(p_k) = R_s - V(p_k). `rewards` are per token (e.g.
    terminal_rewards); a reward on an untrained token would be lost, so it is an error (rewards must be 0
    there). Values under the mask may be anything (inf, NaN): they are never read. Computed in float64 (a
    float32 matmul may run in TF32); returned in the floating type of the inputs, at least float32.
    """
    if rewards.shape != mask.shape or values.shape != mask.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask {tuple(mask.shape)} "
            "must have one shape"
        )
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma={gamma} and lam={lam} must both lie in [0, 1]")
    m = mask.bool()
    if bool(((rewards != 0) & ~m).any()):
        raise ValueError(
            "a reward sits on an untrained token (mask 0), where GAE cannot use it; put each sequence's "
            "reward on its last trained token (terminal_rewards)"
        )
    out_dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    flat_m = m.reshape(-1)
    advantages = torch.zeros(flat_m.numel(), dtype=torch.float64, device=m.device)
    returns = torch.zeros_like(advantages)
    pos = flat_m.nonzero().squeeze(1)
    if pos.numel() > 0:
        # One row per sequence holding its trained tokens in order, right-padded with zeros: a padding
        # value of 0 is the terminal value, and a padding delta of 0 adds nothing to the scan.
        seq = torch.unique(_sequence_index(m, seq_ids).reshape(-1)[pos], return_inverse=True)[1]
        seq, order = torch.sort(seq, stable=True)  # stable: token order within a sequence is kept
        pos = pos[order]
        counts = torch.bincount(seq)
        col = torch.arange(pos.numel(), device=m.device) - (counts.cumsum(0) - counts)[seq]
        grid_r = torch.zeros(counts.numel(), int(counts.max()) + 1, dtype=torch.float64, device=m.device)
        grid_v = torch.zeros_like(grid_r)
        grid_r[seq, col] = rewards.detach().reshape(-1)[pos].double()
        grid_v[seq, col] = values.detach().reshape(-1)[pos].double()
        delta = grid_r[:, :-1] + gamma * grid_v[:, 1:] - grid_v[:, :-1]
        grid_a = _discounted_reverse_cumsum(delta, gamma * lam)
        advantages[pos] = grid_a[seq, col]
        returns[pos] = grid_a[seq, col] + grid_v[seq, col]
    return advantages.to(out_dtype).view(m.shape), returns.to(out_dtype).view(m.shape)


def _discounted_reverse_cumsum(x: torch.Tensor, c: float) -> torch.Tensor:
    """y[:, k] = sum_{j >= k} c^(j-k) x[:, j] for every row of a float64 [rows, width] tensor.

    In blocks of k ~ sqrt(width) columns: within a block one matmul with the k x k matrix of powers c^(b-a),
    then a backward pass over the blocks carries each block's first value into the block before. So the
    Python loop runs ~sqrt(width) times for all rows at once, and every power is computed directly (c^n
    for n <= k), never as a ratio of powers that over- or underflows on long sequences.
    """
    rows, width = x.shape
    k = math.isqrt(max(width - 1, 0)) + 1  # ceil(sqrt(width))
    blocks = -(-width // k)
    x = torch.nn.functional.pad(x, (0, blocks * k - width)).view(rows, blocks, k)
    i = torch.arange(k, device=x.device, dtype=torch.float64)
    gap = i[None, :] - i[:, None]  # gap[a, b] = b - a
    base = torch.tensor(c, dtype=torch.float64, device=x.device)
    powers = torch.where(gap >= 0, base ** gap.clamp(min=0), torch.zeros_like(gap))
    y = x @ powers.T  # y[..., a] = sum_{b >= a} c^(b-a) x[..., b]
    carry = base ** (k - i)  # from position a of a block to the next block's first position
    for q in range(blocks - 2, -1, -1):
        y[:, q] += carry * y[:, q + 1, :1]
    return y.reshape(rows, blocks * k)[:, :width]
