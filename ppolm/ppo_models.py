"""PPO's four models, built in one place: policy (trained), reference (frozen), rewarder (frozen
reward models and/or functions) and critic (trained value model).

The order of construction is part of a run's reproducibility (LoRA factors and a value head draw
their initial weights from the seeded generator), so :func:`build` always builds them in the
order policy, reference, reward models, critic.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ppolm import critic as critic_lib
from ppolm import models
from ppolm.errors import PPOLMError
from ppolm.ppo_config import PPOConfig
from ppolm.reward_train import freeze_lower_layers
from ppolm.rewards import Rewarder, RewardModel


@dataclass
class PPOModels:
    policy: torch.nn.Module
    """The trained policy (a peft model with LoRA)."""
    reference: torch.nn.Module | None
    """The frozen reference policy; None with LoRA, where it is the policy with its adapter disabled."""
    rewarder: Any
    """A :class:`ppolm.rewards.Rewarder`: frozen reward models and/or reward functions."""
    critic: torch.nn.Module | None = None
    """A separate value model: a :class:`ppolm.critic.TrunkCritic` (its top layers on a frozen trunk,
    read by ``tap``) or a whole scalar model; None with ``--critic shared`` and without a critic
    (``--advantage`` other than gae)."""
    value_head: torch.nn.Linear | None = None
    """``--critic shared``: a zero-initialised value head on the policy's trunk."""
    tap: Any = None
    """The :class:`ppolm.critic.Tap` feeding a TrunkCritic its frozen trunk's hidden state, or None."""
    critic_from_rm: bool = False
    """The critic starts from the (first) reward model, not from the policy."""
    critic_source: tuple[Path | str, str] | None = None
    """(model directory, head init) the separate critic was loaded from."""
    value_bias: torch.nn.Parameter | None = None
    """The critic's share of the reward model's normalisation (value = head + bias), trained on."""


def build(cfg: PPOConfig, tokenizer: Any, model_dir: Path, functions: list[Any], dtype: torch.dtype,
          device: torch.device) -> PPOModels:
    """Load and set up the four models of ``cfg`` (``functions``: the loaded reward functions)."""

    m = cfg.model
    load = dict(dtype=dtype, device=device, trust_remote_code=m.trust_remote_code, allow_pickle=m.allow_pickle)
    # --fsdp: the trained models' fp32 weights are the shards FSDP keeps; it computes in ``dtype``
    trained = {**load, "dtype": torch.float32} if m.fsdp else load
    # 1. policy (trained) and 2. reference (frozen)
    policy = models.load_causal_lm(m.model, **trained)
    models.check_output_path(policy)
    reference = None
    if m.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        targets: Any = m.lora_target if m.lora_target == "all-linear" else m.lora_target.split(",")
        policy = get_peft_model(policy, LoraConfig(r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=0.0,
                                                   target_modules=targets, task_type="CAUSAL_LM"))
    ref = reference_of(m.model, m.ref_model)
    if ref != m.model:  # another model than the policy's start: a copy of its own, also with LoRA
        if models.load_tokenizer(ref, trust_remote_code=m.trust_remote_code,
                                 allow_pickle=m.allow_pickle).get_vocab() != tokenizer.get_vocab():
            raise PPOLMError(f"the reference {ref} has another tokenizer than the policy {m.model}; the KL "
                             "compares their probabilities of the same tokens: pass a --ref-model of the same family")
        print(f"reference (KL penalty): {ref}", file=sys.stderr)
        reference = models.load_causal_lm(ref, **load).requires_grad_(False)
    elif m.lora_r == 0:
        reference = models.load_causal_lm(m.model, **load).requires_grad_(False)
    policy.train()  # dropout is already 0 in every model; train() only matters to peft

    # 3. reward: frozen reward models and/or functions
    rms = [RewardModel(p, **load) for p in cfg.reward.reward_model]
    rewarder = Rewarder(rms, functions, model_weight=cfg.reward.reward_model_weight,
                        ensemble_rule=cfg.reward.reward_ensemble)
    built = PPOModels(policy, reference, rewarder)
    if cfg.needs_critic:  # the critic-free estimators (--advantage other than gae) build none
        build_critic(built, cfg, tokenizer, model_dir, trained)
    return built


