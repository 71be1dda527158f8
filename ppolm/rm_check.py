"""On-policy validation of a reward model: does the proxy still agree with the judge on what the
policy writes *now*?

A reward model is fitted to comparisons of the starting policy's answers. PPO then moves the policy
towards answers the proxy scores highly, and those drift away from the data the proxy was fitted on:
its held-out accuracy, measured once on the original pairs, says nothing about them. Gao, Schulman &
Hilton (2022, https://arxiv.org/abs/2210.10760) show the consequence: the proxy reward keeps rising
with the KL from the start while the true reward peaks and falls. This module measures the proxy on
the current policy's own answers, as the Llama 2 team did by hand between rounds of RLHF (Touvron et
al. 2023, https://arxiv.org/abs/2307.09288, section 3.2):

1. pick ``n_pairs`` prompts (a seeded shuffle of ``prompts``, repeated when more pairs than prompts
   are asked) and sample two answers to each from the current policy (one ``sampler`` call);
2. skip the pairs that cannot be compared: two identical answers, or an empty one;
3. ask the judge which answer it prefers (:meth:`ppolm.judge.Judge.label`);
4. count how often the proxy scores the judge's choice higher.

Ties. A pair the judge calls a tie (label 0.5: equal scores, or a pairwise probability of exactly
0.5 without label noise) has no preference to agree with; it is left out of the accuracy and counted
in ``rm/onpolicy_ties``. A proxy that gives both answers the same score (to the last bit) cannot tell
them apart and earns half a point, as a coin flip would, so a proxy that collapsed to a constant
reads 0.5 (chance), not 0. The held-out accuracy below follows the same rule.

Metrics (``metrics`` of :class:`CheckResult`):

* ``rm/onpolicy_accuracy``: agreement of the proxy with the judge over the compared pairs;
* ``rm/onpolicy_accuracy_se``: its binomial standard error ``sqrt(p (1 - p) / n)``;
* ``rm/onpolicy_pairs``: ``n``, the pairs compared (ties and skipped pairs left out);
* ``rm/onpolicy_ties``, ``rm/onpolicy_skipped``: pairs the judge tied, pairs not shown to it;
* ``rm/onpolicy_judge_calls``: comparisons this check asked of the judge (its cost);
* ``rm/heldout_accuracy``, ``rm/heldout_accuracy_se``, ``rm/heldout_pairs``: the same on the
  original held-out pairs (``chosen`` is the preferred answer), when they are given;
* ``time/rm_check``: seconds the check took.

Without any compared pair the accuracy and its error are left out (there is nothing to measure).
With label noise (a judge temperature above 0) the labels themselves disagree with the judge's
scores on some pairs, so even a perfect proxy stays below 1: compare the accuracy with its own
starting value (the ``reward_model_drift`` alarm of :mod:`ppolm.alarms` does), not with 1.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ppolm import distributed, sft
from ppolm import rollout as ro
from ppolm.data import encode_prompt
from ppolm.errors import PPOLMError
from ppolm.judge import Judge
from ppolm.rewards import ensemble
from ppolm.runtime import seeded_rng

Sampler = Callable[[list[Any]], list[str]]
"""prompts -> one sampled completion (text) per prompt, from the current policy."""
Scorer = Callable[[list[Any], list[str]], torch.Tensor]
"""(prompts, completions) -> (N,) proxy scores (normalised, higher is better)."""


@dataclass
class LabelledPair:
    """Two answers of the policy to one prompt and the judge's label (1 = a preferred, 0 = b, 0.5 = tie)."""

    prompt: Any
    a: str
    b: str
    label: float

    def ordered(self) -> tuple[str, str]:
        """(chosen, rejected) by the label; only for pairs that are not ties."""
        return (self.a, self.b) if self.label > 0.5 else (self.b, self.a)


