"""Rollout: batched sampling from the policy, and the forward passes that read a rollout back.

Layout of a rollout (OpenAI details 2 and 3): prompts are LEFT-padded to width P, responses are
RIGHT-padded to width R, so ``input_ids = [query | response]`` has shape (B, P + R) and every
response starts at column P. Position ids come from the attention mask, so padding never shifts
positions. Everything after a response's first EOS is padding and masked out of every loss.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ppolm import core, prefix, trunk
from ppolm.models import head_weight_fp32, output_logits, position_ids_from_mask, scalar_forward
from ppolm.prefix import PrefixSplit


@dataclass
class Rollout:
    query: torch.Tensor
    """(B, P) prompt ids, left-padded with PAD."""
    query_mask: torch.Tensor
    """(B, P) 1 on real prompt tokens."""
    response: torch.Tensor
    """(B, R) sampled ids, right-padded with PAD after the first EOS."""
    response_mask: torch.Tensor
    """(B, R) 1 on real response tokens, the EOS included."""
    ended: torch.Tensor
    """(B,) bool: the response emitted EOS within R tokens."""
    split: PrefixSplit | None = None
    """The prompts' common beginning, run once per forward pass (ppolm/prefix.py); None: plain passes."""
    sample_logprobs: torch.Tensor | None = None
    """(B, R) float32: each sampled token's log-prob as the sampler computed it (logits / temperature,
    before top-k/top-p), 0 on padding; PPO compares it with its recomputed old log-probs."""

    @property
    def input_ids(self) -> torch.Tensor:  # (B, P + R)
        return torch.cat([self.query, self.response], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:  # (B, P + R)
        return torch.cat([self.query_mask, self.response_mask], dim=1)

    @property
    def lengths(self) -> torch.Tensor:  # (B,) real response tokens
        return self.response_mask.sum(1)

    def select(self, idx: torch.Tensor) -> Rollout:
        return Rollout(self.query[idx], self.query_mask[idx], self.response[idx], self.response_mask[idx],
                       self.ended[idx], None if self.split is None else self.split.select(idx),
                       None if self.sample_logprobs is None else self.sample_logprobs[idx])

    def share_prefix(self) -> Rollout:
        """Find the common beginning of the prompts, for the forward passes over this rollout."""
        self.split = prefix.find(self.query, self.query_mask, self.query.shape[1] + self.response.shape[1])
        return self


@dataclass
class Experience:
    """One batch of PPO experience: a rollout and everything computed on it before the update
    (B rows, R response columns; P + R columns in all). Built by :meth:`ppolm.ppo_trainer.PPOTrainer.step`
    (steps 1-5) and read by its update (step 6)."""

    roll: Rollout
    """The sampled batch."""
    mask: torch.Tensor
    """(B, R) float: 1 on real response tokens (the EOS included), 0 on padding."""
    ref_logprobs: torch.Tensor
    """(B, R) the frozen reference's log-probs of the sampled tokens."""
    old_logprobs: torch.Tensor
    """(B, R) the rollout policy's log-probs (PPO's importance-ratio denominator)."""
    entropy: torch.Tensor | None
    """(B, R) the rollout policy's entropy per token (for the metric), or None."""
    values: torch.Tensor
    """(B, R) the critic's values before each response token, 0 on padding; all 0 without a critic
    (``--advantage`` other than gae)."""
    scores: torch.Tensor
    """(B,) the reward: the sources' total with the missing-EOS and length penalties."""
    kl: torch.Tensor
    """(B, R) per-token KL estimate to the reference, 0 on padding."""
    non_score: torch.Tensor
    """(B, R) the KL part of the reward (-beta * kl), whether it enters the reward or the loss."""
    rewards: torch.Tensor
    """(B, R) per-token rewards: -beta * kl, plus the score on each response's last real token."""
    advantages: torch.Tensor
    """(B, R) GAE advantages (whitened over the batch when asked), or those of the ``--advantage``
    estimator (:func:`ppolm.advantages.critic_free_advantages`)."""
    returns: torch.Tensor
    """(B, R) value targets: the unwhitened advantages plus the values (the advantages themselves
    without a critic, unused)."""
    critic_input: torch.Tensor | None = None
    """(B, P + R, d) the frozen trunk's hidden state that feeds a top-layers critic, or None."""
    policy_entering: torch.Tensor | None = None
    """(B, P + R, d) the state entering a LoRA policy's first adapted layer, or None."""
    first_pass: tuple[torch.Tensor, ...] | None = None
    """(log-probs, entropy, values) of the rollout pass still holding its graph (one minibatch per
    epoch: the first epoch reuses it), or None. The update drops it after the first epoch."""
    value_units: tuple[float, float] = (0.0, 1.0)
    """(center, unit): the critic's output v counts as the value (v - center) / unit, in the units
    of the returns. (0, 1) but for a critic that keeps the reward model's head, which predicts the
    scores as they come; ``values`` are already in the returns' units."""


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists -> (ids, mask), each (B, max_len)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def truncate_after_eos(response: torch.Tensor, eos_id: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]:
    """Keep tokens up to and including the first EOS; pad the rest.

    response (B, R) -> (response (B, R), mask (B, R), ended (B,)).
    """
    is_eos = response == eos_id
    ended = is_eos.any(1)
    # position of the first EOS (R where none): tokens at positions <= it are real
    first = torch.where(ended, is_eos.int().argmax(1), torch.full_like(ended, response.shape[1], dtype=torch.long))
    pos = torch.arange(response.shape[1], device=response.device)[None, :]
    mask = (pos <= first[:, None]).long()
    return torch.where(mask.bool(), response, torch.full_like(response, pad_id)), mask, ended


SMALL_ROWS = 64
"""Up to this many rows, a CPU linear layer runs as (W @ x.T).T (see :func:`small_batch_linears`)."""


def _small_linear(mod: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows > SMALL_ROWS or (torch.is_grad_enabled() and (x.requires_grad or mod.weight.requires_grad)):
        return torch.nn.functional.linear(x, mod.weight, mod.bias)
    y = (mod.weight @ x.reshape(rows, x.shape[-1]).t()).t()
    if mod.bias is not None:
        y = y + mod.bias
    return y.reshape(*x.shape[:-1], y.shape[-1]).contiguous()


@contextlib.contextmanager
def small_batch_linears(model: torch.nn.Module) -> Iterator[None]:
    """While sampling on a CPU, compute each linear layer of ``model`` on a few rows as (W @ x.T).T.

    A decode step multiplies a handful of rows (one token per sequence) by every weight matrix, and
    the CPU GEMM kernels behind ``F.linear`` handle that shape poorly: on the 2-core AVX2 machines
    ppolm is developed on, the transposed product is 1.2-1.8x faster per layer and the LM head
    (49152 x 576) 1.8x faster, which makes sampling ~30% faster. Same maths, other summation order;
    no effect on training (grad-enabled calls and calls with more than ``SMALL_ROWS`` rows take the
    usual path) and none off the CPU. Layers that :mod:`ppolm.cpu_linear` routes to oneDNN (its
    ``Linear`` class, not ``nn.Linear``) keep that route: oneDNN beats both on these shapes.
    """
    patched = []
    if next(model.parameters()).device.type == "cpu":
        for mod in model.modules():
            if type(mod) is torch.nn.Linear:  # exact type: peft's LoRA wrappers call their own base layer
                mod.forward = functools.partial(_small_linear, mod)  # instance attribute shadows the method
                patched.append(mod)
    try:
        yield
    finally:
        for mod in patched:
            del mod.forward


@torch.no_grad()
def generate(policy: torch.nn.Module, prompts: list[list[int]], *, pad_id: int, eos_id: int, max_new_tokens: int,
             temperature: float, top_p: float = 1.0, top_k: int = 0, ignore_eos: bool = False,
             share_prefix: bool = True, greedy: bool = False) -> Rollout:
    """Sample one response per prompt with the KV cache, then mask after EOS.

    ppolm's own decode loop over the model's forward (any Hugging Face causal LM that returns a
    cache): the prompts' common beginning is prefilled once (ppolm/prefix.py; ``share_prefix``), and each token is
    drawn by inverting the CDF with one uniform number per row (``torch.multinomial`` costs ~10 ms
    per step on a 49k vocabulary on a CPU). Top-k and top-p filter as Hugging Face's warpers do.
    Stops when every row has emitted EOS. With ``ignore_eos`` EOS is never drawn and every response
    is exactly ``max_new_tokens`` long (TRL's PPO trainer without a stop token), which makes the
    work per step fixed for benchmarks. ``greedy``: the most likely token at each step (argmax, no
    random draw; top-k/top-p ignored), as ReMax's baseline response.
    """
    device = next(policy.parameters()).device
    query, query_mask = left_pad(prompts, pad_id, device)
    with small_batch_linears(policy):
        response, sample_logprobs = _decode(policy, query, query_mask, eos_id=eos_id, pad_id=pad_id, max_new_tokens=max_new_tokens,
                           temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=ignore_eos,
                           share_prefix=share_prefix, greedy=greedy)
    if ignore_eos:
        mask = torch.ones_like(response)
        ended = torch.zeros(response.shape[0], dtype=torch.bool, device=device)
    else:
        response, mask, ended = truncate_after_eos(response, eos_id, pad_id)
    return Rollout(query, query_mask, response, mask, ended, sample_logprobs=sample_logprobs * mask)


def _decode(policy: torch.nn.Module, query: torch.Tensor, query_mask: torch.Tensor, *, eos_id: int, pad_id: int,
            max_new_tokens: int, temperature: float, top_p: float, top_k: int, ignore_eos: bool,
            share_prefix: bool = True, greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N) sampled ids, N <= max_new_tokens, PAD after a row's EOS; and (B, N) their log-probs
    under logits / temperature."""
    b = query.shape[0]
    trunk = backbone(policy)
    head_w = head_weight_fp32(policy)  # fp32 once per rollout, not once per token
    split = prefix.find(query, query_mask, query.shape[1]) if share_prefix and prefix.usable(policy) else None
    if split is not None:  # prefill the common beginning once, then each row's own prompt tokens
        _, out, mask, pos = prefix.run(trunk, query, query_mask, split)
    else:
        mask = query_mask
        pos = position_ids_from_mask(mask)
        out = trunk(input_ids=query, attention_mask=mask, position_ids=pos, use_cache=True)
    cache = out.cache
    if cache is None:
        raise ValueError(f"{type(policy).__name__} returned no key/value cache; ppolm samples with the cache")
    next_pos = pos[:, -1:] + 1
    done = torch.zeros(b, dtype=torch.bool, device=query.device)
    tokens, logps = [], []
    for t in range(max_new_tokens):
        # the same fp32 output path as every log-prob PPO recomputes (models.output_logits)
        logits = output_logits(policy, out.last_hidden_state[:, -1], head_w)
        if ignore_eos:
            logits[:, eos_id] = -math.inf
        tok = logits.argmax(-1) if greedy else sample_next(logits, temperature, top_p, top_k)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        tokens.append(tok)
        logps.append(core.logprobs_from_logits(logits, tok, temperature))
        done |= tok == eos_id
        if t == max_new_tokens - 1 or (done.all() and not ignore_eos):
            break
        mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype, device=mask.device)], dim=1)
        out = trunk(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, cache=cache,
                    use_cache=True)
        next_pos = next_pos + 1
    return torch.stack(tokens, dim=1), torch.stack(logps, dim=1)


def sample_next(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """One token per row from softmax(logits / temperature) (B, V) -> (B,), after top-k (keep the k
    largest; 0 = off) and top-p (keep the smallest set of largest probabilities whose mass reaches p;
    1 = off; the most likely token always stays). Inverse-CDF sampling: the first index whose
    cumulative probability reaches u ~ U(0, 1], so a token of probability 0 is never drawn."""
    if temperature != 1.0:
        logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    cdf = probs.cumsum(-1)
    u = (1.0 - torch.rand(probs.shape[0], 1, device=probs.device)) * cdf[:, -1:]
    return (cdf < u).sum(-1).clamp(max=probs.shape[-1] - 1)


def backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The transformer trunk of a causal LM (through a peft wrapper): hidden states, no head."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, base.base_model_prefix)


def response_hidden(model: torch.nn.Module, roll: Rollout, start: int = 0,
                    entering: torch.Tensor | None = None) -> torch.Tensor:
    """Last hidden states at the positions that predict each response token: (B, R, d).

    Position P - 1 + t predicts response token t, so only R of the P + R positions are kept
    before the LM head (no logits for prompt tokens: less time and memory). With ``entering``
    (B, P + R, d), the hidden state entering layer ``start`` recorded by the reference pass
    (ppolm/trunk.py), only layers ``start ..`` run. With ``roll.split``, the prompts' common
    beginning runs once (ppolm/prefix.py).
    """
    ids, mask = roll.input_ids, roll.attention_mask
    if entering is not None:
        hidden = trunk.run_from(model, start, entering, mask)
    elif roll.split is not None and prefix.usable(model):
        hidden = prefix.forward(backbone(model), ids, mask, roll.split)
    else:
        pos = position_ids_from_mask(mask)
        hidden = backbone(model)(input_ids=ids, attention_mask=mask, position_ids=pos,
                                 use_cache=False).last_hidden_state
    p, r = roll.query.shape[1], roll.response.shape[1]
    return hidden[:, p - 1:p - 1 + r]


def tempered_logits(model: torch.nn.Module, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
    """The model's logits / temperature at the given hidden states (B, R, d) -> (B, R, V), float32,
    through the model's own output path in fp32 (:func:`ppolm.models.output_logits`), as the sampler
    computes them. The rows are made one contiguous (B*R, d) matrix first: a strided 3-D input would
    send the head through a batched matmul with the weight expanded per row (2-3x slower on a CPU)."""
    b, r, d = hidden.shape
    logits = output_logits(model, hidden.reshape(b * r, d))
    if temperature != 1.0:
        logits = logits / temperature
    return logits.view(b, r, -1)


def logprobs(model: torch.nn.Module, roll: Rollout, temperature: float, start: int = 0,
             entering: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token log-probs only (B, R): for the frozen reference (and the policy in evaluation).
    ``start``/``entering``: as in ``response_hidden``."""
    logits = tempered_logits(model, response_hidden(model, roll, start, entering), temperature)
    return core.logprobs_from_logits(logits, roll.response)


def values(critic: torch.nn.Module, roll: Rollout) -> torch.Tensor:
    """Critic values V(s_t) at the state before each response token: (B, R), float32."""
    v = scalar_forward(critic, roll.input_ids, roll.attention_mask, split=roll.split)  # (B, P + R)
    p, r = roll.query.shape[1], roll.response.shape[1]
    return v[:, p - 1:p - 1 + r].float()
