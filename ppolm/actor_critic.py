"""The trained models' forward pass on a rollout: the policy's log-probs and entropy, the critic's values.

:class:`ActorCritic` holds the two trained models of PPO (the policy, and the critic when the
advantage estimator has one) as one ``nn.Module`` whose ``forward`` is the whole training-time
computation. That is what ``DistributedDataParallel`` needs: DDP averages the gradients of the
parameters of the module it wraps, and only for computations that go through its ``forward``
(ppolm's passes call the models' backbones and heads directly, never the models' own
``forward``). On one process it is used as it is.

The frozen models (reference, reward models) never go through here.
"""

from __future__ import annotations

from typing import Any

import torch

from ppolm import core
from ppolm import rollout as ro
from ppolm.models import scalar_head


class ActorCritic(torch.nn.Module):
    """Policy and critic for the PPO update.

    ``critic``: a separate value model, a :class:`ppolm.critic.TrunkCritic` (its top layers fed by
    the frozen trunk's hidden state; ``tap=True``) or a whole scalar model; ``value_head``: a value
    head on the policy's own trunk (``--critic shared``); both None without a critic.
    ``value_bias``: a trained scalar added to every value (the reward model's normalisation bias).
    ``policy_start``: the first layer the policy runs itself (LoRA on the top layers, the state
    entering it coming from the reference pass); 0 = the whole model.
    """

    def __init__(self, policy: torch.nn.Module, *, temperature: float, policy_start: int = 0,
                 critic: torch.nn.Module | None = None, value_head: torch.nn.Module | None = None,
                 tap: bool = False, value_bias: torch.nn.Parameter | None = None):
        super().__init__()
        self.policy = policy
        self.critic = critic
        self.value_head = value_head
        self.value_bias = value_bias
        self.tap = tap
        self.temperature = temperature
        self.policy_start = policy_start

    @property
    def has_critic(self) -> bool:
        return self.critic is not None or self.value_head is not None

    def forward(self, roll: ro.Rollout | None, need_entropy_grad: bool = False, trunk: torch.Tensor | None = None,
                entering: torch.Tensor | None = None, want_entropy: bool = True, want_values: bool = True,
                ptx: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
        """(log-probs (B, R), entropy (B, R) or None, values (B, R) or None) of a rollout; no values
        (and no critic pass) with ``want_values=False``.

        ``trunk`` (B, P + R, d): the frozen trunk's hidden state that feeds a top-layers critic;
        ``entering``: the state entering the policy's first adapted layer, from the reference pass.
        ``roll=None, ptx=(ids, mask)``: instead, the policy's language-modelling loss (a scalar) on
        a microbatch of pretraining text (PPO-ptx)."""
        if roll is None:
            if ptx is None:  # nothing to compute (FSDP's first call: ppolm/distributed.py fsdp)
                return None
            ids, mask = ptx
            labels = ids.masked_fill(mask == 0, -100)
            return self.policy(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.float()
        h = ro.response_hidden(self.policy, roll, self.policy_start, entering)
        logits = ro.tempered_logits(self.policy, h, self.temperature)  # (B, R, V) fp32
        logp = core.logprobs_from_logits(logits, roll.response)
        ent = None  # two more (B, R, V) tensors: only for the first pass's metric or an entropy bonus
        if want_entropy:
            with torch.set_grad_enabled(need_entropy_grad and torch.is_grad_enabled()):
                ent = core.entropy_from_logits(logits)
        return logp, ent, self.values(roll, h, trunk) if want_values else None

    def values(self, roll: ro.Rollout, h: torch.Tensor, trunk: torch.Tensor | None) -> torch.Tensor | None:
        """The critic's values (B, R) of a rollout (None without a critic); ``h``: the policy's hidden
        state over the response (a shared trunk's head reads it)."""

        v = None
        if self.value_head is not None:
            v = scalar_head(self.value_head, h)
        elif self.critic is not None and self.tap:
            p, r = roll.query.shape[1], roll.response.shape[1]
            v = self.critic(trunk, roll.attention_mask)[:, p - 1:p - 1 + r]
        elif self.critic is not None:
            v = ro.values(self.critic, roll)
        if self.value_bias is not None and v is not None:
            v = v + self.value_bias
        return v


def trained(module: Any) -> ActorCritic:
    """The :class:`ActorCritic` itself, through a DDP wrapper."""
    return module.module if hasattr(module, "module") and isinstance(module.module, ActorCritic) else module
