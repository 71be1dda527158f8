"""The PPO trainer of InstructGPT: rollout -> score -> KL vs reference -> advantages -> clipped updates.

The four models are four named attributes of :class:`PPOTrainer`, built in ppolm/ppo_models.py:
``policy`` (trained), ``reference`` (frozen copy; with LoRA, ``None``: the policy with its adapter
disabled), ``rewarder`` (frozen reward models and/or reward functions) and ``critic`` (a separate
value model, or ``value_head`` on the policy's trunk). :meth:`PPOTrainer.step` is one PPO
iteration written as the numbered steps of the seed's pseudo-code: it fills an
:class:`ppolm.rollout.Experience` (the frozen models' part comes from ppolm/frozen.py, the
advantages from ppolm/advantages.py) and the :class:`ppolm.ppo_learner.Learner` runs the PPO epochs
on it; the maths is in :mod:`ppolm.core`, the metrics row in ppolm/ppo_metrics.py, and the run
around the steps (resume, checkpoints, evaluation, outputs) in ppolm/ppo.py. Everything of the run
that changes from step to step besides the weights and the optimisers is one :class:`PPOState`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ppolm import checkpoint, core, distributed, judge, models, ppo_metrics, ppo_models, runtime, scaffold
from ppolm import rollout as ro
from ppolm.actor_critic import ActorCritic
from ppolm.advantages import Advantages, critic_free_advantages, gae_advantages
from ppolm.data import PromptOrder, load_prompts, load_text_corpus
from ppolm.frozen import FrozenModels, FrozenOut
from ppolm.ppo_config import PPOConfig
from ppolm.ppo_learner import Learner
from ppolm.rewards import RewardFunction, function_name, load_reward_fn, reward_model_dir
from ppolm.rundir import OutputDir

OUTPUTS = ("policy", "policy_adapter", "critic", "checkpoints", "tensorboard", "metrics.jsonl", "samples.jsonl",
           "eval.jsonl", "eval_samples.jsonl", "best", "best.json", "config.yaml", "report.html", "plots",
           "reward_model_refreshed")
"""What a PPO run writes in --output-dir (and --overwrite removes)."""

KLController = core.AdaptiveKLController | core.FixedKLController


@dataclass
class PPOState:
    """What a PPO run carries from one step to the next besides weights and optimisers; a checkpoint
    saves and restores it as one object (:meth:`state_dict`)."""

    kl_ctl: KLController
    """beta, the KL coefficient (adaptive: Ziegler et al. 2019's controller)."""
    score_scale: core.RunningScale = field(default_factory=core.RunningScale)
    """The scores' running mean and spread (--score-scale, --score-center, --tied-scores)."""
    guard: scaffold.Guard = field(default_factory=scaffold.Guard)
    """Skipped (non-finite) updates, all and in a row, and the warnings given."""
    lr_boost: float = 1.0
    """--kl-lr-boost: the actor's learning-rate factor for the next update."""
    start_step: int = 0
    """The step this run (re)started from."""
    best_value: float = -math.inf
    """The best --best-metric so far (best/ holds that policy)."""

    def state_dict(self) -> dict[str, Any]:
        return {"kl_ctl": self.kl_ctl.state_dict(), "score_scale": self.score_scale.state_dict(),
                "lr_boost": self.lr_boost, **self.guard.state_dict()}

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        self.kl_ctl.load_state_dict(meta["kl_ctl"])
        if "score_scale" in meta:  # (absent from checkpoints written before --score-scale)
            self.score_scale.load_state_dict(meta["score_scale"])
        self.lr_boost = meta.get("lr_boost", self.lr_boost)
        self.guard.load_state_dict(meta)
        self.start_step = meta["next_step"]

    def improves(self, value: float) -> bool:
        """Whether ``value`` beats the best --best-metric so far (then it is the best)."""
        if value > self.best_value:
            self.best_value = value
            return True
        return False


def non_finite_cause(parts: dict[str, torch.Tensor], scores: torch.Tensor) -> str:
    """Why a batch's scores (after the penalties) are not all finite, on some process: which of this
    process's reward sources, else its penalties, else another process's reward."""
    if bool(torch.isfinite(scores).all()):
        where = ["another process's reward"]
    else:
        where = [k.removeprefix("reward/") for k, v in parts.items() if not torch.isfinite(v).all()] or ["penalties"]
    return f"non-finite reward (NaN/inf) from {', '.join(where)}"


class PPOTrainer:
    def __init__(self, cfg: PPOConfig):
        cfg.validate(world_size=distributed.launched_world_size())  # before any process joins or loads anything
        cfg = cfg.resolve()  # --kl-in, --loss-agg, --kl-coef-max left to their defaults: what they mean for this run
        self.cfg, m = cfg, cfg.model
        self.out = Path(cfg.run.output_dir)
        # Every check of the user's input runs before the processes join (torchrun), so that a bad
        # input stops each of them at once, with one error line.
        self.output_dir().check(cfg)
        runtime.resolve_device(m.device)
        runtime.seed_everything(cfg.run.seed)

        # The reward comes first: a wrong spec should fail before minutes of model loading.
        functions, self.eval_functions = self.load_reward_functions()
        r = cfg.reward  # --judge: the reward models' check and refresh (ppolm/rm_guard.py, built by ppolm/ppo.py)
        self.judge = judge.load_judge(r.judge, r.judge_temperature) if r.judge else None
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
        self.precision = runtime.resolve_precision(m.precision, self.device)
        self.dtype = runtime.dtype_of(self.precision)

        # The four models (ppolm/ppo_models.py): policy, reference, rewarder, critic
        built = ppo_models.build(cfg, self.tokenizer, model_dir, functions, self.dtype, self.device)
        self.policy, self.reference, self.rewarder = built.policy, built.reference, built.rewarder
        # critic and value_head are both None for the critic-free estimators (--advantage other than gae)
        self.critic, self.value_head, self.tap = built.critic, built.value_head, built.tap
        self.critic_from_rm, self.critic_source = built.critic_from_rm, built.critic_source
        # The frozen models' work on each rollout, with the trunk they share (ppolm/frozen.py)
        self.frozen = FrozenModels(self.policy, self.reference, self.rewarder, self.tokenizer,
                                   temperature=cfg.generation.temperature, device=self.device, tap=self.tap,
                                   critic_from_rm=self.critic_from_rm, share_trunk=m.share_trunk,
                                   critic_entry=self.critic.total_layers - self.critic.n if self.tap else 0)
        self.has_critic = self.critic is not None or self.value_head is not None
        self.policy_start = self.frozen.policy_start
        # The trained models' forward pass as one module, under DDP or FSDP with several processes
        self.actor_critic = ActorCritic(self.policy, temperature=cfg.generation.temperature,
                                        policy_start=self.policy_start, critic=self.critic,
                                        value_head=self.value_head, tap=self.tap is not None,
                                        value_bias=built.value_bias)
        train_model = self.parallel()
        self.value_bias = self.actor_critic.value_bias  # (FSDP registers a sharded one in its place)
        if self.rank:  # each process samples its own responses (OpenAI detail 17); process 0 as one process
            runtime.seed_everything(cfg.run.seed + 1_000_033 * self.rank)
        k = cfg.kl
        ceiling = None if math.isinf(k.kl_coef_max) else k.kl_coef_max  # (resolved above; inf: none)
        kl_ctl = (core.AdaptiveKLController(k.kl_coef, k.kl_target, k.kl_horizon, k.floor, k.kl_error_clip, ceiling)
                  if k.adaptive_kl else core.FixedKLController(k.kl_coef))
        # --kl-lr-boost: the actor's lr also scales with the KL budget left (set after each update)
        self.state = PPOState(kl_ctl, lr_boost=core.kl_lr_scale(0.0, k.kl_target, k.kl_lr_boost))
        self.learner = Learner(cfg, self.actor_critic, train_model, self.device, self.ptx_ids, self.pad_id,
                               self.state.lr_boost)
        # A critic that keeps the reward model's head starts out predicting the scores as they come
        # (offset and spread included): its output is moved into the returns' units with the same
        # center and unit as the scores (Experience.value_units), so centring and scaling the scores
        # leave it as close to the returns as it starts.
        self.critic_in_score_units = self.critic_from_rm and not m.critic_zero_head
        self.prompt_order = PromptOrder(len(self.prompts), cfg.run.seed)

    def output_dir(self) -> OutputDir:
        """--output-dir's guard: a run's files are :data:`OUTPUTS` beside config.yaml."""
        return OutputDir(self.out, "config.yaml", "a ppolm run", OUTPUTS)

    def load_reward_functions(self) -> tuple[list[Any], list[RewardFunction]]:
        """The training reward sources other than reward models (functions, weighted; services and
        LLM judges: ppolm/remote.py, ppolm/judge.py) and the held-out evaluation's extra functions."""
        r, taken = self.cfg.reward, set()
        weights = r.reward_fn_weights or [1.0] * len(r.reward_fn)
        functions: list[Any] = [RewardFunction(function_name(s, taken), load_reward_fn(s), w)
                                for s, w in zip(r.reward_fn, weights)]
        functions += judge.build_sources(r, taken)  # --reward-url, --reward-judge
        return functions, [RewardFunction(function_name(s, taken), load_reward_fn(s), 1.0)
                           for s in self.cfg.run.eval_reward_fn]

    def load_data(self, model_dir: Path) -> None:
        """The training and held-out prompts (checked against the model's context length) and the
        PPO-ptx corpus."""
        from transformers import AutoConfig

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
            ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"][:256] for t in texts]
            self.ptx_ids = [x for x in ids if len(x) >= 2]

    def parallel(self) -> Any:
        """The trained models' module as the update calls it: itself on one process, under DDP with
        several, or sharded (FSDP2, --fsdp) computing in the run's dtype from fp32 shards."""
        if not self.cfg.model.fsdp:
            return distributed.ddp(self.actor_critic, self.device)
        sharded = [self.policy] + ([self.critic.model if self.tap is not None else self.critic]
                                   if self.critic is not None else [])
        return distributed.fsdp(self.actor_critic, sharded, first_call=(None,),
                                param_dtype=None if self.dtype == torch.float32 else self.dtype)

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

    def penalise(self, scores: torch.Tensor, roll: ro.Rollout) -> torch.Tensor:
        """The missing-EOS and length penalties on the sources' total (:func:`ppolm.core.penalise_scores`),
        for training and held-out evaluation alike."""
        r = self.cfg.reward
        return core.penalise_scores(scores, roll.ended, roll.lengths, r.missing_eos_penalty, r.length_penalty,
                                    r.length_budget)

    # ----------------------------------------------------------------------------------------
    def step(self, step: int, given: tuple[list[Any], ro.Rollout] | None = None
             ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """One PPO iteration; returns (metrics, sample rows; the rows of every process on process 0).
        ``given``: (prompts, rollout) to learn from instead of sampling (this process's rows)."""
        cfg, a = self.cfg, self.cfg.algo
        clock = ppo_metrics.Clock(self.device)
        prompts = self.prompt_batch(step) if given is None else given[0]

        # 1. Rollout: sample a response per row (no grad, KV cache), mask after EOS.
        roll = self.rollout(prompts, None if given is None else given[1])
        mask = roll.response_mask.float()  # (B, R)
        clock.mark()

        # 2. Score and reference: the frozen models' pass (reference log-probs, reward models and
        #    functions on prompt+response, the critic's tap; ppolm/frozen.py); then the penalties for
        #    no EOS and length. ReMax also decodes and scores one greedy response per prompt.
        fo = self.frozen.run(roll, prompts)
        scores = self.penalise(fo.scores, roll)  # (B,)
        greedy_scores = self.greedy_baseline(prompts) if a.advantage == "remax" else None  # (B,)

        # 3. The rollout policy's own log-probs and values. With one minibatch per epoch the first epoch's
        #    forward pass *is* the rollout pass (ratio 1 exactly): it runs once, with grad, for both.
        fused = a.minibatches == 1 and a.grad_accum == 1
        runtime.malloc_trim()
        with torch.set_grad_enabled(fused):
            first_pass = self.learner.forward_train(roll, a.entropy_coef > 0, fo.critic_input, fo.policy_entering)
        old_logprobs, entropy, old_values = (None if x is None else x.detach() for x in first_pass)  # (B, R) each
        clock.mark()

        # 4. Per-token KL vs the reference; the score lands on each response's last real token.
        # 5. Advantages: GAE with the critic's values, or a critic-free estimator (--advantage).
        beta = self.state.kl_ctl.value
        kl = core.kl_penalty(old_logprobs, fo.ref_logprobs, cfg.kl.kl_estimator) * mask  # (B, R)
        finite = not distributed.any_flag(not bool(torch.isfinite(scores).all()))  # one verdict for all
        adv = self.advantages(scores, kl, beta, mask, old_values, finite, greedy_scores)
        exp = ro.Experience(roll=roll, mask=mask, ref_logprobs=fo.ref_logprobs, old_logprobs=old_logprobs,
                            entropy=entropy, values=adv.values, scores=scores, kl=kl, non_score=adv.non_score,
                            rewards=adv.rewards, advantages=adv.advantages, returns=adv.returns,
                            critic_input=fo.critic_input, policy_entering=fo.policy_entering,
                            first_pass=first_pass if fused else None, value_units=adv.value_units)
        del first_pass

        # 6. PPO epochs: clipped policy and value losses on shuffled minibatches (skipped, and
        #    counted, when a reward is not finite).
        if not finite:
            self.state.guard.skip(non_finite_cause(fo.parts, scores), "reward", where=f"step {step}: ")
        stats, skipped, epochs_done = self.learner.update(exp, beta, step, a.ppo_epochs if finite else 0,
                                                          hold_policy=adv.zeroed and a.tied_scores == "skip")
        if skipped:
            self.state.guard.skip("non-finite loss or gradient", "grad", where=f"step {step}: ")
        skipped += 0 if finite else 1
        clock.mark()

        # 7. Adapt the KL coefficient, then advance the learning-rate schedules.
        lrs = self.learner.lrs()  # (the update's)
        self.control(kl, skipped, adv.zeroed)
        metrics = ppo_metrics.step_metrics(exp, stats, fo.parts, eos_id=self.eos_id, beta=beta, adv=adv, cfg=cfg,
                                           lrs=lrs, epochs=epochs_done, skipped_total=self.state.guard.skipped_total,
                                           times=clock.times, mem=clock.memory.metrics())
        return metrics, self.samples(step, prompts, fo, exp)

    def rollout(self, prompts: list[Any], given: ro.Rollout | None) -> ro.Rollout:
        """Step 1: one sampled response per row (no grad, KV cache), or ``given``; its prompts'
        common beginning then set up to run once per pass (ppolm/prefix.py)."""
        if given is not None:
            roll = given
        else:
            g = self.cfg.generation
            roll = self.decode(prompts, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k)
        if self.cfg.model.share_prefix:
            roll.share_prefix()
        runtime.malloc_trim()
        return roll

    def decode(self, prompts: list[Any], **sampling: Any) -> ro.Rollout:
        """The policy's responses to ``prompts`` (with --fsdp, its full weights gathered while it samples)."""
        g = self.cfg.generation
        self.policy.eval()
        with distributed.gathered(self.learner.train_model):
            roll = ro.generate(self.policy, [p.ids for p in prompts], pad_id=self.pad_id, eos_id=self.eos_id,
                               max_new_tokens=g.response_length, ignore_eos=g.ignore_eos,
                               share_prefix=self.cfg.model.share_prefix, **sampling)
        self.policy.train()
        return roll

    def greedy_baseline(self, prompts: list[Any]) -> torch.Tensor:
        """ReMax's baseline (B,): each prompt's greedy response's score, repeated over its G rows."""
        g = self.cfg.algo.samples_per_prompt
        firsts = prompts[::g]
        greedy = self.decode(firsts, temperature=self.cfg.generation.temperature, greedy=True)
        return self.penalise(self.frozen.score(greedy, firsts)[0], greedy).repeat_interleave(g)

    def advantages(self, scores: torch.Tensor, kl: torch.Tensor, beta: float, mask: torch.Tensor,
                   old_values: torch.Tensor, finite: bool, greedy_scores: torch.Tensor | None) -> Advantages:
        """Steps 4 and 5 (ppolm/advantages.py): GAE with a critic, else --advantage's estimator."""
        if self.cfg.algo.advantage == "gae":
            return gae_advantages(self.cfg, self.state.score_scale, scores, kl, beta, mask, old_values, finite,
                                  self.critic_in_score_units)
        return critic_free_advantages(self.cfg, scores, kl, beta, mask, self.group_ids(), greedy_scores)

    def control(self, kl: torch.Tensor, skipped: int, zeroed: bool) -> None:
        """Step 7: adapt the KL coefficient once per batch, only after an update in which beta acted: a
        skipped update leaves the policy, hence the KL it is steering, where it was, and a batch whose
        advantages --tied-scores zeroed gave beta's penalty no gradient either (counting them, a long
        stretch of a rare reward would wind beta up while nothing could respond). Then the
        learning-rate schedules advance, and the skips are counted."""
        kl_sum, rows = distributed.all_sum_floats([kl.sum().item(), kl.shape[0]])
        mean_kl = kl_sum / rows  # over every process's rows: beta stays the same everywhere
        if not skipped and not zeroed and math.isfinite(mean_kl):
            self.state.kl_ctl.update(mean_kl, 1)  # one PPO update: --kl-horizon counts updates
        if math.isfinite(mean_kl):  # the next update's share of the KL budget left (--kl-lr-boost)
            self.state.lr_boost = core.kl_lr_scale(mean_kl, self.cfg.kl.kl_target, self.cfg.kl.kl_lr_boost)
        self.learner.advance_schedules(self.state.lr_boost)
        self.state.guard.count(skipped)

    def samples(self, step: int, prompts: list[Any], fo: FrozenOut, exp: ro.Experience) -> list[dict[str, Any]]:
        """Every --sample-every steps (and the last): each row's prompt, response, score, KL and length,
        every process's rows on each."""
        if step % self.cfg.run.sample_every and step != self.cfg.algo.steps - 1:
            return []
        mine = [{"step": step, "prompt": p.raw, "response": t, "score": s, "kl": k, "length": n}
                for p, t, s, k, n in zip(prompts, fo.texts, exp.scores.tolist(), exp.kl.sum(1).tolist(),
                                         exp.roll.lengths.tolist())]
        return [r for rows in distributed.gather_objects(mine) for r in rows]

    # ----------------------------------------------------------------------------------------
    def trained_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) of everything trained (fp32 masters with bf16 models)."""
        return self.learner.trained_parameters()

    def checkpoint_state(self, next_step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The checkpoint: trained weights, optimiser and schedule states (the same on every process),
        the run's :class:`PPOState`, and every process's random-number state."""
        tensors, meta = self.learner.state()
        t_rng, m_rng = scaffold.rng_state()
        tensors.update(t_rng)
        return tensors, {"next_step": next_step, "world_size": self.world, "rng": m_rng, **meta,
                         **self.state.state_dict()}

    def load_checkpoint(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.learner.load(tensors, meta)
        self.state.load_state_dict(meta)
        checkpoint.set_rng_state(tensors, meta["rng"], self.rank)
