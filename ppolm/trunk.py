"""Frozen layers that several of PPO's models hold in common are stored once and run once.

The reward model is usually trained from the same base as the policy, and ``ppolm reward`` trains
only its top layers by default (``--train-layers``): its embedding and lower layers are then,
bit for bit, the reference policy's. With LoRA on the policy's top layers only, the policy's lower
layers are the reference's as well. Each frozen layer that the reference shares with another model
computes the same hidden state on the same tokens, so ppolm

* keeps one copy of its weights (the reward model's parameters become the reference's), and
* runs it once per batch: the reference pass records the hidden state where each other model
  departs from it (a forward pre-hook), and that model runs only its own layers from there::

      reference:  embed -> layer 0 .. k-1 -> layer k .. L-1 -> norm -> lm_head   (log-probs)
                                          \\
      reward model:                         -> layer k' .. L-1' -> norm' -> score   (k' = first own layer)

The results are those of the full forward passes (the same operations on the same numbers). Which
layers are shared is decided once, by comparing the weights (``torch.equal``), never assumed.
``--share-trunk false`` turns it off.

Supported for backbones that take ``inputs_embeds`` unchanged (Llama, Mistral, Qwen2/3, Phi-3,
SmolLM); other architectures simply run every model in full.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch

from ppolm import models, prefix
from ppolm.prefix import SUPPORTED


def supported(model: torch.nn.Module) -> bool:
    return getattr(models._unwrap(model).config, "model_type", None) in SUPPORTED and models.stack(model) is not None


def plain_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """A module's base parameters by their names without peft: LoRA factors left out, ``.base_layer``
    dropped (so a peft-wrapped layer and a plain one name the same weights alike)."""
    return {n.replace(".base_layer", ""): p for n, p in module.named_parameters() if "lora_" not in n}


def is_frozen_plain(module: torch.nn.Module) -> bool:
    """True when the module trains nothing and carries no adapter: it computes what its base weights do."""
    return not any(p.requires_grad or "lora_" in n for n, p in module.named_parameters())


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pa, pb = plain_parameters(a), plain_parameters(b)
    return pa.keys() == pb.keys() and all(
        pa[k].dtype == pb[k].dtype and pa[k].shape == pb[k].shape and pa[k].device == pb[k].device
        and torch.equal(pa[k], pb[k]) for k in pa)


def shared_prefix(reference: torch.nn.Module, other: torch.nn.Module) -> int:
    """How many leading decoder layers (with the embedding) of ``other`` equal the reference's base
    weights; ``L`` when every layer does (the final norms may still differ); 0 when even the
    embedding differs or the architectures do not match."""
    if not (supported(reference) and supported(other)):
        return 0
    (rb, rl), (ob, ol) = models.stack(reference), models.stack(other)  # type: ignore[misc]
    if len(rl) != len(ol) or not same_weights(rb.embed_tokens, ob.embed_tokens):
        return 0
    k = 0
    while k < len(rl) and same_weights(rl[k], ol[k]):
        k += 1
    return k


def alias(reference: torch.nn.Module, other: torch.nn.Module, k: int) -> int:
    """Make ``other``'s embedding and first ``k`` layers use the reference's parameter tensors (both
    frozen and equal): one copy in memory. Returns the bytes freed."""
    (rb, rl), (ob, ol) = models.stack(reference), models.stack(other)  # type: ignore[misc]
    freed = 0
    for mine, theirs in [(ob.embed_tokens, rb.embed_tokens)] + [(ol[i], rl[i]) for i in range(k)]:
        src = plain_parameters(theirs)
        for name, p in list(mine.named_parameters()):
            owner_name, _, leaf = name.rpartition(".")
            owner = mine.get_submodule(owner_name) if owner_name else mine
            if owner._parameters[leaf] is not src[name]:
                freed += p.numel() * p.element_size()
                owner._parameters[leaf] = src[name]
    if freed:
        # Weights loaded from safetensors are views of one memory-mapped file: while any of them is
        # alive (the own top layers, the head) the whole mapping stays, and every page read to compare
        # stays resident. Own copies of the rest let the mapping go.
        shared = {id(p) for p in reference.parameters()}
        with torch.no_grad():
            for mod in other.modules():
                for p in list(mod._parameters.values()):
                    if p is not None and id(p) not in shared:
                        p.data = p.data.clone()
        gc.collect()
    return freed


def policy_prefix(policy: torch.nn.Module) -> int:
    """Leading layers of a LoRA policy that carry no adapter and train nothing: there the policy is
    its own reference (adapter disabled), so its forward can start from the reference pass's hidden."""
    if not supported(policy):
        return 0
    backbone, layers = models.stack(policy)  # type: ignore[misc]
    if not is_frozen_plain(backbone.embed_tokens):
        return 0
    k = 0
    while k < len(layers) and is_frozen_plain(layers[k]):
        k += 1
    return k


class Recorder:
    """Records, during a forward pass of the reference, the hidden state entering each chosen layer
    (index ``L`` = entering the final norm)."""

    def __init__(self, model: torch.nn.Module, starts: set[int]):
        self.backbone, self.layers = models.stack(model)  # type: ignore[misc]
        self.starts = {k for k in starts if 0 < k <= len(self.layers)}

    @contextlib.contextmanager
    def record(self) -> Iterator[dict[int, torch.Tensor]]:
        found: dict[int, torch.Tensor] = {}
        handles = []
        for k in self.starts:
            mod = self.layers[k] if k < len(self.layers) else self.backbone.norm

            def hook(_m: torch.nn.Module, args: tuple[Any, ...], k: int = k) -> None:
                h = prefix.captured(id(found) + k, args[0].detach())
                if h is not None:
                    found[k] = h

            handles.append(mod.register_forward_pre_hook(hook))
        try:
            yield found
        finally:
            for h in handles:
                h.remove()


def run_from(model: torch.nn.Module, start: int, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The backbone's last hidden state (after its final norm), running only layers ``start ..`` on
    ``hidden``, the state entering layer ``start``: (B, T, d). Grad flows if enabled."""
    backbone, _ = models.stack(model)  # type: ignore[misc]
    pos = models.position_ids_from_mask(attention_mask)
    with top_layers(backbone, start):
        return backbone(inputs_embeds=hidden, attention_mask=attention_mask, position_ids=pos,
                        use_cache=False).last_hidden_state


@contextlib.contextmanager
def top_layers(backbone: torch.nn.Module, start: int) -> Iterator[None]:
    """For the duration, the backbone holds only its layers ``start ..`` (the same modules), with its
    config's layer count and per-layer types to match."""
    cfg = backbone.config
    saved = (backbone._modules["layers"], cfg.num_hidden_layers, getattr(cfg, "layer_types", None))
    backbone._modules["layers"] = torch.nn.ModuleList(list(saved[0])[start:])
    cfg.num_hidden_layers = len(saved[0]) - start
    if isinstance(saved[2], list):
        cfg.layer_types = saved[2][start:]
    try:
        yield
    finally:
        backbone._modules["layers"], cfg.num_hidden_layers = saved[0], saved[1]
        if isinstance(saved[2], list):
            cfg.layer_types = saved[2]
