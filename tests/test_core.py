"""Hand-computed checks of ppolm.core: every expected number is worked out in a comment."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppolm.core import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    entropy_from_logits,
    explained_variance,
    gae,
    grouped_pairwise_loss,
    kl_loss,
    kl_penalty,
    last_token_index,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    pairwise_loss,
    policy_loss,
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
