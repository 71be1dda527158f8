"""Hand-computed checks of ppolm.core: every expected number is worked out in a comment."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppolm.core import (
    KL_KINDS,
    LOSS_AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    RunningScale,
    aggregate_denominator,
    aggregate_loss,
    dpo_loss,
    entropy_from_logits,
    explained_variance,
    gae,
    group_baseline,
    grouped_pairwise_loss,
    grpo_advantages,
    kl_loss,
    kl_lr_scale,
    kl_penalty,
    last_token_index,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    pairwise_loss,
    policy_loss,
    reinforce_pp_returns,
    remax_advantages,
    rloo_advantages,
    score_center,
    score_unit,
    shape_rewards,
    value_loss,
)

REPO = Path(__file__).resolve().parents[1]

# Uneven lengths in T=3: row 0 has 3 real tokens, row 1 has 1.
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


def close(actual: torch.Tensor | float, expected, atol: float = 1e-6) -> None:
    actual_t = torch.as_tensor(actual, dtype=torch.float64)
    expected_t = torch.as_tensor(expected, dtype=torch.float64)
    assert actual_t.shape == expected_t.shape, (actual_t.shape, expected_t.shape)
    assert torch.allclose(actual_t, expected_t, atol=atol, rtol=0), (actual_t, expected_t)


# ----------------------------------------------------------------------------- masked statistics


def test_masked_sum_and_mean_uneven_rows() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0]])
    # real entries: 1, 2, 3, 4 -> sum 10, count 4, mean 2.5 (50 and 60 are padding)
    close(masked_sum(x, MASK), 10.0)
    close(masked_mean(x, MASK), 2.5)
    # per row: (1+2+3)/3 = 2; 4/1 = 4
    close(masked_sum(x, MASK, dim=1), [6.0, 4.0])
    close(masked_mean(x, MASK, dim=1), [2.0, 4.0])
    # per column: (1+4)/2 = 2.5; 2/1 = 2; 3/1 = 3
    close(masked_mean(x, MASK, dim=0), [2.5, 2.0, 3.0])
    # bool and long masks mean the same
    close(masked_mean(x, MASK.bool()), 2.5)
    close(masked_mean(x, MASK.long()), 2.5)


def test_masked_var_biased_unbiased_and_errors() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0]])
    # entries 1,2,3,4: mean 2.5, squared deviations 2.25+0.25+0.25+2.25 = 5
    # biased 5/4 = 1.25; unbiased 5/3 = 1.666667
    close(masked_var(x, MASK, unbiased=False), 1.25)
    close(masked_var(x, MASK), 5.0 / 3.0)
    with pytest.raises(ValueError):
        masked_var(x, torch.zeros(2, 3))
    one = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    with pytest.raises(ValueError):
        masked_var(x, one, unbiased=True)
    # a single entry has biased variance 0
    close(masked_var(x, one, unbiased=False), 0.0)


def test_masked_whiten_shift_mean_true_and_false() -> None:
    x = torch.tensor([[1.0, 5.0, 1.0], [5.0, 99.0, -7.0]])
    # entries 1,5,1,5: mean 3, deviations -2,2,-2,2, biased var 16/4 = 4, sigma = 2
    # whitened: (1-3)/2 = -1, (5-3)/2 = 1, -1, 1; padding -> 0
    close(masked_whiten(x, MASK), [[-1.0, 1.0, -1.0], [1.0, 0.0, 0.0]])
    # shift_mean=False adds the mean 3 back: 2, 4, 2, 4
    close(masked_whiten(x, MASK, shift_mean=False), [[2.0, 4.0, 2.0], [4.0, 0.0, 0.0]])


# ----------------------------------------------------------------------------- logits


def test_logprobs_from_logits_temperature_two() -> None:
    logits = torch.tensor([[[2.0, 0.0, -2.0], [2.0, 0.0, -2.0], [0.0, 0.0, 0.0]]])
    tokens = torch.tensor([[0, 2, 1]])
    # T=2: logits/2 = [1, 0, -1]; logsumexp = log(e + 1 + 1/e) = log(2.7182818 + 1 + 0.3678794)
    #      = log(4.0861613) = 1.4076060
    # token 0: 1 - 1.4076060 = -0.4076060; token 2: -1 - 1.4076060 = -2.4076060
    # uniform row: log(1/3) = -1.0986123 whatever the temperature
    out = logprobs_from_logits(logits, tokens, temperature=2.0)
    assert out.shape == (1, 3) and out.dtype == torch.float32
    close(out, [[-0.4076060, -2.4076060, -1.0986123]])
    # T=1: logsumexp([2,0,-2]) = log(7.3890561 + 1 + 0.1353353) = log(8.5243914) = 2.1429316
    # token 0: 2 - 2.1429316 = -0.1429316
    close(logprobs_from_logits(logits, tokens)[0, 0], -0.1429316)
    with pytest.raises(ValueError):
        logprobs_from_logits(logits, tokens, temperature=0.0)


def test_logprobs_from_bf16_logits_are_float32() -> None:
    logits = torch.tensor([[[2.0, 0.0, -2.0]]], dtype=torch.bfloat16)  # exactly representable
    out = logprobs_from_logits(logits, torch.tensor([[0]]), temperature=2.0)
    assert out.dtype == torch.float32
    close(out, [[-0.4076060]])


def test_entropy_uniform_one_hot_and_two_way() -> None:
    # uniform over V=4: entropy = log 4 = 1.3862944
    uniform = torch.zeros(1, 1, 4)
    close(entropy_from_logits(uniform), [[math.log(4.0)]])
    # near one-hot: p = [1, e^-100, e^-100] -> entropy ~ 2 * 100 * e^-100 ~ 0
    peaked = torch.tensor([[[100.0, 0.0, 0.0]]])
    close(entropy_from_logits(peaked), [[0.0]])
    # logits [log 3, 0] -> p = [3/4, 1/4]
    # H = 3/4 log(4/3) + 1/4 log 4 = 0.75*0.2876821 + 0.25*1.3862944 = 0.2157616 + 0.3465736 = 0.5623351
    two = torch.tensor([[[math.log(3.0), 0.0]]], dtype=torch.bfloat16).float()
    close(entropy_from_logits(two), [[0.5623351]], atol=1e-3)  # bf16 rounding of log 3
    exact = torch.tensor([[[math.log(3.0), 0.0]]])
    out = entropy_from_logits(exact)
    assert out.dtype == torch.float32
    close(out, [[0.5623351]])


# ----------------------------------------------------------------------------- KL


def test_kl_penalty_k1_k2_k3() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    ref = torch.tensor([[-2.0, -1.0, -3.0]])
    # d = logp - ref = [1, -1, 0]
    close(kl_penalty(logp, ref, "k1"), [[1.0, -1.0, 0.0]])  # k1 can be negative
    # k2 = d^2 / 2 = [0.5, 0.5, 0]
    close(kl_penalty(logp, ref, "k2"), [[0.5, 0.5, 0.0]])
    # k3 = exp(ref - logp) - 1 - (ref - logp): r = [-1, 1, 0]
    # r=-1: e^-1 - 1 + 1 = 0.3678794; r=1: e - 1 - 1 = 0.7182818; r=0: 0
    close(kl_penalty(logp, ref, "k3"), [[0.3678794, 0.7182818, 0.0]])
    assert (kl_penalty(logp, ref, "k1") < 0).any()


def test_kl_loss_gradient_pulls_toward_the_reference() -> None:
    """--kl-in loss: the term's gradient w.r.t. the policy's log-probs depends on the reference.

    k3 = exp(r) - 1 - r with r = ref - logp, so d k3 / d logp = 1 - exp(ref - logp) = 1 - p_ref / p:
    negative (raise logp) where the reference gives the token more probability, positive where
    less, zero where they agree. k1 = logp - ref has gradient 1 whatever the reference, and
    mean(logp) is only pushed down, never toward anything."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    ref = torch.tensor([[math.log(2.0), math.log(0.5), 0.0, 5.0]])
    logp = torch.zeros(1, 4, requires_grad=True)
    kl_loss(logp, ref, mask).backward()
    # masked mean over 3 tokens: (1 - 2) / 3, (1 - 0.5) / 3, (1 - 1) / 3; the masked token gets 0
    close(logp.grad, [[-1 / 3, 0.5 / 3, 0.0, 0.0]])
    # the value is the mean k3: (2 - 1 - ln 2 + 0.5 - 1 + ln 2 + 0) / 3 = 0.5 / 3
    assert kl_loss(logp, ref, mask).item() == pytest.approx(0.5 / 3, abs=1e-6)
    # with k1 the gradient is the same for any reference: what the loss term must not be
    k1 = torch.zeros(1, 4, requires_grad=True)
    masked_mean(kl_penalty(k1, ref, "k1"), mask).backward()
    close(k1.grad, [[1 / 3, 1 / 3, 1 / 3, 0.0]])


