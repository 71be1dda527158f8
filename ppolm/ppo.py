"""The PPO trainer of InstructGPT: rollout -> score -> KL vs reference -> GAE -> clipped updates.

The four models are four named attributes of :class:`PPOTrainer`, built in ppolm/ppo_models.py:
``policy`` (trained), ``reference`` (frozen copy; with LoRA, ``None``: the policy with its adapter
disabled), ``rewarder`` (frozen reward models and/or reward functions) and ``critic`` (a separate
value model, or ``value_head`` on the policy's trunk). :meth:`PPOTrainer.step` is one PPO
iteration written as the numbered steps of the seed's pseudo-code: it fills an
:class:`ppolm.rollout.Experience` (the frozen models' part comes from ppolm/frozen.py) and
:meth:`PPOTrainer.update` runs the PPO epochs on it; the maths is in :mod:`ppolm.core`, the
metrics row in ppolm/ppo_metrics.py, and the run around the steps (resume, checkpoints,
evaluation, outputs) in ppolm/ppo_run.py. ``--advantage`` replaces GAE (step 5) by a critic-free
estimator (GRPO, Dr. GRPO, RLOO, REINFORCE++, ReMax); then no critic exists at all (README, "PPO
and its alternatives")."""

from __future__ import annotations

import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ppolm import core, distributed, ppo_metrics, ppo_run, runtime
from ppolm import rollout as ro
from ppolm.actor_critic import ActorCritic
from ppolm.data import PromptOrder  # noqa: F401  (public here too)
from ppolm.ppo_config import PPOConfig
from ppolm.ppo_run import OUTPUTS, PPOResult  # noqa: F401  (public here too)
from ppolm.runtime import (  # noqa: F401  (public here too)
    resolve_device,
    resolve_precision,
    rng_devices,
    seed_everything,
    seeded_rng,
)


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


def train_ppo(cfg: PPOConfig) -> PPOResult:
    """Run PPO as configured (the Python twin of ``ppolm ppo``); returns the metrics rows."""
    return PPOTrainer(cfg).train()