@dataclass
class FreshPairs:
    """The pairs of one round of sampling and labelling, with what was left out and what it cost."""

    pairs: list[LabelledPair] = field(default_factory=list)
    """The pairs the judge labelled, ties included, in the order sampled."""
    skipped: int = 0
    """Pairs not shown to the judge: two identical answers, or an empty one."""
    judge_calls: int = 0
    """Comparisons asked of the judge."""
    other: int = 0
    """Pairs sampled with one answer from the other sampler (the starting policy, in a refresh)."""

    @property
    def decided(self) -> list[LabelledPair]:
        """The pairs with a preference (the judge did not call a tie)."""
        return [p for p in self.pairs if p.label != 0.5]


def pick_prompts(prompts: Sequence[Any], n: int, rng: random.Random) -> list[int]:
    """Indices of ``n`` prompts: a seeded shuffle of all of them, another after it when ``n`` is larger."""
    order: list[int] = []
    while len(order) < n:
        order += rng.sample(range(len(prompts)), len(prompts))
    return order[:n]


def sample_pairs(prompts: Sequence[Any], sampler: Sampler, judge: Judge, n_pairs: int, rng: random.Random,
                 columns: dict[str, list[Any]] | None = None, *, other: Sampler | None = None,
                 other_share: float = 0.0) -> FreshPairs:
    """Sample two answers to each of ``n_pairs`` prompts (one ``sampler`` call on the picked prompts
    twice over: the first half gives the ``a`` answers, the second the ``b`` ones) and have ``judge``
    label every comparable pair; ``rng`` picks the prompts and then draws the labels. ``columns``: the
    prompts file's other columns (one value per prompt), passed on to the judge.

    ``other``, ``other_share``: the last ``round(other_share * n_pairs)`` pairs set one answer of
    ``sampler`` against one of ``other`` (e.g. the starting policy), in an order drawn from ``rng``
    (a judge with a position bias then favours neither source); ``sampler`` is called on
    the picked prompts and the first ones again, ``other`` once on the last ones."""
    if not prompts:
        raise PPOLMError("no prompts to sample pairs on; give the training (or held-out) prompts")
    if n_pairs < 1:
        raise PPOLMError(f"the number of pairs must be at least 1; got {n_pairs}")
    if not 0.0 <= other_share <= 1.0:
        raise PPOLMError(f"the share of pairs against the other sampler must be in [0, 1]; got {other_share}")
    n_other = round(other_share * n_pairs) if other is not None else 0
    picks = pick_prompts(prompts, n_pairs, rng)
    chosen_prompts = [prompts[i] for i in picks]
    n_own = n_pairs - n_other
    out = sampler(chosen_prompts + chosen_prompts[:n_own])
    if n_other:
        out = list(out) + list(other(chosen_prompts[n_own:]))  # type: ignore[misc]
    if len(out) != 2 * n_pairs or not all(isinstance(x, str) for x in out):
        raise PPOLMError(f"the sampler must return one text per prompt; it returned {len(out)} values for "
                         f"{2 * n_pairs} prompts")
    if n_other:  # out[n_pairs + j] for j >= n_own is other's answer: put it first or second at random
        for j in range(n_own, n_pairs):
            if rng.random() < 0.5:
                out[j], out[n_pairs + j] = out[n_pairs + j], out[j]
    keep = [j for j in range(n_pairs)
            if out[j].strip() and out[n_pairs + j].strip() and out[j].strip() != out[n_pairs + j].strip()]
    found = FreshPairs(skipped=n_pairs - len(keep), other=n_other)
    if not keep:
        return found
    before = judge.calls
    cols = {k: [v[picks[j]] for j in keep] for k, v in (columns or {}).items()}

    def label() -> tuple[list[float], Any, int]:
        labels = judge.label([chosen_prompts[j] for j in keep], [out[j] for j in keep],
                             [out[n_pairs + j] for j in keep], rng, cols or None)
        return labels, rng.getstate(), judge.calls

    if distributed.active():  # torchrun: process 0 asks the judge, once; every process gets its answers
        labels, state, calls = distributed.on_main(label)
        rng.setstate(state)
        judge.calls = calls
    else:
        labels = label()[0]
    found.judge_calls = judge.calls - before
    found.pairs = [LabelledPair(chosen_prompts[j], out[j], out[n_pairs + j], lab) for j, lab in zip(keep, labels)]
    return found


