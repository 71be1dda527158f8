"""The PPO math of RLHF, as pure functions on tensors.

Everything here imports only torch: masked statistics, log-probabilities and entropy from
logits, the per-token KL penalty and reward shaping of InstructGPT, GAE, the group and
critic-free advantage estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++, ReMax), the loss
aggregation modes, the clipped policy loss of PPO (with DAPO's clip-higher and dual-clip) and
its value loss, the Bradley-Terry reward-model loss, the DPO/IPO losses and the KL-coefficient
controllers. Functions take tensors and floats, never a config object.

Shapes: B is the batch (one row per prompt/response), T the response length, V the vocabulary.
``mask`` is a (B, T) 0/1 (or bool) tensor marking real response tokens, right-padded
(``1 ... 1 0 ... 0`` per row). ``group_ids`` is a (B,) integer tensor: rows with the same id are
responses to the same prompt (any ids, any order, groups of any size).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3")
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo")


def _mask_like(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The mask as a float tensor of at least float32 precision (bf16 sums of counts lose integers)."""
    dtype = torch.promote_types(x.dtype, torch.float32) if x.is_floating_point() else torch.float32
    return mask.to(dtype)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask), over all entries (``dim=None``) or along ``dim``. x, mask: (B, T).

    Source: the masked statistics of OpenAI lm-human-preferences (padding never counts).
    """
    m = _mask_like(mask, x)
    return (x * m).sum() if dim is None else (x * m).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask), over all entries or along ``dim``. x, mask: (B, T).

    A slice with no real entries gives nan (0/0); callers pass masks with at least one 1.
    Source: OpenAI lm-human-preferences (means over response tokens only).
    """
    m = _mask_like(mask, x)
    if dim is None:
        return (x * m).sum() / m.sum()
    return (x * m).sum(dim) / m.sum(dim)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the entries of x where mask is 1 (a scalar tensor). x, mask: (B, T).

    var = masked_mean((x - mu)^2), mu = masked_mean(x); with ``unbiased`` it is multiplied by
    n / (n - 1), n = sum(mask) (Bessel). Raises ValueError if n == 0, or n == 1 and unbiased.
    Source: OpenAI lm-human-preferences (moments over real tokens).
    """
    n = float(_mask_like(mask, x).sum().item())
    if n == 0:
        raise ValueError("masked_var: mask selects no entries")
    if unbiased and n == 1:
        raise ValueError("masked_var: unbiased variance needs at least 2 entries, mask selects 1")
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return var * (n / (n - 1)) if unbiased else var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  moments: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """(x - mu) / sqrt(var + 1e-8) with mu, var over the real entries; (B, T) -> (B, T).

    With ``shift_mean=False`` the mean is added back: (x - mu) / sigma + mu (used for rewards,
    whose sign matters). Padding (mask 0) is returned as 0. ``moments``: (mu, biased var) given
    instead of computed from ``x`` (data-parallel training passes those of the global batch).
    Source: ``whiten`` in OpenAI lm-human-preferences (advantages are whitened with shift_mean=True).
    """
    if moments is not None:
        mean, var = moments
    else:
        mean = masked_mean(x, mask)
        # Biased variance, as OpenAI's whiten (tf.nn.moments divides by n): for the thousands of
        # tokens of a PPO batch the difference is negligible and a batch of one token stays finite.
        var = masked_var(x, mask, unbiased=False)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * _mask_like(mask, whitened)


def logprobs_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature)[tokens]: logits (B, T, V), tokens (B, T) -> (B, T) float32.

    Computed as gathered logit - logsumexp(logits) in float32 (also for bf16 logits), without
    materialising the full log-softmax. The temperature must be the one used for sampling.
    Source: Ziegler et al. 2019 / OpenAI lm-human-preferences (logits divided by the temperature).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = logits.float()
    if temperature != 1.0:  # (no full-size copy for T = 1)
        scaled = scaled / temperature
    picked = torch.gather(scaled, -1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits): logsumexp(l) - sum(softmax(l) * l); (B, T, V) -> (B, T) float32.

    Equal to -sum p log p; logits must be finite. Source: Shannon entropy, the PPO entropy
    diagnostic of Schulman et al. 2017 and lm-human-preferences.
    """
    lf = logits.float()
    probs = torch.softmax(lf, dim=-1)
    return torch.logsumexp(lf, dim=-1) - (probs * lf).sum(-1)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens; (B, T) -> (B, T).

    With d = logp - logp_ref (tokens sampled from the policy):
    k1 = d (unbiased, can be negative), k2 = d^2 / 2 (biased, low variance, >= 0),
    k3 = exp(-d) - 1 + d (unbiased, >= 0). Source: J. Schulman, "Approximating KL
    divergence" (blog, 2020); k1 is the penalty of Ziegler et al. 2019 and InstructGPT.
    """
    d = logprobs.float() - ref_logprobs.float()
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d**2
    if kind == "k3":
        r = -d  # log(p_ref / p)
        return torch.expm1(r) - r  # exp(r) - 1 - r, accurate for small r
    raise ValueError(f"unknown KL estimator {kind!r}; valid kinds: {', '.join(KL_KINDS)}")


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The KL term added to the policy loss with ``--kl-in loss`` (times beta): the masked mean of
    the k3 estimator, whatever ``--kl-estimator`` (which sets only the reported KL); scalar.

    Differentiated through the policy's log-probs of its own samples, k1 = logp - logp_ref has
    gradient 1 per token whatever the reference (it only lowers logp), so it penalises nothing.
    k3 = exp(r) - 1 - r, r = logp_ref - logp, has gradient 1 - p_ref/p, which pulls each token's
    probability toward the reference's; it is unbiased and non-negative, and is GRPO's choice
    (Shao et al. 2024, DeepSeekMath, eq. 4). Source: J. Schulman, "Approximating KL divergence" (2020).
    """
    return masked_mean(kl_penalty(logprobs, ref_logprobs, "k3"), mask)