def test_k3_is_never_negative() -> None:
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(8, 16, generator=gen) * 5
    ref = -torch.rand(8, 16, generator=gen) * 5
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert (kl_penalty(logp, ref, "k2") >= 0).all()


def test_k3_gradient_depends_on_the_reference_k1_does_not() -> None:
    # d k3 / d logp = d/dlogp [exp(ref - logp) - 1 - (ref - logp)] = 1 - exp(ref - logp)
    # logp = -1, ref = -2, -1, 0: 1 - e^-1 = 0.6321206; 1 - 1 = 0; 1 - e = -1.7182818
    logp = torch.full((1, 3), -1.0, requires_grad=True)
    ref = torch.tensor([[-2.0, -1.0, 0.0]])
    kl_penalty(logp, ref, "k3").sum().backward()
    close(logp.grad, [[0.6321206, 0.0, -1.7182818]])
    # k1 = logp - ref: gradient 1 whatever the reference
    logp.grad = None
    kl_penalty(logp, ref, "k1").sum().backward()
    close(logp.grad, [[1.0, 1.0, 1.0]])


def test_kl_penalty_unknown_kind_names_the_valid_ones() -> None:
    assert KL_KINDS == ("k1", "k2", "k3")
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "full")


# ----------------------------------------------------------------------------- rewards


def test_last_token_index() -> None:
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    idx = last_token_index(mask)
    assert idx.dtype == torch.long
    assert idx.tolist() == [2, 0, 1]
    assert last_token_index(mask.bool()).tolist() == [2, 0, 1]
    with pytest.raises(ValueError):
        last_token_index(torch.tensor([[1, 1, 0], [0, 0, 0]]))


def test_shape_rewards_score_at_last_real_token_only() -> None:
    scores = torch.tensor([10.0, 20.0])
    kl = torch.tensor([[0.5, 1.0, 2.0], [4.0, 8.0, 8.0]])
    rewards, non_score = shape_rewards(scores, kl, 0.1, MASK)
    # non_score = -0.1 * kl * mask = [[-0.05, -0.1, -0.2], [-0.4, 0, 0]]
    close(non_score, [[-0.05, -0.1, -0.2], [-0.4, 0.0, 0.0]])
    # scores land at t=2 (row 0) and t=0 (row 1): -0.2 + 10 = 9.8; -0.4 + 20 = 19.6
    close(rewards, [[-0.05, -0.1, 9.8], [19.6, 0.0, 0.0]])


# ----------------------------------------------------------------------------- GAE


def test_gae_hand_recursion_gamma1_lambda095() -> None:
    rewards = torch.tensor([[1.0, 0.0, 2.0], [3.0, 5.0, 5.0]])  # row 1 padding holds garbage
    values = torch.tensor([[1.0, 2.0, 1.0], [0.5, 9.0, 9.0]])
    adv, ret = gae(rewards, values, MASK, gamma=1.0, lam=0.95)
    # row 0 (length 3), backwards, V after the last token = 0:
    #   t=2: delta = 2 + 0 - 1 = 1;            A2 = 1
    #   t=1: delta = 0 + 1*1 - 2 = -1;         A1 = -1 + 0.95*1 = -0.05
    #   t=0: delta = 1 + 1*2 - 1 = 2;          A0 = 2 + 0.95*(-0.05) = 1.9525
    #   returns = A + V = [2.9525, 1.95, 2]
    # row 1 (length 1): t=0: delta = 3 + 0 - 0.5 = 2.5; A0 = 2.5; return 3.0; padding 0
    close(adv, [[1.9525, -0.05, 1.0], [2.5, 0.0, 0.0]])
    close(ret, [[2.9525, 1.95, 2.0], [3.0, 0.0, 0.0]])
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32


