"""The metrics row of one PPO iteration.

Names follow TRL's PPOTrainer and OpenAI's lm-human-preferences, so runs compare (README,
docs/details.md): ``objective/*`` (KL, its coefficient, entropy, scores, the RLHF reward),
``policy/*``, ``loss/*``, ``val/*`` (the critic: absent, as ``loss/value_avg`` and ``lr/critic``,
for the critic-free estimators), ``adv/var``, ``response/length_mean``, the
learning rates, ``guard/skipped_updates``, ``time/*``, ``memory/*`` and one ``reward/<source>`` per
source.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ppolm import core, distributed, memory
from ppolm import rollout as ro
from ppolm.advantages import Advantages
from ppolm.ppo_config import PPOConfig


class Clock:
    """When a PPO step began and when each of its phases (rollout, score, train) ended, and the peak
    memory of each phase (:class:`ppolm.memory.PhasePeaks`, sampled until the last phase ends)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.memory = memory.PhasePeaks(device)
        self.memory.start()
        self.marks = [time.perf_counter()]

    def mark(self) -> None:
        self.marks.append(time.perf_counter())
        self.memory.mark()
        if len(self.marks) == len(memory.PHASES) + 1:
            self.memory.stop()

    @property
    def times(self) -> tuple[float, float, float, float]:
        t_start, t_rollout, t_score, t_train = self.marks
        return t_start, t_rollout, t_score, t_train


