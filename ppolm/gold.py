"""The demo's task and its gold judge: a deterministic scorer standing in for human preference.

Task: *write a short review* of a product or film named in the prompt. The judge prefers reviews
that are (1) positive, (2) short and (3) not repetitive, the way a human rater asked for "a short,
warm review" would. In numbers, for a response of ``w`` words::

    gold = VADER compound sentiment                 in [-1, 1]  (Hutto & Gilbert 2014)
           - 0.1 per word beyond 12 words           (the word budget: one short sentence)
           - 1.5 x fraction of repeated word bigrams  (repetition)
           - 1 if the response is empty

A *proxy* reward model trained on a few hundred noisy comparisons by this judge learns the easy
part, length, and little of the rest: on ~200 distinct training responses sampled at temperature 1,
a linear read-out of SmolLM2's last-token state orders held-out pairs by the length term 83% of the time
and by the sentiment term 58% (measured; with 0.04 per word beyond 15, sentiment dominated the
judge and the trained proxies came out at 0.50-0.54 against it). So PPO against the proxy can find
responses the proxy likes and the judge does not: terse, flat or empty ones. That gap is Goodhart's law
as measured by Gao, Schulman & Hilton (2022), and :mod:`ppolm.demo` shows it.

``gold_judge`` follows TRL's reward-function convention, so it also works as
``--reward-fn ppolm.gold:gold_judge`` (train on gold directly) or ``--eval-reward-fn`` (score only).
"""

from __future__ import annotations

import random
import re
from typing import Any

from ppolm.builtin_rewards import _vader, completion_text

WORD_BUDGET = 12
PER_EXTRA_WORD = 0.1
REPETITION_WEIGHT = 1.5
EMPTY_PENALTY = 1.0

JUDGE_DESCRIPTION = (
    f"gold = VADER compound sentiment of the response (in [-1, 1]) "
    f"- {PER_EXTRA_WORD} per word beyond a budget of {WORD_BUDGET} words "
    f"- {REPETITION_WEIGHT} x the fraction of repeated word bigrams "
    f"- {EMPTY_PENALTY} for an empty response. Deterministic; higher is better.")


def repeated_bigram_fraction(text: str) -> float:
    """Fraction of word bigrams that already occurred earlier in the text (0 = none repeated)."""
    words = re.findall(r"\w+", text.lower())
    bigrams = list(zip(words, words[1:]))
    return 1 - len(set(bigrams)) / len(bigrams) if bigrams else 0.0


def gold_score(text: str) -> float:
    """The gold judge on one response text (see the module docstring)."""
    if not text.strip():
        return -EMPTY_PENALTY
    words = len(text.split())
    score = _vader().polarity_scores(text)["compound"]
    score -= PER_EXTRA_WORD * max(0, words - WORD_BUDGET)
    score -= REPETITION_WEIGHT * repeated_bigram_fraction(text)
    return float(score)


def gold_judge(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """Gold reward of each completion (TRL convention); the prompt is not used."""
    return [gold_score(completion_text(c)) for c in completions]


MIN_WORDS = 5
PER_MISSING_WORD = 0.2

REVIEW_JUDGE_DESCRIPTION = (
    JUDGE_DESCRIPTION.removesuffix(" Deterministic; higher is better.")
    + f" - {PER_MISSING_WORD} per word short of {MIN_WORDS} words (a review is at least a short sentence). "
    "Deterministic; higher is better.")


def review_score(text: str) -> float:
    """:func:`gold_score` with a floor on length: minus ``PER_MISSING_WORD`` per word short of
    ``MIN_WORDS``. The rater of ``ppolm demo --overoptimisation``: asked for a short review, a person
    does not count "Awesome." as one. The starting policy's answers are longer than that, so the
    proxy's pairs hardly show the floor, and a proxy that learnt "shorter is better" keeps rewarding
    answers past it: gold then peaks and falls as Gao et al. describe."""
    score = gold_score(text)
    return score - PER_MISSING_WORD * max(0, MIN_WORDS - len(text.split())) if text.strip() else score


def review_judge(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """:func:`review_score` of each completion (TRL convention); the prompt is not used."""
    return [review_score(completion_text(c)) for c in completions]


# ------------------------------------------------------------------------------------ prompts

FILMS = [
    "The Quiet Harbour", "Paper Moons", "Last Train to Varna", "The Glass Orchard", "Midnight in Lagos",
    "A Field of Static", "The Cartographer's Daughter", "Salt and Iron", "Neon Monsoon", "The Long Winter Road",
    "Borrowed Light", "The Clockmaker's Apprentice", "Red Dust Rising", "Small Hours", "The Lighthouse Keeper",
    "Echoes of Tomorrow", "Under the Linden Tree", "The Ninth Bridge", "Copper Sky", "Whispering Pines",
    "The Velvet Hour", "Islands Apart", "Northbound", "The Paper Crane",
]
PRODUCTS = [
    "a stainless steel water bottle", "a pair of wireless earbuds", "a cast iron frying pan",
    "a mechanical keyboard", "a wool winter scarf", "a pair of trail running shoes", "a bamboo cutting board",
    "a portable phone charger", "a French press coffee maker", "a desk lamp", "a yoga mat", "a rain jacket",
    "a backpack for commuting", "an electric kettle", "a set of kitchen knives", "a paperback thriller novel",
    "a houseplant in a ceramic pot", "a board game for families", "a smartwatch", "a camping tent",
    "a pair of sunglasses", "a robot vacuum cleaner", "a bluetooth speaker", "a travel pillow",
]
TEMPLATES = [  # one sentence, so that most responses end (with EOS) within the demo's response length
    "Write a one-sentence review of {item}.",
    "In one sentence, what do you think of {item}?",
    "Review {item} in a single short sentence.",
    "Give a one-line opinion of {item}.",
]


def review_prompts(n_train: int = 80, n_eval: int = 24, seed: int = 0) -> tuple[list[str], list[str]]:
    """Disjoint train and held-out review prompts: held-out prompts name items never seen in training.

    Items (films quoted as titles, and products) are shuffled with ``seed`` and split; each split's
    items are combined with the templates, so the held-out set tests generalisation, not memory.
    """
    items = [f"the film '{t}'" for t in FILMS] + PRODUCTS
    rng = random.Random(seed)
    rng.shuffle(items)
    n_eval_items = max(1, len(items) // 4)
    eval_items, train_items = items[:n_eval_items], items[n_eval_items:]

    def make(pool: list[str], n: int, offset: int) -> list[str]:
        combos = [t.format(item=i) for i in pool for t in TEMPLATES]
        random.Random(seed + offset).shuffle(combos)
        return combos[:n]

    train, held = make(train_items, n_train, 1), make(eval_items, n_eval, 2)
    if len(train) < n_train or len(held) < n_eval:
        raise ValueError(f"at most {len(train_items) * len(TEMPLATES)} train and "
                         f"{len(eval_items) * len(TEMPLATES)} held-out prompts are available")
    return train, held