def test_gae_lambda1_gives_reward_to_go_and_zeros_on_padding() -> None:
    rewards = torch.tensor([[1.0, 0.0, 2.0], [3.0, 5.0, 5.0]])
    values = torch.tensor([[1.0, 2.0, 1.0], [0.5, 9.0, 9.0]])
    adv, ret = gae(rewards, values, MASK, gamma=1.0, lam=1.0)
    # gamma = lam = 1: returns are the sums of future rewards: row 0 [1+0+2, 0+2, 2] = [3, 2, 2]
    # row 1: [3]; advantages = returns - values = [2, 0, 1], [2.5]
    close(ret, [[3.0, 2.0, 2.0], [3.0, 0.0, 0.0]])
    close(adv, [[2.0, 0.0, 1.0], [2.5, 0.0, 0.0]])
    assert (adv[MASK == 0] == 0).all() and (ret[MASK == 0] == 0).all()


def test_gae_discount_gamma_half_lambda_half() -> None:
    rewards = torch.tensor([[0.0, 0.0, 4.0]])
    values = torch.zeros(1, 3)
    adv, _ = gae(rewards, values, torch.ones(1, 3), gamma=0.5, lam=0.5)
    # V = 0 so delta = r: A2 = 4; A1 = 0 + 0.25*4 = 1; A0 = 0 + 0.25*1 = 0.25
    close(adv, [[0.25, 1.0, 4.0]])


# ----------------------------------------------------------------------------- critic-free advantages

# Four groups, rows interleaved, ids neither contiguous nor sorted:
#   id 3: rows 0, 2, 4 with scores 1, 2, 3; id 7: rows 1, 5 with 4, 8; id 0: row 3 alone (5);
#   id 1: rows 6-8, all 0.7 (a tie).
GROUP_SCORES = torch.tensor([1.0, 4.0, 2.0, 5.0, 3.0, 8.0, 0.7, 0.7, 0.7])
GROUP_IDS = torch.tensor([3, 7, 3, 0, 3, 7, 1, 1, 1])


def test_grpo_and_dr_grpo_advantages_uneven_groups() -> None:
    adv = grpo_advantages(GROUP_SCORES, GROUP_IDS)
    # id 3: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1 -> (1-2)/1 = -1, 0, 1 (eps 1e-6 moves the 6th digit)
    # id 7: mean 6, unbiased std sqrt((4 + 4) / 1) = 2.8284271 -> -2/2.8284271 = -0.7071068, +0.7071068
    # id 0 (singleton) and id 1 (all equal): 0
    close(adv, [-1.0, -0.7071068, 0.0, 0.0, 1.0, 0.7071068, 0.0, 0.0, 0.0], atol=1e-5)
    assert adv.shape == (9,) and adv.dtype == torch.float32
    assert (adv[[3, 6, 7, 8]] == 0).all()  # exactly, not eps-scaled rounding noise
    # Dr. GRPO: no division by the std: s - mean = -1, -2, 0, 0, 1, 2, 0, 0, 0
    close(grpo_advantages(GROUP_SCORES, GROUP_IDS, scale=False), [-1.0, -2.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.0])
    # the biased std would give id 7 std 2 -> +-1, not +-0.7071068
    assert abs(float(adv[5]) - 1.0) > 0.2


def test_rloo_leave_one_out_baseline() -> None:
    adv = rloo_advantages(GROUP_SCORES, GROUP_IDS)
    # id 3: 1 - (2+3)/2 = -1.5; 2 - (1+3)/2 = 0; 3 - (1+2)/2 = 1.5
    # id 7: 4 - 8 = -4; 8 - 4 = 4;  singleton (no other response) 0;  tie 0
    close(adv, [-1.5, -4.0, 0.0, 0.0, 1.5, 4.0, 0.0, 0.0, 0.0])
    assert (adv[[3, 6, 7, 8]] == 0).all()


def test_group_baseline_and_remax() -> None:
    # s - group mean: id 3: -1, 0, 1; id 7: -2, 2; singleton: 5 - 5 = 0; tie 0
    close(group_baseline(GROUP_SCORES, GROUP_IDS), [-1.0, -2.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.0])
    # ReMax: s - greedy score of the same prompt: 1 - 0.25 = 0.75; 0.5 - 0.5 = 0; -1 - 2 = -3
    close(remax_advantages(torch.tensor([1.0, 0.5, -1.0]), torch.tensor([0.25, 0.5, 2.0])), [0.75, 0.0, -3.0])
    with pytest.raises(ValueError):
        remax_advantages(torch.zeros(3), torch.zeros(2))


def test_group_estimators_all_ties_singletons_and_bad_shapes() -> None:
    ties = torch.full((4,), 0.1)  # 0.1 is not exact in binary: the group mean may round
    ids = torch.tensor([0, 0, 0, 0])
    for fn in (grpo_advantages, rloo_advantages, group_baseline):
        out = fn(ties, ids)
        assert torch.isfinite(out).all() and (out == 0).all(), fn.__name__
        alone = fn(torch.tensor([3.0, -2.0]), torch.tensor([5, 6]))  # two singleton groups
        assert torch.isfinite(alone).all() and (alone == 0).all(), fn.__name__
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long))


def test_reinforce_pp_returns_to_go_and_whitening() -> None:
    rewards, _ = shape_rewards(torch.tensor([10.0, 20.0]), torch.tensor([[0.5, 1.0, 2.0], [4.0, 8.0, 8.0]]),
                               0.1, MASK)
    # (from test_shape_rewards) rewards = [[-0.05, -0.1, 9.8], [19.6, 0, 0]]
    rewards[1, 1:] = 5.0  # garbage on padding must not count
    # gamma 1: row 0 backwards: 9.8; -0.1 + 9.8 = 9.7; -0.05 + 9.7 = 9.65.  row 1: 19.6, padding 0
    g1 = reinforce_pp_returns(rewards, MASK, gamma=1.0)
    close(g1, [[9.65, 9.7, 9.8], [19.6, 0.0, 0.0]], atol=1e-5)
    # gamma 0.5: 9.8; -0.1 + 0.5 * 9.8 = 4.8; -0.05 + 0.5 * 4.8 = 2.35
    close(reinforce_pp_returns(rewards, MASK, gamma=0.5), [[2.35, 4.8, 9.8], [19.6, 0.0, 0.0]], atol=1e-5)
    # the same as GAE with a zero critic and lambda 1
    close(g1, gae(rewards, torch.zeros(2, 3), MASK, 1.0, 1.0)[0], atol=1e-5)
    # REINFORCE++ advantages: whitened over the batch's real tokens -> mean 0, (biased) variance 1
    adv = masked_whiten(g1, MASK)
    close(masked_mean(adv, MASK), 0.0, atol=1e-5)
    close(masked_var(adv, MASK, unbiased=False), 1.0, atol=1e-4)