def penalise_scores(scores: torch.Tensor, ended: torch.Tensor, lengths: torch.Tensor,
                    missing_eos_penalty: float | None = None, length_penalty: float = 0.0,
                    length_budget: int = 0) -> torch.Tensor:
    """The score PPO maximises, from the sources' total; (B,) -> (B,).

    A response that never emitted EOS (``ended`` False) gets ``missing_eos_penalty`` instead of its
    score (OpenAI's lm-human-preferences, detail 4; None = off); then ``length_penalty`` per response
    token beyond ``length_budget`` is subtracted: score - length_penalty * max(0, length - budget).
    The same definition serves training (objective/scores) and held-out evaluation (eval/score).
    """
    if missing_eos_penalty is not None:
        scores = torch.where(ended.to(scores.device), scores, torch.full_like(scores, missing_eos_penalty))
    if length_penalty:
        over = (lengths.to(scores.device) - length_budget).clamp(min=0).to(scores.dtype)
        scores = scores - length_penalty * over
    return scores


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of a (B, T) mask -> (B,) long.

    Raises ValueError if a row has no 1 (an empty response has no token to carry the score).
    Source: InstructGPT (Ouyang et al. 2022): the reward-model score sits on the last token.
    """
    m = mask != 0
    if bool((~m.any(dim=-1)).any()):
        raise ValueError("last_token_index: a row of the mask has no real token")
    positions = torch.arange(m.shape[-1], device=m.device).expand_as(m)
    return torch.where(m, positions, torch.zeros_like(positions)).amax(dim=-1)


def shape_rewards(
    scores: torch.Tensor, kl: torch.Tensor, kl_coef: float, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards of RLHF: the KL penalty on every token, the score on the last one.

    non_score[b, t] = -kl_coef * kl[b, t] * mask[b, t];
    rewards = non_score, plus scores[b] at t = last real token of row b.
    scores (B,), kl (B, T), mask (B, T) -> (rewards, non_score_rewards), each (B, T).
    Source: Ziegler et al. 2019; OpenAI lm-human-preferences; Ouyang et al. 2022 (InstructGPT).
    """
    m = _mask_like(mask, kl)
    non_score = -kl_coef * kl.to(m.dtype) * m
    rewards = non_score.clone()
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last_token_index(mask)] += scores.to(rewards.dtype)
    return rewards, non_score


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation; rewards, values, mask (B, T) -> (advantages, returns).

    delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1} * m_{t+1},
    with V_T = A_T = 0: the episode ends after the last real token (bootstrap value 0).
    returns = advantages + values. Both are float32 and 0 where mask is 0.
    Source: Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE".
    """
    m = mask.float()
    r = rewards.float() * m
    v = values.float() * m
    batch, length = r.shape
    next_value = torch.zeros(batch, dtype=torch.float32, device=r.device)
    next_adv = torch.zeros_like(next_value)
    next_mask = torch.zeros_like(next_value)
    reversed_adv = []
    for t in reversed(range(length)):
        delta = r[:, t] + gamma * next_value * next_mask - v[:, t]
        next_adv = delta + gamma * lam * next_adv * next_mask
        reversed_adv.append(next_adv)
        next_value, next_mask = v[:, t], m[:, t]
    advantages = torch.stack(reversed_adv[::-1], dim=1) * m
    returns = (advantages + v) * m
    return advantages, returns


# ------------------------------------------------------------------ critic-free advantage estimators
# One score per response, s (B,); several responses per prompt share a group id. No value model:
# the baseline comes from the other responses to the same prompt (or, for ReMax, a greedy one).


def _group_moments(
    scores: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's group size n, group mean, unbiased group std (0 when n = 1) and whether its group's
    scores are all equal; each (B,), float64 (the sums of a few scores, exact enough to cancel)."""
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"scores and group_ids must both be (B,); got {tuple(scores.shape)} and "
                         f"{tuple(group_ids.shape)}")
    s = scores.double()
    _, inv = torch.unique(group_ids, return_inverse=True)  # group ids -> 0 .. G-1
    zeros = torch.zeros(int(inv.max()) + 1 if inv.numel() else 0, dtype=s.dtype, device=s.device)
    n = zeros.index_add(0, inv, torch.ones_like(s))
    mean = zeros.index_add(0, inv, s) / n
    sq_dev = zeros.index_add(0, inv, (s - mean[inv]) ** 2)
    std = torch.sqrt(sq_dev / (n - 1).clamp(min=1))
    hi = zeros.scatter_reduce(0, inv, s, "amax", include_self=False)
    lo = zeros.scatter_reduce(0, inv, s, "amin", include_self=False)
    return n[inv], mean[inv], std[inv], (hi == lo)[inv]


