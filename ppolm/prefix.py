"""Prompts that begin alike share one forward pass over their common beginning.

Chat templates put the same tokens in front of every prompt (SmolLM2's adds a 21-token system
prompt, and ``<|im_start|>user`` follows); a prompt set built from one template shares more. On the
peer benchmark's prompts the first 28 of 36-37 prompt tokens are the same in every row, 40 % of
each 69-token sequence. Every layer of a causal model computes, at those positions, the same hidden
states in every row (same tokens, same positions, nothing earlier to attend to), so ppolm computes
them once, at batch size 1, and lets each row's remaining tokens attend to them through the model's
key/value cache (expanded to the batch). Gradients flow through the shared part (summed over rows,
as autograd does for any broadcast), so the policy's training forward uses it too.

The rollout layout does not change: a prompt is left-padded, so its common beginning starts at a
different column in each row. :class:`PrefixSplit` holds, per row, the permutation that brings the
shared columns first (``perm``) and its inverse (``inv``); :func:`forward` runs the two passes and
returns the hidden states in the rollout's own layout, (B, T, d), as a plain forward would, up to
float rounding (the same operations on the same numbers, summed in another order).

Forward pre-hooks (the trunk :class:`ppolm.trunk.Recorder`, the critic's tap) fire once per pass;
:func:`captured` stitches the two captures back into the (B, T, d) layout.

Used for the backbones of :data:`SUPPORTED` with a Hugging Face ``DynamicCache``; other
models run the plain forward. ``--share-prefix false`` turns it off.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field

import torch

from ppolm import models

# Backbones that ppolm runs in pieces: their forward feeds ``inputs_embeds`` to the first layer as
# they are (so a recorded hidden state can be injected there, ppolm/trunk.py; Gemma, for one,
# scales them by sqrt(d) first) and continues from a ``DynamicCache`` (this module).
SUPPORTED = {"llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3"}

MIN_SHARED = 8
"""Shorter common beginnings are not worth a second pass (a pass has a fixed cost per layer)."""

_ACTIVE: contextvars.ContextVar[PrefixSplit | None] = contextvars.ContextVar("ppolm_prefix_split", default=None)


@dataclass
class PrefixSplit:
    length: int
    """c: the number of leading real prompt tokens that every row has in common."""
    perm: torch.Tensor
    """(B, T): for row i, the original columns in [shared | the rest] order."""
    inv: torch.Tensor
    """(B, T): the inverse permutation (original column -> position in [shared | rest] order)."""
    stage: str = "off"
    pending: dict[int, torch.Tensor] = field(default_factory=dict)

    def select(self, idx: torch.Tensor) -> PrefixSplit:
        return PrefixSplit(self.length, self.perm[idx], self.inv[idx])

    def usable(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` can run this split (:func:`usable`)."""
        return usable(model)

    def forward(self, backbone: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The backbone's last hidden state over ``ids`` with this split (:func:`forward`)."""
        return forward(backbone, ids, mask, self)

    def stitch(self, shared: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        """(1, c, ...) shared + (B, T - c, ...) rest, in [shared | rest] order -> (B, T, ...) original layout."""
        b = rest.shape[0]
        both = torch.cat([shared.expand(b, *shared.shape[1:]), rest], dim=1)
        idx = self.inv.view(*self.inv.shape, *([1] * (both.dim() - 2))).expand(-1, -1, *both.shape[2:])
        return both.gather(1, idx)


def find(query: torch.Tensor, query_mask: torch.Tensor, width: int) -> PrefixSplit | None:
    """The split of a rollout whose prompts ``query`` (B, P) are left-padded, for sequences of ``width``
    columns (P + R); None when the rows share fewer than MIN_SHARED leading tokens. At least one
    token of every prompt stays out of the shared part: the last prompt position predicts the first
    response token, and each row must keep it."""
    b, p = query.shape
    if b < 2:
        return None
    pads = (query_mask == 0).long().sum(1)  # (B,) left pads per row
    lengths = p - pads
    limit = int(lengths.min()) - 1
    if limit < MIN_SHARED:
        return None
    cols = pads[:, None] + torch.arange(limit, device=query.device)[None, :]  # (B, limit)
    tokens = query.gather(1, cols)
    same = (tokens == tokens[:1]).all(0)  # (limit,)
    c = int(same.long().cumprod(0).sum())
    if c < MIN_SHARED:
        return None
    ar = torch.arange(width, device=query.device)[None, :].expand(b, -1)
    # sort key: shared columns first (in order), then the rest in their original order
    shared = (ar >= pads[:, None]) & (ar < pads[:, None] + c)
    key = torch.where(shared, ar - width, ar)
    perm = key.argsort(1)
    inv = perm.argsort(1)
    return PrefixSplit(c, perm, inv)


def run(module: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, split: PrefixSplit,
        **kwargs: object) -> tuple[object, object, torch.Tensor, torch.Tensor]:
    """The two passes of ``module`` (a backbone, or a causal LM for sampling's prefill) over ``ids``
    (B, T): the shared beginning once (batch 1), then every row's rest attending to it through the
    key/value cache. Returns both outputs and the attention mask and position ids of the
    [shared | rest] layout (B, T), which a decode loop continues from."""
    c = split.length
    b = ids.shape[0]
    rest_mask = mask.gather(1, split.perm[:, c:])
    full_mask = torch.cat([torch.ones(b, c, dtype=mask.dtype, device=mask.device), rest_mask], dim=1)
    pos = models.position_ids_from_mask(full_mask)
    token = _ACTIVE.set(split)
    try:
        split.stage = "shared"
        first = module(input_ids=ids[:1].gather(1, split.perm[:1, :c]), position_ids=pos[:1, :c], use_cache=True,
                       **kwargs)
        first.cache.batch_repeat_interleave(b)
        split.stage = "rest"
        out = module(input_ids=ids.gather(1, split.perm[:, c:]), attention_mask=full_mask, position_ids=pos[:, c:],
                     cache=first.cache, use_cache=True, **kwargs)
    finally:
        split.stage = "off"
        split.pending.clear()
        _ACTIVE.reset(token)
    return first, out, full_mask, pos


def forward(backbone: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, split: PrefixSplit) -> torch.Tensor:
    """The backbone's last hidden state (B, T, d) in the layout of ``ids``, its shared beginning run
    once (batch 1) and the rest of every row attending to it through the key/value cache."""
    first, out, _, _ = run(backbone, ids, mask, split)
    return split.stitch(first.last_hidden_state, out.last_hidden_state)  # type: ignore[attr-defined]


def captured(key: int, x: torch.Tensor) -> torch.Tensor | None:
    """For a forward pre-hook: the hidden state to keep, (B, T, d) in the rollout layout. During the
    shared pass of :func:`forward` the capture is held back (None), and stitched to the rest's."""
    split = _ACTIVE.get()
    if split is None or split.stage == "off":
        return x
    if split.stage == "shared":
        split.pending[key] = x
        return None
    shared = split.pending.pop(key, None)
    return x if shared is None else split.stitch(shared, x)


def usable(model: torch.nn.Module) -> bool:
    """Whether ``model``'s backbone takes a key/value cache as :func:`forward` needs (supported types)."""
    return getattr(models._unwrap(model).config, "model_type", None) in SUPPORTED