# ----------------------------------------------------------------------------- loss aggregation


def test_aggregate_loss_modes_on_a_ragged_mask() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # 3, 1 and 0 real tokens
    # token-mean: (1 + 2 + 3 + 4) / 4 = 2.5
    close(aggregate_loss(x, mask, "token-mean"), 2.5)
    # seq-mean-token-sum: row sums 6 and 4 (the empty row is left out) -> 5
    close(aggregate_loss(x, mask, "seq-mean-token-sum"), 5.0)
    # seq-mean-token-mean: row means 2 and 4 -> 3
    close(aggregate_loss(x, mask, "seq-mean-token-mean"), 3.0)
    # seq-mean-token-sum-norm: 10 / (B * T) = 10 / (3 * 3) = 1.1111111; constant 5: 10 / 15 = 0.6666667
    close(aggregate_loss(x, mask, "seq-mean-token-sum-norm"), 10.0 / 9.0)
    close(aggregate_loss(x, mask, "seq-mean-token-sum-norm", constant=5), 10.0 / 15.0)
    assert LOSS_AGG_MODES == ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum"):
        aggregate_loss(x, mask, "sum")
    # gradients: token-mean gives each real token 1/4; seq-mean-token-mean gives row 0 tokens 1/(2*3)
    xg = x.clone().requires_grad_(True)
    aggregate_loss(xg, mask, "seq-mean-token-mean").backward()
    close(xg.grad, [[1 / 6, 1 / 6, 1 / 6], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_aggregate_denominator_is_what_each_mode_divides_by() -> None:
    """The units each mode averages over (the global counts of data-parallel training add these up):
    4 real tokens; 2 rows with a token; rows x constant = 3 x 3 (default: the width), or 3 x 5.
    loss x denominator is the loss's sum over its units: 10 for the token modes, 6 + 4 = 10 for
    seq-mean-token-sum, 2 + 4 = 6 for seq-mean-token-mean."""
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    want = {"token-mean": (4.0, 10.0), "seq-mean-token-sum": (2.0, 10.0), "seq-mean-token-mean": (2.0, 6.0),
            "seq-mean-token-sum-norm": (9.0, 10.0)}
    for mode, (den, total) in want.items():
        assert aggregate_denominator(mask, mode) == den, mode
        close(aggregate_loss(x, mask, mode) * den, total)
    assert aggregate_denominator(mask, "seq-mean-token-sum-norm", constant=5) == 15.0
    assert aggregate_denominator(mask, "seq-mean-token-sum-norm", length=8) == 24.0
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum"):
        aggregate_denominator(mask, "sum")


def test_masked_whiten_with_given_moments() -> None:
    """With the moments of a larger (global) batch: (x - 2) / sqrt(4 + 1e-8), padding 0; shift_mean=False adds 2 back."""
    x = torch.tensor([[1.0, 3.0, 9.0]])
    mask = torch.tensor([[1, 1, 0]])
    moments = (torch.tensor(2.0), torch.tensor(4.0))
    close(masked_whiten(x, mask, moments=moments), [[-0.5, 0.5, 0.0]], atol=1e-6)
    close(masked_whiten(x, mask, shift_mean=False, moments=moments), [[1.5, 2.5, 0.0]], atol=1e-6)


# ----------------------------------------------------------------------------- PPO losses


def _ppo_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ratios = torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]])  # below 1-eps, inside, above 1+eps
    logprobs = torch.log(ratios).requires_grad_(True)
    old = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    return logprobs, old, adv


def test_policy_loss_clip_boundaries_and_clipfrac() -> None:
    logprobs, old, adv = _ppo_batch()
    loss, stats = policy_loss(logprobs, old, adv, torch.ones(2, 3), clip_eps=0.2)
    # A=+1: r=0.5: max(-0.5, -0.8) = -0.5 (unclipped); r=1: -1; r=1.5: max(-1.5, -1.2) = -1.2 (clipped)
    # A=-1: r=0.5: max(0.5, 0.8) = 0.8 (clipped);   r=1: 1;  r=1.5: max(1.5, 1.2) = 1.5 (unclipped)
    # mean = (-0.5 - 1 - 1.2 + 0.8 + 1 + 1.5) / 6 = (-2.7 + 3.3) / 6 = 0.6 / 6 = 0.1
    close(loss, 0.1)
    close(stats["clipfrac"], 2.0 / 6.0)  # exactly 2 of 6 tokens clipped
    # ratio mean = (0.5 + 1 + 1.5) * 2 / 6 = 1
    close(stats["ratio"], 1.0)
    # approxkl = mean(½ log(r)^2): ½(0.6931472)^2 = 0.2402265, 0, ½(0.4054651)^2 = 0.0822010
    # = 2 * (0.2402265 + 0.0822010) / 6 = 0.1074758
    close(stats["approxkl"], 0.1074758)
    assert all(not s.requires_grad for s in stats.values())
    # gradient d/dlogp of -A*r is -A*r/6 on unclipped tokens, 0 on clipped ones
    loss.backward()
    close(logprobs.grad, [[-0.5 / 6, -1.0 / 6, 0.0], [0.0, 1.0 / 6, 1.5 / 6]])


def test_policy_loss_masked_uneven_rows() -> None:
    logprobs, old, adv = _ppo_batch()
    loss, stats = policy_loss(logprobs, old, adv, MASK, clip_eps=0.2)
    # real tokens: -0.5, -1, -1.2 (clipped), 0.8 (clipped) -> sum -1.9 / 4 = -0.475; clipfrac 2/4
    close(loss, -0.475)
    close(stats["clipfrac"], 0.5)
    # ratio mean (0.5 + 1 + 1.5 + 0.5) / 4 = 0.875
    close(stats["ratio"], 0.875)


