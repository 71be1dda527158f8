"""The frozen models' work on a rollout, in one call: reference log-probs, reward scores, and the
hidden states that trained models start from.

PPO runs three things on every rollout that never train: the reference policy (its log-probs give
the KL penalty), the reward models and functions (the score), and, with a top-layers critic
(ppolm/critic.py), the frozen trunk that feeds it. :meth:`FrozenModels.run` does all of it and
returns a :class:`FrozenOut`. Behind it sit three speed paths, each switchable and each computing
the same numbers as the plain passes:

* a shared trunk (``--share-trunk``, ppolm/trunk.py): layers the reference has in common with a
  reward model (or, with LoRA on the top layers only, with the policy) are stored once and run
  once; the reference pass records where the others depart from it;
* a shared prefix (``--share-prefix``, ppolm/prefix.py): the prompts' common beginning runs once
  per pass (it rides on ``roll.split``);
* the critic's tap (ppolm/critic.py): the hidden state entering the critic's first own layer is
  read while the frozen model it shares runs anyway.

The order of the passes is fixed (reference, then scoring, then, only when neither fed the tap, one
more frozen pass): models that share the reference's layers read what its pass recorded.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from ppolm import models
from ppolm import rollout as ro
from ppolm import trunk as trunk_lib
from ppolm.models import scalar_forward


@dataclass
class FrozenOut:
    """What the frozen models computed on a rollout of B rows and R response columns (P + R in all)."""

    ref_logprobs: torch.Tensor
    """(B, R) the reference's log-probs of the sampled tokens (logits / temperature)."""
    scores: torch.Tensor
    """(B,) the reward sources' weighted total, before the missing-EOS and length penalties."""
    parts: dict[str, torch.Tensor]
    """Each source's raw score, (B,), keyed ``reward/<name>``."""
    texts: list[str]
    """The decoded responses."""
    critic_input: torch.Tensor | None
    """(B, P + R, d) the frozen trunk's hidden state that feeds a top-layers critic; None without one."""
    policy_entering: torch.Tensor | None
    """(B, P + R, d) the state entering a LoRA policy's first adapted layer; None when it runs in full."""


