"""GAE over the trainer's packed micro-batch and the critic's clipped value loss, against plain per-token
Python loops in float64 (written from the formulas, not from the implementation) and a few hand-worked
numbers.

Run: .venv/bin/python -m pytest -q tests/unit/trainer/test_gae.py
"""

from __future__ import annotations

import math

import pytest
import torch

from pipeline_rl.messages import RolloutGroup, Sample
from pipeline_rl.preprocess.ops import PreprocessConfig, group_to_training_samples
from pipeline_rl.trainer.gae import gae, terminal_rewards
from pipeline_rl.trainer.losses import value_loss
from pipeline_rl.trainer.step import micro_batch_tensors

CPU = torch.device("cpu")
F64 = torch.float64
NAN = math.nan

# ---------------------------------------------------------------- references


def _reference_gae(mask, seq, seq_rewards, values, gamma, lam):
    """Per token: for each sequence, its trained tokens in order; reward on the last; V after it 0."""
    n = len(mask)
    adv, ret = [0.0] * n, [0.0] * n
    for s in sorted(set(seq)):
        trained = [t for t in range(n) if seq[t] == s and mask[t]]
        a, next_value = 0.0, 0.0
        for k in range(len(trained) - 1, -1, -1):
            t = trained[k]
            r = seq_rewards[s] if k == len(trained) - 1 else 0.0
            delta = r + gamma * next_value - values[t]
            a = delta + gamma * lam * a
            adv[t], ret[t] = a, a + values[t]
            next_value = values[t]
    return adv, ret


def _reference_value_loss(v, v_old, ret, mask, seq, clip, normalize, num_sequences, num_tokens):
    trained = [t for t in range(len(mask)) if mask[t]]
    lengths: dict[int, int] = {}
    for t in trained:
        lengths[seq[t]] = lengths.get(seq[t], 0) + 1
    n_seq = num_sequences or len(lengths)
    n_tok = num_tokens or len(trained)
    total, clipped = 0.0, 0
    for t in trained:
        term = (v[t] - ret[t]) ** 2
        if clip is not None:
            moved = min(max(v[t] - v_old[t], -clip), clip)
            clipped_term = (v_old[t] + moved - ret[t]) ** 2
            clipped += clipped_term > term
            term = max(term, clipped_term)
        weight = {
            "sequences": 1 / n_seq,
            "tokens": 1 / n_tok,
            "sequence_mean": 1 / (n_seq * lengths[seq[t]]),
        }[normalize]
        total += weight * 0.5 * term
    return total, clipped / len(trained)


# ---------------------------------------------------------------- a packed micro-batch


def _sample(i: int, prompt: list[int], completion: int, reward: float, mask: list[int] | None) -> Sample:
    return Sample(
        sample_id=f"g/{i}",
        prompt_token_ids=prompt,
        completion_token_ids=list(range(10, 10 + completion)),
        completion_logprobs=[-0.5] * completion,
        version_spans=[{"version": 0, "start": 0, "end": completion}],
        finish_reason="stop",
        reward=reward,
        completion_mask=mask,
    )


def _micro_batch():
    """Three samples through the real preprocessing and the trainer's collation:
    seq 0: a 3-token prompt and 4 model tokens;
    seq 1: a multi-turn episode, model [2] env [3] model [3] env [1] (the environment has the last word);
    seq 2: 40 completion tokens with environment gaps, long enough for several blocks of the scan.
    """
    long_mask = [0 if t % 7 in (3, 4) else 1 for t in range(40)]
    samples = [
        _sample(0, [1, 2, 3], 4, 1.0, None),
        _sample(1, [1, 2], 9, 0.0, [1, 1, 0, 0, 0, 1, 1, 1, 0]),
        _sample(2, [4, 5], 40, -0.5, long_mask),
    ]
    group = RolloutGroup(group_id="g", task="t", prompt_index=0, actor_id=0, samples=samples)
    micro_batch = group_to_training_samples(group, PreprocessConfig(seq_length=128))
    batch = micro_batch_tensors(micro_batch, CPU)
    seq_rewards = torch.tensor([s.reward for s in micro_batch], dtype=F64)
    return batch["mask"], batch["seq_ids"], seq_rewards


def test_the_micro_batch_has_what_the_gae_tests_need():
    mask, seq_ids, _ = _micro_batch()
    m, seq = mask.tolist(), seq_ids.tolist()
    # Shifted by one (position t holds token t+1): seq 0 keeps 6 of its 7 tokens, 2 prompt then 4 trained.
    assert seq[:6] == [0] * 6 and m[:6] == [0, 0, 1, 1, 1, 1]
    # Seq 1 keeps all its tokens (only the row's first token is shifted out): prompt 2, model 2, env 3,
    # model 3, env 1.
    one = [x for x, s in zip(m, seq, strict=True) if s == 1]
    assert one == [0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0]
    lengths = [sum(x for x, s in zip(m, seq, strict=True) if s == k) for k in range(3)]
    assert lengths == [4, 5, 40 - 2 * 6]