def test_policy_loss_defaults_and_aggregation() -> None:
    logprobs, old, adv = _ppo_batch()
    base, _ = policy_loss(logprobs, old, adv, MASK, clip_eps=0.2)
    same, stats = policy_loss(logprobs, old, adv, MASK, 0.2, clip_eps_high=0.2, loss_agg="token-mean")
    assert torch.equal(base, same) and "dual_clipfrac" not in stats
    # per-token losses on MASK: row 0: -0.5, -1, -1.2; row 1: 0.8
    # seq-mean-token-mean: (-2.7/3 + 0.8) / 2 = (-0.9 + 0.8) / 2 = -0.05
    close(policy_loss(logprobs, old, adv, MASK, 0.2, loss_agg="seq-mean-token-mean")[0], -0.05)
    # seq-mean-token-sum-norm: (-2.7 + 0.8) / (2 * 3) = -0.3166667
    close(policy_loss(logprobs, old, adv, MASK, 0.2, loss_agg="seq-mean-token-sum-norm")[0], -1.9 / 6)


def test_policy_loss_clip_higher_boundaries() -> None:
    # eps_low 0.2, eps_high 0.25: ratios clipped to [0.8, 1.25]
    ratios = torch.tensor([[1.2, 1.25, 1.26], [0.75, 0.8, 1.26]])
    logprobs = torch.log(ratios).requires_grad_(True)
    old, adv = torch.zeros(2, 3), torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    loss, _ = policy_loss(logprobs, old, adv, torch.ones(2, 3), 0.2, clip_eps_high=0.25)
    # A=+1: r=1.2 inside -> -1.2; r=1.25 (at 1 + eps_high) -> -1.25 either way; r=1.26 -> clipped -1.25
    # A=-1: r=0.75 below 1 - eps_low -> max(0.75, 0.8) = 0.8 (low side as before); r=0.8 -> 0.8;
    #       r=1.26 -> max(1.26, 1.25) = 1.26 (unclipped: the pessimistic term)
    # mean = (-1.2 - 1.25 - 1.25 + 0.8 + 0.8 + 1.26) / 6 = -0.84 / 6 = -0.14
    close(loss, -0.14)
    loss.backward()
    # gradient -A*r/6 where unclipped, 0 where clipped (the boundary columns are not checked)
    close(logprobs.grad[:, [0, 2]], [[-1.2 / 6, 0.0], [0.0, 1.26 / 6]])
    # symmetric eps 0.2 clips r=1.2 .. 1.26 at 1.2: (-1.2 * 3 + 0.8 + 0.8 + 1.26) / 6 = -0.74 / 6
    close(policy_loss(logprobs, old, adv, torch.ones(2, 3), 0.2)[0], -0.74 / 6)
    # clipfrac away from the boundaries: r=1.26 (A>0) and r=0.75 (A<0) are clipped, 2 of 4 tokens
    off_boundary = torch.tensor([[1, 0, 1], [1, 0, 1]])
    loss, stats = policy_loss(logprobs, old, adv, off_boundary, 0.2, clip_eps_high=0.25)
    close(stats["clipfrac"], 0.5)
    close(loss, (-1.2 - 1.25 + 0.8 + 1.26) / 4)


def test_policy_loss_dual_clip_caps_negative_advantages_only() -> None:
    ratios = torch.tensor([[0.5, 2.0, 3.0, 50.0], [0.5, 2.0, 3.0, 50.0]])
    logprobs = torch.log(ratios).requires_grad_(True)
    old, adv = torch.zeros(2, 4), torch.tensor([[-1.0] * 4, [1.0] * 4])
    loss, stats = policy_loss(logprobs, old, adv, torch.ones(2, 4), 0.2, dual_clip=3.0)
    # A=-1, cap -C*A = 3: r=0.5 -> max(0.5, 0.8) = 0.8; r=2 -> 2 (< 3); r=3 -> 3 (at the cap);
    #       r=50 -> max(50, 1.2) = 50, capped to 3
    # A=+1 (no cap): r=0.5 -> -0.5; r=2, 3, 50 -> max(-r, -1.2) = -1.2
    # mean = (0.8 + 2 + 3 + 3 - 0.5 - 1.2 - 1.2 - 1.2) / 8 = 4.7 / 8 = 0.5875
    close(loss, 0.5875)
    loss.backward()
    # gradient -A*r/8 where the unclipped term is used: (A=-1, r=2): 2/8; (A=+1, r=0.5): -0.5/8;
    # 0 where clipped or capped (r=50 with A<0 no longer pushes)
    close(logprobs.grad[:, [0, 1, 3]], [[0.0, 2.0 / 8, 0.0], [-0.5 / 8, 0.0, 0.0]])
    # without dual-clip the r=50 token costs 50: (0.8 + 2 + 3 + 50 - 4.1) / 8 = 51.7 / 8
    close(policy_loss(logprobs, old, adv, torch.ones(2, 4), 0.2)[0], 51.7 / 8)
    # capped fraction away from the boundary column: 1 of 6 tokens
    off_boundary = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 1]])
    close(policy_loss(logprobs, old, adv, off_boundary, 0.2, dual_clip=3.0)[1]["dual_clipfrac"], 1.0 / 6.0)
    assert stats["dual_clipfrac"].requires_grad is False
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(logprobs, old, adv, torch.ones(2, 4), 0.2, dual_clip=1.0)


