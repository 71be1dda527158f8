"""What a PPO run leaves behind: ``policy/`` (and ``policy_adapter/`` with LoRA), ``critic/`` and
``best/``, each in Hugging Face format (safetensors), loadable by plain transformers, and written
atomically (:func:`ppolm.atomic.atomic_dir`: a full disk leaves the previous one, and the
checkpoints, intact). No ``critic/`` for the critic-free estimators.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ppolm import atomic, checkpoint, distributed, models
from ppolm.critic import TrunkCritic
from ppolm.errors import PPOLMError
from ppolm.ppo_trainer import PPOTrainer


@dataclass
class TrainedModels:
    """The trained models as they are saved: fp32, on process 0."""

    policy: Any
    critic: Any
    value_head: torch.nn.Linear | None
    value_bias: torch.Tensor | None
    trunk_critic: bool
    """``critic`` is a :class:`ppolm.critic.TrunkCritic` (top layers on the frozen trunk)."""
    critic_source: tuple[Path | str, str] | None
    tokenizer: Any
    cfg: Any


def trained(trainer: PPOTrainer) -> TrainedModels:
    """The trainer's own models, made fp32 (bf16 models take their fp32 masters' weights)."""
    learner = trainer.learner
    learner.actor.to_fp32_model()
    learner.critic_weights.to_fp32_model()
    trainer.policy.float()
    if trainer.critic is not None:
        trainer.critic.float()
    return TrainedModels(trainer.policy, trainer.critic, trainer.value_head, trainer.value_bias,
                         trainer.tap is not None, trainer.critic_source, trainer.tokenizer, trainer.cfg)


def gathered(trainer: PPOTrainer) -> TrainedModels | None:
    """--fsdp: the sharded policy and critic gathered whole (every process takes part) into fp32
    copies on process 0 (None on the others)."""

    def whole(module: Any) -> dict[str, torch.Tensor]:
        return {k: distributed.full(v).detach().cpu() for k, v in module.state_dict().items()}

    m = trainer.cfg.model
    tap = trainer.tap is not None
    policy_state = whole(trainer.policy)
    critic_state = None if trainer.critic is None else whole(trainer.critic.model if tap else trainer.critic)
    head_state = None if trainer.value_head is None else whole(trainer.value_head)
    bias = None if trainer.value_bias is None else distributed.full(trainer.value_bias).detach().cpu()
    if not distributed.is_main():
        return None
    load = dict(dtype=torch.float32, device=torch.device("cpu"), trust_remote_code=m.trust_remote_code,
                allow_pickle=m.allow_pickle)
    policy = models.load_causal_lm(m.model, **load)
    policy.load_state_dict(policy_state)
    critic = None
    if critic_state is not None:
        src, head_init = trainer.critic_source
        critic = models.load_scalar_model(src, head_init=head_init, **load)
        if tap:  # top layers on the frozen trunk: the same cut of a fresh copy
            critic = TrunkCritic(critic, trainer.critic.n)
            critic.model.load_state_dict(critic_state)
        else:
            critic.load_state_dict(critic_state)
    head = None
    if head_state is not None:
        head = torch.nn.Linear(head_state["weight"].shape[1], 1)
        head.load_state_dict(head_state)
    return TrainedModels(policy, critic, head, None if bias is None else torch.nn.Parameter(bias), tap,
                         trainer.critic_source, trainer.tokenizer, trainer.cfg)


def save(t: TrainedModels, out: Path) -> None:
    """policy/ (and policy_adapter/ with LoRA) and critic/ in ``out``."""
    named = [(f"policy.{n}", p) for n, p in t.policy.named_parameters()]
    for name, mod in (("critic", t.critic), ("critic", t.value_head)):
        named += [] if mod is None else [(f"{name}.{n}", p) for n, p in mod.named_parameters()]
    bad = checkpoint.first_non_finite(named + ([("critic.value_bias", t.value_bias)] if t.value_bias is not None else []))
    if bad:
        raise PPOLMError(f"non-finite weights in {bad}; not saving them (see metrics.jsonl guard/*)")
    policy = t.policy
    if hasattr(policy, "merge_and_unload"):  # LoRA: save the adapter, and the merged model in policy/
        with atomic.atomic_dir(out / "policy_adapter") as tmp:
            policy.save_pretrained(str(tmp))
        policy = policy.merge_and_unload()
    with atomic.atomic_dir(out / "policy") as tmp:
        models.save_pretrained(policy, t.tokenizer, tmp)
    if t.critic is None and t.value_head is None:
        return
    with atomic.atomic_dir(out / "critic") as tmp:
        if t.trunk_critic:  # top layers on a frozen trunk: saved as one whole model
            src, _ = t.critic_source
            m = t.cfg.model
            full = t.critic.full_model(src, dtype=torch.float32, device="cpu", trust_remote_code=m.trust_remote_code,
                                       allow_pickle=m.allow_pickle)
            models.save_pretrained(full, t.tokenizer, tmp)
            del full
        elif t.critic is not None:
            models.save_pretrained(t.critic, t.tokenizer, tmp)
        else:
            from safetensors.torch import save_file

            save_file({k: v.detach().cpu().contiguous() for k, v in t.value_head.state_dict().items()},
                      str(tmp / "value_head.safetensors"))
        if t.value_bias is not None:  # value = head output + bias (the RM's normalisation, trained on)
            (tmp / "ppolm_value.json").write_text(json.dumps({"bias": float(t.value_bias.detach())}, indent=2))


def policy_weights(trainer: PPOTrainer) -> dict[str, torch.Tensor]:
    """The policy's trained parameters as they stand, by name: fp32 CPU copies of the optimiser's
    masters (a bf16 model computes with rounded copies of them)."""
    names = [n for n, p in trainer.policy.named_parameters() if p.requires_grad]
    return {n: m.detach().float().cpu().clone() for n, m in zip(names, trainer.learner.actor.params)}


def save_best(trainer: PPOTrainer, updates: int, name: str, metrics: dict[str, Any],
              weights: dict[str, torch.Tensor] | None = None) -> None:
    """The policy to best/ and its metric to best.json (--best-metric improved, e.g. a gold judge).
    ``weights``: the trained parameters the evaluation saw (:func:`policy_weights`), when the policy
    has moved on since (the first evaluation, logged after the first step); by default the current
    ones. Saved in fp32, as policy/ is."""
    out = trainer.out
    best = out / "best"
    if weights is None:  # (--fsdp: the model's own weights, as they are)
        weights = {} if trainer.cfg.model.fsdp else policy_weights(trainer)
    params = dict(trainer.policy.named_parameters())
    kept = {n: params[n].data for n in weights}
    try:
        for n, w in weights.items():
            params[n].data = w
        if hasattr(trainer.policy, "merge_and_unload"):
            trainer.policy.save_pretrained(str(best / "policy_adapter"))
        else:
            models.save_pretrained(trainer.policy, trainer.tokenizer, best / "policy")
    finally:
        for n, data in kept.items():
            params[n].data = data
    atomic.write_text(out / "best.json", json.dumps(
        {"step": updates, "metric": name, "value": metrics[name], "se": metrics.get(name + "_se"),
         "kl": metrics["eval/kl"]}, indent=2))