def sharded_sampler(sampler: Sampler) -> Sampler:
    """Under torchrun, a sampler whose work is shared: process r of N samples prompts r, r + N, ...
    with its own policy copy and every process gets all the answers, in the prompts' order (every
    process must call it, as FSDP's sharded forward needs). One process: ``sampler`` itself."""

    def sample(prompts: list[Any]) -> list[str]:
        if not distributed.active():
            return sampler(prompts)
        r, w = distributed.rank(), distributed.world_size()
        parts = distributed.gather_objects(list(sampler(prompts[r::w])))
        out: list[Any] = [None] * len(prompts)
        for k, part in enumerate(parts):
            if len(part) != len(range(k, len(prompts), w)):
                raise PPOLMError(f"the sampler of process {k} returned {len(part)} texts for "
                                 f"{len(range(k, len(prompts), w))} prompts; return one per prompt")
            out[k::w] = part
        return out

    return sample


def agreement(preferred: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """(accuracy, binomial standard error) of scores that should rank ``preferred`` over ``other``:
    a strictly higher score is a point, an equal one half a point; (nan, nan) without pairs."""
    n = preferred.numel()
    if n == 0:
        return math.nan, math.nan
    points = (preferred > other).double() + 0.5 * (preferred == other).double()
    p = float(points.mean())
    return p, math.sqrt(p * (1 - p) / n)


def score_pairs(scorer: Scorer, prompts: list[Any], first: list[str], second: list[str]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The proxy's scores of both answers of each pair, in one scorer call: ((P,), (P,))."""
    n = len(prompts)
    s = torch.as_tensor(scorer(prompts + prompts, first + second)).float().flatten().cpu()
    if s.numel() != 2 * n:
        raise PPOLMError(f"the proxy scorer returned {s.numel()} scores for {2 * n} completions; return one each")
    if not torch.isfinite(s).all():
        raise PPOLMError("the proxy reward model gave a non-finite score; check its weights and normalisation")
    return s[:n], s[n:]


@dataclass
class CheckResult:
    metrics: dict[str, float]
    """The ``rm/...`` metrics of the module docstring."""
    fresh: FreshPairs
    """The labelled on-policy pairs (a refresh of the reward model can learn from them)."""


def onpolicy_check(prompts: Sequence[Any], sampler: Sampler, scorer: Scorer, judge: Judge, n_pairs: int,
                   rng: random.Random, *, heldout: Sequence[Any] | None = None,
                   columns: dict[str, list[Any]] | None = None) -> CheckResult:
    """Sample ``n_pairs`` pairs from the current policy, label them with ``judge`` and report how often
    the proxy ``scorer`` agrees (see the module docstring for the steps, the ties and the metrics).
    ``heldout``: the original held-out pairs (:class:`ppolm.pairs.Pair`, chosen preferred), for
    ``rm/heldout_accuracy`` beside the on-policy one."""
    t0 = time.perf_counter()
    fresh = sample_pairs(prompts, sampler, judge, n_pairs, rng, columns)
    decided = fresh.decided
    metrics: dict[str, float] = {"rm/onpolicy_pairs": float(len(decided)),
                                 "rm/onpolicy_ties": float(len(fresh.pairs) - len(decided)),
                                 "rm/onpolicy_skipped": float(fresh.skipped),
                                 "rm/onpolicy_judge_calls": float(fresh.judge_calls)}
    if decided:
        chosen, rejected = zip(*(p.ordered() for p in decided))
        sc, sr = score_pairs(scorer, [p.prompt for p in decided], list(chosen), list(rejected))
        acc, se = agreement(sc, sr)
        metrics.update({"rm/onpolicy_accuracy": acc, "rm/onpolicy_accuracy_se": se})
    if heldout:
        sc, sr = score_pairs(scorer, [p.prompt for p in heldout], [p.chosen for p in heldout],
                             [p.rejected for p in heldout])
        acc, se = agreement(sc, sr)
        metrics.update({"rm/heldout_accuracy": acc, "rm/heldout_accuracy_se": se,
                        "rm/heldout_pairs": float(len(heldout))})
    metrics["time/rm_check"] = time.perf_counter() - t0
    return CheckResult(metrics, fresh)


# ------------------------------------------------------------------------------------ proxy scorers

def reward_model_scorer(rm: Any, *, chat_template: bool = True, max_length: int = 512,
                        batch_size: int = 8) -> Scorer:
    """A :class:`ppolm.rewards.RewardModel` as a scorer: each prompt and completion laid out as
    ``ppolm reward`` trains on them and PPO scores a rollout (chat-templated prompt, response, EOS),
    tokenised by the reward model's own tokenizer; normalised scores (gain and bias applied)."""
    tok = rm.tokenizer

    def score(prompts: list[Any], completions: list[str]) -> torch.Tensor:
        dev = next(rm.model.parameters()).device
        seqs = [sft.encode_response(encode_prompt(p, tok, chat_template), c, tok, max_length, "on-policy check")
                for p, c in zip(prompts, completions)]
        out = []
        for i in range(0, len(seqs), batch_size):
            ids, mask = ro.left_pad(seqs[i:i + batch_size], tok.pad_token_id, dev)
            out.append(rm.score_ids(ids, mask).float().cpu())
        return torch.cat(out) if out else torch.zeros(0)

    return score


def policy_sampler(policy: Any, tok: Any, *, response_length: int, temperature: float, top_p: float = 1.0,
                   top_k: int = 0, chat_template: bool = True, batch_size: int = 32,
                   rng: random.Random | None = None, adapter: bool = True) -> Sampler:
    """A causal LM as a sampler: one answer per prompt, drawn as PPO draws its rollouts (``temperature``,
    ``top_p``, ``top_k``), cut after EOS, decoded without special tokens. With ``rng``, each call
    samples under its own seed (one draw from ``rng``) and leaves torch's random stream as it found
    it: a check then changes nothing in the run it measures, and ``rng``'s state (in the checkpoint)
    is all a resumed run needs to draw the same answers. Without it, torch's stream is used.
    ``adapter=False``: a peft model samples with its adapter disabled (a LoRA policy's starting point)."""
    def draw(prompts: list[Any]) -> list[str]:
        texts: list[str] = []
        for i in range(0, len(prompts), batch_size):
            ids = [encode_prompt(p, tok, chat_template) for p in prompts[i:i + batch_size]]
            with torch.no_grad(), policy.disable_adapter() if not adapter else contextlib.nullcontext():
                roll = ro.generate(policy, ids, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                                   max_new_tokens=response_length, temperature=temperature, top_p=top_p,
                                   top_k=top_k)
            texts += tok.batch_decode(roll.response * roll.response_mask, skip_special_tokens=True)
        return texts

    def sample(prompts: list[Any]) -> list[str]:
        if rng is None:
            return draw(prompts)
        with seeded_rng(rng.getrandbits(63), next(policy.parameters()).device):
            return draw(prompts)

    return sample


def ensemble_scorer(scorers: Sequence[Scorer], rule: str = "mean") -> Scorer:
    """Several members' scores combined as PPO combines an ensemble (:func:`ppolm.rewards.ensemble`)."""
    def score(prompts: list[Any], completions: list[str]) -> torch.Tensor:
        return ensemble(torch.stack([torch.as_tensor(s(prompts, completions)).float() for s in scorers]), rule)

    return score