class PPOTrainer:
    def __init__(self, cfg: PPOConfig):
        from ppolm import judge, models, ppo_models
        from ppolm.frozen import FrozenModels
        from ppolm.rewards import RewardFunction, function_name, load_reward_fn, reward_model_dir

        cfg.validate(world_size=distributed.launched_world_size())  # before any process joins or loads anything
        cfg.resolve()  # --kl-in, --loss-agg, --kl-coef-max left to their defaults: what they mean for this run
        self.cfg = cfg
        m = cfg.model
        self.out = Path(cfg.run.output_dir)
        # Every check of the user's input runs before the processes join (torchrun), so that a bad
        # input stops each of them at once, with one error line.
        runtime.prepare_ppo_output_dir(self.out, cfg, OUTPUTS)
        resolve_device(m.device)
        seed_everything(cfg.run.seed)

        # The reward comes first: a wrong spec should fail before minutes of model loading.
        specs = list(cfg.reward.reward_fn)
        weights = cfg.reward.reward_fn_weights or [1.0] * len(specs)
        taken: set[str] = set()
        functions = [RewardFunction(function_name(s, taken), load_reward_fn(s), w) for s, w in zip(specs, weights)]
        functions += judge.build_sources(cfg.reward, taken)  # --reward-url, --reward-judge
        self.eval_functions = [RewardFunction(function_name(s, taken), load_reward_fn(s), 1.0)
                               for s in cfg.run.eval_reward_fn]
        self.tokenizer = models.load_tokenizer(m.model)
        self.pad_id, self.eos_id = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        # Data and reward models' heads before any model loads, so a bad input fails in seconds.
        model_dir = models.resolve_model_dir(m.model, allow_pickle=m.allow_pickle)
        for path in cfg.reward.reward_model:
            reward_model_dir(path, allow_pickle=m.allow_pickle)
        self.load_data(model_dir)

        # torchrun: join the other processes; each takes 1/N of every batch (ppolm/distributed.py)
        self.device = distributed.init(m.device, cfg.run.dist_timeout)
        self.rank, self.world = distributed.rank(), distributed.world_size()
        self.local_batch = cfg.algo.batch_size // self.world  # this process's rows of each batch
        # bf16: every model computes in bf16, trained weights keep fp32 masters (ppolm/runtime.py)
        self.precision = resolve_precision(m.precision, self.device)
        self.dtype = runtime.dtype_of(self.precision)
        self.best_value = -math.inf

        # The four models (ppolm/ppo_models.py): policy, reference, rewarder, critic
        built = ppo_models.build(cfg, self.tokenizer, model_dir, functions, self.dtype, self.device)
        self.policy, self.reference, self.rewarder = built.policy, built.reference, built.rewarder
        # critic and value_head are both None for the critic-free estimators (--advantage other than gae)
        self.critic, self.value_head, self.tap, self.value_bias = built.critic, built.value_head, built.tap, \
            built.value_bias
        self.critic_from_rm, self.critic_source = built.critic_from_rm, built.critic_source
        # The frozen models' work on each rollout, with the trunk they share (ppolm/frozen.py)
        self.frozen = FrozenModels(self.policy, self.reference, self.rewarder, self.tokenizer,
                                   temperature=cfg.generation.temperature, device=self.device, tap=self.tap,
                                   critic_from_rm=self.critic_from_rm, share_trunk=m.share_trunk,
                                   critic_entry=self.critic.total_layers - self.critic.n if self.tap else 0)
        self.has_critic = self.critic is not None or self.value_head is not None
        self.policy_start = self.frozen.policy_start
        # The trained models' forward pass as one module, under DDP with several processes
        self.actor_critic = ActorCritic(self.policy, temperature=cfg.generation.temperature,
                                        policy_start=self.policy_start, critic=self.critic,
                                        value_head=self.value_head, tap=self.tap is not None,
                                        value_bias=self.value_bias)
        if m.fsdp:  # the trained models sharded (FSDP2), computing in the run's dtype from fp32 shards
            sharded = [self.policy] + ([self.critic.model if self.tap is not None else self.critic]
                                       if self.critic is not None else [])
            self.train_model = distributed.fsdp(self.actor_critic, sharded,
                                                param_dtype=None if self.dtype == torch.float32 else self.dtype,
                                                first_call=(None,))
            self.value_bias = self.actor_critic.value_bias  # (FSDP registered a sharded one in its place)
        else:
            self.train_model = distributed.ddp(self.actor_critic, self.device)
        if self.rank:  # each process samples its own responses (OpenAI detail 17); process 0 as one process
            seed_everything(cfg.run.seed + 1_000_033 * self.rank)
        self.build_optimisers()
        k = cfg.kl
        ceiling = None if math.isinf(k.kl_coef_max) else k.kl_coef_max  # (resolved above; inf: none)
        self.kl_ctl = (core.AdaptiveKLController(k.kl_coef, k.kl_target, k.kl_horizon, k.floor, k.kl_error_clip,
                                                  ceiling)
                       if k.adaptive_kl else core.FixedKLController(k.kl_coef))
        self.score_scale = core.RunningScale()
        # A critic that keeps the reward model's head starts out predicting the scores as they come
        # (offset and spread included): its output is moved into the returns' units with the same
        # center and unit as the scores (Experience.value_units), so centring and scaling the scores
        # leave it as close to the returns as it starts.
        self.critic_in_score_units = self.critic_from_rm and not m.critic_zero_head
        self.prompt_order = PromptOrder(len(self.prompts), cfg.run.seed)
        self.skipped_total = 0
        self.consecutive_skips = 0
        self.start_step = 0
        self.warned: set[str] = set()

    def load_data(self, model_dir: Path) -> None:
        """The training and held-out prompts (checked against the model's context length) and the
        PPO-ptx corpus."""
        from transformers import AutoConfig

        from ppolm.data import load_prompts, load_text_corpus

        cfg, m, g = self.cfg, self.cfg.model, self.cfg.generation
        ctx = getattr(AutoConfig.from_pretrained(model_dir, trust_remote_code=m.trust_remote_code),
                      "max_position_embeddings", None)

        def prompts(path: str | None) -> list[Any]:
            return load_prompts(path, self.tokenizer, chat_template=cfg.run.chat_template,
                                max_length=g.max_prompt_length, context_length=ctx, response_length=g.response_length)

        self.prompts = prompts(cfg.run.prompts)
        self.eval_prompts = prompts(cfg.run.eval_prompts) if cfg.run.eval_prompts is not None else None
        self.ptx_ids = None
        if cfg.algo.ptx_coef > 0:
            texts = load_text_corpus(cfg.algo.ptx_data)  # type: ignore[arg-type]
            self.ptx_ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"][:256] for t in texts]
            self.ptx_ids = [x for x in self.ptx_ids if len(x) >= 2]

    def build_optimisers(self) -> None:
        """Separate AdamW optimisers and learning rates for actor and critic (Adam eps 1e-5, detail
        16); with bf16 models they step fp32 master copies (ppolm/runtime.py). Without a critic
        (critic-free estimators) ``critic_opt`` and ``critic_sched`` are None."""
        a = self.cfg.algo
        self.actor = runtime.MasterWeights((p for p in self.policy.parameters() if p.requires_grad),
                                           seed=self.cfg.run.seed)
        self.critic_weights = runtime.MasterWeights((p for _, p in self.critic_named_parameters()),
                                                    seed=self.cfg.run.seed + 1)
        self.actor_params, self.critic_params = self.actor.params, self.critic_weights.params
        # fused AdamW: one kernel over all parameters, ~4x faster than the per-tensor loop on a CPU
        adam = dict(eps=a.adam_eps, weight_decay=a.weight_decay,
                    fused=self.device.type in ("cpu", "cuda") and not self.cfg.model.fsdp)
        self.actor_opt = torch.optim.AdamW(self.actor_params, lr=a.actor_lr, betas=(a.actor_adam_beta1, 0.999), **adam)
        decay = (lambda s: max(0.0, 1.0 - s / a.steps)) if a.lr_schedule == "linear" else (lambda s: 1.0)
        # --kl-lr-boost: the actor's lr also scales with the KL budget left (set after each update)
        self.lr_boost = core.kl_lr_scale(0.0, self.cfg.kl.kl_target, self.cfg.kl.kl_lr_boost)
        f0 = a.actor_lr_warmup_from
        warmup = ((lambda s: f0 + (1.0 - f0) * min(1.0, (s + 1) / a.actor_lr_warmup)) if a.actor_lr_warmup
                  else (lambda s: 1.0))
        self.actor_sched = torch.optim.lr_scheduler.LambdaLR(self.actor_opt,
                                                             lambda s: decay(s) * warmup(s) * self.lr_boost)
        self.critic_opt = self.critic_sched = None
        if self.critic_params:
            eps = a.adam_eps if a.critic_adam_eps is None else a.critic_adam_eps
            self.critic_opt = torch.optim.AdamW(self.critic_params, lr=a.critic_lr, **dict(adam, eps=eps))
            self.critic_sched = torch.optim.lr_scheduler.LambdaLR(self.critic_opt, decay)

    # ----------------------------------------------------------------------------------------
    def prompt_batch(self, step: int) -> list[Any]:
        """This process's prompts of a step: a fresh seeded permutation per pass over the data
        (resume-safe) gives the step's batch_size / G prompts (--samples-per-prompt G), each repeated
        G times in adjacent rows (one group per prompt; see :meth:`group_ids`). With N processes,
        process r takes the r-th of N equal slices of those prompts: their union is one process's
        batch, and a prompt's group stays on one process."""
        a = self.cfg.algo
        g = a.samples_per_prompt
        ids = self.prompt_order.indices(step, a.batch_size // g)
        share = len(ids) // self.world
        return [self.prompts[i] for i in ids[self.rank * share:(self.rank + 1) * share] for _ in range(g)]

    def group_ids(self) -> torch.Tensor:
        """(B,) the group (prompt) of each of this process's rows: 0, .., 0, 1, .., 1, .. in runs of G."""
        g = self.cfg.algo.samples_per_prompt
        return torch.arange(self.local_batch // g, device=self.device).repeat_interleave(g)

    def forward_train(self, roll: ro.Rollout, need_entropy_grad: bool,
                      trunk: torch.Tensor | None = None,
                      entering: torch.Tensor | None = None, want_entropy: bool = True,
                      want_values: bool = True) -> tuple[Any, ...]:
        """Policy log-probs, entropy and values on a rollout, each (B, R), through the trained models'
        module (:class:`ppolm.actor_critic.ActorCritic`, under DDP with several processes). ``trunk``
        (B, P + R, d): the frozen trunk's hidden state that feeds a top-layers critic; ``entering``:
        the state entering the policy's first adapted layer, from the reference pass."""
        return self.train_model(roll, need_entropy_grad, trunk, entering, want_entropy, want_values)

    def forward_rows(self, exp: ro.Experience, rows: torch.Tensor, need_entropy_grad: bool = False,
                     want_entropy: bool = False, want_values: bool = True) -> tuple[Any, ...]:
        """:meth:`forward_train` on some rows (indices) of a batch, with their trunk and entering states."""
        trunk, entering = (None if x is None else x[rows] for x in (exp.critic_input, exp.policy_entering))
        return self.forward_train(exp.roll.select(rows), need_entropy_grad, trunk, entering,
                                  want_entropy=want_entropy, want_values=want_values)

    def penalise(self, scores: torch.Tensor, roll: ro.Rollout) -> torch.Tensor:
        """The missing-EOS and length penalties on the sources' total (:func:`ppolm.core.penalise_scores`),
        for training and held-out evaluation alike."""
        r = self.cfg.reward
        return core.penalise_scores(scores, roll.ended, roll.lengths, r.missing_eos_penalty, r.length_penalty,
                                    r.length_budget)

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

    @property
    def minibatch_rows(self) -> int:
        """This process's rows per minibatch."""
        return self.local_batch // self.cfg.algo.minibatches

    @property
    def micro_size(self) -> int:
        """This process's rows per microbatch (gradient accumulation)."""
        return self.minibatch_rows // self.cfg.algo.grad_accum

    # ----------------------------------------------------------------------------------------
    def step(self, step: int, given: tuple[list[Any], ro.Rollout] | None = None
             ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """One PPO iteration; returns (metrics, sample rows; the rows of every process on process 0).
        ``given``: (prompts, rollout) to learn from instead of sampling (this process's rows)."""
        cfg, a, g = self.cfg, self.cfg.algo, self.cfg.generation
        t_start = time.perf_counter()
        prompts = self.prompt_batch(step) if given is None else given[0]

        # 1. Rollout: sample a response per row (no grad, KV cache), mask after EOS; ReMax also
        #    decodes one greedy response per prompt, its baseline.
        self.policy.eval()
        greedy = None
        with distributed.gathered(self.train_model):  # --fsdp: the policy's full weights while it samples
            if given is None:
                roll = ro.generate(self.policy, [p.ids for p in prompts], pad_id=self.pad_id, eos_id=self.eos_id,
                                   max_new_tokens=g.response_length, temperature=g.temperature, top_p=g.top_p,
                                   top_k=g.top_k, ignore_eos=g.ignore_eos, share_prefix=cfg.model.share_prefix)
            else:
                roll = given[1]
            if a.advantage == "remax":
                firsts = prompts[::a.samples_per_prompt]
                greedy = ro.generate(self.policy, [p.ids for p in firsts], pad_id=self.pad_id, eos_id=self.eos_id,
                                     max_new_tokens=g.response_length, temperature=g.temperature, greedy=True,
                                     ignore_eos=g.ignore_eos, share_prefix=cfg.model.share_prefix)
        if cfg.model.share_prefix:
            roll.share_prefix()  # the prompts' common beginning runs once per pass (ppolm/prefix.py)
        self.policy.train()
        mask = roll.response_mask.float()  # (B, R)
        runtime.malloc_trim()
        t_rollout = time.perf_counter()

        # 2. Score and reference: the frozen models' pass (reference log-probs, reward models and
        #    functions on prompt+response, the critic's tap; ppolm/frozen.py); then the penalties for
        #    no EOS and length.
        fo = self.frozen.run(roll, prompts)
        scores = self.penalise(fo.scores, roll)  # (B,)
        greedy_scores = None
        if greedy is not None:  # (B,): each prompt's greedy score, repeated over its G rows
            greedy_scores = self.penalise(self.frozen.score(greedy, firsts)[0], greedy)
            greedy_scores = greedy_scores.repeat_interleave(a.samples_per_prompt)

        # 3. The rollout policy's own log-probs and values. With one minibatch per epoch the first
        #    epoch's forward pass *is* the rollout pass (ratio 1 exactly), so it runs once, with
        #    grad, and the update reuses it: no repeated forward pass.
        fused = a.minibatches == 1 and a.grad_accum == 1
        runtime.malloc_trim()
        with torch.set_grad_enabled(fused):
            first_pass = self.forward_train(roll, a.entropy_coef > 0, fo.critic_input, fo.policy_entering)
        old_logprobs, entropy, old_values = (None if x is None else x.detach() for x in first_pass)  # (B, R) each
        t_score = time.perf_counter()

        # 4. Per-token KL vs the reference; the score lands on each response's last real token.
        # 5. Advantages: GAE with the critic's values, or a critic-free estimator (--advantage).
        beta = self.kl_ctl.value
        kl = core.kl_penalty(old_logprobs, fo.ref_logprobs, cfg.kl.kl_estimator) * mask  # (B, R)
        finite = not distributed.any_flag(not bool(torch.isfinite(scores).all()))  # one verdict for all
        if a.advantage == "gae":
            adv = self.gae_advantages(scores, kl, beta, mask, old_values, finite)
        else:
            adv = self.critic_free_advantages(scores, kl, beta, mask, greedy_scores)
        exp = ro.Experience(roll=roll, mask=mask, ref_logprobs=fo.ref_logprobs, old_logprobs=old_logprobs,
                            entropy=entropy, values=adv.values, scores=scores, kl=kl, non_score=adv.non_score,
                            rewards=adv.rewards, advantages=adv.advantages, returns=adv.returns,
                            critic_input=fo.critic_input, policy_entering=fo.policy_entering,
                            first_pass=first_pass if fused else None, value_units=adv.value_units)
        del first_pass

        # 6. PPO epochs: clipped policy and value losses on shuffled minibatches (skipped, and
        #    counted, when a reward is not finite).
        if not finite:
            bad = [k.removeprefix("reward/") for k, v in fo.parts.items() if not torch.isfinite(v).all()] or \
                ["another process's reward"]
            self.skip_cause = f"non-finite reward (NaN/inf) from {', '.join(bad or ['penalties'])}"
            self.warn_once("reward", f"step {step}: {self.skip_cause}; update skipped (guard/skipped_updates)")
        stats, skipped, epochs_done = self.update(exp, beta, step, a.ppo_epochs if finite else 0,
                                                  hold_policy=adv.zeroed and a.tied_scores == "skip")
        skipped += 0 if finite else 1
        t_train = time.perf_counter()

        # 7. Adapt the KL coefficient once per batch, only after an update in which beta acted: a
        #    skipped update leaves the policy, hence the KL it is steering, where it was, and a batch
        #    whose advantages --tied-scores zeroed gave beta's penalty no gradient either (counting
        #    them, a long stretch of a rare reward would wind beta up while nothing could respond).
        #    Then advance the learning-rate schedules.
        kl_sum, rows = distributed.all_sum_floats([kl.sum().item(), kl.shape[0]])
        mean_kl = kl_sum / rows  # over every process's rows: beta stays the same everywhere
        if not skipped and not adv.zeroed and math.isfinite(mean_kl):
            self.kl_ctl.update(mean_kl, 1)  # one PPO update: --kl-horizon counts updates
        if math.isfinite(mean_kl):  # the next update's share of the KL budget left (--kl-lr-boost)
            self.lr_boost = core.kl_lr_scale(mean_kl, cfg.kl.kl_target, cfg.kl.kl_lr_boost)
        lr = self.actor_sched.get_last_lr()[0]
        critic_lr = self.critic_sched.get_last_lr()[0] if self.critic_sched is not None else None
        self.actor_sched.step()
        if self.critic_sched is not None:
            self.critic_sched.step()
        self.skipped_total += skipped
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0

        metrics = ppo_metrics.step_metrics(exp, stats, fo.parts, eos_id=self.eos_id, beta=beta, adv_var=adv.adv_var,
                                           lr=lr, critic_lr=critic_lr, epochs=epochs_done,
                                           skipped_total=self.skipped_total,
                                           times=(t_start, t_rollout, t_score, t_train))
        if a.advantage == "gae" and cfg.reward.score_scale != "none":
            metrics["objective/score_scale"] = adv.unit
        if a.advantage == "gae" and cfg.reward.score_center != "none":
            metrics["objective/score_center"] = adv.center
        if a.advantage == "gae":
            metrics["adv/tied"] = float(adv.tied)
            metrics["adv/unearned"] = float(adv.unearned)
        samples = []
        if step % cfg.run.sample_every == 0 or step == a.steps - 1:
            kl_seq = kl.sum(1)
            for p, t, s, k, n in zip(prompts, fo.texts, scores.tolist(), kl_seq.tolist(), roll.lengths.tolist()):
                samples.append({"step": step, "prompt": p.raw, "response": t, "score": s, "kl": k, "length": n})
            samples = [r for rows in distributed.gather_objects(samples) for r in rows]
        return metrics, samples

    def gae_advantages(self, scores: torch.Tensor, kl: torch.Tensor, beta: float, mask: torch.Tensor,
                       old_values: torch.Tensor, finite: bool) -> Advantages:
        """Steps 4 and 5 with a critic: per-token rewards, GAE (gamma, lambda), the batch's whitening.

        The score lands on each response's last real token, divided by core.score_unit of the
        spread of the scores within their batches, pooled over the run (--score-scale): by default
        only a reward whose spread lies outside the range the default beta was measured on is
        rescaled to it. --score-center first subtracts the running mean's part beyond two running
        stds (all of it with "running"), so that the zero-initialised critic starts no further
        from the returns than on a [0, 1] reward. ``finite``: every process's scores are finite
        (else the running statistics and --tied-scores leave them out).
        """
        a, cfg = self.cfg.algo, self.cfg
        if finite:  # (also kept under --score-scale none: --tied-scores compares with its mean)
            mean, var, n = distributed.masked_moments(scores, torch.ones_like(scores))  # every process's
            self.score_scale.update(n, float(mean), float(var) * n)
        unit = core.score_unit(self.score_scale.spread, cfg.reward.score_scale)
        center = core.score_center(self.score_scale.mean, self.score_scale.std, cfg.reward.score_center)
        rewards, non_score = core.shape_rewards((scores - center) / unit, kl,
                                                beta if cfg.kl.kl_in == "reward" else 0.0, mask)
        non_score = non_score * unit  # logged in the score's own units: rlhf_reward = score - unit * beta * KL
        if cfg.kl.kl_in == "loss":
            non_score = -beta * kl
        if cfg.reward.whiten_rewards:  # batch statistics: over every process's rows
            rewards = distributed.masked_whiten(rewards, mask, shift_mean=False)

        # GAE; returns = advantages + values; the advantages whitened per batch.
        value_units = 0.0, 1.0
        if self.critic_in_score_units:
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
            unearned = tied and hi <= self.score_scale.mean + 1e-9 * max(1.0, abs(hi))
            zeroed = unearned and a.tied_scores in ("zero", "skip")
            if zeroed:
                advantages = torch.zeros_like(advantages)
        return Advantages(rewards=rewards, non_score=non_score, advantages=advantages, returns=returns,
                          values=old_values, adv_var=adv_var, unit=unit, center=center, tied=tied,
                          unearned=unearned, zeroed=zeroed, value_units=value_units)

    def critic_free_advantages(self, scores: torch.Tensor, kl: torch.Tensor, beta: float, mask: torch.Tensor,
                               greedy_scores: torch.Tensor | None
                               ) -> Advantages:
        """Steps 4 and 5 of the critic-free estimators (README, "PPO and its alternatives"): no
        values; the returns are the advantages.

        * reinforce++: per-token rewards of :func:`ppolm.core.shape_rewards` (score on the last
          token, -beta * KL on each with --kl-in reward), returns-to-go with --gamma, whitened over
          the batch; reinforce++-baseline subtracts each group's mean score first (Hu 2025).
        * grpo, dr-grpo, rloo, remax: one advantage per response from its score, broadcast over its
          tokens, not whitened. The score is the reward's (penalties included); with --kl-in reward
          it is the RLHF reward, score - beta * the response's KL (ReMax's greedy baseline then
          keeps its bare score: its KL is not computed).
        """
        a, in_reward = self.cfg.algo, self.cfg.kl.kl_in == "reward"
        gid = self.group_ids()
        if a.advantage in ("reinforce++", "reinforce++-baseline"):
            base = core.group_baseline(scores, gid) if a.advantage == "reinforce++-baseline" else scores
            rewards, non_score = core.shape_rewards(base, kl, beta if in_reward else 0.0, mask)
            if self.cfg.reward.whiten_rewards:
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

    def update(self, exp: ro.Experience, beta: float, step: int, epochs: int, hold_policy: bool = False
               ) -> tuple[dict[str, list[float]], int, int]:
        """PPO's update (step 6): ``epochs`` passes over the batch, a fresh shuffle each, in
        minibatches of microbatches (gradient accumulation), with the clipped policy and value
        losses, the KL-in-loss, entropy and PPO-ptx terms when asked, and one optimiser step per
        minibatch (the critic's alone with ``hold_policy``). Returns the per-microbatch statistics
        (and the gradient norms of each optimiser step taken), the skipped (non-finite) optimiser
        steps and the epochs run (``--target-kl`` may stop early)."""
        cfg, a = self.cfg, self.cfg.algo
        stats: dict[str, list[float]] = {k: [] for k in ("approxkl", "clipfrac", "pg", "vf", "vf_clipfrac",
                                                         "ratio", "ptx", "dual_clipfrac", "grad_norm",
                                                         "vf_grad_norm", "update_kl", "update_scale")}
        skipped, epochs_done = 0, 0
        bounded = a.update_kl_max is not None and epochs > 0 and not hold_policy
        start = [p.detach().clone() for p in self.actor_params] if bounded else None
        gen = torch.Generator().manual_seed(cfg.run.seed * 7919 + step)
        length = cfg.generation.response_length
        for _epoch in range(epochs):
            # each process shuffles its own rows with the same generator (one process: the whole batch)
            perm = torch.randperm(self.local_batch, generator=gen).to(self.device)
            micros = [mb.split(self.micro_size) for mb in perm.split(self.minibatch_rows)]
            scales = self.global_scales(exp.mask, [m for mb in micros for m in mb])
            epoch_kl = []
            for mb in micros:
                for micro in mb:
                    pg_scale, tok_scale = scales.pop(0)  # this microbatch's share of the global averages
                    if exp.first_pass is not None:  # the rollout pass, with grad (rows in minibatch order)
                        logp, ent, v = (None if x is None else x[micro] for x in exp.first_pass)
                    else:
                        logp, ent, v = self.forward_rows(exp, micro, a.entropy_coef > 0, want_entropy=a.entropy_coef > 0)
                    m_ = exp.mask[micro]
                    pg_loss, pg = core.policy_loss(logp, exp.old_logprobs[micro], exp.advantages[micro], m_,
                                                   a.clip_eps, clip_eps_high=a.clip_eps_high, dual_clip=a.dual_clip,
                                                   loss_agg=a.loss_agg, agg_constant=length)
                    loss = pg_loss * pg_scale
                    if cfg.kl.kl_in == "loss":  # always k3: the k1 gradient ignores the reference
                        loss = loss + beta * core.kl_loss(logp, exp.ref_logprobs[micro], m_) * tok_scale
                    if a.entropy_coef:
                        loss = loss - a.entropy_coef * core.masked_mean(ent, m_) * tok_scale
                    if self.ptx_ids:
                        ptx = self.ptx_loss(gen)
                        loss = loss + a.ptx_coef * ptx
                        stats["ptx"].append(ptx.item())
                    logged = [("approxkl", pg["approxkl"]), ("clipfrac", pg["clipfrac"]), ("pg", pg_loss),
                              ("ratio", pg["ratio"])]
                    if "dual_clipfrac" in pg:
                        logged.append(("dual_clipfrac", pg["dual_clipfrac"]))
                    if self.has_critic:
                        center, unit = exp.value_units
                        v = (v - center) / unit
                        vf_loss, vf = core.value_loss(v, exp.values[micro], exp.returns[micro], m_, a.vf_clip)
                        # separate critic: its own graph and optimiser; shared trunk: weighted sum
                        loss = loss + (a.vf_coef * vf_loss if self.value_head is not None else vf_loss) * tok_scale
                        logged += [("vf", vf_loss), ("vf_clipfrac", vf["clipfrac"])]
                    (loss / a.grad_accum).backward()  # with DDP: the gradients averaged over processes
                    self.actor.grads_to_master()  # bf16 models: accumulate in fp32, not in bf16
                    self.critic_weights.grads_to_master()
                    for key, val in logged:
                        stats[key].append(float(val.detach()) if torch.is_tensor(val) else float(val))
                    epoch_kl.append(float(pg["approxkl"]))
                ok, norms = self.optimizer_step(hold_policy)
                if ok:  # (the norms are global: the gradients were reduced over the processes)
                    for key, norm in zip(("grad_norm", "vf_grad_norm"), norms):
                        stats[key].append(norm)
                else:
                    skipped += 1
                    self.skip_cause = "non-finite loss or gradient"
                    self.warn_once("grad", f"step {step}: {self.skip_cause}; update skipped (guard/skipped_updates)")
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

    def train(self) -> PPOResult:
        """The whole run (ppolm/ppo_run.py): resume, steps, evaluation, checkpoints, final outputs."""
        return ppo_run.run(self)

    def warn_once(self, key: str, msg: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            print(f"warning: {msg}", file=sys.stderr)

    # ----------------------------------------------------------------------------------------
    def evaluate(self, updates: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Held-out evaluation after ``updates`` steps: (metrics, sample rows); see
        :func:`ppolm.evaluate.during_ppo`."""
        from ppolm.evaluate import during_ppo

        with distributed.gathered(self.train_model):  # --fsdp: the policy whole while it samples
            return during_ppo(self, updates)

    def trained_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) of everything trained: the policy and the critic or value head; with bf16
        models, their fp32 master copies (what the optimisers step and checkpoints hold)."""
        names = [f"policy.{n}" for n, p in self.policy.named_parameters() if p.requires_grad] + \
            [f"critic.{n}" for n, _ in self.critic_named_parameters()]
        return list(zip(names, self.actor.params + self.critic_weights.params))

    def critic_named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The critic's trained parameters (value head, or the critic's trained layers and head, and
        the value bias carried over from the reward model's normalisation)."""
        mod = self.value_head if self.value_head is not None else self.critic
        if mod is None:  # critic-free estimators
            return []
        named = [(n, p) for n, p in mod.named_parameters() if p.requires_grad]
        return named + ([("value_bias", self.value_bias)] if self.value_bias is not None else [])



warnings.filterwarnings("ignore", message=".*generation flags are not valid.*")
