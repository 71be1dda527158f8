"""Step 6 of a PPO iteration: the PPO epochs that train the policy and the critic on one batch.

:class:`Learner` owns what the update changes: the trained models' forward pass (an
:class:`ppolm.actor_critic.ActorCritic`, under DDP or FSDP with several processes), their fp32
master weights, the two AdamW optimisers and their learning-rate schedules. It runs
``--ppo-epochs`` passes over a batch (a fresh shuffle each), in minibatches of microbatches, with
the clipped policy and value losses of :mod:`ppolm.core`, and the KL-in-loss, entropy and PPO-ptx
terms when asked. The minibatch shuffles and the PPO-ptx draws have a generator each, so turning
``--ptx-coef`` on leaves the shuffles as they were.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ppolm import checkpoint, core, distributed, runtime
from ppolm import rollout as ro
from ppolm.actor_critic import ActorCritic
from ppolm.ppo_config import PPOConfig

STATS = ("approxkl", "clipfrac", "pg", "vf", "vf_clipfrac", "ratio", "ptx", "dual_clipfrac", "grad_norm",
         "vf_grad_norm", "update_kl", "update_scale")
"""The per-microbatch statistics an update returns (the metrics row averages them)."""

PTX_STREAM = 104_729
"""Offsets the PPO-ptx generator's seed from the shuffles' (both are seeded per step)."""


class ActorSchedule(torch.optim.lr_scheduler.LRScheduler):
    """The actor's learning rate: ``actor_lr * schedule(step) * boost``, where ``boost`` is
    --kl-lr-boost's scale for the next update (:func:`ppolm.core.kl_lr_scale`), given at each
    :meth:`advance`."""

    def __init__(self, opt: torch.optim.Optimizer, schedule: Callable[[int], float], boost: float):
        self.schedule, self.boost = schedule, boost
        super().__init__(opt)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return [base * (self.schedule(self.last_epoch) * self.boost) for base in self.base_lrs]

    def advance(self, boost: float) -> None:
        self.boost = boost
        self.step()

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "schedule", "boost")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__dict__.update({k: v for k, v in state.items() if k != "lr_lambdas"})  # (saved by LambdaLR before)


class Learner:
    """The trained models and their optimisers; :meth:`update` is PPO's step 6 on one batch."""

    def __init__(self, cfg: PPOConfig, actor_critic: ActorCritic, train_model: Any, device: torch.device,
                 ptx_ids: list[list[int]] | None, pad_id: int, lr_boost: float):
        self.cfg, self.actor_critic, self.train_model, self.device = cfg, actor_critic, train_model, device
        self.ptx_ids, self.pad_id = ptx_ids, pad_id
        self.rank, self.world = distributed.rank(), distributed.world_size()
        self.local_batch = cfg.algo.batch_size // self.world  # this process's rows of each batch
        self.minibatch_rows = self.local_batch // cfg.algo.minibatches  # this process's rows per minibatch
        self.micro_size = self.minibatch_rows // cfg.algo.grad_accum  # ... per microbatch (gradient accumulation)
        self.has_critic = actor_critic.critic is not None or actor_critic.value_head is not None
        self.build_optimisers(lr_boost)

    def build_optimisers(self, lr_boost: float) -> None:
        """Separate AdamW optimisers and learning rates for actor and critic (Adam eps 1e-5, detail
        16); with bf16 models they step fp32 master copies (ppolm/runtime.py). Without a critic
        (critic-free estimators) ``critic_opt`` and ``critic_sched`` are None."""
        a, seed = self.cfg.algo, self.cfg.run.seed
        self.actor = runtime.MasterWeights((p for p in self.actor_critic.policy.parameters() if p.requires_grad),
                                           seed=seed)
        self.critic_weights = runtime.MasterWeights((p for _, p in self.critic_named_parameters()), seed=seed + 1)
        self.actor_params, self.critic_params = self.actor.params, self.critic_weights.params
        # fused AdamW: one kernel over all parameters, ~4x faster than the per-tensor loop on a CPU
        adam = dict(eps=a.adam_eps, weight_decay=a.weight_decay,
                    fused=self.device.type in ("cpu", "cuda") and not self.cfg.model.fsdp)
        self.actor_opt = torch.optim.AdamW(self.actor_params, lr=a.actor_lr, betas=(a.actor_adam_beta1, 0.999), **adam)
        decay = (lambda s: max(0.0, 1.0 - s / a.steps)) if a.lr_schedule == "linear" else (lambda s: 1.0)
        f0 = a.actor_lr_warmup_from
        warmup = ((lambda s: f0 + (1.0 - f0) * min(1.0, (s + 1) / a.actor_lr_warmup)) if a.actor_lr_warmup
                  else (lambda s: 1.0))
        self.actor_sched = ActorSchedule(self.actor_opt, lambda s: decay(s) * warmup(s), lr_boost)
        self.critic_opt = self.critic_sched = None
        if self.critic_params:
            eps = a.adam_eps if a.critic_adam_eps is None else a.critic_adam_eps
            self.critic_opt = torch.optim.AdamW(self.critic_params, lr=a.critic_lr, **dict(adam, eps=eps))
            self.critic_sched = torch.optim.lr_scheduler.LambdaLR(self.critic_opt, decay)

    # ------------------------------------------------------------------------------ the weights
    def critic_named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The critic's trained parameters (value head, or the critic's trained layers and head, and
        the value bias carried over from the reward model's normalisation)."""
        ac = self.actor_critic
        mod = ac.value_head if ac.value_head is not None else ac.critic
        if mod is None:  # critic-free estimators
            return []
        named = [(n, p) for n, p in mod.named_parameters() if p.requires_grad]
        return named + ([("value_bias", ac.value_bias)] if ac.value_bias is not None else [])

    def trained_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) of everything trained: the policy and the critic or value head; with bf16
        models, their fp32 master copies (what the optimisers step and checkpoints hold)."""
        names = [f"policy.{n}" for n, p in self.actor_critic.policy.named_parameters() if p.requires_grad] + \
            [f"critic.{n}" for n, _ in self.critic_named_parameters()]
        return list(zip(names, self.actor.params + self.critic_weights.params))

    def lrs(self) -> tuple[float, float | None]:
        """The learning rates of the update about to run: the actor's, and the critic's (None without)."""
        return self.actor_sched.get_last_lr()[0], \
            self.critic_sched.get_last_lr()[0] if self.critic_sched is not None else None

    def advance_schedules(self, lr_boost: float) -> None:
        self.actor_sched.advance(lr_boost)
        if self.critic_sched is not None:
            self.critic_sched.step()

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The trained weights (gathered whole with --fsdp) and the optimisers' and schedules' states."""
        tensors = {n: distributed.full(p) for n, p in self.trained_parameters()}
        ta, meta = checkpoint.optimizer_state(self.actor_opt, "actor_opt")
        tensors.update(ta)
        out = {"actor_opt": meta, "actor_sched": self.actor_sched.state_dict()}
        if self.critic_opt is not None:  # the critic-free estimators have none
            tc, mc = checkpoint.optimizer_state(self.critic_opt, "critic_opt")
            tensors.update(tc)
            out.update(critic_opt=mc, critic_sched=self.critic_sched.state_dict())
        return tensors, out

    def load(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        with torch.no_grad():
            for n, p in self.trained_parameters():
                p.copy_(distributed.shard_like(tensors[n], p))  # --fsdp: each process takes its shard
        self.actor.copy_to_model()
        self.critic_weights.copy_to_model()
        checkpoint.load_optimizer_state(self.actor_opt, "actor_opt", tensors, meta["actor_opt"])
        self.actor_sched.load_state_dict(meta["actor_sched"])
        if self.critic_opt is not None:
            checkpoint.load_optimizer_state(self.critic_opt, "critic_opt", tensors, meta["critic_opt"])
            self.critic_sched.load_state_dict(meta["critic_sched"])

    # ------------------------------------------------------------------------------ forward passes
    def forward_train(self, roll: ro.Rollout, need_entropy_grad: bool, trunk: torch.Tensor | None = None,
                      entering: torch.Tensor | None = None, want_entropy: bool = True,
                      want_values: bool = True) -> tuple[Any, ...]:
        """Policy log-probs, entropy and values on a rollout, each (B, R), through the trained models'
        module. ``trunk`` (B, P + R, d): the frozen trunk's hidden state that feeds a top-layers
        critic; ``entering``: the state entering the policy's first adapted layer, from the reference pass."""
        return self.train_model(roll, need_entropy_grad, trunk, entering, want_entropy, want_values)

    def forward_rows(self, exp: ro.Experience, rows: torch.Tensor, need_entropy_grad: bool = False,
                     want_entropy: bool = False, want_values: bool = True) -> tuple[Any, ...]:
        """:meth:`forward_train` on some rows (indices) of a batch, with their trunk and entering states."""
        trunk, entering = (None if x is None else x[rows] for x in (exp.critic_input, exp.policy_entering))
        return self.forward_train(exp.roll.select(rows), need_entropy_grad, trunk, entering,
                                  want_entropy=want_entropy, want_values=want_values)

    def ptx_loss(self, gen: torch.Generator) -> torch.Tensor:
        """Language-modelling loss on a microbatch of the pretraining corpus (PPO-ptx); with several
        processes each draws its own microbatch (the same generator, its own offset)."""
        n = self.micro_size
        drawn = torch.randint(len(self.ptx_ids), (n * self.world,), generator=gen)[self.rank * n:(self.rank + 1) * n]
        picks = [self.ptx_ids[int(i)] for i in drawn]
        width = max(len(x) for x in picks)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, x in enumerate(picks):
            ids[i, :len(x)], mask[i, :len(x)] = torch.tensor(x), 1
        return self.train_model(None, ptx=(ids.to(self.device), mask.to(self.device)))

    # ------------------------------------------------------------------------------ the update
    def update(self, exp: ro.Experience, beta: float, step: int, epochs: int, hold_policy: bool = False
               ) -> tuple[dict[str, list[float]], int, int]:
        """PPO's update (step 6): ``epochs`` passes over the batch, a fresh shuffle each, in
        minibatches of microbatches, one optimiser step per minibatch (the critic's alone with
        ``hold_policy``). Returns the per-microbatch statistics (and the gradient norms of each
        optimiser step taken), the skipped (non-finite) optimiser steps and the epochs run
        (``--target-kl`` may stop early)."""
        a = self.cfg.algo
        stats: dict[str, list[float]] = {k: [] for k in STATS}
        skipped, epochs_done = 0, 0
        bounded = a.update_kl_max is not None and epochs > 0 and not hold_policy
        start = [p.detach().clone() for p in self.actor_params] if bounded else None
        seed = self.cfg.run.seed * 7919 + step
        shuffles = torch.Generator().manual_seed(seed)
        ptx_draws = torch.Generator().manual_seed(seed + PTX_STREAM)
        for _epoch in range(epochs):
            # each process shuffles its own rows with the same generator (one process: the whole batch)
            perm = torch.randperm(self.local_batch, generator=shuffles).to(self.device)
            micros = [mb.split(self.micro_size) for mb in perm.split(self.minibatch_rows)]
            scales = self.global_scales(exp.mask, [m for mb in micros for m in mb])
            epoch_kl = []
            for mb in micros:
                for micro in mb:
                    epoch_kl.append(self.microbatch(exp, micro, beta, scales.pop(0), ptx_draws, stats))
                ok, norms = self.optimizer_step(hold_policy)
                if ok:  # (the norms are global: the gradients were reduced over the processes)
                    for key, norm in zip(("grad_norm", "vf_grad_norm"), norms):
                        stats[key].append(norm)
                else:
                    skipped += 1
            epochs_done += 1
            exp.first_pass = None  # the first epoch's graph is spent
            # Early stop for the batch once the policy moved too far from the rollout policy
            # (judged on every process's microbatches, so all stop together).
            kl_total, kl_n = distributed.all_sum_floats([sum(epoch_kl), len(epoch_kl)])
            if a.target_kl is not None and kl_total / kl_n > a.target_kl:
                break
        exp.first_pass = None
        if start is not None:
            kl, scale = self.bound_update(exp, start, a.update_kl_max)
            stats["update_kl"].append(kl)
            stats["update_scale"].append(scale)
        return self.average_stats(stats), skipped, epochs_done

    def microbatch(self, exp: ro.Experience, micro: torch.Tensor, beta: float, scales: tuple[float, float],
                   ptx_draws: torch.Generator, stats: dict[str, list[float]]) -> float:
        """One microbatch's losses and backward pass (gradients accumulate until the minibatch's
        optimiser step); its statistics go to ``stats``. ``scales``: its share of the global averages
        (:meth:`global_scales`). Returns its approximate KL to the rollout policy."""
        cfg, a = self.cfg, self.cfg.algo
        pg_scale, tok_scale = scales
        if exp.first_pass is not None:  # the rollout pass, with grad (rows in minibatch order)
            logp, ent, v = (None if x is None else x[micro] for x in exp.first_pass)
        else:
            logp, ent, v = self.forward_rows(exp, micro, a.entropy_coef > 0, want_entropy=a.entropy_coef > 0)
        m_ = exp.mask[micro]
        pg_loss, pg = core.policy_loss(logp, exp.old_logprobs[micro], exp.advantages[micro], m_, a.clip_eps,
                                       clip_eps_high=a.clip_eps_high, dual_clip=a.dual_clip, loss_agg=a.loss_agg,
                                       agg_constant=cfg.generation.response_length)
        loss = pg_loss * pg_scale
        if cfg.kl.kl_in == "loss":  # always k3: the k1 gradient ignores the reference
            loss = loss + beta * core.kl_loss(logp, exp.ref_logprobs[micro], m_) * tok_scale
        if a.entropy_coef:
            loss = loss - a.entropy_coef * core.masked_mean(ent, m_) * tok_scale
        if self.ptx_ids:
            ptx = self.ptx_loss(ptx_draws)
            loss = loss + a.ptx_coef * ptx
            stats["ptx"].append(ptx.item())
        logged = [("approxkl", pg["approxkl"]), ("clipfrac", pg["clipfrac"]), ("pg", pg_loss), ("ratio", pg["ratio"])]
        if "dual_clipfrac" in pg:
            logged.append(("dual_clipfrac", pg["dual_clipfrac"]))
        if self.has_critic:
            center, unit = exp.value_units
            v = (v - center) / unit
            vf_loss, vf = core.value_loss(v, exp.values[micro], exp.returns[micro], m_, a.vf_clip)
            # separate critic: its own graph and optimiser; shared trunk: weighted sum
            shared = self.actor_critic.value_head is not None
            loss = loss + (a.vf_coef * vf_loss if shared else vf_loss) * tok_scale
            logged += [("vf", vf_loss), ("vf_clipfrac", vf["clipfrac"])]
        (loss / a.grad_accum).backward()  # with DDP: the gradients averaged over processes
        self.actor.grads_to_master()  # bf16 models: accumulate in fp32, not in bf16
        self.critic_weights.grads_to_master()
        for key, val in logged:
            stats[key].append(float(val.detach()) if torch.is_tensor(val) else float(val))
        return float(pg["approxkl"])

    def optimizer_step(self, hold_policy: bool = False) -> tuple[bool, list[float]]:
        """Clip and step both optimisers (the actor's alone without a critic); skip every step if any
        gradient is non-finite. ``hold_policy``: step the critic's only (--tied-scores skip on a batch
        nobody earned). Returns (stepped, the global gradient norms before clipping: the policy's,
        then the separate critic's if there is one)."""
        a = self.cfg.algo
        self.actor.grads_to_master()
        self.critic_weights.grads_to_master()
        opts = [self.actor_opt] + ([self.critic_opt] if self.critic_opt is not None else [])
        stepped = opts[1:] if hold_policy else opts
        norms = [distributed.full(torch.nn.utils.clip_grad_norm_(ps, a.max_grad_norm))
                 for ps in (self.actor_params, self.critic_params) if ps]
        ok = all(torch.isfinite(n) for n in norms)
        if ok:
            for opt in stepped:
                opt.step()
            self.actor.copy_to_model()
            self.critic_weights.copy_to_model()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        return ok, [float(n) for n in norms]

    @torch.no_grad()
    def bound_update(self, exp: ro.Experience, start: list[torch.Tensor], limit: float) -> tuple[float, float]:
        """--update-kl-max: the policy's mean per-token k2 to the rollout policy on this batch after the
        update (every process's tokens), and the step shrunk towards ``start`` (the parameters before
        it) by sqrt(limit / KL) where that KL exceeds ``limit``. Returns (KL before shrinking, factor)."""
        total, count = 0.0, 0.0
        for micro in torch.arange(self.local_batch, device=self.device).split(self.micro_size):
            logp = self.forward_rows(exp, micro, want_values=False)[0]  # the policy alone
            m_ = exp.mask[micro]
            total += float((core.kl_penalty(logp, exp.old_logprobs[micro], "k2") * m_).sum())
            count += float(m_.sum())
        total, count = distributed.all_sum_floats([total, count])
        kl = total / max(count, 1.0)
        scale = 1.0
        if math.isfinite(kl) and kl > limit:
            scale = math.sqrt(limit / kl)
            for p, p0 in zip(self.actor_params, start):
                p.lerp_(p0, 1.0 - scale)  # p0 + scale * (p - p0)
            self.actor.copy_to_model()
        return kl, scale

    def global_scales(self, mask: torch.Tensor, micros: list[torch.Tensor]) -> list[tuple[float, float]]:
        """For each microbatch (row indices into ``mask``): the factors that make its policy loss
        (aggregated by --loss-agg) and its token-mean losses (value, KL, entropy) this process's share
        of the averages over the global microbatch (:func:`ppolm.distributed.scale_to_global`); all
        (1, 1) on one process. One all-reduce for the whole epoch."""
        if self.world == 1:
            return [(1.0, 1.0)] * len(micros)
        a, length = self.cfg.algo, self.cfg.generation.response_length
        local = []
        for idx in micros:
            m = mask[idx]
            local += [core.aggregate_denominator(m, a.loss_agg, length), float(m.sum())]
        total = distributed.all_sum_floats(local)
        return [(distributed.scale_to_global(local[2 * i], total[2 * i]),
                 distributed.scale_to_global(local[2 * i + 1], total[2 * i + 1])) for i in range(len(micros))]

    def average_stats(self, stats: dict[str, list[float]]) -> dict[str, list[float]]:
        """Each per-microbatch statistic averaged over the processes (every process ran the same
        number of microbatches); unchanged on one process."""
        if self.world == 1:
            return stats
        keys = [k for k in stats if stats[k]]
        flat = distributed.all_sum_floats([x for k in keys for x in stats[k]])
        out, i = {k: [] for k in stats}, 0
        for k in keys:
            out[k] = [x / self.world for x in flat[i:i + len(stats[k])]]
            i += len(stats[k])
        return out