def step_metrics(exp: ro.Experience, stats: dict[str, list[float]], parts: dict[str, torch.Tensor], *, eos_id: int,
                 beta: float, adv: Advantages, cfg: PPOConfig, lrs: tuple[float, float | None], epochs: int,
                 skipped_total: int, times: tuple[float, float, float, float],
                 mem: dict[str, float] | None = None) -> dict[str, Any]:
    """One PPO iteration's metrics row (names as TRL's PPOTrainer logs them, see docs/details.md);
    ``stats``: the update's per-microbatch values; ``adv``: steps 4 and 5's outcome; ``lrs``: the
    update's learning rates, the actor's and the critic's (None: no critic, no value metrics);
    ``times``: when the step, and its score and train phases, began and when the update ended;
    ``mem``: the ``memory/*`` metrics of this process (the largest over the processes is logged)."""
    roll, mask = exp.roll, exp.mask
    lr, critic_lr = lrs

    def avg(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    t_start, t_rollout, t_score, t_train = times
    # Batch quantities as (sum, count) over every process's rows, summed in one all-reduce: the
    # same row on each process, equal to one process's on the whole batch.
    rows, tokens = float(mask.shape[0]), mask.sum()
    seq_kl = exp.kl.sum(1)
    sums = distributed.Sums()
    sums.add("objective/kl", seq_kl.sum(), rows)
    sums.add("objective/entropy", (-exp.old_logprobs * mask).sum(), rows)
    sums.add("objective/scores", exp.scores.sum(), rows)
    sums.add("objective/non_score_reward", exp.non_score.sum(), rows)
    sums.add("objective/rlhf_reward", (exp.scores + exp.non_score.sum(1)).sum(), rows)
    sums.add("policy/entropy_avg", core.masked_sum(exp.entropy, mask), tokens)
    sums.add("val/num_eos_tokens", (roll.response == eos_id).sum(), 1.0 / distributed.world_size())
    # |recomputed - sampled| log-prob per token: ~0 in fp32, bf16 rounding of two computation
    # paths (KV-cache decoding vs one full pass) otherwise; large values mean the rollouts were
    # not drawn from the distribution PPO optimises
    sums.add("policy/sampler_logprob_gap", core.masked_sum((exp.old_logprobs - roll.sample_logprobs).abs(), mask),
             tokens)
    sums.add("response/length_mean", roll.lengths.sum(), rows)
    # explained variance from the moments of the returns and of the residuals
    ret, res = exp.returns.double(), (exp.returns - exp.values).double()
    for name, x in (("ret", ret), ("res", res)):
        sums.add(f"{name}1", core.masked_sum(x, mask), tokens)
        sums.add(f"{name}2", core.masked_sum(x * x, mask), tokens)
    for name, s in parts.items():
        sums.add(name, s.float().sum(), rows)
    g = sums.means()
    var_ret, var_res = g.pop("ret2") - g.pop("ret1") ** 2, g.pop("res2") - g.pop("res1") ** 2
    g["val/num_eos_tokens"] = int(round(g["val/num_eos_tokens"]))
    metrics = {
        "objective/kl": g["objective/kl"],
        "objective/kl_coef": beta,
        "objective/entropy": g["objective/entropy"],
        "objective/scores": g["objective/scores"],
        "objective/non_score_reward": g["objective/non_score_reward"],
        "objective/rlhf_reward": g["objective/rlhf_reward"],
        "policy/approxkl_avg": avg(stats["approxkl"]),
        "policy/clipfrac_avg": avg(stats["clipfrac"]),
        "policy/entropy_avg": g["policy/entropy_avg"],
        "loss/policy_avg": avg(stats["pg"]),
        "loss/value_avg": avg(stats["vf"]),
        "val/clipfrac_avg": avg(stats["vf_clipfrac"]),
        "val/ratio": avg(stats["ratio"]),
        # 1 - Var(R - v) / Var(R) over the real tokens (core.explained_variance), nan if Var(R) = 0
        "val/vf_explained_var": 1.0 - var_res / var_ret if var_ret > 0 else float("nan"),
        "val/num_eos_tokens": g["val/num_eos_tokens"],
        "policy/sampler_logprob_gap": g["policy/sampler_logprob_gap"],
        "adv/var": adv.adv_var,
        "response/length_mean": g["response/length_mean"],
        "lr": lr,
        "lr/critic": critic_lr,
        "ppo/epochs": epochs,
        "guard/skipped_updates": skipped_total,
        "time/rollout_s": t_rollout - t_start,
        "time/score_s": t_score - t_rollout,
        "time/train_s": t_train - t_score,
        "time/step_s": time.perf_counter() - t_start,
    }
    mem = dict(mem or {})
    if distributed.world_size() > 1:  # each process decodes until its own longest response ends
        keys = sorted(mem)  # the same keys on every process (same device type and OS)
        top = distributed.all_max_floats([t_rollout - t_start] + [mem[k] for k in keys])
        metrics["time/rollout_max_s"] = top[0]
        mem = dict(zip(keys, top[1:]))
    metrics.update(mem)
    if critic_lr is None:
        for k in ("loss/value_avg", "val/clipfrac_avg", "val/vf_explained_var", "lr/critic"):
            del metrics[k]
    if stats["dual_clipfrac"]:
        metrics["policy/dual_clipfrac_avg"] = avg(stats["dual_clipfrac"])
    if stats["ptx"]:
        metrics["loss/ptx_avg"] = avg(stats["ptx"])
    # global gradient norms before --max-grad-norm clips them, averaged over the update's optimiser
    # steps (under AdamW a clip that binds scales the gradients down, so Adam's epsilon weighs more;
    # docs/learning.md, "How large the policy's gradients are")
    if stats["grad_norm"]:
        metrics["policy/grad_norm"] = avg(stats["grad_norm"])
    if stats["vf_grad_norm"]:  # a separate critic (with --critic shared the policy's norm includes the head)
        metrics["val/grad_norm"] = avg(stats["vf_grad_norm"])
    if stats["update_kl"]:  # --update-kl-max
        metrics["policy/update_kl"] = avg(stats["update_kl"])
        metrics["policy/update_scale"] = avg(stats["update_scale"])
    for name in parts:
        metrics[name] = g[name]
    if cfg.algo.advantage == "gae":
        if cfg.reward.score_scale != "none":
            metrics["objective/score_scale"] = adv.unit
        if cfg.reward.score_center != "none":
            metrics["objective/score_center"] = adv.center
        metrics["adv/tied"] = float(adv.tied)
        metrics["adv/unearned"] = float(adv.unearned)
    return metrics