def reference_of(model: str, ref_model: str | None) -> str:
    """--ref-model if given; else, when ``model`` is a `ppolm ppo` run's policy/ (or best/), that run's
    own reference, followed back through earlier rounds, so that every round's KL is measured from
    the original SFT model (InstructGPT's penalty); else ``model`` itself."""
    import yaml

    if ref_model:
        return ref_model
    here = model
    for _ in range(100):  # rounds back to the first (a bound against a loop of configs)
        saved = Path(here).parent / "config.yaml"
        if Path(here).name not in ("policy", "best") or not saved.is_file():
            break
        try:
            section = yaml.safe_load(saved.read_text(encoding="utf-8"))["model"]
            earlier = section.get("ref_model") or section["model"]
        except (OSError, yaml.YAMLError, TypeError, KeyError, AttributeError):
            break
        if not isinstance(earlier, str):
            break
        if section.get("ref_model"):
            return earlier
        here = earlier
    return here


def build_critic(built: PPOModels, cfg: PPOConfig, tokenizer: Any, model_dir: Path, load: dict[str, Any]) -> None:
    """4. critic: a separate model (from the RM or the policy), by default only its top layers
    trained on the frozen trunk they share with that model (ppolm/critic.py); or a value head on
    the policy's trunk. Sets the critic fields of ``built``."""

    m, rms, device = cfg.model, built.rewarder.models, load["device"]
    if m.critic == "shared":
        d = built.policy.config.hidden_size
        built.value_head = torch.nn.Linear(d, 1).to(device)
        torch.nn.init.zeros_(built.value_head.weight)
        torch.nn.init.zeros_(built.value_head.bias)
        return
    if m.critic_model is not None:  # a trained critic (last round's): kept whole, its top layers trained
        built.critic_source = (m.critic_model, "keep")
        built.critic = models.load_scalar_model(m.critic_model, head_init="keep", **load)
        freeze_lower_layers(models._unwrap(built.critic), m.critic_layers if m.critic_layers > 0 else -1)
        built.critic.train()
        saved = Path(m.critic_model) / "ppolm_value.json"  # value = head + bias (from a reward model's norm)
        if saved.is_file():
            bias = torch.tensor(float(json.loads(saved.read_text())["bias"]), device=device)
            built.value_bias = torch.nn.Parameter(bias.reshape(1) if m.fsdp else bias)
        return
    from_rm = bool(m.critic_init == "reward" and rms)
    if from_rm and rms[0].tokenizer.get_vocab() != tokenizer.get_vocab():
        print(f"the reward model {rms[0].name} has its own tokenizer: the critic starts from the policy",
              file=sys.stderr)
        from_rm = False
    built.critic_from_rm = from_rm
    head = "keep" if from_rm and not m.critic_zero_head else "value"  # "value": a zero head
    source = built.critic_source = (rms[0].dir if from_rm else model_dir, head)
    frozen = rms[0].model if from_rm else (built.reference if built.reference is not None else built.policy)
    found = critic_lib.build(source[0], frozen, m.critic_layers, head_init=source[1], **load)
    if found is not None:
        built.critic, built.tap = found
    else:
        built.critic = models.load_scalar_model(source[0], head_init=source[1], **load)
    built.critic.train()
    if from_rm and not m.critic_zero_head:
        # The RM scores through its normalisation (gain, bias); so does the critic at the start, so
        # its first values are on the scale of the returns (else explained variance starts << 0).
        score = models._unwrap(built.critic.model if built.tap is not None else built.critic).score
        with torch.no_grad():
            score.weight.mul_(rms[0].gain)
        bias = torch.tensor(float(rms[0].bias), device=device)
        # FSDP shards along dim 0, so under --fsdp the bias is a vector of one (it adds the same)
        built.value_bias = torch.nn.Parameter(bias.reshape(1) if m.fsdp else bias)