def test_value_loss_clip_boundaries() -> None:
    old = torch.zeros(2, 3)
    values = torch.tensor([[0.1, 0.5, -0.5], [0.5, 0.5, -0.5]])
    returns = torch.tensor([[1.0, 1.0, 1.0], [0.3, 2.0, -2.0]])
    # clip 0.2: v_clip = [0.1, 0.2, -0.2], [0.2, 0.2, -0.2]
    # (v-R)^2 vs (v_clip-R)^2 -> max, clipped-larger?
    #   0.81 vs 0.81 -> 0.81 no | 0.25 vs 0.64 -> 0.64 yes | 2.25 vs 1.44 -> 2.25 no
    #   0.04 vs 0.01 -> 0.04 no | 2.25 vs 3.24 -> 3.24 yes | 2.25 vs 3.24 -> 3.24 yes
    # full: 0.5 * (0.81+0.64+2.25+0.04+3.24+3.24)/6 = 0.5 * 10.22/6 = 0.8516667; clipfrac 3/6
    loss, stats = value_loss(values, old, returns, torch.ones(2, 3), clip=0.2)
    close(loss, 0.5 * 10.22 / 6)
    close(stats["clipfrac"], 0.5)
    # uneven mask: 0.5 * (0.81+0.64+2.25+0.04)/4 = 0.5 * 0.935 = 0.4675; clipfrac 1/4
    loss, stats = value_loss(values, old, returns, MASK, clip=0.2)
    close(loss, 0.4675)
    close(stats["clipfrac"], 0.25)


def test_pairwise_loss() -> None:
    # equal scores: -log sigmoid(0) = log 2 = 0.6931472
    close(pairwise_loss(torch.tensor([0.3, -1.0]), torch.tensor([0.3, -1.0])), math.log(2.0))
    # margin: diffs = [1 - 0 - 1, 2 - 0 - 0] = [0, 2]
    # -log sigmoid(0) = 0.6931472; -log sigmoid(2) = log(1 + e^-2) = log(1.1353353) = 0.1269280
    # mean = (0.6931472 + 0.1269280) / 2 = 0.4100376
    chosen, rejected = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0])
    close(pairwise_loss(chosen, rejected, margin=torch.tensor([1.0, 0.0])), 0.4100376)
    # stable for large gaps: -log sigmoid(1000) = 0, -log sigmoid(-1000) = 1000
    close(pairwise_loss(torch.tensor([1000.0]), torch.tensor([0.0])), 0.0)
    close(pairwise_loss(torch.tensor([0.0]), torch.tensor([1000.0])), 1000.0)


def test_grouped_pairwise_loss_weighs_each_prompt_as_one_item() -> None:
    # scores of 3 distinct responses; pairs (0 > 1) and (0 > 2) of prompt 0, (2 > 1) of prompt 1
    scores = torch.tensor([2.0, 0.0, 1.0])
    c, r, g = torch.tensor([0, 0, 2]), torch.tensor([1, 2, 1]), torch.tensor([0, 0, 1])
    # diffs 2, 1, 1: -log sigmoid(2) = 0.1269280, -log sigmoid(1) = log(1 + e^-1) = 0.3132617
    # prompt 0: (0.1269280 + 0.3132617) / 2 = 0.2200949; prompt 1: 0.3132617; mean 0.2666783
    close(grouped_pairwise_loss(scores, c, r, g), 0.2666783)
    # margins [0, 1, 0]: diffs 2, 0, 1 -> prompt 0: (0.1269280 + 0.6931472) / 2 = 0.4100376;
    # mean with prompt 1: (0.4100376 + 0.3132617) / 2 = 0.3616497
    close(grouped_pairwise_loss(scores, c, r, g, torch.tensor([0.0, 1.0, 0.0])), 0.3616497)
    # one pair per group: the plain pairwise loss
    s = torch.tensor([0.5, -0.2, 1.5, 0.1])
    close(grouped_pairwise_loss(s, torch.tensor([0, 2]), torch.tensor([1, 3]), torch.tensor([0, 1])),
          pairwise_loss(torch.tensor([0.5, 1.5]), torch.tensor([-0.2, 0.1])))
    # the gradient reaches each score once per use: d/ds0 = -(sigmoid(-2) + sigmoid(-1)) / 2 / 2
    s = scores.clone().requires_grad_(True)
    grouped_pairwise_loss(s, c, r, g).backward()
    sig = torch.sigmoid
    close(s.grad[0], -(sig(torch.tensor(-2.0)) + sig(torch.tensor(-1.0))) / 4)


def test_dpo_sigmoid_cdpo_and_ipo() -> None:
    # pair 1: policy -1 / -3, reference -2 / -2 -> log-ratios +1 and -1, h = 2
    # pair 2: everything -4 -> h = 0
    pc, pr = torch.tensor([-1.0, -4.0]), torch.tensor([-3.0, -4.0])
    rc, rr = torch.tensor([-2.0, -4.0]), torch.tensor([-2.0, -4.0])
    loss, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta=0.5)
    # beta*h = 1: -log sigmoid(1) = log(1 + e^-1) = 0.3132617; beta*h = 0: log 2 = 0.6931472
    # mean = 0.5032044;  rewards = beta * log-ratio: chosen [0.5, 0], rejected [-0.5, 0]
    close(loss, 0.5032044)
    close(chosen, [0.5, 0.0])
    close(rejected, [-0.5, 0.0])
    # cDPO, eps 0.2: pair 1: 0.8 * 0.3132617 + 0.2 * -log sigmoid(-1) = 0.2506094 + 0.2 * 1.3132617 = 0.5132617
    # pair 2: 0.8 log 2 + 0.2 log 2 = 0.6931472 -> mean 0.6032044
    close(dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.2)[0], 0.6032044)
    # IPO, beta 0.25: target 1 / (2 * 0.25) = 2: (2 - 2)^2 = 0, (0 - 2)^2 = 4 -> mean 2
    close(dpo_loss(pc, pr, rc, rr, beta=0.25, loss_type="ipo")[0], 2.0)
    # gradient of the DPO loss w.r.t. pair 1's chosen log-prob: -beta * sigmoid(-beta*h) / B
    # = -0.5 * 0.2689414 / 2 = -0.0672354; the rewards carry no gradient
    pcg = pc.clone().requires_grad_(True)
    loss, chosen, _ = dpo_loss(pcg, pr, rc, rr, beta=0.5)
    loss.backward()
    close(pcg.grad[0], -0.0672354)
    assert not chosen.requires_grad
    for kw, msg in (({"beta": 0.0}, "beta must be > 0"), ({"beta": 0.1, "label_smoothing": 0.5}, r"\[0, 0.5\)"),
                    ({"beta": 0.1, "label_smoothing": 0.1, "loss_type": "ipo"}, "sigmoid"),
                    ({"beta": 0.1, "loss_type": "hinge"}, "sigmoid, ipo")):
        with pytest.raises(ValueError, match=msg):
            dpo_loss(pc, pr, rc, rr, **kw)


