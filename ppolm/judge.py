"""Judges: the preferences that a proxy reward model is trained to imitate.

A judge stands for the human (or the stronger model) whose comparisons a reward model learnt. ppolm
uses one wherever comparisons are made without a person: ``ppolm label --judge``, the on-policy
check of a reward model, and the refresh of a reward model during PPO. Two conventions are accepted:

* **pointwise**, the reward-function convention (TRL's GRPO)::

      def judge(prompts, completions, **kwargs) -> list[float]        # higher is better

  Two answers are compared through their scores, as a Bradley–Terry model does:
  ``P(a preferred) = sigmoid((s_a - s_b) / T)``.

* **pairwise**::

      def judge(prompts, completions_a, completions_b, **kwargs) -> list[float]

  returning, for each pair, the probability that answer ``a`` is preferred (0.5 = no preference).

``temperature`` sets the label noise. 0 (default): every label follows the judge (the higher score
wins; a pairwise probability above 0.5 picks ``a``); equal scores and a probability of exactly 0.5
are ties. T > 0: each label is a Bernoulli draw from the probability above (for a pairwise judge, from
its own probability), so that a judge can stand in for noisy human raters (InstructGPT's labellers
agreed with each other on about 73 % of comparisons; Ouyang et al. 2022, section 5.1).
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ppolm.errors import PPOLMError
from ppolm.rewards import load_callable

PAIRWISE_PARAMS = ("completions_a", "completions_b")


def judge_kind(fn: Callable[..., Any], spec: str) -> Literal["pointwise", "pairwise"]:
    """Pairwise when the function names ``completions_a`` and ``completions_b``, pointwise when it
    accepts ``prompts`` and ``completions``; anything else is refused."""
    try:
        params = inspect.signature(fn).parameters
    except ValueError:  # a builtin without a signature: take it as pointwise
        return "pointwise"
    if all(p in params for p in PAIRWISE_PARAMS):
        return "pairwise"
    sig = inspect.signature(fn)
    if not (any(p.kind is p.VAR_KEYWORD for p in params.values())
            or ("prompts" in params and "completions" in params)):
        raise PPOLMError(f"judge '{spec}' must accept (prompts, completions, **kwargs) or (prompts, completions_a, "
                         f"completions_b, **kwargs); its signature is {sig}")
    return "pointwise"


def _numbers(out: Any, n: int, spec: str, what: str) -> list[float]:
    try:
        values = [float(v) for v in out]
    except (TypeError, ValueError):
        raise PPOLMError(f"judge '{spec}' must return a list of numbers; got {type(out).__name__}") from None
    if len(values) != n:
        raise PPOLMError(f"judge '{spec}' returned {len(values)} values for {n} {what}; return one each")
    bad = next((v for v in values if not math.isfinite(v)), None)
    if bad is not None:
        raise PPOLMError(f"judge '{spec}' returned {bad}; a judge's values must be finite")
    return values


@dataclass
class Judge:
    """A loaded judge; see the module docstring for the conventions and ``temperature``."""

    spec: str
    fn: Callable[..., Any]
    kind: Literal["pointwise", "pairwise"]
    temperature: float = 0.0
    calls: int = 0
    """Comparisons asked of the judge so far (its cost: human labels, or calls to a judging model)."""

    def _kwargs(self, columns: dict[str, list[Any]] | None) -> dict[str, Any]:
        kwargs = dict(columns or {})
        try:
            params = inspect.signature(self.fn).parameters
            if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                kwargs = {k: v for k, v in kwargs.items() if k in params}
        except ValueError:
            pass
        return kwargs

    def _call(self, **kw: Any) -> Any:
        try:
            return self.fn(**kw)
        except PPOLMError:
            raise
        except Exception as e:
            raise PPOLMError(f"judge '{self.spec}' raised {type(e).__name__}: {e}; fix the judge") from None

    def scores(self, prompts: Sequence[Any], completions: Sequence[Any],
               columns: dict[str, list[Any]] | None = None) -> list[float]:
        """A pointwise judge's score of each completion."""
        if self.kind != "pointwise":
            raise PPOLMError(f"judge '{self.spec}' is pairwise; it compares answers and gives no score of one")
        out = self._call(prompts=list(prompts), completions=list(completions), **self._kwargs(columns))
        return _numbers(out, len(completions), self.spec, "completions")

    def preference(self, prompts: Sequence[Any], completions_a: Sequence[Any], completions_b: Sequence[Any],
                   columns: dict[str, list[Any]] | None = None) -> list[float]:
        """P(a preferred over b) for each pair, before any label noise is drawn."""
        if not len(prompts) == len(completions_a) == len(completions_b):
            raise ValueError("prompts, completions_a and completions_b must have one entry per pair")
        self.calls += len(prompts)
        if self.kind == "pairwise":
            out = self._call(prompts=list(prompts), completions_a=list(completions_a),
                             completions_b=list(completions_b), **self._kwargs(columns))
            probs = _numbers(out, len(prompts), self.spec, "pairs")
            bad = next((p for p in probs if not 0.0 <= p <= 1.0), None)
            if bad is not None:
                raise PPOLMError(f"pairwise judge '{self.spec}' returned {bad}; it must return P(a preferred) "
                                 "in [0, 1]")
            return probs
        cols = {k: list(v) + list(v) for k, v in (columns or {}).items()}
        both = self.scores(list(prompts) * 2, list(completions_a) + list(completions_b), cols)
        n = len(prompts)
        return [bradley_terry(both[i], both[n + i], self.temperature) for i in range(n)]

    def label(self, prompts: Sequence[Any], completions_a: Sequence[Any], completions_b: Sequence[Any],
              rng: random.Random, columns: dict[str, list[Any]] | None = None) -> list[float]:
        """One label per pair: 1.0 (a preferred), 0.0 (b preferred) or 0.5 (a tie). With temperature 0
        the label follows the judge; above 0 it is a Bernoulli draw from ``preference``, one ``rng``
        draw per pair (so a seed fixes the labels)."""
        probs = self.preference(prompts, completions_a, completions_b, columns)
        if self.temperature > 0:
            return [1.0 if rng.random() < p else 0.0 for p in probs]
        return [1.0 if p > 0.5 else 0.0 if p < 0.5 else 0.5 for p in probs]


def bradley_terry(score_a: float, score_b: float, temperature: float) -> float:
    """P(a preferred) = sigmoid((score_a - score_b) / T); at T = 0 the step function (0.5 at a tie)."""
    d = score_a - score_b
    if temperature <= 0:
        return 1.0 if d > 0 else 0.0 if d < 0 else 0.5
    z = d / temperature
    return 1 / (1 + math.exp(-z)) if z >= 0 else math.exp(z) / (1 + math.exp(z))


def load_judge(spec: str, temperature: float = 0.0) -> Judge:
    """The judge named by 'path/to/file.py:function' or 'package.module:function'."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise PPOLMError(f"judge temperature {temperature} must be a finite number >= 0 (0 = labels without noise)")
    fn = load_callable(spec, "judge")
    return Judge(spec=spec, fn=fn, kind=judge_kind(fn, spec), temperature=temperature)
