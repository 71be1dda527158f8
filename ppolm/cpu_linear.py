"""fp32 linear layers on x86 CPUs through oneDNN rather than the BLAS behind torch's matmul.

torch computes an fp32 ``F.linear`` on a CPU with MKL's sgemm. On the AMD EPYC machines ppolm is
measured on, MKL runs each of a linear layer's three products (the forward ``x Wᵀ``, the input
gradient ``g W`` and the weight gradient ``gᵀ x``) at about half the speed of oneDNN's kernels on
the same cores, at the shapes of a 135M model's training passes (~300 rows) and of decoding (8-32
rows). oneDNN ships inside every x86 torch wheel, its linear kernel exposed as
``torch.ops.mkldnn._linear_pointwise``, so ppolm computes all three products
of an fp32 CPU linear layer with it: :class:`Linear` replaces ``nn.Linear``'s class in the models
ppolm loads (:func:`install`), and :func:`linear` serves the fp32 LM head. Everything else (bf16,
an autocast region, CUDA, a DTensor under FSDP) takes ``F.linear`` unchanged.

Same maths, another summation order: the outputs differ from ``F.linear``'s by float rounding
(~1e-6 relative), as two BLAS libraries do; a run is still deterministic for a thread count.
``PPOLM_CPU_LINEAR=aten`` turns the routing off (then ppolm's numbers are bit-identical to a plain
torch run); ``bench/cpu_linear.py`` times both on your machine.
"""

from __future__ import annotations

import functools
import os
import platform

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ppolm.errors import PPOLMError

ENV = "PPOLM_CPU_LINEAR"
BACKENDS = ("onednn", "aten")


@functools.cache
def backend() -> str:
    """``onednn`` on x86 CPUs whose torch has oneDNN, else ``aten``; ``$PPOLM_CPU_LINEAR`` overrides."""
    asked = os.environ.get(ENV, "").strip().lower()
    if asked and asked not in BACKENDS:
        raise PPOLMError(f"{ENV}={asked!r}: use one of {', '.join(BACKENDS)} (or leave it unset)")
    available = (platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()
                 and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    if asked == "onednn" and not available:
        raise PPOLMError(f"{ENV}=onednn: this torch build or CPU has no oneDNN linear kernel; unset it")
    return asked or ("onednn" if available else "aten")


def _plain(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor or type(t) is nn.Parameter  # not a DTensor or another subclass


def routed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear(x, weight)`` runs on oneDNN here (fp32 CPU tensors, no autocast)."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and x.numel() > 0 and _plain(weight) and backend() == "onednn"
            and not torch.is_autocast_enabled("cpu"))


def _mm_t(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b.T (+ bias) on oneDNN; a (N, k), b (n, k), either may be a strided view."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        x2 = x.reshape(-1, x.shape[-1])
        ctx.x_shape = x.shape
        ctx.save_for_backward(x2 if weight.requires_grad else None, weight)
        ctx.has_bias = bias is not None
        return _mm_t(x2, weight, bias).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _mm_t(g2, weight.t()).reshape(ctx.x_shape)  # g W
        if ctx.needs_input_grad[1]:
            gw = _mm_t(g2.t(), x2.t())  # gᵀ x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on oneDNN where :func:`routed` says so."""
    if routed(x, weight):
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad)):
            return _OneDNNLinear.apply(x, weight, bias)
        # no graph to record (sampling, frozen passes): skip the autograd.Function's overhead
        return _mm_t(x.reshape(-1, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    return nn.functional.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`linear`; same parameters, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def is_linear(module: nn.Module) -> bool:
    """A plain linear layer (``nn.Linear`` or :class:`Linear`), not an adapter wrapping one."""
    return type(module) is nn.Linear or type(module) is Linear


def install(model: nn.Module) -> nn.Module:
    """Switch every plain ``nn.Linear`` of ``model`` to :class:`Linear` (in place) when the backend
    is oneDNN and the model is on the CPU (a model moved to a GPU later falls back per call); peft's
    LoRA wrappers keep their class and reach their base layer through it."""
    first = next(model.parameters(), None)
    if backend() == "onednn" and first is not None and first.device.type == "cpu":
        for module in model.modules():
            if type(module) is nn.Linear:
                module.__class__ = Linear
    return model