# ---------------------------------------------------------------- gae


def test_gae_worked_by_hand_across_an_environment_gap():
    # One sequence: prompt, trained, env, trained, trained. gamma = lam = 0.5, R = 1 on the last token.
    #   t=4: delta = 1 + 0.5*0      - 0.75 =  0.25     A = 0.25                    ret = 1.0
    #   t=3: delta = 0 + 0.5*0.75   - 0.25 =  0.125    A = 0.125 + 0.25*0.25  = 0.1875     ret = 0.4375
    #   t=1: delta = 0 + 0.5*0.25   - 0.5  = -0.375    A = -0.375 + 0.25*0.1875 = -0.328125 ret = 0.171875
    # The environment token t=2 is skipped: t=1's next value is V(3), not V(2) = 9.
    mask = torch.tensor([0, 1, 0, 1, 1])
    values = torch.tensor([9.0, 0.5, 9.0, 0.25, 0.75], dtype=F64)
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0], dtype=F64)
    adv, ret = gae(rewards, values, mask, torch.zeros(5, dtype=torch.long), 0.5, 0.5)
    assert adv.tolist() == [0.0, -0.328125, 0.0, 0.1875, 0.25]
    assert ret.tolist() == [0.0, 0.171875, 0.0, 0.4375, 1.0]


@pytest.mark.parametrize("gamma, lam", [(0.9, 0.8), (0.99, 0.95), (1.0, 0.95), (0.9, 0.0), (1.0, 1.0)])
def test_gae_matches_the_per_token_loop_on_a_packed_micro_batch(gamma, lam):
    mask, seq_ids, seq_rewards = _micro_batch()
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(mask.shape, generator=gen, dtype=F64)
    values_seen = torch.where(mask, values, torch.tensor(NAN, dtype=F64))  # untrained values are never read
    rewards = terminal_rewards(seq_rewards, mask, seq_ids)
    adv, ret = gae(rewards, values_seen, mask, seq_ids, gamma, lam)
    want_adv, want_ret = _reference_gae(
        mask.tolist(), seq_ids.tolist(), seq_rewards.tolist(), values.tolist(), gamma, lam
    )
    assert adv.dtype == ret.dtype == F64
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=F64), atol=1e-12, rtol=0)
    torch.testing.assert_close(ret, torch.tensor(want_ret, dtype=F64), atol=1e-12, rtol=0)


def test_gamma_and_lam_one_give_the_reward_minus_the_value():
    mask, seq_ids, seq_rewards = _micro_batch()
    values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    adv, ret = gae(terminal_rewards(seq_rewards, mask, seq_ids), values, mask, seq_ids, 1.0, 1.0)
    reward_of_token = seq_rewards[seq_ids]
    torch.testing.assert_close(adv[mask], (reward_of_token - values)[mask], atol=1e-12, rtol=0)
    torch.testing.assert_close(ret[mask], reward_of_token[mask], atol=1e-12, rtol=0)
    assert adv[~mask].eq(0).all() and ret[~mask].eq(0).all()


def test_each_reward_sits_on_its_sequence_last_trained_token():
    mask, seq_ids, seq_rewards = _micro_batch()
    m, seq = mask.tolist(), seq_ids.tolist()
    want = [0.0] * len(m)
    for s in range(3):
        last = max(t for t in range(len(m)) if seq[t] == s and m[t])
        want[last] = seq_rewards[s].item()
    rewards = terminal_rewards(seq_rewards, mask, seq_ids)
    assert rewards.tolist() == want
    # Seq 1 ends with an environment token: its reward is on the token before it, not on its last token.
    last_of_1 = max(t for t in range(len(m)) if seq[t] == 1)
    assert m[last_of_1] == 0 and rewards[last_of_1 - 1] == seq_rewards[1]
    with pytest.raises(ValueError, match="one reward per sequence"):
        terminal_rewards(seq_rewards[:2], mask, seq_ids)