def _out_dtype(scores: torch.Tensor) -> torch.dtype:
    return torch.promote_types(scores.dtype, torch.float32) if scores.is_floating_point() else torch.float32


def grpo_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, scale: bool = True
) -> torch.Tensor:
    """GRPO's group-relative advantage of each response: scores, group_ids (B,) -> (B,).

    A_i = (s_i - mean_g) / (std_g + eps), mean and std over the responses of i's group g; the std
    is the unbiased one (divides by n_g - 1), as ``torch.std`` in DeepSeekMath's GRPO and TRL.
    ``scale=False`` is Dr. GRPO: A_i = s_i - mean_g, without the division, which favours groups
    with little spread (too easy or too hard prompts) and biases towards them.
    A group whose scores are all equal (a singleton included) gives exactly 0: it holds no
    preference, and the rounding of its mean must not be divided by a near-zero std.
    Each token of response i then gets A_i (broadcast over its mask).
    Sources: Shao et al. 2024, "DeepSeekMath" (GRPO), https://arxiv.org/abs/2402.03300;
    Liu et al. 2025, "Understanding R1-Zero-Like Training" (Dr. GRPO), https://arxiv.org/abs/2503.20783.
    """
    _, mean, std, tied = _group_moments(scores, group_ids)
    centred = scores.double() - mean
    adv = centred / (std + eps) if scale else centred
    return torch.where(tied, torch.zeros_like(adv), adv).to(_out_dtype(scores))


def rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out: each response's baseline is the mean of the other n - 1 of its group.

    A_i = s_i - (sum_g - s_i) / (n_g - 1) = n_g / (n_g - 1) * (s_i - mean_g); scores, group_ids
    (B,) -> (B,). The baseline does not depend on s_i, so the estimate stays unbiased. A singleton
    group has no other response: 0. A group of equal scores gives exactly 0.
    Source: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs", https://arxiv.org/abs/2402.14740.
    """
    n, mean, _, tied = _group_moments(scores, group_ids)
    adv = n / (n - 1).clamp(min=1) * (scores.double() - mean)
    return torch.where(tied, torch.zeros_like(adv), adv).to(_out_dtype(scores))


def group_baseline(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """The group mean as baseline (REINFORCE++-baseline): A_i = s_i - mean_g; (B,) -> (B,).

    The mean includes s_i itself, so a singleton group gives s_i - s_i = 0 (and a group of equal
    scores exactly 0). REINFORCE++-baseline then whitens these over the whole batch
    (:func:`masked_whiten` of the per-token values) instead of dividing by each group's std.
    Source: Hu 2025, "REINFORCE++", https://arxiv.org/abs/2501.03262 (the -baseline variant).
    """
    _, mean, _, tied = _group_moments(scores, group_ids)
    adv = scores.double() - mean
    return torch.where(tied, torch.zeros_like(adv), adv).to(_out_dtype(scores))


def remax_advantages(scores: torch.Tensor, greedy_scores: torch.Tensor) -> torch.Tensor:
    """ReMax: the baseline of a sampled response is the score of the greedy response to its prompt.

    A_i = s_i - b_i, b_i = reward of argmax decoding for the same prompt; scores, greedy_scores
    (B,) -> (B,) (repeat b per sample when a prompt has several).
    Source: Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning
    Method for Aligning Large Language Models", https://arxiv.org/abs/2310.10505 (Algorithm 1).
    """
    if scores.shape != greedy_scores.shape:
        raise ValueError(f"scores and greedy_scores must have one shape; got {tuple(scores.shape)} and "
                         f"{tuple(greedy_scores.shape)}")
    dtype = _out_dtype(scores)
    return scores.to(dtype) - greedy_scores.to(dtype)


def reinforce_pp_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Discounted returns-to-go per token: G_t = r_t + gamma * G_{t+1}, G = 0 after the last real token.

    token_rewards, mask (B, T) -> (B, T) float32, 0 on padding. The rewards are those of
    :func:`shape_rewards`: -beta * KL on every token, plus the score on the last one, so with
    gamma = 1, G_t = score - beta * (sum of the KL from token t on). REINFORCE++ uses no critic:
    its advantages are these returns whitened over the whole batch, ``masked_whiten(G, mask)``
    (equal to :func:`gae` with values 0 and lambda 1, before whitening).
    Source: Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models", https://arxiv.org/abs/2501.03262.
    """
    m = mask.float()
    r = token_rewards.float() * m
    returns = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for t in reversed(range(r.shape[1])):
        running = r[:, t] + gamma * running
        returns[:, t] = running
    return returns * m


# ------------------------------------------------------------------ losses


def aggregate_loss(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", constant: float | None = None
) -> torch.Tensor:
    """Reduce a per-token loss (B, T) over the real tokens (mask (B, T)) to a scalar.

    * ``token-mean``: sum over all real tokens / their number (each token weighs the same; PPO of
      lm-human-preferences, DAPO's token-level loss);
    * ``seq-mean-token-sum``: per-sequence sum, then the mean over sequences;
    * ``seq-mean-token-mean``: per-sequence mean, then the mean over sequences (GRPO as published:
      a long response's tokens each weigh less);
    * ``seq-mean-token-sum-norm``: sum over all real tokens / (B * constant), constant = the
      maximum response length (default: T), as Dr. GRPO, which removes the length bias of the
      per-sequence mean.
    In the two seq-mean modes rows without a real token are left out of the mean over sequences.
    Sources: Yu et al. 2025, "DAPO", https://arxiv.org/abs/2503.14476 (token-level loss);
    Liu et al. 2025, "Dr. GRPO", https://arxiv.org/abs/2503.20783.
    """
    if mode == "token-mean":
        return masked_mean(per_token, mask)
    m = _mask_like(mask, per_token)
    seq_sum = (per_token * m).sum(-1)  # (B,)
    if mode == "seq-mean-token-sum-norm":
        c = float(per_token.shape[-1] if constant is None else constant)
        if c <= 0:
            raise ValueError(f"aggregate_loss: constant must be > 0, got {constant}")
        return seq_sum.sum() / (per_token.shape[0] * c)
    n = m.sum(-1)  # (B,) real tokens per row
    has = (n > 0).to(m.dtype)
    if mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif mode == "seq-mean-token-mean":
        per_seq = seq_sum / n.clamp(min=1)
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")
    return (per_seq * has).sum() / has.sum()


