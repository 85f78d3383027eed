"""Decoupled PPO (AReaL) and the per-token lag correction, against a float64 reference written here from
the per-token formulas of docs/objectives.md, on one mixed-version batch.

Run: .venv/bin/python -m pytest -q tests/unit/trainer/test_decoupled.py
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from pipeline_rl.trainer.losses import AlgoConfig, rl_loss

NAN, INF = float("nan"), float("inf")

# Three packed sequences trained at step 5 (weights of version 4). Each row is one token:
#   (sequence, trained, advantage, new, proximal, old (sampler's), version)
# lag = 4 - version, so every sequence mixes versions. Untrained tokens hold garbage that must not leak.
# What each trained token exercises under decoupled (eps 0.2, cap 5; rho = exp(new - prox),
# w = exp(prox - old)):
MIXED = [
    (0, 1, 1.0, -1.0, -1.1, -1.3, 2),  # rho e^0.1 inside, w e^0.2
    (0, 1, 1.0, -0.5, -0.8, -1.0, 2),  # rho e^0.3 > 1.2 with A > 0: clipped
    (0, 1, 1.0, -2.0, -2.0, -4.0, 3),  # w e^2 = 7.4 > 5: masked by the behaviour cap
    (0, 1, 1.0, -0.7, -0.6, -0.6, 4),  # rho e^-0.1 below 1 with A > 0: not clipped
    (1, 0, NAN, -INF, NAN, INF, -1),  # the prompt token: garbage everywhere
    (1, 1, -0.5, -1.5, -1.2, -1.0, 1),  # rho e^-0.3 < 0.8 with A < 0: clipped
    (1, 1, -0.5, -0.3, -0.4, -2.0, 3),  # w e^1.6 = 4.95, just under the cap: kept
    (1, 1, -0.5, -1.0, -0.9, -0.5, 4),  # rho e^-0.1 inside, w e^-0.4
    (2, 1, 2.0, -0.2, -0.4, -0.1, 0),  # rho e^0.2 = 1.2214 > 1.2 with A > 0: clipped; lag 4
    (2, 0, 2.0, -3.0, -3.0, -9.0, 4),  # untrained in the middle (w e^6 would be masked: must not count)
    (2, 1, 2.0, -1.0, -1.05, -2.85, 1),  # rho e^0.05 inside, w e^1.8 = 6.05 > 5: masked; lag 3
]
STEP = 5
NAMES = ["grpo", "ppo", "dapo", "decoupled"]
NORMALIZE = ["sequences", "sequence_mean", "tokens"]


def _column(k: int) -> list:
    return [row[k] for row in MIXED]


def _tensors():
    new = torch.tensor(_column(3), dtype=torch.float32, requires_grad=True)
    return {
        "new": new,
        "prox": torch.tensor(_column(4)),
        "old": torch.tensor(_column(5)),
        "adv": torch.tensor(_column(2)),
        "mask": torch.tensor(_column(1)),
        "seq": torch.tensor(_column(0)),
        "lags": (STEP - 1) - torch.tensor(_column(6)),
    }


def _reference(cfg: AlgoConfig, proximal: list[float]) -> tuple[float, list[float]]:
    """(loss, d loss / d new_t) in float64 from the per-token formulas, without the code under test."""
    trained = [i for i, row in enumerate(MIXED) if row[1]]
    lengths: dict[int, int] = {}
    for i in trained:
        lengths[MIXED[i][0]] = lengths.get(MIXED[i][0], 0) + 1
    n_seq, n_tok = len(lengths), len(trained)
    loss, grad = 0.0, [0.0] * len(MIXED)
    for i in trained:
        s, _, a, new, _, old, version = MIXED[i]
        weight = {
            "sequences": 1 / n_seq,
            "sequence_mean": 1 / (n_seq * lengths[s]),
            "tokens": 1 / n_tok,
        }[cfg.normalize]
        decay = cfg.lag_decay ** ((STEP - 1) - version) if cfg.lag_correction == "decay" else 1.0
        if cfg.name == "grpo":
            w = min(math.exp(new - old), cfg.is_cap)
            term, d_term = -w * a * new, -w * a
        else:
            # ppo/dapo: the ratio to the sampler, no behaviour weight; decoupled: ratio to the proximal
            # policy times the behaviour weight, zero above the cap.
            anchor, behav = old, 1.0
            if cfg.name == "decoupled":
                anchor = proximal[i]
                behav = math.exp(anchor - old)
                behav = 0.0 if behav > cfg.behav_imp_weight_cap else behav
            rho = math.exp(new - anchor)
            low, high = 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high
            clipped_rho = min(max(rho, low), high)
            if rho * a <= clipped_rho * a:  # the unclipped branch is the min: d(rho)/d(new) = rho
                term, d_term = -behav * rho * a, -behav * rho * a
            else:  # the clipped branch is a constant
                term, d_term = -behav * clipped_rho * a, 0.0
        loss += weight * decay * term
        grad[i] = weight * decay * d_term
    return loss, grad


def _config(name: str, normalize: str, lag: bool) -> AlgoConfig:
    extra = {"lag_correction": "decay", "lag_decay": 0.8} if lag else {}
    return AlgoConfig(name=name, normalize=normalize, **extra)


# ---------------------------------------------------------------- every objective against the reference


@pytest.mark.parametrize("normalize", NORMALIZE)
@pytest.mark.parametrize("lag", [False, True], ids=["lag-none", "lag-decay"])
@pytest.mark.parametrize("name", NAMES)
def test_mixed_version_batch_matches_the_float64_reference(name, lag, normalize):
    cfg = _config(name, normalize, lag)
    t = _tensors()
    proximal = t["prox"] if name == "decoupled" else None
    loss, _ = rl_loss(
        t["new"],
        t["old"],
        t["adv"],
        t["mask"],
        cfg,
        seq_ids=t["seq"],
        proximal_logprobs=proximal,
        token_lags=t["lags"],
    )
    loss.backward()
    expected_loss, expected_grad = _reference(cfg, _column(4))
    assert abs(expected_loss) > 1e-3  # a comparison of two near-zero losses would prove nothing
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(t["new"].grad.double(), torch.tensor(expected_grad, dtype=torch.float64))


def test_decoupled_metrics_count_masked_and_clipped_trained_tokens_only():
    t = _tensors()
    _, metrics = rl_loss(
        t["new"],
        t["old"],
        t["adv"],
        t["mask"],
        AlgoConfig(name="decoupled"),
        seq_ids=t["seq"],
        proximal_logprobs=t["prox"],
    )
    # 9 trained tokens: masked by the cap rows 2 and 10 (row 9 would be, but is not trained);
    # clipped rows 1, 5 and 8.
    assert metrics["behav_masked_frac"] == pytest.approx(2 / 9)
    assert metrics["clip_frac"] == pytest.approx(3 / 9)
    assert metrics["truncated_frac"] == 0.0
    assert (metrics["num_tokens"], metrics["num_sequences"]) == (9.0, 3.0)


def test_the_lag_decay_weighs_each_token_of_a_mixed_version_sequence_by_its_own_lag():
    # Sequence 0 alone (versions 2, 2, 3, 4 at step 5): the per-token gradients with decay 0.8 divided by
    # those without are 0.8 ** lag_t token by token (lags 2, 2, 1, 0), not one factor for the sequence.
    t = _tensors()
    grads = []
    for lag in (False, True):
        new = t["new"].detach()[:4].clone().requires_grad_(True)
        loss, _ = rl_loss(
            new,
            t["old"][:4],
            t["adv"][:4],
            t["mask"][:4],
            _config("grpo", "sequences", lag),
            token_lags=t["lags"][:4],
        )
        loss.backward()
        grads.append(new.grad)
    torch.testing.assert_close(grads[1] / grads[0], torch.tensor([0.8**2, 0.8**2, 0.8, 1.0]))


# ---------------------------------------------------------------- what decoupled is in this trainer


@pytest.mark.parametrize("normalize", NORMALIZE)
def test_decoupled_with_the_default_proximal_is_grpo_with_a_masked_weight(normalize):
    """One optimizer step per batch: proximal = sg(new), so rho = 1, nothing is clipped, and the gradient
    is -w_t A_t with w_t = exp(new - old) (or 0 above the cap): grpo's, masked instead of truncated."""
    t = _tensors()
    loss, metrics = rl_loss(
        t["new"],
        t["old"],
        t["adv"],
        t["mask"],
        AlgoConfig(name="decoupled", normalize=normalize),
        seq_ids=t["seq"],
    )
    loss.backward()
    as_proximal = _column(3)  # the reference with proximal = new
    expected_loss, expected_grad = _reference(AlgoConfig(name="decoupled", normalize=normalize), as_proximal)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    torch.testing.assert_close(t["new"].grad.double(), torch.tensor(expected_grad, dtype=torch.float64))
    assert metrics["clip_frac"] == 0.0

    grpo_new = t["new"].detach().clone().requires_grad_(True)
    grpo_loss, _ = rl_loss(
        grpo_new, t["old"], t["adv"], t["mask"], AlgoConfig(normalize=normalize), seq_ids=t["seq"]
    )
    grpo_loss.backward()
    ratio = torch.exp(t["new"].detach() - t["old"])
    kept = t["mask"].bool() & (ratio <= 5.0)
    over = t["mask"].bool() & (ratio > 5.0)
    assert kept.sum() == 6 and over.sum() == 3  # rows 2, 6, 10: exp(new - old) = e^2, e^1.7, e^1.85
    torch.testing.assert_close(t["new"].grad[kept], grpo_new.grad[kept])
    assert (t["new"].grad[over] == 0).all() and (grpo_new.grad[over] != 0).all()