# ----------------------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_upper_lower_and_inside() -> None:
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # error = 12/6 - 1 = 1 -> clipped to 0.2; 0.1 * (1 + 0.2*256/10000) = 0.1 * 1.00512 = 0.100512
    ctl.update(12.0, 256)
    close(ctl.value, 0.100512, atol=1e-12)
    low = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # error = 0/6 - 1 = -1 -> clipped to -0.2; 0.1 * (1 - 0.00512) = 0.099488
    low.update(0.0, 256)
    close(low.value, 0.099488, atol=1e-12)
    mid = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # error = 6.6/6 - 1 = 0.1 (inside); 0.1 * (1 + 0.1*256/10000) = 0.100256
    mid.update(6.6, 256)
    close(mid.value, 0.100256, atol=1e-12)
    on_target = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    on_target.update(6.0, 256)
    assert on_target.value == 0.1


def test_adaptive_kl_controller_floor() -> None:
    # horizon 1 update: each update moves beta by up to 20%. Below target: 0.05 * 0.8 = 0.04, then
    # the floor 0.05 holds it; above: 0.05 * 1.2 = 0.06, 0.072; back below: 0.072 * 0.8 = 0.0576.
    ctl = AdaptiveKLController(0.05, target=6.0, horizon=1, min_value=0.05)
    ctl.update(0.0, 1)
    assert ctl.value == 0.05
    ctl.update(12.0, 1)
    close(ctl.value, 0.06, atol=1e-12)
    ctl.update(100.0, 1)
    close(ctl.value, 0.072, atol=1e-12)
    ctl.update(1.0, 1)
    close(ctl.value, 0.0576, atol=1e-12)
    ctl.update(1.0, 1)
    assert ctl.value == 0.05  # 0.0576 * 0.8 = 0.04608 < floor
    free = AdaptiveKLController(0.05, target=6.0, horizon=1)  # no floor, as Ziegler et al.
    free.update(0.0, 1)
    close(free.value, 0.04, atol=1e-12)
    with pytest.raises(ValueError, match="min_value"):
        AdaptiveKLController(0.05, target=6.0, horizon=1, min_value=-1.0)


def test_adaptive_kl_controller_ceiling() -> None:
    # horizon 1, ceiling 0.1: KL 12 -> 0.05 * 1.2 = 0.06, 0.072, 0.0864, then 0.10368 > 0.1 -> 0.1,
    # held there while the KL stays high; back below target: 0.1 * 0.8 = 0.08 (from the ceiling,
    # not from where an unbounded beta would have climbed to).
    ctl = AdaptiveKLController(0.05, target=6.0, horizon=1, min_value=0.05, max_value=0.1)
    for want in (0.06, 0.072, 0.0864, 0.1, 0.1, 0.1):
        ctl.update(12.0, 1)
        close(ctl.value, want, atol=1e-12)
    ctl.update(0.0, 1)
    close(ctl.value, 0.08, atol=1e-12)
    restored = AdaptiveKLController(0.05, target=6.0, horizon=1)
    restored.load_state_dict(ctl.state_dict())
    assert restored.max_value == 0.1
    restored.update(100.0, 1)
    close(restored.value, 0.096, atol=1e-12)
    restored.update(100.0, 1)
    assert restored.value == 0.1
    with pytest.raises(ValueError, match="max_value"):
        AdaptiveKLController(0.05, target=6.0, horizon=1, min_value=0.05, max_value=0.04)


def test_kl_lr_scale_spends_the_budget_left() -> None:
    # clip(target / KL, 1, max): target 6, max 2.5
    assert kl_lr_scale(0.0, 6.0, 2.5) == 2.5  # nothing spent yet: the largest step
    assert kl_lr_scale(2.0, 6.0, 2.5) == 2.5  # 6 / 2 = 3, capped at 2.5
    assert kl_lr_scale(3.0, 6.0, 2.5) == 2.0  # 6 / 3
    assert kl_lr_scale(4.0, 6.0, 2.5) == 1.5  # 6 / 4
    assert kl_lr_scale(6.0, 6.0, 2.5) == 1.0  # on target: the plain lr
    assert kl_lr_scale(18.0, 6.0, 2.5) == 1.0  # past it: never below the plain lr
    assert kl_lr_scale(-0.5, 6.0, 2.5) == 2.5  # k1's sample mean can dip below 0
    assert kl_lr_scale(float("nan"), 6.0, 2.5) == 1.0
    assert kl_lr_scale(0.0, 6.0, 1.0) == 1.0  # max 1: off
    with pytest.raises(ValueError, match="max_scale"):
        kl_lr_scale(1.0, 6.0, 0.5)


def test_adaptive_kl_controller_error_clip() -> None:
    # error_clip 0.5, horizon 1: KL 12 (error 1) -> x 1.5: 0.1 -> 0.15; KL 9 (error 0.5, at the clip)
    # -> 0.225; KL 0 (error -1) -> x 0.5: 0.1125; KL 4.5 (error -0.25, inside) -> 0.084375.
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=1, error_clip=0.5)
    for kl, want in ((12.0, 0.15), (9.0, 0.225), (0.0, 0.1125), (4.5, 0.084375)):
        ctl.update(kl, 1)
        close(ctl.value, want, atol=1e-12)
    restored = AdaptiveKLController(0.1, target=6.0, horizon=1)
    restored.load_state_dict(ctl.state_dict())
    assert restored.error_clip == 0.5
    for bad in (0.0, 1.0):
        with pytest.raises(ValueError, match="error_clip"):
            AdaptiveKLController(0.1, target=6.0, horizon=1, error_clip=bad)


def test_kl_controllers_state_dict_roundtrip_and_fixed() -> None:
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(12.0, 256)
    restored = AdaptiveKLController(0.5, target=1.0, horizon=1)
    restored.load_state_dict(ctl.state_dict())
    assert restored.state_dict() == ctl.state_dict()
    assert restored.value == ctl.value
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 256)
    assert fixed.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.05