def aggregate_denominator(mask: torch.Tensor, mode: str = "token-mean", constant: float | None = None,
                          length: int | None = None) -> float:
    """What :func:`aggregate_loss` divides by for this mask: the number of real tokens
    (``token-mean``), of rows with a real token (the two seq-mean modes), or rows * constant
    (``seq-mean-token-sum-norm``; constant default: ``length``, else the mask's width).

    ``aggregate_loss(l, mask, mode) * aggregate_denominator(mask, mode)`` is the loss's sum over
    its units, so data-parallel training can divide that sum by the global batch's denominator.
    """
    m = mask != 0
    if mode == "token-mean":
        return float(m.sum())
    if mode == "seq-mean-token-sum-norm":
        c = float(constant if constant is not None else (length if length is not None else mask.shape[-1]))
        return float(mask.shape[0]) * c
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return float(m.any(-1).sum())
    raise ValueError(f"unknown loss aggregation {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    *,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    loss_agg: str = "token-mean",
    agg_constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss; all inputs (B, T) -> (scalar loss, stats).

    r = exp(logp - logp_old); per token l = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high)),
    eps_low = ``clip_eps``, eps_high = ``clip_eps_high`` (default: ``clip_eps``, plain PPO);
    loss = aggregate_loss(l, mask, ``loss_agg``), by default masked_mean(l) (token-mean).
    Clip-higher (eps_high > eps_low, DAPO uses 0.2 / 0.28) lets low-probability tokens with A > 0
    grow further before the clip, against entropy collapse.
    Dual-clip (``dual_clip`` = C > 1): where A < 0 the loss is capped, l = min(l, -C * A), so a
    token whose ratio has run far above 1 (r > C) stops pushing an unbounded step; tokens with
    A >= 0 are unchanged.
    stats (detached scalars): clipfrac = fraction of real tokens where the clipped term is the
    larger one, approxkl = masked_mean((logp - logp_old)^2 / 2), ratio = masked_mean(r); with
    dual-clip also dual_clipfrac = fraction of real tokens where the cap applies.
    Sources: Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (eq. 7),
    https://arxiv.org/abs/1707.06347; Yu et al. 2025, "DAPO" (clip-higher),
    https://arxiv.org/abs/2503.14476; Ye et al. 2020, "Mastering Complex Control in MOBA Games
    with Deep Reinforcement Learning" (dual-clip), https://arxiv.org/abs/1912.09729.
    """
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = logprobs.float() - old_logprobs.float()
    ratio = torch.exp(log_ratio)
    adv = advantages.float()
    pg_loss1 = -adv * ratio
    pg_loss2 = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high)
    pg_loss = torch.max(pg_loss1, pg_loss2)
    capped = None
    if dual_clip is not None:
        cap = -dual_clip * adv  # (B, T), > 0 where A < 0
        capped = (adv < 0) & (pg_loss > cap)
        pg_loss = torch.where(capped, cap, pg_loss)
    loss = aggregate_loss(pg_loss, mask, loss_agg, agg_constant)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((pg_loss2 > pg_loss1).float(), mask),
            "approxkl": masked_mean(0.5 * log_ratio**2, mask),
            "ratio": masked_mean(ratio, mask),
        }
        if capped is not None:
            stats["dual_clipfrac"] = masked_mean(capped.float(), mask)
    return loss, {k: s.detach() for k, s in stats.items()}


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss; all inputs (B, T) -> (scalar loss, stats).

    v_clip = clip(v, v_old - c, v_old + c);
    loss = 0.5 * masked_mean(max((v - R)^2, (v_clip - R)^2)).
    stats: clipfrac = fraction of real tokens where the clipped term is strictly larger.
    Source: OpenAI baselines ppo2 / lm-human-preferences (value clipping of PPO implementations).
    """
    v, v_old, ret = values.float(), old_values.float(), returns.float()
    v_clipped = v_old + torch.clamp(v - v_old, -clip, clip)
    vf_loss1 = (v - ret) ** 2
    vf_loss2 = (v_clipped - ret) ** 2
    loss = 0.5 * masked_mean(torch.max(vf_loss1, vf_loss2), mask)
    with torch.no_grad():
        clipfrac = masked_mean((vf_loss2 > vf_loss1).float(), mask)
    return loss, {"clipfrac": clipfrac.detach()}


def pairwise_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """Bradley-Terry reward-model loss: mean(-log sigmoid(r_chosen - r_rejected - margin)).

    chosen, rejected, margin: (B,); margin None means 0. Uses logsigmoid (stable for large gaps).
    Source: Christiano et al. 2017; Ouyang et al. 2022 (InstructGPT); margin as in Llama 2.
    """
    diff = chosen.float() - rejected.float()
    if margin is not None:
        diff = diff - margin.float()
    return -F.logsigmoid(diff).mean()


