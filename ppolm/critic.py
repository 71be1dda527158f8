"""The critic (value model) as a few trainable top layers on a frozen trunk that is already in memory.

A separate critic is usually a full copy of the reward model (or of the policy), trained end to end:
one more model's weights, gradients and Adam states, and one more forward and backward pass over
every layer each step. But a critic initialised from a frozen model whose *lower* layers are then
kept frozen computes, in those layers, exactly what the frozen model computes. So ppolm keeps only
the critic's top ``n`` layers (plus the final norm and the value head) and feeds them the hidden
state the frozen model already produced on the same tokens:

    reward model (frozen):  embed -> layer 0 .. layer L-n-1 -> layer L-n .. L-1 -> norm -> score
                                                          \\
    critic (trained):                                       -> layer L-n' .. L-1' -> norm' -> value

The hidden state entering layer ``L - n`` is read by a forward pre-hook on the frozen model (a
*tap*) while it scores the batch (the reward model) or computes reference log-probs (the reference
policy), so the shared trunk costs no extra memory and no extra compute. ``n = 0`` (or ``n >= L``)
gives the classic full separate critic.

Supported for backbones with ``layers`` (a ModuleList) and ``norm`` attributes (Llama, Mistral,
Qwen, Gemma, Phi-3, SmolLM ...); for other architectures the critic falls back to a full copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ppolm import models, prefix


class Tap:
    """Captures the hidden state entering one decoder layer of a frozen model, while active (the
    last capture wins; clear ``hidden`` before a new batch)."""

    def __init__(self, layer: torch.nn.Module):
        self.layer = layer
        self.hidden: torch.Tensor | None = None

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        def hook(_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            h = prefix.captured(id(self), args[0].detach())
            if h is not None:
                self.hidden = h

        handle = self.layer.register_forward_pre_hook(hook)
        try:
            yield
        finally:
            handle.remove()


class TrunkCritic(torch.nn.Module):
    """The top ``n`` layers, final norm and value head of a scalar model, fed from a frozen trunk.

    Built from a freshly loaded scalar model (so its top layers start as the source's, in fp32) whose
    lower layers and embedding are dropped; ``forward(hidden, mask)`` gives values (B, T), float32.
    """

    def __init__(self, scalar_model: torch.nn.Module, n: int):
        super().__init__()
        found = models.stack(scalar_model)
        if found is None:
            raise ValueError("architecture without backbone.layers/backbone.norm")
        backbone, layers = found
        self.total_layers = len(layers)
        self.n = n
        # keep only the top n layers; the embedding is never used (hidden states come from the tap)
        backbone.layers = torch.nn.ModuleList(list(layers)[-n:])
        d = scalar_model.config.hidden_size
        backbone.embed_tokens = torch.nn.Embedding(1, d).requires_grad_(False)
        cfg = backbone.config
        cfg.num_hidden_layers = n
        if isinstance(getattr(cfg, "layer_types", None), list):
            cfg.layer_types = cfg.layer_types[-n:]
        self.model = scalar_model

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        inner = models._unwrap(self.model)
        backbone = getattr(inner, inner.base_model_prefix)
        pos = models.position_ids_from_mask(attention_mask)
        dtype = next(inner.score.parameters()).dtype
        out = backbone(inputs_embeds=hidden.to(dtype), attention_mask=attention_mask, position_ids=pos,
                       use_cache=False)
        return models.scalar_head(inner.score, out.last_hidden_state)

    def full_model(self, source: str, **load: Any) -> torch.nn.Module:
        """The whole critic as one Hugging Face sequence-classification model: the source's lower
        layers (as loaded from disk, unchanged by training) with this critic's top layers, norm and head."""
        full = models.load_scalar_model(source, head_init="value", **load)
        backbone, layers = models.stack(full)  # type: ignore[misc]
        mine, my_layers = models.stack(self.model)  # type: ignore[misc]
        with torch.no_grad():
            for dst, src in zip(list(layers)[-self.n:], my_layers):
                dst.load_state_dict(src.state_dict())
            backbone.norm.load_state_dict(mine.norm.state_dict())
            models._unwrap(full).score.load_state_dict(models._unwrap(self.model).score.state_dict())
        return full


def build(source_dir: str | Path, frozen: torch.nn.Module, n: int, *, head_init: str,
          **load: Any) -> tuple[TrunkCritic, Tap] | None:
    """A TrunkCritic from ``source_dir`` tapping the frozen model ``frozen`` (the same weights, in
    memory), or None when ``n`` covers every layer or the architecture is not supported."""
    found = models.stack(frozen)
    if n <= 0 or found is None or n >= len(found[1]):
        return None
    scalar = models.load_scalar_model(source_dir, head_init=head_init, **load)  # type: ignore[arg-type]
    own = models.stack(scalar)
    if own is None or len(own[1]) != len(found[1]):
        return None
    critic = TrunkCritic(scalar, n)
    return critic, Tap(found[1][critic.total_layers - n])
