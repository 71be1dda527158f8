"""Device and numeric precision, chosen one way for every command, and PPO's mixed-precision recipe.

``--precision auto`` is a speed choice only: bf16 where the hardware computes it natively (CUDA
with bf16 support; CPUs with AMX or AVX512-BF16), fp32 elsewhere (on a CPU without those
instructions bf16 is emulated and slower than fp32). The choice and its reason are printed once.

The bf16 recipe of ``ppolm ppo`` (mixed precision as in Micikevicius et al. 2018,
https://arxiv.org/abs/1710.03740, and as FSDP's ``MixedPrecisionPolicy(param_dtype=bf16)`` runs it):

* every model computes in bf16 with bf16 weights: the policy, the frozen reference, the reward
  models and the critic; so the policy and the reference run *the same operations on the same
  numbers* until the first update (KL exactly 0, importance ratio exactly 1), and a LoRA policy's
  reference (its adapter disabled) is the same bf16 base;
* trained weights keep an fp32 master copy (:class:`MasterWeights`): gradients are moved to it after
  each backward pass, the optimiser (and its states) works in fp32, and the bf16 weights are
  rounded from it after each step, so updates far below bf16's resolution still accumulate;
  LoRA adapters are kept in fp32 by peft and need no copy;
* every quantity the PPO maths reads is fp32: logits come from the LM head in fp32
  (:func:`ppolm.models.output_logits`; the LM head's bf16 rounding alone makes sampled and
  recomputed log-probs differ by ~0.03 nats per token, MiniMax-M1, https://arxiv.org/abs/2506.13585),
  values from the value head in fp32, and log-probs, rewards, advantages and losses are fp32.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from ppolm.errors import PPOLMError


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cuda' without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise PPOLMError("--device cuda was asked for but no CUDA device is available; use --device cpu or auto")
    return torch.device(name)


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` computes bf16 natively, and what that was read from."""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, f"{torch.cuda.get_device_name(device)} {'supports' if ok else 'does not support'} bf16"
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    found = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    if not found and not flags:  # no /proc/cpuinfo (macOS, Windows): ask torch's own CPU probe
        try:
            if torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported():
                found = ["bf16 (torch.cpu)"]
        except AttributeError:
            pass
    if found:
        return True, f"this CPU has {' and '.join(found)}"
    return False, "this CPU has neither AMX nor AVX512-BF16, so bf16 would be emulated and slower than fp32"


_SAID: set[tuple[str, str, str]] = set()


def resolve_precision(name: str, device: torch.device, *, say: bool = True) -> str:
    """'auto' -> 'bf16' where ``device`` computes bf16 natively, else 'fp32'; prints the choice and
    why once per process (``say=False``: silent)."""
    if name not in ("auto", "bf16", "fp32"):
        raise PPOLMError(f"--precision must be auto, bf16 or fp32; got {name!r}")
    if name == "auto":
        ok, why = native_bf16(device)
        chosen, reason = ("bf16" if ok else "fp32"), f"auto: {why}"
    else:
        chosen, reason = name, "as asked"
    key = (name, chosen, device.type)
    if say and key not in _SAID:
        _SAID.add(key)
        print(f"precision: {chosen} on {device.type} ({reason})", file=sys.stderr)
    return chosen


def dtype_of(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


class MasterWeights:
    """fp32 master copies of trained parameters that the model holds in bf16.

    The optimiser steps :attr:`params` (fp32); the model's own parameters (``model_params``) are
    what the forward pass uses. An fp32 model parameter is its own master (no copy). Use:
    ``loss.backward(); mw.grads_to_master()`` after every backward pass (gradients accumulate in
    fp32, not bf16), then clip and step the optimiser on ``mw.params``, then ``mw.copy_to_model()``.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter]):
        self.model_params = list(params)
        self.params = [p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float().clone())
                       for p in self.model_params]

    def pairs(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        return [(p, m) for p, m in zip(self.model_params, self.params) if p is not m]

    def grads_to_master(self) -> None:
        for p, m in self.pairs():
            if p.grad is None:
                continue
            g = p.grad.float()
            m.grad = g if m.grad is None else m.grad.add_(g)
            p.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for p, m in self.pairs():
            p.copy_(m)

    @torch.no_grad()
    def to_fp32_model(self) -> None:
        """Make the model's parameters fp32 copies of the masters (before saving the final model)."""
        for p, m in self.pairs():
            p.data = m.detach().clone()
