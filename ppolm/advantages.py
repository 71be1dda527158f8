"""Steps 4 and 5 of a PPO iteration: per-token rewards (the score on the last token, the KL penalty
on each) and the advantages the policy loss multiplies, with a critic (GAE) or without (the
critic-free estimators of ``--advantage``: GRPO, Dr. GRPO, RLOO, REINFORCE++, ReMax; README, "PPO
and its alternatives"). The formulas are in :mod:`ppolm.core`; sums and statistics run over every
process's rows (:mod:`ppolm.distributed`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppolm import core, distributed
from ppolm.ppo_config import PPOConfig


@dataclass
class Advantages:
    """Steps 4 and 5 of one batch: what the rewards, the KL and the critic's values make of it."""

    rewards: torch.Tensor
    """(B, R) per-token rewards: the (scaled) score on the last token, -beta * KL with --kl-in reward."""
    non_score: torch.Tensor
    """(B, R) the KL part of the reward (-beta * KL) in the score's own units."""
    advantages: torch.Tensor
    """(B, R) what the policy loss multiplies: GAE's (whitened when asked) or a critic-free estimator's."""
    returns: torch.Tensor
    """(B, R) the critic's targets (the advantages themselves without a critic, unused)."""
    values: torch.Tensor
    """(B, R) the rollout policy's values in the returns' units, 0 on padding (0 without a critic)."""
    adv_var: float
    """The advantages' variance before whitening (``adv/var``)."""
    unit: float = 1.0
    """The score's unit (--score-scale): the scores were divided by it."""
    center: float = 0.0
    """What --score-center subtracted from the scores first."""
    tied: bool = False
    """Every score of the batch alike (over every process)."""
    unearned: bool = False
    """Tied, and no better than the run's mean score: a reward nobody in the batch earned."""
    zeroed: bool = False
    """Unearned, and --tied-scores zeroed its advantages."""
    value_units: tuple[float, float] = (0.0, 1.0)
    """Experience.value_units: (center, unit) of a critic that predicts the scores as they come."""


def gae_advantages(cfg: PPOConfig, score_scale: core.RunningScale, scores: torch.Tensor, kl: torch.Tensor,
                   beta: float, mask: torch.Tensor, old_values: torch.Tensor, finite: bool,
                   critic_in_score_units: bool) -> Advantages:
    """Steps 4 and 5 with a critic: per-token rewards, GAE (gamma, lambda), the batch's whitening.

    The score lands on each response's last real token, divided by core.score_unit of the
    spread of the scores within their batches, pooled over the run (--score-scale): by default
    only a reward whose spread lies outside the range the default beta was measured on is
    rescaled to it. --score-center first subtracts the running mean's part beyond two running
    stds (all of it with "running"), so that the zero-initialised critic starts no further
    from the returns than on a [0, 1] reward. ``finite``: every process's scores are finite
    (else the running statistics and --tied-scores leave them out). ``score_scale``: the run's
    running statistics of the scores (updated here); ``critic_in_score_units``: the critic predicts
    the scores as they come (Experience.value_units).
    """
    a = cfg.algo
    if finite:  # (also kept under --score-scale none: --tied-scores compares with its mean)
        mean, var, n = distributed.masked_moments(scores, torch.ones_like(scores))  # every process's
        score_scale.update(n, float(mean), float(var) * n)
    unit = core.score_unit(score_scale.spread, cfg.reward.score_scale)
    center = core.score_center(score_scale.mean, score_scale.std, cfg.reward.score_center)
    rewards, non_score = core.shape_rewards((scores - center) / unit, kl,
                                            beta if cfg.kl.kl_in == "reward" else 0.0, mask)
    non_score = non_score * unit  # logged in the score's own units: rlhf_reward = score - unit * beta * KL
    if cfg.kl.kl_in == "loss":
        non_score = -beta * kl
    if cfg.reward.whiten_rewards:  # batch statistics: over every process's rows
        rewards = distributed.masked_whiten(rewards, mask, shift_mean=False)

    # GAE; returns = advantages + values; the advantages whitened per batch.
    value_units = 0.0, 1.0
    if critic_in_score_units:
        value_units = center, unit
        old_values = (old_values - center) / unit
    old_values = old_values * mask
    advantages, returns = core.gae(rewards, old_values, mask, a.gamma, a.lam)  # (B, R)
    if a.critic_lam is not None and a.critic_lam != a.lam:  # decoupled GAE: the critic's own lambda
        _, returns = core.gae(rewards, old_values, mask, a.gamma, a.critic_lam)
    adv_var = distributed.masked_var(advantages, mask)
    if a.whiten_advantages:
        advantages = distributed.masked_whiten(advantages, mask)
    tied = unearned = zeroed = False
    if finite:  # every score alike (over every process): no reward signal in this batch
        hi, neg_lo = distributed.all_max_floats([float(scores.max()), -float(scores.min())])
        tied = hi + neg_lo <= 1e-9 * max(1.0, abs(hi))
        # ... and no better than the run's mean score: a reward nobody in the batch earned. A batch
        # that all earned alike above it (a reward the policy has mastered) keeps its advantages:
        # their KL penalty is then the batch's one signal, and it pulls the policy back.
        unearned = tied and hi <= score_scale.mean + 1e-9 * max(1.0, abs(hi))
        zeroed = unearned and a.tied_scores in ("zero", "skip")
        if zeroed:
            advantages = torch.zeros_like(advantages)
    return Advantages(rewards=rewards, non_score=non_score, advantages=advantages, returns=returns,
                      values=old_values, adv_var=adv_var, unit=unit, center=center, tied=tied,
                      unearned=unearned, zeroed=zeroed, value_units=value_units)

