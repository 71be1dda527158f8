"""The reward functions that ship with ppolm (ppolm/builtin_rewards.py), on hand-counted texts."""

from __future__ import annotations

import pytest

from ppolm.builtin_rewards import repetition, word_budget


def test_word_budget_is_zero_within_the_budget_then_minus_a_tenth_per_word():
    five = "one two three four five"
    chat = [{"role": "assistant", "content": "a b c "}, {"role": "assistant", "content": "d e f g"}]  # 7 words
    got = word_budget(["p"] * 4, [five, "", chat, five + " six seven"], budget=5)
    assert got == pytest.approx([0.0, 0.0, -0.2, -0.2])
    # the default budget is 25 words: 30 words are 5 over
    assert word_budget(["p"], [" ".join(["w"] * 30)]) == pytest.approx([-0.5])
    assert word_budget(["p"], [" ".join(["w"] * 25)]) == [0.0]


def test_repetition_is_minus_the_share_of_repeated_bigrams():
    # "the cat the cat the dog": bigrams (the cat) (cat the) (the cat) (cat the) (the dog): 3 distinct of 5
    assert repetition(["p"], ["The cat, the cat; the dog"]) == pytest.approx([-(1 - 3 / 5)])
    assert repetition(["p", "p"], ["all different words here", "single"]) == [0.0, 0.0]
