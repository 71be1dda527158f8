"""Judges (ppolm/judge.py): both conventions, Bradley-Terry labels computed by hand, bad judges refused."""

import math
import random

import pytest

from ppolm.errors import PPOLMError
from ppolm.judge import bradley_terry, load_judge

JUDGES = '''
def length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]

def prefer_short(prompts, completions_a, completions_b, **kwargs):
    return [0.9 if len(a) < len(b) else 0.1 if len(a) > len(b) else 0.5
            for a, b in zip(completions_a, completions_b)]

def by_column(prompts, completions, target):
    return [-abs(len(c) - t) for c, t in zip(completions, target)]

def wrong_count(prompts, completions, **kwargs):
    return [1.0]

def out_of_range(prompts, completions_a, completions_b):
    return [1.5 for _ in prompts]

def nan(prompts, completions):
    return [float("nan") for _ in completions]

def two_args(x, y):
    return []
'''


@pytest.fixture
def judges(tmp_path):
    f = tmp_path / "judges.py"
    f.write_text(JUDGES)
    return lambda name, t=0.0: load_judge(f"{f}:{name}", temperature=t)


def test_bradley_terry_by_hand():
    assert bradley_terry(2.0, 1.0, 1.0) == pytest.approx(1 / (1 + math.exp(-1)))
    assert bradley_terry(1.0, 2.0, 0.5) == pytest.approx(1 / (1 + math.exp(2)))
    assert bradley_terry(-800.0, 800.0, 1.0) == pytest.approx(0.0)  # no overflow
    assert (bradley_terry(3, 1, 0), bradley_terry(1, 3, 0), bradley_terry(2, 2, 0)) == (1.0, 0.0, 0.5)


def test_pointwise_judge_labels_follow_scores_without_noise(judges):
    j = judges("length")
    assert j.kind == "pointwise"
    labels = j.label(["p", "p", "p"], ["aaa", "a", "ab"], ["a", "aaa", "ba"], random.Random(0))
    assert labels == [1.0, 0.0, 0.5]
    assert j.calls == 3


def test_pointwise_judge_with_noise_draws_from_bradley_terry(judges):
    j = judges("length", 2.0)
    p = j.preference(["p"], ["aaaa"], ["aa"])[0]
    assert p == pytest.approx(1 / (1 + math.exp(-1.0)))
    rng, ref = random.Random(7), random.Random(7)
    labels = j.label(["p"] * 200, ["aaaa"] * 200, ["aa"] * 200, rng)
    assert labels == [1.0 if ref.random() < p else 0.0 for _ in range(200)]
    assert 0.6 < sum(labels) / 200 < 0.85  # about 0.73


def test_pairwise_judge(judges):
    j = judges("prefer_short")
    assert j.kind == "pairwise"
    assert j.preference(["p", "p"], ["a", "aaa"], ["aa", "a"]) == [0.9, 0.1]
    assert j.label(["p", "p", "p"], ["a", "aaa", "xy"], ["aa", "a", "yx"], random.Random(0)) == [1.0, 0.0, 0.5]
    with pytest.raises(PPOLMError, match="pairwise"):
        j.scores(["p"], ["a"])


def test_columns_reach_a_judge_that_names_them(judges):
    j = judges("by_column")
    assert j.scores(["p", "q"], ["abc", "a"], {"target": [3, 3], "unused": [0, 0]}) == [0.0, -2.0]
    assert j.label(["p"], ["abc"], ["a"], random.Random(0), {"target": [3]}) == [1.0]


@pytest.mark.parametrize("name,msg", [("wrong_count", "returned 1 values for 2"),
                                      ("nan", "must be finite")])
def test_bad_pointwise_output_is_one_clear_error(judges, name, msg):
    with pytest.raises(PPOLMError, match=msg):
        judges(name).scores(["p", "q"], ["a", "b"])


def test_bad_judges_are_refused(judges, tmp_path):
    with pytest.raises(PPOLMError, match=r"in \[0, 1\]"):
        judges("out_of_range").preference(["p"], ["a"], ["b"])
    with pytest.raises(PPOLMError, match="must accept"):
        judges("two_args")
    with pytest.raises(PPOLMError, match="has no function 'lenght'; did you mean 'length'"):
        judges("lenght")
    with pytest.raises(PPOLMError, match="does not exist"):
        load_judge(f"{tmp_path}/missing.py:f")
    with pytest.raises(PPOLMError, match="temperature"):
        judges("length", -1.0)


def test_the_demo_gold_judge_loads_as_a_judge():
    j = load_judge("ppolm.gold:gold_judge")
    assert j.kind == "pointwise"
    assert j.label(["p"], ["A wonderful, lovely film."], ["A terrible, awful film."], random.Random(0)) == [1.0]
