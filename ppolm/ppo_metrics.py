"""The metrics row of one PPO iteration.

Names follow TRL's PPOTrainer and OpenAI's lm-human-preferences, so runs compare (README,
docs/details.md): ``objective/*`` (KL, its coefficient, entropy, scores, the RLHF reward),
``policy/*``, ``loss/*``, ``val/*`` (the critic: absent, as ``loss/value_avg`` and ``lr/critic``,
for the critic-free estimators), ``adv/var``, ``response/length_mean``, the
learning rates, ``guard/skipped_updates``, ``time/*`` and one ``reward/<source>`` per source.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ppolm import core
from ppolm import rollout as ro


def step_metrics(exp: ro.Experience, stats: dict[str, list[float]], parts: dict[str, torch.Tensor], *, eos_id: int,
                 beta: float, adv_var: float, lr: float, critic_lr: float | None, epochs: int, skipped_total: int,
                 times: tuple[float, float, float, float]) -> dict[str, Any]:
    """One PPO iteration's metrics row (names as TRL's PPOTrainer logs them, see docs/details.md);
    ``stats``: the update's per-microbatch values; ``times``: when the step, and its score and
    train phases, began and when the update ended. ``critic_lr`` None: no critic, no value metrics."""
    roll, mask = exp.roll, exp.mask

    def avg(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    t_start, t_rollout, t_score, t_train = times
    metrics = {
        "objective/kl": exp.kl.sum(1).mean().item(),
        "objective/kl_coef": beta,
        "objective/entropy": (-exp.old_logprobs * mask).sum(1).mean().item(),
        "objective/scores": exp.scores.mean().item(),
        "objective/non_score_reward": exp.non_score.sum(1).mean().item(),
        "objective/rlhf_reward": (exp.scores + exp.non_score.sum(1)).mean().item(),
        "policy/approxkl_avg": avg(stats["approxkl"]),
        "policy/clipfrac_avg": avg(stats["clipfrac"]),
        "policy/entropy_avg": core.masked_mean(exp.entropy, mask).item(),
        "loss/policy_avg": avg(stats["pg"]),
        "loss/value_avg": avg(stats["vf"]),
        "val/clipfrac_avg": avg(stats["vf_clipfrac"]),
        "val/ratio": avg(stats["ratio"]),
        "val/vf_explained_var": core.explained_variance(exp.values, exp.returns, mask),
        "val/num_eos_tokens": int((roll.response == eos_id).sum()),
        # |recomputed - sampled| log-prob per token: ~0 in fp32, bf16 rounding of two computation
        # paths (KV-cache decoding vs one full pass) otherwise; large values mean the rollouts were
        # not drawn from the distribution PPO optimises
        "policy/sampler_logprob_gap": core.masked_mean((exp.old_logprobs - roll.sample_logprobs).abs(), mask).item(),
        "adv/var": adv_var,
        "response/length_mean": roll.lengths.float().mean().item(),
        "lr": lr,
        "lr/critic": critic_lr,
        "ppo/epochs": epochs,
        "guard/skipped_updates": skipped_total,
        "time/rollout_s": t_rollout - t_start,
        "time/score_s": t_score - t_rollout,
        "time/train_s": t_train - t_score,
        "time/step_s": time.perf_counter() - t_start,
    }
    if critic_lr is None:
        for k in ("loss/value_avg", "val/clipfrac_avg", "val/vf_explained_var", "lr/critic"):
            del metrics[k]
    if stats["dual_clipfrac"]:
        metrics["policy/dual_clipfrac_avg"] = avg(stats["dual_clipfrac"])
    if stats["ptx"]:
        metrics["loss/ptx_avg"] = avg(stats["ptx"])
    for name, s in parts.items():
        metrics[name] = s.float().mean().item()
    return metrics