def grouped_pairwise_loss(
    scores: torch.Tensor,
    chosen_idx: torch.Tensor,
    rejected_idx: torch.Tensor,
    group: torch.Tensor,
    margin: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bradley-Terry loss with each prompt's comparisons as one item: mean over groups of the mean of
    -log sigmoid(s[c] - s[r] - margin) over that group's pairs.

    scores: (N,) one score per distinct response; chosen_idx, rejected_idx, group: (P,) long, pair p
    compares scores[chosen_idx[p]] with scores[rejected_idx[p]] and belongs to group[p] (0..G-1, every
    group used); margin: (P,) or None. With K ranked responses per prompt each response is scored once
    and its C(K, 2) comparisons weigh as one item, so a response is not fitted K - 1 times per epoch.
    Source: Ouyang et al. 2022 (InstructGPT), section 3.5, the reward-model loss over C(K, 2) pairs.
    """
    diff = scores.float()[chosen_idx] - scores.float()[rejected_idx]
    if margin is not None:
        diff = diff - margin.float()
    n_groups = int(group.max()) + 1
    size = torch.zeros(n_groups, dtype=torch.float32, device=diff.device)
    size.index_add_(0, group, torch.ones_like(diff))
    return (-F.logsigmoid(diff) / size[group]).sum() / n_groups


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO loss of a batch of preference pairs -> (mean loss, chosen_rewards (B,), rejected_rewards (B,)).

    Inputs (B,): log-probabilities of each whole response given its prompt, under the policy and
    the frozen reference. With the implicit rewards r_c = beta * (logpi_c - logref_c),
    r_r = beta * (logpi_r - logref_r) (returned detached) and h = (logpi_c - logref_c) -
    (logpi_r - logref_r):
    * ``sigmoid`` (DPO): loss = -log sigmoid(beta * h); with ``label_smoothing`` eps (conservative
      DPO, cDPO: each label is flipped with probability eps),
      loss = -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h), 0 <= eps < 0.5;
    * ``ipo``: loss = (h - 1 / (2 * beta))^2, regressing the log-ratio gap to a finite target
      instead of pushing it to infinity. Following TRL (PR #1294) the caller passes per-token
      *average* log-probabilities for IPO (as IPO's authors do), the response sums for DPO; this
      function uses what it is given. Label smoothing does not apply to IPO.
    Sources: Rafailov et al. 2023, "Direct Preference Optimization", https://arxiv.org/abs/2305.18290
    (eq. 7); Mitchell 2023, "A note on DPO with noisy preferences" (cDPO); Azar et al. 2023,
    "A General Theoretical Paradigm to Understand Learning from Human Preferences" (IPO),
    https://arxiv.org/abs/2310.12036.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_ratio = policy_chosen_logps.float() - ref_chosen_logps.float()
    rejected_ratio = policy_rejected_logps.float() - ref_rejected_logps.float()
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        if label_smoothing:
            raise ValueError("label_smoothing applies to the sigmoid (DPO) loss only, not to ipo")
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss type {loss_type!r}; valid types: {', '.join(DPO_LOSS_TYPES)}")
    return losses.mean(), (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach()


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - v) / Var(R) over the real tokens (biased masked variances); (B, T) -> float.

    1 is a perfect value function, 0 no better than the mean, negative worse. nan if Var(R) == 0.
    Source: ``explained_variance`` of OpenAI baselines, a PPO value-function diagnostic.
    """
    var_returns = float(masked_var(returns.float(), mask, unbiased=False).item())
    if var_returns == 0.0:
        return float("nan")
    var_residual = float(masked_var(returns.float() - values.float(), mask, unbiased=False).item())
    return 1.0 - var_residual / var_returns


class AdaptiveKLController:
    """Adaptive KL coefficient: steer the measured KL towards a target.

    error = clip(current_kl / target - 1, -c, c);
    value = min(max_value, max(min_value, value * (1 + error * n_steps / horizon))),
    with c = ``error_clip`` (0.2, as published).
    Source: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences" (sec. 2.2),
    plus an optional floor ``min_value`` (0 = none, as published). The floor keeps the controller
    from winding down while the KL sits below its target, as it does for the many updates a rare
    reward takes to be found: without it beta decays toward 0 and the KL then runs far past its
    target before beta has climbed back. An optional ceiling ``max_value`` (None = none, as
    published) stops beta where its penalty would outweigh the reward and throw the policy back
    past its target rather than hold it there.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float, min_value: float = 0.0,
                 error_clip: float = 0.2, max_value: float | None = None) -> None:
        if target <= 0 or horizon <= 0 or not 0 < error_clip < 1:
            raise ValueError(f"target and horizon must be > 0 and error_clip in (0, 1), got target={target}, "
                             f"horizon={horizon}, error_clip={error_clip}")
        if min_value < 0:
            raise ValueError(f"min_value must be >= 0, got {min_value}")
        if max_value is not None and max_value < max(min_value, init_kl_coef):
            raise ValueError(f"max_value must be >= min_value and init_kl_coef, got {max_value}")
        self.max_value: float | None = None if max_value is None else float(max_value)
        self.value: float = max(float(init_kl_coef), float(min_value))
        self.target: float = float(target)
        self.horizon: float = float(horizon)
        self.min_value: float = float(min_value)
        self.error_clip: float = float(error_clip)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient after ``n_steps`` (in the horizon's unit: ppolm passes 1 per PPO
        update, Ziegler et al. the batch's sample count) with mean KL ``current_kl``."""
        error = min(max(float(current_kl) / self.target - 1.0, -self.error_clip), self.error_clip)
        self.value = max(self.min_value, self.value * (1.0 + error * n_steps / self.horizon))
        if self.max_value is not None:
            self.value = min(self.value, self.max_value)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon, "min_value": self.min_value,
                "error_clip": self.error_clip, "max_value": self.max_value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))
        self.min_value = float(state.get("min_value", self.min_value))
        self.error_clip = float(state.get("error_clip", self.error_clip))
        self.max_value = state.get("max_value", self.max_value)


