"""A PPO run's reward models under watch: the on-policy check (ppolm/rm_check.py) and the refresh
(ppolm/rm_refresh.py) of its frozen reward models, on their schedule and with a random stream of
their own. Its use: docs/overoptimisation.md."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ppolm import checkpoint, distributed, rewards
from ppolm.errors import PPOLMError
from ppolm.judge import Judge
from ppolm.pairs import Pair
from ppolm.rm_check import (
    Sampler,
    ensemble_scorer,
    onpolicy_check,
    policy_sampler,
    reward_model_scorer,
    sharded_sampler,
)
from ppolm.rm_refresh import (
    RefreshConfig,
    RewardModelRefresher,
    original_pairs,
    pair_responses,
    refresh_ensemble,
)


@dataclass
class GuardOptions:
    """When a PPO run checks and refreshes its reward models (``ppolm ppo``'s --rm-check-* and
    --rm-refresh-* options)."""

    check_every: int = 0
    """Check every N steps; 0: at each held-out evaluation."""
    check_pairs: int = 64
    """Answer pairs per check; 0: no check."""
    refresh_every: int = 0
    """Refresh every K steps; 0: never."""
    refresh_pairs: int = 64
    """Answer pairs labelled per refresh."""
    refresh_steps: int = 32
    """Reward-model optimiser steps per refresh."""
    refresh_start_share: float = 0.0
    """Share of each refresh's pairs that set the current policy's answer against the starting policy's
    (0 here, so that a guard needs no starting-policy sampler unless asked; ``ppolm ppo`` defaults to 0.5)."""

    def validate(self) -> None:
        for name in ("check_every", "check_pairs", "refresh_every"):
            if getattr(self, name) < 0:
                raise PPOLMError(f"--rm-{name.replace('_', '-')} must be >= 0; got {getattr(self, name)}")
        if self.refresh_every and (self.refresh_pairs < 1 or self.refresh_steps < 1):
            raise PPOLMError("--rm-refresh-every needs --rm-refresh-pairs >= 1 and --rm-refresh-steps >= 1")
        if not 0.0 <= self.refresh_start_share <= 1.0:
            raise PPOLMError(f"--rm-refresh-start-share must be in [0, 1]; got {self.refresh_start_share}")


class RewardModelGuard:
    """The on-policy check and the refresh of a PPO run's reward models, with one random stream of its
    own: neither changes the run's sampling stream, and its state (:meth:`state_dict`) is all a
    resumed run needs to repeat them.

    ``reward_models``: PPO's frozen :class:`ppolm.rewards.RewardModel` objects (the ensemble, in order);
    a refresh trains each one's own copy and then loads it into them (:meth:`RewardModelRefresher.load_into`),
    training exactly what ``ppolm reward`` trained (read from ``reward_config.yaml``), which PPO never
    shares with the reference policy. ``heldout``: the pairs for ``rm/heldout_accuracy``; default: the
    first reward model's own held-out pairs (:func:`original_pairs`), none when they cannot be read.
    """

    def __init__(self, reward_models: Sequence[rewards.RewardModel], judge: Judge, opts: GuardOptions, *,
                 seed: int, device: str | torch.device, precision: Literal["bf16", "fp32"] = "fp32",
                 ensemble_rule: str = "mean", chat_template: bool = True, max_length: int = 512,
                 heldout: Sequence[Pair] | None = None):
        opts.validate()
        if not reward_models:
            raise PPOLMError("--judge checks and refreshes a reward model: give --reward-model DIR")
        self.rms, self.judge, self.opts = list(reward_models), judge, opts
        self.scorer = ensemble_scorer([reward_model_scorer(rm, chat_template=chat_template, max_length=max_length)
                                       for rm in self.rms], ensemble_rule)
        if heldout is None:
            try:
                heldout = original_pairs(self.rms[0].dir)[1]
            except PPOLMError:
                heldout = []
        self.heldout = list(heldout)
        self.refreshers = []
        for i, rm in enumerate(self.rms if opts.refresh_every else []):
            train, held = original_pairs(rm.dir)
            cfg = RefreshConfig.from_reward_model(rm.dir, precision=precision, seed=seed + i)
            self.refreshers.append(RewardModelRefresher(rm.dir, pairs=train, reference=pair_responses(train + held),
                                                        cfg=cfg, device=device))
        self.rng = random.Random(seed)

    def sampler(self, policy: Any, tok: Any, **generation: Any) -> Sampler:
        """The policy as the check's and refresh's sampler (``generation``: response_length, temperature,
        top_p, top_k, chat_template, batch_size, adapter of :func:`ppolm.rm_check.policy_sampler`), seeded from
        this guard's stream and shared by the processes of a torchrun job."""
        return sharded_sampler(policy_sampler(policy, tok, rng=self.rng, **generation))

    def check_due(self, step: int, evaluating: bool) -> bool:
        """Whether the check runs at ``step``: with each held-out evaluation, or every --rm-check-every steps."""
        if not self.opts.check_pairs:
            return False
        return evaluating if self.opts.check_every == 0 else step % self.opts.check_every == 0

    def check(self, prompts: Sequence[Any], sampler: Sampler,
              columns: dict[str, list[Any]] | None = None) -> dict[str, float]:
        """The ``rm/...`` metrics of :func:`ppolm.rm_check.onpolicy_check` for the current policy."""
        return onpolicy_check(prompts, sampler, self.scorer, self.judge, self.opts.check_pairs, self.rng,
                              heldout=self.heldout, columns=columns).metrics

    def refresh_due(self, step: int) -> bool:
        """Whether a refresh follows update ``step`` (counted from 1): every --rm-refresh-every updates."""
        return bool(self.opts.refresh_every) and step > 0 and step % self.opts.refresh_every == 0

    def refresh(self, prompts: Sequence[Any], sampler: Sampler, columns: dict[str, list[Any]] | None = None,
                start: Sampler | None = None) -> dict[str, float]:
        """Refresh every reward model on one set of fresh pairs and load the result into PPO's frozen
        models; returns the ``rm_refresh/...`` record. ``start``: the starting policy's sampler, for
        the --rm-refresh-start-share of the pairs (:meth:`sampler` of the frozen reference, or of a LoRA
        policy with ``adapter=False``)."""
        o = self.opts
        if o.refresh_start_share and start is None:
            raise PPOLMError("--rm-refresh-start-share needs a sampler of the starting policy")
        kw = {"columns": columns, "start": start, "start_share": o.refresh_start_share}
        if len(self.refreshers) == 1:
            record = self.refreshers[0].refresh(prompts, sampler, self.judge, o.refresh_pairs, o.refresh_steps,
                                                self.rng, **kw)
        else:
            record = refresh_ensemble(self.refreshers, prompts, sampler, self.judge, o.refresh_pairs,
                                      o.refresh_steps, self.rng, **kw)
        for refresher, rm in zip(self.refreshers, self.rms):
            refresher.load_into(rm)
        return record

    def save(self, out_dir: str | Path) -> list[Path]:
        """The refreshed reward models, as reward-model directories: ``out_dir/reward_model_refreshed``
        (with an ensemble, one sub-directory per member); nothing before the first refresh."""
        root = Path(out_dir) / "reward_model_refreshed"
        if not self.refreshers or not self.refreshers[0].rounds:
            return []
        if len(self.refreshers) == 1:
            return [self.refreshers[0].save(root)]
        return [r.save(root / f"{i}_{r.name}") for i, r in enumerate(self.refreshers)]

    def state_dict(self, prefix: str = "rm_guard") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, JSON meta) for :func:`ppolm.checkpoint.save`: the stream, the judge's count and each
        refresher's state."""
        tensors: dict[str, torch.Tensor] = {}
        members = []
        for i, r in enumerate(self.refreshers):
            t, m = r.state_dict(f"{prefix}.{i}")
            tensors.update(t)
            members.append(m)
        return tensors, {"rng": checkpoint._jsonable(self.rng.getstate()), "judge_calls": self.judge.calls,
                         "refreshers": members}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], prefix: str = "rm_guard") -> None:
        """Restore :meth:`state_dict`'s state and give PPO's frozen models the refreshed weights again."""
        if len(meta["refreshers"]) != len(self.refreshers):
            raise PPOLMError(f"the checkpoint refreshed {len(meta['refreshers'])} reward models, this run "
                             f"{len(self.refreshers)}; resume with the same --reward-model and --rm-refresh-every")
        self.rng.setstate(checkpoint._tupled(meta["rng"]))
        self.judge.calls = int(meta["judge_calls"])
        for i, (r, m, rm) in enumerate(zip(self.refreshers, meta["refreshers"], self.rms)):
            r.load_state_dict(tensors, m, f"{prefix}.{i}")
            if r.rounds:
                r.load_into(rm)