def critic_free_advantages(cfg: PPOConfig, scores: torch.Tensor, kl: torch.Tensor, beta: float, mask: torch.Tensor,
                           gid: torch.Tensor, greedy_scores: torch.Tensor | None) -> Advantages:
    """Steps 4 and 5 of the critic-free estimators (README, "PPO and its alternatives"): no
    values; the returns are the advantages.

    * reinforce++: per-token rewards of :func:`ppolm.core.shape_rewards` (score on the last
      token, -beta * KL on each with --kl-in reward), returns-to-go with --gamma, whitened over
      the batch; reinforce++-baseline subtracts each group's mean score first (Hu 2025).
    * grpo, dr-grpo, rloo, remax: one advantage per response from its score, broadcast over its
      tokens, not whitened. The score is the reward's (penalties included); with --kl-in reward
      it is the RLHF reward, score - beta * the response's KL (ReMax's greedy baseline then
      keeps its bare score: its KL is not computed).

    ``gid`` (B,): each row's group (prompt).
    """
    a, in_reward = cfg.algo, cfg.kl.kl_in == "reward"
    if a.advantage in ("reinforce++", "reinforce++-baseline"):
        base = core.group_baseline(scores, gid) if a.advantage == "reinforce++-baseline" else scores
        rewards, non_score = core.shape_rewards(base, kl, beta if in_reward else 0.0, mask)
        if cfg.reward.whiten_rewards:
            rewards = distributed.masked_whiten(rewards, mask, shift_mean=False)
        returns = core.reinforce_pp_returns(rewards, mask, a.gamma)
        adv_var = distributed.masked_var(returns, mask)
        advantages = distributed.masked_whiten(returns, mask)
    else:
        rewards, non_score = core.shape_rewards(scores, kl, beta if in_reward else 0.0, mask)
        seq = scores + non_score.sum(1) if in_reward else scores  # (B,)
        if a.advantage in ("grpo", "dr-grpo"):
            per_seq = core.grpo_advantages(seq, gid, scale=a.advantage == "grpo")
        elif a.advantage == "rloo":
            per_seq = core.rloo_advantages(seq, gid)
        else:  # remax
            per_seq = core.remax_advantages(seq, greedy_scores)
        advantages = per_seq.float()[:, None] * mask
        adv_var = distributed.masked_var(advantages, mask)
    if not in_reward:
        non_score = -beta * kl
    return Advantages(rewards=rewards, non_score=non_score, advantages=advantages, returns=advantages,
                      values=torch.zeros_like(mask), adv_var=adv_var)