class RunningScale:
    """The running standard deviation of every score a run has seen, from which :func:`score_unit`
    derives the divisor of the scores before PPO's KL penalty (score / unit - beta * KL per token).

    Why: the KL coefficient trades nats of KL against units of reward, so with raw scores its right
    value depends on the reward's scale: a coefficient that suits a reward in [0, 1] holds a reward
    in [0, 0.1] at its start (the KL penalty outweighs it) and lets one in [0, 10] run past its KL
    target for the many updates the adaptive controller needs to climb 10x. Dividing by the running
    std ("reward scaling", Engstrom et al. 2020, "Implementation Matters in Deep Policy Gradients",
    sec. 3, ``--score-scale std``) makes --kl-coef mean the same for every reward; advantages are whitened afterwards, so
    the scale of the scores themselves does not otherwise matter. The running ``mean`` is what
    ``--score-center`` subtracts (all of it, or by default its part beyond two stds:
    :func:`score_center`): a constant shift of every score changes no advantage once the critic
    has learnt it, but the critic's value head starts at 0, and until then GAE with
    lambda < 1 hands each response's late tokens more of the shift than its early ones.
    ``std`` is 0 until two scores seen differ (a reward nobody has earned yet carries no unit).
    Moments are combined per batch (Chan et al. 1979), in float64.

    :func:`score_unit` takes ``spread``, not ``std``: the spread of the scores around their own
    batch's mean, pooled over every batch. ``std`` also counts how far the batch means moved
    apart, i.e. the policy's progress: on a reward the policy climbs from -120 to -10 (length20
    of bench/learning_tasks.py) ``std`` grew fivefold over 40 updates, to twice the spread within
    the batches, and shrank the differences PPO learns from towards the size of the KL penalty
    just as the policy got good. Advantages compare answers within a batch, so their spread is
    the unit.
    """

    def __init__(self) -> None:
        self.count: float = 0.0
        self.mean: float = 0.0
        self.m2: float = 0.0  # sum of squared deviations from the mean of every score
        self.within_m2: float = 0.0  # sum of squared deviations from each score's own batch mean

    def update(self, count: float, mean: float, m2: float) -> None:
        """Add a batch: its number of scores, their mean and their sum of squared deviations."""
        if count <= 0:
            return
        total = self.count + count
        delta = mean - self.mean
        self.m2 += m2 + delta * delta * self.count * count / total
        self.within_m2 += m2
        self.mean += delta * count / total
        self.count = total

    @property
    def std(self) -> float:
        """The running std; 0 until two scores seen differ."""
        var = self.m2 / self.count if self.count else 0.0
        return math.sqrt(var) if var > 1e-12 else 0.0

    @property
    def spread(self) -> float:
        """The pooled within-batch std (see above); ``std`` where no batch had two scores that
        differ (batches of one score); 0 until two scores seen differ."""
        var = self.within_m2 / self.count if self.count else 0.0
        return math.sqrt(var) if var > 1e-12 else self.std

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2, "within_m2": self.within_m2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])
        # (checkpoints written before the within-batch spread: their pooled std stands in for it)
        self.within_m2 = float(state.get("within_m2", self.m2))


