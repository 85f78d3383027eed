"""RL objectives on tensors small enough to work out by hand (the arithmetic is in the comments).

Run: .venv/bin/python -m pytest -q tests/unit/trainer/test_losses.py
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from inference_shim.openai_protocol import VersionSpan
from pipeline_rl.messages import RolloutGroup, Sample
from pipeline_rl.preprocess.ops import (
    PreprocessConfig,
    collate_micro_batch,
    group_advantages,
    group_to_training_samples,
)
from pipeline_rl.trainer.losses import AlgoConfig, rl_loss, token_entropy, token_logprobs, trained_counts

LN2, LN10 = math.log(2.0), math.log(10.0)


def _leaf(values: list[float] | list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


# ---------------------------------------------------------------- config


def test_algo_defaults_per_algorithm():
    grpo = AlgoConfig()
    assert (grpo.name, grpo.is_cap, grpo.normalize) == ("grpo", 5.0, "sequences")
    assert grpo.clip_eps_low is None and grpo.clip_eps_high is None
    ppo = AlgoConfig(name="ppo", clip_eps_low=0.1)
    assert (ppo.clip_eps_low, ppo.clip_eps_high, ppo.normalize, ppo.is_cap) == (0.1, 0.1, "sequences", None)
    dapo = AlgoConfig(name="dapo")
    assert (dapo.clip_eps_low, dapo.clip_eps_high, dapo.normalize) == (0.2, 0.28, "tokens")
    # A resolved config round-trips through its dump (what the launcher writes into the run directory).
    assert AlgoConfig.model_validate(dapo.model_dump()) == dapo


@pytest.mark.parametrize(
    "kwargs, hint",
    [
        ({"name": "grpo", "clip_eps_low": 0.2}, "is_cap"),
        ({"name": "ppo", "is_cap": 3.0}, "clip_eps"),
        ({"name": "dapo", "clip_eps_low": 0.3, "clip_eps_high": 0.2}, "clip_eps_high >= algo.clip_eps_low"),
        ({"name": "ppo", "clip_eps_low": 1.0}, "(0, 1)"),
        ({"name": "grpo", "is_cap": 0.0}, "> 0"),
        ({"kl_coef": -0.1}, "greater than or equal"),
        ({"name": "reinforce"}, "grpo"),
        ({"is_capp": 5.0}, "extra"),
        # Names from before the three normalizations were told apart: rejected with the new names.
        ({"normalize": "sequence"}, '"sequence_mean" for its behaviour'),
        ({"normalize": "token"}, 'renamed to "tokens"'),
        ({"normalize": "mean"}, "'sequences', 'sequence_mean' or 'tokens'"),
    ],
)
def test_algo_config_rejects_bad_combinations_with_a_fix(kwargs, hint):
    with pytest.raises(ValidationError) as err:
        AlgoConfig(**kwargs)
    assert hint in str(err.value)


# ---------------------------------------------------------------- grpo

# Two packed sequences: seq 0 = tokens 0..2 (A = +1), seq 1 = tokens 3..4 (A = -1).
# log ratio new - old = [0, ln2, ln10, 0, -ln2]  ->  ratio [1, 2, 10, 1, 0.5]; with is_cap 5 the weight
# of token 2 is truncated to 5.
GRPO_NEW = [-1.0, -2.0, -0.5, -1.0, -3.0]
GRPO_LOG_RATIO = [0.0, LN2, LN10, 0.0, -LN2]
GRPO_ADV = [1.0, 1.0, 1.0, -1.0, -1.0]
GRPO_SEQ = [0, 0, 0, 1, 1]


def _grpo_inputs():
    new = _leaf(GRPO_NEW)
    old = torch.tensor(GRPO_NEW) - torch.tensor(GRPO_LOG_RATIO)
    return new, old, torch.tensor(GRPO_ADV), torch.ones(5), torch.tensor(GRPO_SEQ)


def test_grpo_value_gradient_and_truncation():
    new, old, adv, mask, seq = _grpo_inputs()
    loss, metrics = rl_loss(new, old, adv, mask, AlgoConfig(), seq_ids=seq)
    # per-token -w*A*new: t0 -1*1*-1 = 1, t1 -2*1*-2 = 4, t2 -5*1*-0.5 = 2.5 (weight capped 10 -> 5),
    #                     t3 -1*-1*-1 = -1, t4 -0.5*-1*-3 = -1.5
    # default "sequences": token sum (1+4+2.5-1-1.5) = 5 over 2 sequences = 2.5
    assert loss.item() == pytest.approx(2.5)
    loss.backward()
    # d/dnew_t = -w_t*A_t / num_seqs: -1/2, -2/2, -5/2, +1/2, +0.5/2 (weight is a constant)
    expected = torch.tensor([-0.5, -1.0, -2.5, 0.5, 0.25])
    torch.testing.assert_close(new.grad, expected)
    assert metrics["truncated_frac"] == pytest.approx(1 / 5)
    assert metrics["clip_frac"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx((1 + 2 + 10 + 1 + 0.5) / 5)
    # ESS = (sum w)^2 / (n sum w^2) = 14.5^2 / (5 * 106.25) = 0.395765
    assert metrics["ess"] == pytest.approx(14.5**2 / (5 * 106.25))
    assert metrics["logprob_mismatch"] == pytest.approx((2 * LN2 + LN10) / 5)
    assert (metrics["num_tokens"], metrics["num_sequences"]) == (5.0, 2.0)


def test_grpo_raising_the_cap_removes_truncation():
    new, old, adv, mask, seq = _grpo_inputs()
    loss, metrics = rl_loss(new, old, adv, mask, AlgoConfig(is_cap=20.0), seq_ids=seq)
    # token 2 now keeps weight 10: -10*1*-0.5 = 5; loss = (1+4+5-1-1.5)/2
    assert loss.item() == pytest.approx(7.5 / 2)
    assert metrics["truncated_frac"] == 0.0


def test_grpo_padded_2d_batch_equals_packed_and_ignores_garbage():
    # Same two sequences as rows of a [2, 3] batch; the padding slot holds inf/nan garbage.
    new = _leaf([[-1.0, -2.0, -0.5], [-1.0, -3.0, float("-inf")]])
    old = torch.tensor([[-1.0, -2.0 - LN2, -0.5 - LN10], [-1.0, -3.0 + LN2, float("inf")]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, _ = rl_loss(new, old, adv, mask, AlgoConfig())  # no seq_ids: one row = one sequence
    assert loss.item() == pytest.approx(2.5)
    loss.backward()
    assert torch.isfinite(new.grad).all()
    assert new.grad[1, 2].item() == 0.0
    assert new.grad[1, 1].item() == pytest.approx(0.25)


def test_global_num_sequences_scales_the_micro_batch_loss():
    new, old, adv, mask, seq = _grpo_inputs()
    loss, _ = rl_loss(new, old, adv, mask, AlgoConfig(), seq_ids=seq, num_sequences=4)
    # same token sum 5, divided by the 4 sequences of the whole step
    assert loss.item() == pytest.approx(1.25)
    with pytest.raises(ValueError, match="num_sequences=1"):
        rl_loss(new, old, adv, mask, AlgoConfig(), seq_ids=seq, num_sequences=1)


# ---------------------------------------------------------------- ppo


def _one_token_rows(ratios: list[float], advs: list[float]):
    """Each row is one single-token sequence, so all three normalizations are a plain mean over rows."""
    new = _leaf([[0.0] for _ in ratios])
    old = torch.tensor([[-math.log(r)] for r in ratios])
    return new, old, torch.tensor([[a] for a in advs]), torch.ones(len(ratios), 1)


def test_ppo_clips_both_sides_for_both_advantage_signs():
    # eps 0.2 -> trust region [0.8, 1.2]
    #   A=+1, r=1.5: -min(1.5, 1.2)   = -1.2  clipped (gradient 0)
    #   A=+1, r=0.5: -min(0.5, 0.8)   = -0.5  unclipped, d/dnew = -r*A = -0.5
    #   A=-1, r=0.5: -min(-0.5, -0.8) = +0.8  clipped (gradient 0)
    #   A=-1, r=1.5: -min(-1.5, -1.2) = +1.5  unclipped, d/dnew = -r*A = +1.5
    # loss = (-1.2 - 0.5 + 0.8 + 1.5)/4 = 0.15; gradients are divided by the 4 sequences.
    new, old, adv, mask = _one_token_rows([1.5, 0.5, 0.5, 1.5], [1.0, 1.0, -1.0, -1.0])
    loss, metrics = rl_loss(new, old, adv, mask, AlgoConfig(name="ppo"))
    assert loss.item() == pytest.approx(0.15)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[0.0], [-0.125], [0.0], [0.375]]))
    assert metrics["clip_frac"] == pytest.approx(0.5)
    assert metrics["truncated_frac"] == 0.0


# ---------------------------------------------------------------- dapo

# seq 0 = tokens 0..2, seq 1 = token 3.   (A, r): (+1, 1.25) (+1, 1.3) (-1, 0.75) (-1, 1.0)
DAPO_RATIOS = [1.25, 1.3, 0.75, 1.0]
DAPO_ADV = [1.0, 1.0, -1.0, -1.0]


def _dapo_inputs():
    new = _leaf([0.0] * 4)
    old = torch.tensor([-math.log(r) for r in DAPO_RATIOS])
    return new, old, torch.tensor(DAPO_ADV), torch.ones(4), torch.tensor([0, 0, 0, 1])


def test_dapo_clip_higher_and_tokens_normalization():
    # trust region [0.8, 1.28]:
    #   t0: r=1.25 inside             -> -1.25, d/dnew = -1.25
    #   t1: r=1.3 > 1.28, A>0         -> -1.28, clipped
    #   t2: r=0.75 < 0.8, A<0         -> -min(-0.75, -0.8) = 0.8, clipped
    #   t3: r=1                       -> 1.0,  d/dnew = -r*A = +1
    # token normalization: (-1.25 - 1.28 + 0.8 + 1.0)/4 = -0.1825
    new, old, adv, mask, seq = _dapo_inputs()
    loss, metrics = rl_loss(new, old, adv, mask, AlgoConfig(name="dapo"), seq_ids=seq)
    assert loss.item() == pytest.approx(-0.1825)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([-1.25 / 4, 0.0, 0.0, 0.25]))
    assert metrics["clip_frac"] == pytest.approx(0.5)


def test_dapo_differs_from_ppo_only_where_clip_higher_matters():
    new, old, adv, mask, seq = _dapo_inputs()
    loss, _ = rl_loss(new, old, adv, mask, AlgoConfig(name="ppo", normalize="tokens"), seq_ids=seq)
    loss.backward()
    # Symmetric eps 0.2: t0 (r=1.25 > 1.2, A>0) is now clipped as well -> its gradient vanishes and its
    # value is -1.2: (-1.2 - 1.2 + 0.8 + 1.0)/4 = -0.15 (t1 is clipped at 1.2 too).
    assert loss.item() == pytest.approx(-0.15)
    torch.testing.assert_close(new.grad, torch.tensor([0.0, 0.0, 0.0, 0.25]))


def test_dapo_with_other_normalizations():
    new, old, adv, mask, seq = _dapo_inputs()
    # token terms (-1.25, -1.28, 0.8 | 1.0): seq0 sum -1.73, mean -0.576667; seq1 1.0
    loss, _ = rl_loss(new, old, adv, mask, AlgoConfig(name="dapo", normalize="sequences"), seq_ids=seq)
    assert loss.item() == pytest.approx((-1.73 + 1.0) / 2)
    loss, _ = rl_loss(new, old, adv, mask, AlgoConfig(name="dapo", normalize="sequence_mean"), seq_ids=seq)
    assert loss.item() == pytest.approx((-1.73 / 3 + 1.0) / 2)
    loss_tok, _ = rl_loss(new, old, adv, mask, AlgoConfig(name="dapo"), seq_ids=seq, num_tokens=8)
    assert loss_tok.item() == pytest.approx(-0.73 / 8)  # token-sum over the global 8 tokens


# ---------------------------------------------------------------- the three normalizations by hand

# Three packed sequences of different lengths, on-policy (old = new, so the grpo weight is 1 and the
# per-token term is l_t = -A_t * new_t, with gradient -A_t):
#   seq 0: 3 trained tokens, A = +1,   new = -1, -2, -3  ->  l = 1, 2, 3   (sum 6, mean 2)
#   seq 1: 1 trained token,  A = -2,   new = -0.5        ->  l = -1        (sum -1, mean -1)
#   seq 2: a prompt token (mask 0, garbage values) then 2 trained tokens, A = +0.5, new = -2, -4
#                                                        ->  l = 1, 2      (sum 3, mean 1.5)
# N = 3 sequences, N_tok = 6 trained tokens.
NORM_NEW = [-1.0, -2.0, -3.0, -0.5, float("-inf"), -2.0, -4.0]
NORM_ADV = [1.0, 1.0, 1.0, -2.0, float("nan"), 0.5, 0.5]
NORM_MASK = [1, 1, 1, 1, 0, 1, 1]
NORM_SEQ = [0, 0, 0, 1, 2, 2, 2]
NORM_EXPECTED = {
    # sum of all tokens / N: (6 - 1 + 3)/3; every token's gradient is -A_t/N whatever its sequence's length
    "sequences": (8 / 3, [-1 / 3, -1 / 3, -1 / 3, 2 / 3, 0.0, -1 / 6, -1 / 6]),
    # mean of the sequence means: (2 - 1 + 1.5)/3; gradient -A_t/(L_s N): a long answer's tokens weigh less
    "sequence_mean": (2.5 / 3, [-1 / 9, -1 / 9, -1 / 9, 2 / 3, 0.0, -1 / 12, -1 / 12]),
    # sum of all tokens / N_tok: 8/6; gradient -A_t/N_tok
    "tokens": (8 / 6, [-1 / 6, -1 / 6, -1 / 6, 1 / 3, 0.0, -1 / 12, -1 / 12]),
}


def _norm_loss(normalize: str, tokens: slice, **counts):
    new = _leaf(NORM_NEW[tokens])
    loss, _ = rl_loss(
        new,
        new.detach(),
        torch.tensor(NORM_ADV[tokens]),
        torch.tensor(NORM_MASK[tokens]),
        AlgoConfig(normalize=normalize),
        seq_ids=torch.tensor(NORM_SEQ[tokens]),
        **counts,
    )
    loss.backward()
    return loss.item(), new.grad


@pytest.mark.parametrize("normalize", list(NORM_EXPECTED))
def test_each_normalization_by_hand(normalize):
    expected_loss, expected_grad = NORM_EXPECTED[normalize]
    loss, grad = _norm_loss(normalize, slice(None))
    assert loss == pytest.approx(expected_loss)
    torch.testing.assert_close(grad, torch.tensor(expected_grad))


@pytest.mark.parametrize("normalize", list(NORM_EXPECTED))
def test_each_normalization_accumulates_exactly_over_micro_batches(normalize):
    # The same three sequences as two micro-batches, [seq 0] and [seq 1, seq 2], each given the counts
    # of the whole step: the losses add up to the one-batch loss and the gradients line up token by token.
    expected_loss, expected_grad = NORM_EXPECTED[normalize]
    counts = {"num_sequences": 3, "num_tokens": 6}
    loss_a, grad_a = _norm_loss(normalize, slice(0, 3), **counts)
    loss_b, grad_b = _norm_loss(normalize, slice(3, None), **counts)
    assert loss_a + loss_b == pytest.approx(expected_loss)
    torch.testing.assert_close(torch.cat([grad_a, grad_b]), torch.tensor(expected_grad))
    # Each micro-batch normalizing by its own counts gives another loss (here: seq 0 alone over N = 1).
    alone, _ = _norm_loss(normalize, slice(0, 3))
    assert alone != pytest.approx(loss_a)


# ---------------------------------------------------------------- KL and entropy


def test_k3_kl_value_and_gradient():
    # advantages 0 so only the KL term remains. d = ref - new = [ln2, -ln2]
    # k3 = e^d - d - 1 = [2 - ln2 - 1, 0.5 + ln2 - 1] = [0.306853, 0.193147]; their sum is exactly 0.5.
    new = _leaf([-1.0, -1.0])
    ref = torch.tensor([-1.0 + LN2, -1.0 - LN2])
    cfg = AlgoConfig(kl_coef=0.1)
    loss, metrics = rl_loss(new, new.detach(), torch.zeros(2), torch.ones(2), cfg, ref_logprobs=ref)
    assert loss.item() == pytest.approx(0.1 * 0.5)  # one sequence: 0.1 * sum of k3 / 1 sequence
    assert metrics["kl"] == pytest.approx(0.25)
    loss.backward()
    # d k3 / d new = 1 - e^d = [-1, 0.5], times 0.1
    torch.testing.assert_close(new.grad, torch.tensor([-0.1, 0.05]))


def test_kl_needs_reference_logprobs():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        rl_loss(x, x, x, torch.ones(2), AlgoConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        rl_loss(x, x, x, torch.ones(2), AlgoConfig(entropy_coef=0.1))


def test_entropy_bonus_is_subtracted():
    ent = _leaf([1.0, 3.0])
    new = _leaf([-1.0, -1.0])
    cfg = AlgoConfig(entropy_coef=0.01)
    loss, metrics = rl_loss(new, new.detach(), torch.zeros(2), torch.ones(2), cfg, entropy=ent)
    # one sequence: -0.01 * (1 + 3) / 1 = -0.04; d/dH = -0.01 per token
    assert loss.item() == pytest.approx(-0.04)
    assert metrics["entropy"] == pytest.approx(2.0)
    loss.backward()
    torch.testing.assert_close(ent.grad, torch.tensor([-0.01, -0.01]))


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("name", ["grpo", "ppo", "dapo", "decoupled"])
def test_empty_mask_gives_zero_loss_with_a_valid_graph(name):
    new = _leaf([-1.0, float("-inf"), -2.0])
    old = torch.tensor([float("inf"), 0.0, float("nan")])
    ent = _leaf([1.0, float("nan"), 2.0])
    ref = torch.tensor([0.0, float("inf"), -5.0])
    cfg = AlgoConfig(name=name, kl_coef=0.1, entropy_coef=0.01)
    loss, metrics = rl_loss(new, old, torch.ones(3), torch.zeros(3), cfg, ref_logprobs=ref, entropy=ent)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(new.grad, torch.zeros(3)) and torch.equal(ent.grad, torch.zeros(3))
    assert metrics["num_tokens"] == 0.0 and all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", ["grpo", "ppo", "dapo", "decoupled"])
def test_all_equal_rewards_give_zero_loss_and_zero_gradient(name):
    advantages = group_advantages([1.0, 1.0, 1.0], PreprocessConfig())
    assert advantages == [0.0, 0.0, 0.0]
    new = _leaf([-0.5, -1.0, -2.0])
    old = torch.tensor([-0.7, -0.4, -2.5])  # off-policy ratios must not matter when A = 0
    loss, _ = rl_loss(new, old, torch.tensor(advantages), torch.ones(3), AlgoConfig(name=name))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(new.grad, torch.zeros(3))


@pytest.mark.parametrize("name", ["grpo", "ppo", "dapo", "decoupled"])
def test_extreme_logprob_mismatch_stays_finite(name):
    # A sampler logprob of -1000 (a broken engine) gives log ratio +999: exp overflows float32 unless it
    # is bounded, and then 0 * inf = NaN would poison the whole step even for A = 0 tokens.
    new = _leaf([-1.0, -1.0])
    old = torch.tensor([-1000.0, -1.0])
    loss, metrics = rl_loss(new, old, torch.tensor([0.0, 1.0]), torch.ones(2), AlgoConfig(name=name))
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(new.grad).all()
    assert metrics["ess"] == pytest.approx(0.5)  # one weight dominates: ESS -> 1/n


def test_trained_counts_ignore_sequences_without_trained_tokens():
    mask = torch.tensor([0, 1, 1, 0, 0, 1])
    seq = torch.tensor([7, 7, 7, 9, 9, 4])  # any integers; sequence 9 has no trained token
    assert trained_counts(mask, seq) == (2, 3)
    assert trained_counts(torch.tensor([[1, 0], [0, 0], [1, 1]])) == (2, 3)


# ---------------------------------------------------------------- gradient accumulation

SEQ_LENGTHS = [3, 5, 2, 4]
Sequence = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _toy_data() -> list[Sequence]:
    """Four sequences of (features, labels, old logprobs, advantage per token, mask, token lags) for a
    linear model. Each sequence mixes versions: its early tokens are older (lags ..., 2, 1, 0)."""
    g = torch.Generator().manual_seed(0)
    data = []
    for length in SEQ_LENGTHS:
        x = torch.randn(length, 4, generator=g)
        labels = torch.randint(0, 6, (length,), generator=g)
        old = torch.randn(length, generator=g) * 0.3 - 1.8
        adv = torch.randn((), generator=g).expand(length)
        mask = (torch.rand(length, generator=g) > 0.2).float()
        mask[0] = 1.0  # every sequence is trained on, so each micro-batch has something to normalize
        lags = torch.arange(length).flip(0) % 3
        data.append((x, labels, old, adv, mask, lags))
    return data


def _pack(data: list[Sequence], seqs: list[int]):
    cols = [torch.cat([data[i][k] for i in seqs]) for k in range(6)]
    seq_ids = torch.cat([torch.full((SEQ_LENGTHS[i],), n) for n, i in enumerate(seqs)])
    return *cols, seq_ids


def _accumulated(
    cfg: AlgoConfig, micro_batches: list[list[int]], global_counts: bool
) -> tuple[float, torch.Tensor]:
    """(sum of the micro-batch losses, accumulated gradient of a linear model) over one step."""
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 6)
    data = _toy_data()
    packed = [_pack(data, mb) for mb in micro_batches]
    counts = {}
    if global_counts:  # what the trainer does: sum trained_counts over every micro-batch of the step
        per_mb = [trained_counts(p[4], p[6]) for p in packed]
        counts = {"num_sequences": sum(c[0] for c in per_mb), "num_tokens": sum(c[1] for c in per_mb)}
    total = 0.0
    for x, labels, old, adv, mask, lags, seq_ids in packed:
        logits = model(x)
        new = token_logprobs(logits, labels)
        ent = token_entropy(logits)
        loss, _ = rl_loss(new, old, adv, mask, cfg, seq_ids=seq_ids, entropy=ent, token_lags=lags, **counts)
        loss.backward()
        total += loss.item()
    return total, torch.cat([model.weight.grad.flatten(), model.bias.grad])


@pytest.mark.parametrize(
    "cfg",
    [
        AlgoConfig(),
        AlgoConfig(normalize="sequence_mean"),
        AlgoConfig(normalize="tokens"),
        AlgoConfig(name="ppo", entropy_coef=0.01),
        AlgoConfig(name="dapo", entropy_coef=0.01),
        AlgoConfig(name="dapo", entropy_coef=0.01, normalize="sequence_mean"),
        AlgoConfig(name="decoupled", entropy_coef=0.01),
        AlgoConfig(name="decoupled", normalize="sequence_mean", lag_correction="decay", lag_decay=0.7),
        AlgoConfig(name="ppo", lag_correction="decay", lag_decay=0.7),
    ],
    ids=[
        "grpo",
        "grpo-sequence_mean",
        "grpo-tokens",
        "ppo",
        "dapo",
        "dapo-sequence_mean",
        "decoupled",
        "decoupled-sequence_mean-decay",
        "ppo-decay",
    ],
)
@pytest.mark.parametrize("split", [[[0], [1, 2, 3]], [[3, 0], [2], [1]]], ids=["1+3", "2+1+1"])
def test_gradient_accumulation_with_global_counts_equals_one_big_batch(cfg, split):
    one_loss, one_batch = _accumulated(cfg, [[0, 1, 2, 3]], global_counts=False)
    acc_loss, accumulated = _accumulated(cfg, split, global_counts=True)
    assert one_batch.abs().max() > 1e-3  # the comparison below is not between two zero vectors
    assert acc_loss == pytest.approx(one_loss, rel=1e-5)
    torch.testing.assert_close(accumulated, one_batch)
    # Without the step's counts each micro-batch normalizes by itself and the sum is a different gradient.
    _, local = _accumulated(cfg, split, global_counts=False)
    assert not torch.allclose(local, one_batch, atol=1e-5)


# ---------------------------------------------------------------- logprobs and entropy


def test_token_logprobs_and_entropy_by_hand():
    # logits [0, ln3] -> p = [1/4, 3/4]
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]], dtype=torch.bfloat16)
    lp = token_logprobs(logits, torch.tensor([1, 0]))
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, torch.tensor([math.log(0.75), math.log(0.25)]), atol=1e-2, rtol=0)
    h = token_entropy(torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]]))
    # -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335 ; uniform over 2 = ln 2
    torch.testing.assert_close(h, torch.tensor([0.562335, LN2]))


def test_entropy_and_logprobs_survive_banned_tokens_and_ignore_labels():
    logits = torch.tensor([[0.0, 0.0, float("-inf")]], requires_grad=True)
    h = token_entropy(logits)
    assert h.item() == pytest.approx(LN2)
    lp = token_logprobs(logits, torch.tensor([-100]))  # -100: placeholder value, masked by the caller
    (h.sum() + lp.sum()).backward()
    assert torch.isfinite(lp).all() and torch.isfinite(logits.grad).all()


def test_packed_micro_batch_from_preprocess_matches_separate_sequences():
    # Two samples of one group, packed and collated as the trainer gets them, then shifted by one
    # (position t predicts token t+1). The boundary position (the logit at the end of sample a scoring
    # sample b's first token) must not leak into the loss.
    def sample(i: int, completion: list[int], reward: float) -> Sample:
        return Sample(
            sample_id=f"g/{i}",
            prompt_token_ids=[1, 2],
            completion_token_ids=completion,
            completion_logprobs=[-0.5] * len(completion),
            version_spans=[VersionSpan(version=0, start=0, end=len(completion))],
            finish_reason="stop",
            reward=reward,
        )

    group = RolloutGroup(
        group_id="g",
        task="t",
        prompt_index=0,
        actor_id=0,
        samples=[sample(0, [3, 4, 5], 1.0), sample(1, [6], 0.0)],
    )
    a, b = group_to_training_samples(group, PreprocessConfig(std_normalize=False))
    fake_new = {3: -0.2, 4: -0.9, 5: -0.4, 6: -1.5, 1: -7.0, 2: -3.0}  # "model" logprob of each token id

    def loss_of(micro_batch, num_sequences=None):
        packed = collate_micro_batch(micro_batch)
        new = torch.tensor([fake_new[t] for t in packed.input_ids[1:]])
        loss, _ = rl_loss(
            new,
            torch.tensor(packed.old_logprobs[1:]),
            torch.tensor(packed.advantages[1:]),
            torch.tensor(packed.labels_mask[1:]),
            AlgoConfig(),
            seq_ids=torch.tensor(packed.seq_ids[1:]),
            num_sequences=num_sequences,
        )
        return loss.item()

    together = loss_of([a, b])
    assert together == pytest.approx(loss_of([a], num_sequences=2) + loss_of([b], num_sequences=2))
    # by hand: A = +0.5 / -0.5; weight exp(new - old): a tokens exp(0.3), exp(-0.4), exp(0.1); b exp(-1)
    a_sum = -0.5 * (math.exp(0.3) * -0.2 + math.exp(-0.4) * -0.9 + math.exp(0.1) * -0.4)
    b_sum = 0.5 * math.exp(-1.0) * -1.5
    assert together == pytest.approx((a_sum + b_sum) / 2)  # token sum over the 2 sequences