class PPOWatch:
    """A PPO run's :class:`RewardModelGuard` (``ppolm ppo --judge``), owned by the run loop
    (ppolm/ppo.py), which calls it at three points of each step:

    - :meth:`after_update`: the refresh due after this update, its ``rm_refresh/...`` record going into
      the step's metrics row;
    - :meth:`check`: the on-policy check due for the policy after ``u`` updates (with the held-out
      evaluation at ``u``, or every --rm-check-every updates), into eval.jsonl's row ``u`` and into
      the metrics row of step ``u``, whose rollout that policy samples: the row's ``objective/kl`` is
      the check's KL. The check of the final policy has no step row (only eval.jsonl's, if any);
    - :meth:`pending`: the check waiting for step ``u``'s row; it is in the checkpoint, so a resumed
      run writes the same rows.

    ``trainer``: a :class:`ppolm.ppo_trainer.PPOTrainer` with a judge."""

    def __init__(self, trainer: Any):
        cfg, r, g = trainer.cfg, trainer.cfg.reward, trainer.cfg.generation
        self.trainer = trainer
        self.guard = RewardModelGuard(
            trainer.rewarder.models, trainer.judge,
            GuardOptions(r.rm_check_every, r.rm_check_pairs, r.rm_refresh_every, r.rm_refresh_pairs,
                         r.rm_refresh_steps, r.rm_refresh_start_share),
            seed=cfg.run.seed + 7919, device=trainer.device, precision=trainer.precision,
            ensemble_rule=r.reward_ensemble, chat_template=cfg.run.chat_template,
            max_length=g.max_prompt_length + g.response_length + 1)
        generation = dict(response_length=g.response_length, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                          chat_template=cfg.run.chat_template, batch_size=cfg.run.eval_batch_size)
        self.sample = self.guard.sampler(trainer.policy, trainer.tokenizer, **generation)
        # the starting policy, for the refresh's pairs against it: the frozen reference, or with LoRA
        # the policy with its adapter disabled
        self.start: Sampler | None = None
        if r.rm_refresh_every and r.rm_refresh_start_share:
            ref = trainer.reference
            self.start = (self.guard.sampler(ref, trainer.tokenizer, **generation) if ref is not None else
                          self.guard.sampler(trainer.policy, trainer.tokenizer, adapter=False, **generation))
        self.waiting: dict[str, float] = {}

    @classmethod
    def of(cls, trainer: Any) -> PPOWatch | None:
        """The run's watch; None without --judge (then nothing of the run changes: no random stream is touched)."""
        return cls(trainer) if trainer.judge is not None else None

    def _run(self, fn: Any, prompts: Sequence[Any]) -> dict[str, float]:
        """``fn(raw prompts, sampler, columns)`` with the policy whole (--fsdp) and in eval mode."""
        columns = {k: [p.extra.get(k) for p in prompts] for k in set().union(*(p.extra for p in prompts))}
        policy = self.trainer.policy
        with distributed.gathered(self.trainer.learner.train_model):
            policy.eval()
            try:
                return fn([p.raw for p in prompts], self.sample, columns or None)
            finally:
                policy.train()

    def after_update(self, updates: int) -> dict[str, float]:
        """The refresh due after update ``updates`` (counted from 1): its record, or {}."""
        if not self.guard.refresh_due(updates):
            return {}
        return self._run(lambda p, sample, columns: self.guard.refresh(p, sample, columns, start=self.start),
                         self.trainer.prompts)

    def check(self, updates: int, evaluating: bool) -> dict[str, float]:
        """The check due for the policy after ``updates`` updates (``evaluating``: a held-out evaluation
        runs then), or {}; kept for step ``updates``'s row. It runs when due even after the last step,
        where only eval.jsonl shows it: a run extended later with --resume --steps then draws what a
        longer run drew."""
        if not self.guard.check_due(updates, evaluating):
            return {}
        prompts = self.trainer.eval_prompts or self.trainer.prompts
        self.waiting = self._run(self.guard.check, prompts)
        return dict(self.waiting)

    def pending(self) -> dict[str, float]:
        """The check of this step's policy, for its metrics row (once)."""
        metrics, self.waiting = self.waiting, {}
        return metrics

    def checkpoint_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The trainer's checkpoint (``tensors``, ``meta``) with the guard's state added."""
        t, m = self.guard.state_dict()
        return {**tensors, **t}, {**meta, "rm_guard": {**m, "pending": self.waiting}}

    def load_checkpoint(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        if "rm_guard" not in meta:
            raise PPOLMError("the checkpoint was written by a run without --judge; resume with the same options, "
                             "or start again with --overwrite")
        self.guard.load_state_dict(tensors, meta["rm_guard"])
        self.waiting = dict(meta["rm_guard"].get("pending") or {})

    def save(self, out_dir: str | Path) -> list[Path]:
        """``out_dir/reward_model_refreshed`` (after a refresh; :meth:`RewardModelGuard.save`)."""
        return self.guard.save(out_dir)
