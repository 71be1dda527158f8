"""Reward functions that ship with ppolm (TRL GRPO convention), usable as
``--reward-fn ppolm.builtin_rewards:NAME``.

``positive_sentiment`` (``ppolm ppo --reward-fn ppolm.builtin_rewards:positive_sentiment``): VADER's
compound sentiment score (Hutto & Gilbert 2014) of the completion, in [-1, 1]. Rule-based, instant on a CPU,
and easy to read in samples, so a first run shows PPO learning.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any


def completion_text(c: Any) -> str:
    """A completion as text: a string, or the content of a chat completion's messages."""
    if isinstance(c, str):
        return c
    return "".join(m.get("content", "") for m in c)


@cache
def _vader() -> Any:
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


def positive_sentiment(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """VADER compound sentiment of each completion, in [-1, 1] (higher = more positive)."""
    return [_vader().polarity_scores(completion_text(c))["compound"] for c in completions]


def word_budget(prompts: list[Any], completions: list[Any], budget: int = 25, **kwargs: Any) -> list[float]:
    """0 within ``budget`` words, then -0.1 per extra word (counters length drift)."""
    return [-0.1 * max(0, len(completion_text(c).split()) - budget) for c in completions]


def repetition(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """Minus the fraction of repeated word bigrams (0 = none repeated, -1 = all repeats)."""
    out = []
    for c in completions:
        words = re.findall(r"\w+", completion_text(c).lower())
        bigrams = list(zip(words, words[1:]))
        out.append(-(1 - len(set(bigrams)) / len(bigrams)) if bigrams else 0.0)
    return out