def test_gae_on_rows_without_seq_ids():
    # [B, T]: each row is one sequence (rl_loss's convention without seq_ids).
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 1, 1, 1, 1]])
    values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    seq_rewards = torch.tensor([2.0, -1.0], dtype=F64)
    rewards = terminal_rewards(seq_rewards, mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 2.0, 0], [0, 0, 0, 0, 0, -1.0]]
    adv, ret = gae(rewards, values, mask, None, 0.95, 0.9)
    rows = [0] * 6 + [1] * 6
    want_adv, want_ret = _reference_gae(
        mask.reshape(-1).tolist(), rows, seq_rewards.tolist(), values.reshape(-1).tolist(), 0.95, 0.9
    )
    torch.testing.assert_close(adv.reshape(-1), torch.tensor(want_adv, dtype=F64), atol=1e-12, rtol=0)
    torch.testing.assert_close(ret.reshape(-1), torch.tensor(want_ret, dtype=F64), atol=1e-12, rtol=0)


def test_gae_on_interleaved_seq_ids():
    # rl_loss accepts any integers equal within a sequence; GAE links each sequence's trained tokens in
    # position order even when another sequence's tokens sit between them.
    seq = [7, 3, 7, 3, 3, 7, 7, 3]
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1])
    values = torch.randn(8, generator=torch.Generator().manual_seed(4), dtype=F64)
    seq_rewards = torch.zeros(8, dtype=F64)
    seq_rewards[3], seq_rewards[7] = 1.5, -2.0
    seq_ids = torch.tensor(seq)
    adv, ret = gae(terminal_rewards(seq_rewards, mask, seq_ids), values, mask, seq_ids, 0.9, 0.7)
    want_adv, want_ret = _reference_gae(mask.tolist(), seq, seq_rewards.tolist(), values.tolist(), 0.9, 0.7)
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=F64), atol=1e-12, rtol=0)
    torch.testing.assert_close(ret, torch.tensor(want_ret, dtype=F64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("length", [1, 2, 3, 4, 15, 16, 17, 300])
def test_gae_scan_blocks_on_sequences_of_many_lengths(length):
    # Sequences of ragged lengths in one batch cross the scan's block boundaries at different places.
    gen = torch.Generator().manual_seed(length)
    lengths = [length, max(1, length // 2), 1]
    seq = [k for k, n in enumerate(lengths) for _ in range(n + 1)]  # each with one untrained first token
    mask = torch.tensor([0 if t == 0 or seq[t - 1] != seq[t] else 1 for t in range(len(seq))])
    values = torch.randn(len(seq), generator=gen, dtype=F64)
    seq_rewards = torch.randn(3, generator=gen, dtype=F64)
    seq_ids = torch.tensor(seq)
    adv, _ = gae(terminal_rewards(seq_rewards, mask, seq_ids), values, mask, seq_ids, 0.97, 0.9)
    want, _ = _reference_gae(mask.tolist(), seq, seq_rewards.tolist(), values.tolist(), 0.97, 0.9)
    torch.testing.assert_close(adv, torch.tensor(want, dtype=F64), atol=1e-12, rtol=0)


def test_gae_edge_cases():
    mask = torch.tensor([0, 1, 1])
    seq_ids = torch.zeros(3, dtype=torch.long)
    values = torch.zeros(3, dtype=F64)
    with pytest.raises(ValueError, match="untrained token"):
        gae(torch.tensor([1.0, 0.0, 0.0], dtype=F64), values, mask, seq_ids, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        gae(torch.zeros(3, dtype=F64), values, mask, seq_ids, 1.5, 1.0)
    # A padding micro-batch (nothing trained): zeros, no error.
    adv, ret = gae(torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.bool), seq_ids, 0.9, 0.9)
    assert adv.tolist() == ret.tolist() == [0.0, 0.0, 0.0] and adv.dtype == torch.float32


# ---------------------------------------------------------------- value loss

# Two sequences; tokens 0 and 4 untrained (garbage there). clip c = 0.2:
#   t  v     v_old  R      (v-R)^2  v_old+clamp(v-v_old)  (.-R)^2   larger
#   1  1.0   0.5    0.0    1.0      0.7                   0.49      unclipped
#   2  0.5   0.0    1.0    0.25     0.2                   0.64      CLIPPED
#   3 -0.2   0.5   -0.3    0.01     0.3                   0.36      CLIPPED
#   5  2.0   1.0    0.5    2.25     1.2                   0.49      unclipped
#   6  0.0   0.1    0.05   0.0025   0.0 (within the clip) 0.0025    equal
# Halved: 0.5 + 0.32 + 0.18 + 1.125 + 0.00125 = 2.12625; "sequences" over 2 sequences: 1.063125.
VL_MASK = [0, 1, 1, 1, 0, 1, 1]
VL_SEQ = [0, 0, 0, 0, 1, 1, 1]
VL_V = [math.inf, 1.0, 0.5, -0.2, NAN, 2.0, 0.0]
VL_OLD = [0.0, 0.5, 0.0, 0.5, 0.0, 1.0, 0.1]
VL_RET = [0.0, 0.0, 1.0, -0.3, 0.0, 0.5, 0.05]


def _vl_inputs():
    v = torch.tensor(VL_V, dtype=F64, requires_grad=True)
    tensors = (torch.tensor(x, dtype=F64) for x in (VL_OLD, VL_RET))
    return v, *tensors, torch.tensor(VL_MASK), torch.tensor(VL_SEQ)


def test_value_loss_worked_by_hand():
    v, old, ret, mask, seq = _vl_inputs()
    loss, metrics = value_loss(v, old, ret, mask, 0.2, "sequences", seq_ids=seq)
    assert loss.item() == pytest.approx(1.063125, abs=1e-12)
    assert metrics["value_clip_frac"] == pytest.approx(0.4, abs=1e-12)
    assert (metrics["num_tokens"], metrics["num_sequences"]) == (5.0, 2.0)
    loss.backward()
    # d/dv of 0.5 (v - R)^2 / 2 is (v - R) / 2 where the unclipped term counts; the clipped term is
    # constant in v once the clamp binds, so tokens 2 and 3 get no gradient.
    torch.testing.assert_close(
        v.grad, torch.tensor([0.0, 0.5, 0.0, 0.0, 0.0, 0.75, -0.025], dtype=F64), atol=1e-12, rtol=0
    )
    unclipped, metrics = value_loss(v, old, ret, mask, None, "sequences", seq_ids=seq)
    assert unclipped.item() == pytest.approx(0.5 * (1.0 + 0.25 + 0.01 + 2.25 + 0.0025) / 2, abs=1e-12)
    assert metrics["value_clip_frac"] == 0.0


@pytest.mark.parametrize("normalize", ["sequences", "sequence_mean", "tokens"])
@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("counts", [(None, None), (4, 11)])
def test_value_loss_matches_the_per_token_loop(normalize, clip, counts):
    v, old, ret, mask, seq = _vl_inputs()
    num_sequences, num_tokens = counts
    loss, metrics = value_loss(
        v, old, ret, mask, clip, normalize, seq_ids=seq, num_sequences=num_sequences, num_tokens=num_tokens
    )
    want, clip_frac = _reference_value_loss(
        VL_V, VL_OLD, VL_RET, VL_MASK, VL_SEQ, clip, normalize, num_sequences, num_tokens
    )
    assert loss.dtype == F64
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert metrics["value_clip_frac"] == pytest.approx(clip_frac, abs=1e-12)
    assert metrics["value_loss"] == pytest.approx(want, abs=1e-12)


def test_value_loss_trains_on_gae_returns_of_the_micro_batch():
    # The two pieces together on the real layout. A critic at its targets has zero loss unclipped; clipped,
    # the pessimistic max keeps what the clip could not reach: (|R - v_old| - c)^2 where that is > 0.
    mask, seq_ids, seq_rewards = _micro_batch()
    values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    _, ret = gae(terminal_rewards(seq_rewards, mask, seq_ids), values, mask, seq_ids, 0.9, 0.8)
    at_target, _ = value_loss(ret, values, ret, mask, None, "tokens", seq_ids=seq_ids)
    assert at_target.item() == 0.0
    clipped, metrics = value_loss(ret, values, ret, mask, 0.2, "tokens", seq_ids=seq_ids)
    beyond = ((ret - values).abs() - 0.2).clamp(min=0)[mask]
    assert clipped.item() == pytest.approx(0.5 * float((beyond**2).mean()), abs=1e-12)
    assert metrics["value_clip_frac"] == pytest.approx(float((beyond > 0).double().mean()), abs=1e-12)
    assert 0 < metrics["value_clip_frac"] < 1
    loss, _ = value_loss(values, values, ret, mask, None, "tokens", seq_ids=seq_ids)
    assert loss.item() == pytest.approx(0.5 * float(((values - ret)[mask] ** 2).mean()), abs=1e-12)


def test_value_loss_refuses_bad_arguments():
    v, old, ret, mask, seq = _vl_inputs()
    with pytest.raises(ValueError, match="> 0"):
        value_loss(v, old, ret, mask, 0.0, "tokens", seq_ids=seq)
    with pytest.raises(ValueError, match="old_values"):
        value_loss(v, None, ret, mask, 0.2, "tokens", seq_ids=seq)
    with pytest.raises(ValueError, match="returns has shape"):
        value_loss(v, old, ret[:3], mask, None, "tokens", seq_ids=seq)
    with pytest.raises(ValueError, match="unknown normalization"):
        value_loss(v, old, ret, mask, None, "mean", seq_ids=seq)