SCORE_SPREAD = (0.05, 0.5)
"""The running score std within which ``score_unit(..., "auto")`` leaves scores as they are: the
spread of the [0, 1] rule-based rewards of bench/learning.py (0.05-0.45), on which PPO's default
beta of 0.01 per reward unit was measured."""


def score_unit(std: float, mode: str, spread: tuple[float, float] = SCORE_SPREAD) -> float:
    """The divisor of the scores before the KL penalty, from their spread ``std`` (PPO passes
    :attr:`RunningScale.spread`, the pooled std within batches).

    none: 1 (raw scores). std: ``std`` (scores in units of their spread; beta per std). auto:
    ``std / clip(std, lo, hi)``: 1 while the spread lies in ``spread``, else the factor that brings
    it to the nearer edge, so that a reward 10x smaller or larger than the ones the default beta
    was measured on is priced against the KL as they are. 1 whenever ``std`` is 0 (no spread yet).
    """
    if mode not in ("none", "std", "auto"):
        raise ValueError(f"mode must be none, std or auto, got {mode!r}")
    if mode == "none" or std <= 0:
        return 1.0
    if mode == "std":
        return float(std)
    lo, hi = spread
    return float(std) / min(max(float(std), lo), hi)


SCORE_CENTER_BAND = 2.0
"""How many running stds from 0 the running mean of the scores may lie before
``score_center(..., "auto")`` subtracts the excess: the [0, 1] rule-based rewards of
bench/learning.py stay inside it while their mean is under 0.8 (a 0/1 reward's mean is
sqrt(p / (1 - p)) of its std from 0), so only an offset larger than such a reward's own is moved."""


def score_center(mean: float, std: float, mode: str, band: float = SCORE_CENTER_BAND) -> float:
    """What is subtracted from every score before GAE, from the running mean and std of the
    scores (:class:`RunningScale`).

    none: 0. running: ``mean`` (reward centering, Naik et al. 2024, arXiv:2405.09999). auto:
    ``mean - clip(mean, -band * std, band * std)``, the part of the offset beyond ``band`` spreads
    from 0: a reward whose mean lies within it keeps its scores as they are, one further off (a
    reward that is never positive, or one that starts at 3) is brought to the band's edge, so the
    zero-initialised value head starts no further from the returns than on a [0, 1] reward. With
    no spread yet (``std`` 0) that edge is 0 and auto subtracts the whole mean.
    """
    if mode not in ("none", "running", "auto"):
        raise ValueError(f"mode must be none, running or auto, got {mode!r}")
    if mode == "none":
        return 0.0
    if mode == "running":
        return float(mean)
    edge = band * float(std)
    return float(mean) - min(max(float(mean), -edge), edge)


def kl_lr_scale(kl: float, target: float, max_scale: float) -> float:
    """The factor on the actor's learning rate for a policy whose mean KL to the reference is ``kl``
    (``--kl-lr-boost``): clip(target / kl, 1, max_scale), ``max_scale`` at kl <= 0 (no KL spent yet).

    The KL budget left decides how large a step the policy may take: far inside it (a rare reward
    not yet found, few nats spent) the step grows up to ``max_scale`` times; at or past the target
    it is the plain learning rate, and the adaptive KL coefficient does the steering.
    """
    if target <= 0 or max_scale < 1:
        raise ValueError(f"target must be > 0 and max_scale >= 1, got target={target}, max_scale={max_scale}")
    if not math.isfinite(kl):
        return 1.0
    if kl <= 0:
        return float(max_scale)
    return float(min(max_scale, max(1.0, target / kl)))


class FixedKLController:
    """Constant KL coefficient, with the interface of AdaptiveKLController (update does nothing)."""

    def __init__(self, kl_coef: float) -> None:
        self.value: float = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays fixed."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


__all__ = [
    "DPO_LOSS_TYPES", "KL_KINDS", "LOSS_AGG_MODES", "SCORE_SPREAD", "AdaptiveKLController", "FixedKLController",
    "RunningScale", "aggregate_loss", "score_unit",
    "dpo_loss", "entropy_from_logits", "explained_variance", "gae", "group_baseline", "grouped_pairwise_loss",
    "grpo_advantages", "kl_lr_scale", "kl_penalty", "last_token_index", "logprobs_from_logits", "masked_mean", "masked_sum",
    "masked_var", "masked_whiten", "pairwise_loss", "policy_loss", "reinforce_pp_returns", "remax_advantages",
    "rloo_advantages", "shape_rewards", "value_loss",
]