# ---------------------------------------------------------------- lag_correction=none is today's loss


@pytest.mark.parametrize("name", NAMES)
def test_lag_correction_none_ignores_token_lags_bit_for_bit(name):
    results = []
    for lags in (None, "given"):
        t = _tensors()
        loss, metrics = rl_loss(
            t["new"],
            t["old"],
            t["adv"],
            t["mask"],
            AlgoConfig(name=name),
            seq_ids=t["seq"],
            token_lags=None if lags is None else t["lags"],
        )
        loss.backward()
        results.append((loss.detach(), t["new"].grad, metrics))
    (loss_a, grad_a, metrics_a), (loss_b, grad_b, metrics_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b) and metrics_a == metrics_b


@pytest.mark.parametrize("name", NAMES)
def test_decay_at_lag_zero_is_bit_identical_to_no_correction(name):
    results = []
    for cfg in (AlgoConfig(name=name), AlgoConfig(name=name, lag_correction="decay", lag_decay=0.5)):
        t = _tensors()
        loss, _ = rl_loss(
            t["new"], t["old"], t["adv"], t["mask"], cfg, seq_ids=t["seq"], token_lags=torch.zeros(len(MIXED))
        )
        loss.backward()
        results.append((loss.detach(), t["new"].grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


# ---------------------------------------------------------------- config and misuse


def test_decoupled_and_lag_defaults():
    cfg = AlgoConfig(name="decoupled")
    assert (cfg.clip_eps_low, cfg.clip_eps_high, cfg.behav_imp_weight_cap) == (0.2, 0.2, 5.0)
    assert (cfg.normalize, cfg.is_cap, cfg.lag_correction, cfg.lag_decay) == ("tokens", None, "none", None)
    assert AlgoConfig.model_validate(cfg.model_dump()) == cfg
    decay = AlgoConfig(lag_correction="decay", lag_decay=0.9)
    assert (decay.name, decay.is_cap, decay.lag_decay) == ("grpo", 5.0, 0.9)
    assert AlgoConfig.model_validate(decay.model_dump()) == decay


@pytest.mark.parametrize(
    "kwargs, hint",
    [
        ({"name": "decoupled", "is_cap": 3.0}, "algo.behav_imp_weight_cap instead"),
        ({"name": "ppo", "behav_imp_weight_cap": 5.0}, "Remove it or set algo.name=decoupled"),
        ({"behav_imp_weight_cap": 5.0}, "only applies to decoupled"),
        ({"name": "decoupled", "behav_imp_weight_cap": 1.0}, "must be > 1"),
        ({"name": "decoupled", "clip_eps_low": 1.0}, "(0, 1)"),
        ({"name": "decoupled", "clip_eps_high": 0.0}, "clip_eps_high must be > 0"),
        ({"lag_correction": "decay"}, "needs algo.lag_decay in (0, 1)"),
        ({"lag_correction": "decay", "lag_decay": 1.0}, "algo.lag_correction=none"),
        ({"lag_correction": "decay", "lag_decay": 0.0}, "needs algo.lag_decay in (0, 1)"),
        ({"lag_decay": 0.9}, "set lag_correction=decay or remove"),
        ({"lag_correction": "gamma"}, "'none' or 'decay'"),
    ],
)
def test_bad_decoupled_and_lag_configs_are_refused_with_a_fix(kwargs, hint):
    with pytest.raises(ValidationError) as err:
        AlgoConfig(**kwargs)
    assert hint in str(err.value)


def test_rl_loss_refuses_missing_lags_stray_proximal_and_negative_lags():
    t = _tensors()
    args = (t["new"], t["old"], t["adv"], t["mask"])
    decay = AlgoConfig(lag_correction="decay", lag_decay=0.9)
    with pytest.raises(ValueError, match="needs token_lags"):
        rl_loss(*args, decay, seq_ids=t["seq"])
    with pytest.raises(ValueError, match="only apply to algo.name=decoupled"):
        rl_loss(*args, AlgoConfig(name="ppo"), proximal_logprobs=t["prox"])
    with pytest.raises(ValueError, match="token_lags has shape"):
        rl_loss(*args, decay, token_lags=t["lags"][:3])
    newer = t["lags"].clone()
    newer[0] = -1  # a trained token sampled by weights newer than the trainer's
    with pytest.raises(ValueError, match="negative lag"):
        rl_loss(*args, decay, seq_ids=t["seq"], token_lags=newer)
    newer = t["lags"].clone()
    newer[4] = -1  # the same on an untrained token does not matter
    loss, _ = rl_loss(*args, decay, seq_ids=t["seq"], token_lags=newer)
    assert math.isfinite(loss.item())
