"""Short rule-based rewards for bench/learning.py, in TRL's GRPO convention f(prompts, completions) -> floats.

Each is in [0, 1] (1 = the maximum, so "share of the gap closed" = (after - before) / (1 - before)),
except ``length20``, TRL's GRPO quickstart reward, which is never positive (its maximum, 0, is in
MAXIMUM): a reward whose mean lies far from 0, as a user's own often does.
"""

from __future__ import annotations

import re

KEYWORDS = ("bright", "gentle", "golden")
SENSES = ("smell", "sound", "taste")


def _text(c) -> str:
    return c if isinstance(c, str) else c[-1]["content"]  # a string, or TRL's chat-message list


def exclaim(prompts, completions, **kwargs):
    """Punctuation: up to three exclamation marks (1/3 each)."""
    return [min(_text(c).count("!"), 3) / 3 for c in completions]


def short(prompts, completions, **kwargs):
    """Word budget: 1 up to 10 words, then 0.05 less per word beyond (0 from 30 words)."""
    out = []
    for c in completions:
        n = len(_text(c).split())
        out.append(1.0 if n <= 10 else max(0.0, 1.0 - (n - 10) / 20))
    return out


def _share_used(completions, vocabulary: tuple[str, ...]) -> list[float]:
    """For each answer, the share of the words of ``vocabulary`` it uses (lower case, whole words)."""
    out = []
    for c in completions:
        words = set(re.findall(r"[a-z]+", _text(c).lower()))
        out.append(sum(k in words for k in vocabulary) / len(vocabulary))
    return out


def keyword(prompts, completions, **kwargs):
    """Vocabulary: the share of the words bright, gentle and golden that the answer uses."""
    return _share_used(completions, KEYWORDS)


def senses(prompts, completions, **kwargs):
    """Vocabulary, like keyword with other words: the share of smell, sound and taste that the answer uses."""
    return _share_used(completions, SENSES)


def question(prompts, completions, **kwargs):
    """Format: the answer is one question: it ends with '?' (1), half if a '?' appears elsewhere."""
    out = []
    for c in completions:
        t = _text(c).strip()
        out.append(1.0 if t.endswith("?") else 0.5 if "?" in t else 0.0)
    return out


def digit(prompts, completions, **kwargs):
    """Format: the answer contains a number written in digits (1), else 0."""
    return [1.0 if re.search(r"[0-9]", _text(c)) else 0.0 for c in completions]


def caps(prompts, completions, **kwargs):
    """Style: up to three words of two or more letters written in capitals (1/3 each)."""
    return [min(sum(w.isalpha() and len(w) > 1 and w.isupper() for w in re.findall(r"[A-Za-z]+", _text(c))), 3) / 3
            for c in completions]


def comma(prompts, completions, **kwargs):
    """Punctuation: up to three commas (1/3 each)."""
    return [min(_text(c).count(","), 3) / 3 for c in completions]


def quote(prompts, completions, **kwargs):
    """Format: the answer quotes something: a pair of double quotes around at least one word (1), else 0."""
    return [1.0 if re.search(r'["\u201c][^"\u201c\u201d]*[A-Za-z][^"\u201c\u201d]*["\u201d]', _text(c)) else 0.0
            for c in completions]


def length20(prompts, completions, **kwargs):
    """Length, as in TRL's GRPO quickstart: minus the distance of the answer's length from 20 characters."""
    return [-float(abs(20 - len(_text(c)))) for c in completions]


# The first four chose the defaults; digit and caps were added afterwards, to check them on
# rewards they were not tuned on, senses later still, to check whether keyword's result holds
# for another rarely used vocabulary, comma and quote after the ceiling on beta became a default,
# and length20, a reward far below 0, with the default centring of such a reward.
TASKS = {"exclaim": exclaim, "short": short, "keyword": keyword, "question": question, "digit": digit, "caps": caps,
         "senses": senses, "comma": comma, "quote": quote, "length20": length20}
MAXIMUM = {"length20": 0.0}  # a task's best reward, where it is not 1


def maximum(task: str) -> float:
    """The best reward ``task`` gives (the top of its "share of the gap closed")."""
    return MAXIMUM.get(task, 1.0)


HELD_OUT = [f"Write one sentence about {x}." for x in (
    "a lighthouse", "autumn leaves", "a train journey", "a chess game", "fresh bread", "a rainy afternoon",
    "a museum visit", "a mountain village")] + [f"Describe {x} in one short sentence." for x in (
    "a busy market", "a quiet library", "a summer storm", "a football match", "a garden at dawn",
    "a snowy street", "a river bank", "a night sky")] + [f"Say something nice about {x}." for x in (
    "a nurse", "a bus driver", "an old friend", "a local bakery", "a public park", "a science teacher",
    "a neighbour's dog", "a cycling club")] + [f"Write a short review of {x}." for x in (
    "a pizza place", "a detective novel", "a jazz album", "a hiking boot", "a city tour", "a board game",
    "a coffee machine", "a theatre play")]