class FrozenModels:
    """The reference policy, the rewarder and the critic's tap, with the trunk they may share.

    ``reference`` None means a LoRA policy whose reference is ``policy`` with its adapter disabled.
    ``tap``: a top-layers critic's :class:`ppolm.critic.Tap` on ``critic_frozen`` (the reward
    model's or the reference's layers), or None.
    """

    def __init__(self, policy: torch.nn.Module, reference: torch.nn.Module | None, rewarder: Any, tokenizer: Any, *,
                 temperature: float, device: torch.device, tap: Any = None, critic_from_rm: bool = False,
                 critic_entry: int = 0, share_trunk: bool = True):

        self.policy, self.reference, self.rewarder, self.tokenizer = policy, reference, rewarder, tokenizer
        self.temperature, self.device = temperature, device
        self.pad_id = tokenizer.pad_token_id
        self.tap, self.critic_from_rm = tap, critic_from_rm
        rms = rewarder.models
        self.rm_same_vocab = [rm.tokenizer.get_vocab() == tokenizer.get_vocab() for rm in rms]
        # Frozen layers the reference has in common with the reward models (and, with LoRA on the top
        # layers only, with the policy) are stored once and run once per batch (ppolm/trunk.py).
        ref_model = reference if reference is not None else policy
        self.rm_start = [0] * len(rms)
        self.policy_start = 0
        if share_trunk:
            for i, rm in enumerate(rms):
                k = trunk_lib.shared_prefix(ref_model, rm.model) if self.rm_same_vocab[i] else 0
                if k:
                    trunk_lib.alias(ref_model, rm.model, k)
                    self.rm_start[i] = k
            if reference is None:
                self.policy_start = trunk_lib.policy_prefix(policy)
            if tap is not None and critic_from_rm and critic_entry < self.rm_start[0]:
                # the critic's trunk enters a layer the reward model now shares: tap the reference's
                tap.layer = models.stack(ref_model)[1][critic_entry]  # type: ignore[index]
        self.recorder = (trunk_lib.Recorder(ref_model, set(self.rm_start) | {self.policy_start})
                         if any(self.rm_start) or self.policy_start else None)

    @torch.no_grad()
    def run(self, roll: ro.Rollout, prompts: list[Any], rewarder: Any = None, *, tap: bool = True) -> FrozenOut:
        """Reference log-probs, scores and the trained models' starting states for ``roll``.
        ``rewarder``: score with other sources (held-out evaluation); ``tap=False``: no critic input."""
        tapping = tap and self.tap is not None
        if tapping:
            self.tap.hidden = None

        def tapped() -> contextlib.AbstractContextManager:
            return self.tap.capture() if tapping else contextlib.nullcontext()

        # The reference pass comes first: reward models (and a LoRA policy) that share its frozen
        # lower layers start from the hidden state it recorded (ppolm/trunk.py).
        with tapped():
            ref_logprobs, found = self.reference_pass(roll)  # (B, R)
        with tapped():
            scores, parts, texts = self.score(roll, prompts, rewarder, found)  # (B,)
        critic_input = None
        if tapping:
            critic_input = self.tap.hidden if self.tap.hidden is not None else self.trunk_hidden(roll)
        entering = found.get(self.policy_start) if self.policy_start else None
        return FrozenOut(ref_logprobs, scores, parts, texts, critic_input, entering)

    @torch.no_grad()
    def reference_pass(self, roll: ro.Rollout) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Reference log-probs (B, R) and the hidden states, by layer index, where the reward models
        and the policy part from the reference's frozen layers (empty when nothing is shared)."""
        if self.recorder is None:
            return self.reference_logprobs(roll), {}
        with self.recorder.record() as found:
            ref = self.reference_logprobs(roll)
        if self.policy_start:
            # The policy runs from the state entering its first adapted layer (PPOTrainer.forward_train),
            # so its reference (the adapter disabled) must take the same path: then both compute the
            # same operations on the same numbers until the first update (KL 0, ratio 1), also in
            # bf16, where two paths to one result differ by rounding.
            with self.policy.disable_adapter():
                ref = ro.logprobs(self.policy, roll, self.temperature, self.policy_start, found[self.policy_start])
        return ref, found

    @torch.no_grad()
    def reference_logprobs(self, roll: ro.Rollout) -> torch.Tensor:
        """(B, R) log-probs of the reference, run in full."""
        if self.reference is None:  # LoRA: the reference is the policy without its adapter
            with self.policy.disable_adapter():
                return ro.logprobs(self.policy, roll, self.temperature)
        return ro.logprobs(self.reference, roll, self.temperature)

    @torch.no_grad()
    def score(self, roll: ro.Rollout, prompts: list[Any], rewarder: Any = None,
              found: dict[int, torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[str]]:
        """Score each full prompt+response once; (B,) total plus each source's (B,). ``found``: the
        reference pass's hidden states, from which reward models sharing its layers start."""
        rewarder = rewarder or self.rewarder
        mask = roll.response_mask
        texts = self.tokenizer.batch_decode(roll.response * mask + self.pad_id * (1 - mask), skip_special_tokens=True)

        def rm_scores(rm: Any) -> torch.Tensor:
            i = rewarder.models.index(rm)
            if self.rm_same_vocab[i]:
                k = self.rm_start[i]
                if found and k in found:
                    return rm.score_ids(roll.input_ids, roll.attention_mask, k, found[k])
                return rm.score_ids(roll.input_ids, roll.attention_mask, split=roll.split)
            full = self.tokenizer.batch_decode(
                [row[m.bool()] for row, m in zip(roll.input_ids, roll.attention_mask)])
            return rm.score_texts(full)

        keys = sorted({k for p in prompts for k in p.extra})
        columns = {k: [p.extra.get(k) for p in prompts] for k in keys}
        total, parts = rewarder.score(model_inputs=rm_scores, prompts=[p.raw for p in prompts],
                                      completions=texts, columns=columns, **rewarder.query_texts(roll, self.tokenizer))
        return total.to(self.device), parts, texts

    @torch.no_grad()
    def trunk_hidden(self, roll: ro.Rollout) -> torch.Tensor:
        """The frozen trunk's hidden state for a top-layers critic when no tapped pass ran this step
        (e.g. a reward-model weight of zero): one forward of the frozen model under the tap."""

        with self.tap.capture():
            if self.critic_from_rm:
                scalar_forward(self.rewarder.models[0].model, roll.input_ids, roll.attention_mask, split=roll.split)
            else:
                self.reference_logprobs(roll)
        return self.tap.hidden