def test_running_scale_is_the_std_of_every_score_seen() -> None:
    scale = RunningScale()
    assert scale.std == 0.0  # nothing seen: no unit
    scale.update(2, 0.0, 0.0)  # scores [0, 0]: still no spread
    assert scale.std == 0.0
    # then [1, 3] (mean 2, squared deviations 1 + 1 = 2): all four {0, 0, 1, 3} have mean 1 and
    # variance (1 + 1 + 0 + 4) / 4 = 1.5
    scale.update(2, 2.0, 2.0)
    assert scale.count == 4 and scale.mean == 1.0
    close(scale.std, math.sqrt(1.5), atol=1e-12)
    # batch by batch equals all at once (Chan et al.): [5] then [-1, 2, 2]
    scale.update(1, 5.0, 0.0)
    scale.update(3, 1.0, 6.0)
    every = torch.tensor([0.0, 0.0, 1.0, 3.0, 5.0, -1.0, 2.0, 2.0], dtype=torch.float64)
    close(scale.std, every.std(unbiased=False).item(), atol=1e-12)
    restored = RunningScale()
    restored.load_state_dict(scale.state_dict())
    assert restored.std == scale.std and restored.count == 8
    scale.update(0, 123.0, 0.0)  # an empty batch changes nothing
    assert restored.state_dict() == scale.state_dict()


def test_running_scale_spread_is_the_pooled_std_within_each_batch() -> None:
    """The divisor of the scores comes from their spread around their own batch's mean, not from
    how far the batch means moved apart (the policy's progress)."""
    scale = RunningScale()
    assert scale.spread == 0.0
    # [0, 0], [1, 3], [5], [-1, 2, 2]: squared deviations within each batch 0, 2, 0 and 6 (mean 1:
    # 4 + 1 + 1), 8 over 8 scores -> var 1, while all eight together have a std of ~1.73
    for count, mean, m2 in ((2, 0.0, 0.0), (2, 2.0, 2.0), (1, 5.0, 0.0), (3, 1.0, 6.0)):
        scale.update(count, mean, m2)
    close(scale.spread, 1.0, atol=1e-12)
    assert scale.std > 1.7
    # batch means that drift apart (-120, then -60, then -10, each batch spread +-5) leave the spread at 5
    drift = RunningScale()
    for mean in (-120.0, -60.0, -10.0):
        drift.update(4, mean, 4 * 25.0)
    close(drift.spread, 5.0, atol=1e-12)
    assert drift.std > 40
    # batches of one score have no spread of their own: the std of all of them stands in
    ones = RunningScale()
    for x in (1.0, 3.0):
        ones.update(1, x, 0.0)
    assert ones.spread == ones.std == 1.0
    restored = RunningScale()
    restored.load_state_dict(scale.state_dict())
    assert restored.spread == scale.spread
    old = RunningScale()  # a checkpoint written before the spread was kept: its std stands in
    old.load_state_dict({"count": 8.0, "mean": 1.0, "m2": 24.0})
    close(old.spread, math.sqrt(3.0), atol=1e-12)
    assert old.spread == old.std


def test_score_unit_leaves_the_measured_spread_alone() -> None:
    assert score_unit(0.0, "auto") == score_unit(0.0, "std") == 1.0  # no spread yet: raw
    assert score_unit(0.2, "none") == 1.0 and score_unit(0.2, "std") == 0.2
    # auto: inside [0.05, 0.5] raw; 0.01 -> 0.01 / 0.05 = 0.2 (scores x 5); 2.0 -> 2 / 0.5 = 4
    assert score_unit(0.05, "auto") == score_unit(0.3, "auto") == score_unit(0.5, "auto") == 1.0
    close(score_unit(0.01, "auto"), 0.2, atol=1e-12)
    close(score_unit(2.0, "auto"), 4.0, atol=1e-12)
    with pytest.raises(ValueError, match="none, std or auto"):
        score_unit(1.0, "raw")


def test_score_center_moves_only_an_offset_beyond_two_spreads() -> None:
    assert score_center(3.0, 0.5, "none") == 0.0 and score_center(3.0, 0.5, "running") == 3.0
    # auto: 3 - clip(3, -1, 1) = 2, the scores then average 1 = two stds of 0.5
    close(score_center(3.0, 0.5, "auto"), 2.0, atol=1e-12)
    close(score_center(-120.0, 10.0, "auto"), -100.0, atol=1e-12)  # -120 - (-20)
    assert score_center(0.3, 0.4, "auto") == 0.0 and score_center(-0.8, 0.4, "auto") == 0.0  # inside the band
    # a 0/1 reward earned by a share p: mean p, std sqrt(p (1 - p)); inside the band up to p = 0.8
    for p, inside in ((0.02, True), (0.5, True), (0.79, True), (0.81, False), (0.95, False)):
        assert (score_center(p, (p * (1 - p)) ** 0.5, "auto") == 0.0) == inside
    close(score_center(0.95, (0.95 * 0.05) ** 0.5, "auto"), 0.95 - 2 * (0.95 * 0.05) ** 0.5, atol=1e-12)
    assert score_center(-3.0, 0.0, "auto") == -3.0  # no spread yet: the whole mean
    with pytest.raises(ValueError, match="none, running or auto"):
        score_center(1.0, 1.0, "mean")


# ----------------------------------------------------------------------------- diagnostics


def test_explained_variance() -> None:
    returns = torch.tensor([[1.0, 2.0, 3.0], [4.0, 77.0, 77.0]])
    # perfect prediction: residual 0 -> 1 - 0/Var(R) = 1
    assert explained_variance(returns.clone(), returns, MASK) == pytest.approx(1.0)
    # v = mean of real returns (1+2+3+4)/4 = 2.5: residual = R - 2.5, same variance -> 0
    assert explained_variance(torch.full((2, 3), 2.5), returns, MASK) == pytest.approx(0.0, abs=1e-6)
    # R = {1, 3}, v = {1, 2}: Var(R) = 1, residual {0, 1} has var 0.25 -> 1 - 0.25 = 0.75
    r2 = torch.tensor([[1.0, 3.0, 999.0]])
    v2 = torch.tensor([[1.0, 2.0, -5.0]])
    m2 = torch.tensor([[1.0, 1.0, 0.0]])
    assert explained_variance(v2, r2, m2) == pytest.approx(0.75)
    # constant returns -> nan
    assert math.isnan(explained_variance(torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3)))


def test_import_core_is_light() -> None:
    code = (
        "import sys, ppolm.core; "
        "heavy = [m for m in ('transformers', 'datasets') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
