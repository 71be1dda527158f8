"""On-policy reward-model validation (ppolm/rm_check.py) computed by hand, on tiny models, and the
``reward_model_drift`` alarm (ppolm/alarms.py) on hand-made metric rows."""

from __future__ import annotations

import math
import random

import pytest
import torch

from ppolm import alarms, models
from ppolm.errors import PPOLMError
from ppolm.judge import Judge
from ppolm.pairs import Pair, encode_pairs
from ppolm.rewards import RewardModel
from ppolm.rm_check import onpolicy_check, policy_sampler, reward_model_scorer, sample_pairs
from ppolm.rollout import left_pad

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

# prompt -> (answer a, answer b); the judge counts the letter 'a', the proxy measures length
ANSWERS = {
    "p0": ("aaa", "a"),       # judge: a (3 > 1); proxy: 3 > 1, agrees
    "p1": ("b", "aab"),       # judge: b (2 > 0); proxy: 3 > 1, agrees
    "p2": ("xa", "ya"),       # judge: tie (1 = 1): left out
    "p3": ("same", "same"),   # identical: skipped, never shown to the judge
    "p4": ("", "aa"),         # empty answer: skipped
    "p5": ("aaaa", "aaab"),   # judge: a (4 > 3); proxy: 4 = 4, half a point
    "p6": ("aa", "bbbbb"),    # judge: a (2 > 0); proxy: 2 < 5, disagrees
}


def scripted_sampler(prompts):
    """The first half of the call gives each prompt's answer a, the second half its answer b."""
    half = len(prompts) // 2
    return [ANSWERS[p][0 if i < half else 1] for i, p in enumerate(prompts)]


def count_a(prompts, completions, **kwargs):
    return [float(c.count("a")) for c in completions]


def length_proxy(prompts, completions):
    return torch.tensor([float(len(c)) for c in completions])


def judge():
    return Judge(spec="count_a", fn=count_a, kind="pointwise")


def test_onpolicy_accuracy_by_hand():
    j = judge()
    res = onpolicy_check(list(ANSWERS), scripted_sampler, length_proxy, j, 7, random.Random(0))
    m = res.metrics
    # decided pairs p0, p1, p5, p6: 1 + 1 + 0.5 + 0 points of 4
    assert m["rm/onpolicy_accuracy"] == 0.625
    assert m["rm/onpolicy_accuracy_se"] == pytest.approx(math.sqrt(0.625 * 0.375 / 4))
    assert (m["rm/onpolicy_pairs"], m["rm/onpolicy_ties"], m["rm/onpolicy_skipped"]) == (4, 1, 2)
    assert m["rm/onpolicy_judge_calls"] == 5 and j.calls == 5
    assert "rm/heldout_accuracy" not in m and m["time/rm_check"] >= 0
    assert sorted(p.prompt for p in res.fresh.pairs) == ["p0", "p1", "p2", "p5", "p6"]
    assert {p.prompt: p.ordered() for p in res.fresh.decided}["p1"] == ("aab", "b")


def test_heldout_accuracy_beside_the_onpolicy_one():
    held = [Pair("q", "a long answer", "short"), Pair("q", "x", "yy"), Pair("q", "same", "size")]
    m = onpolicy_check(["p0"], scripted_sampler, length_proxy, judge(), 1, random.Random(0), heldout=held).metrics
    # right, wrong, tied: 1.5 of 3
    assert m["rm/heldout_accuracy"] == 0.5 and m["rm/heldout_pairs"] == 3
    assert m["rm/heldout_accuracy_se"] == pytest.approx(math.sqrt(0.25 / 3))
    assert m["rm/onpolicy_accuracy"] == 1.0 and m["rm/onpolicy_accuracy_se"] == 0.0


def test_no_comparable_pair_reports_no_accuracy():
    m = onpolicy_check(["p3", "p4"], scripted_sampler, length_proxy, judge(), 4, random.Random(0)).metrics
    assert "rm/onpolicy_accuracy" not in m and m["rm/onpolicy_pairs"] == 0 and m["rm/onpolicy_skipped"] == 4
    assert m["rm/onpolicy_judge_calls"] == 0


def test_prompts_cycle_and_labels_follow_the_seed():
    j = Judge(spec="count_a", fn=count_a, kind="pointwise", temperature=1.0)
    a = sample_pairs(["p0", "p1", "p6"], scripted_sampler, j, 7, random.Random(3))
    b = sample_pairs(["p0", "p1", "p6"], scripted_sampler, j, 7, random.Random(3))
    assert [p.prompt for p in a.pairs] == [p.prompt for p in b.pairs] and [p.label for p in a.pairs] == \
        [p.label for p in b.pairs]
    # 7 pairs on 3 prompts: two whole shuffles, then one prompt more
    counts = sorted([p.prompt for p in a.pairs].count(x) for x in ("p0", "p1", "p6"))
    assert counts == [2, 2, 3]


def test_pairs_against_another_sampler():
    """other_share 0.5 of 6 pairs: the last 3 set one answer of the sampler against one of `other`
    (called once, on those prompts), each in an order drawn from the rng; the first 3 are as without it."""
    calls = []

    def own(prompts):
        calls.append(("own", list(prompts)))
        return [f"own {p} {i}" for i, p in enumerate(prompts)]

    def start(prompts):
        calls.append(("start", list(prompts)))
        return [f"start {p}" for p in prompts]

    prompts = ["p0", "p1", "p2", "p3", "p4", "p5"]
    j = judge()
    rng = random.Random(5)
    got = sample_pairs(prompts, own, j, 6, rng, other=start, other_share=0.5)
    picks = [prompts[i] for i in random.Random(5).sample(range(6), 6)]
    assert calls == [("own", picks + picks[:3]), ("start", picks[3:])]
    assert got.other == 3 and len(got.pairs) == 6
    assert [(p.a, p.b) for p in got.pairs[:3]] == [(f"own {q} {i}", f"own {q} {6 + i}") for i, q in enumerate(picks[:3])]
    for i, p in enumerate(got.pairs[3:], start=3):
        assert {p.a, p.b} == {f"own {picks[i]} {i}", f"start {picks[i]}"} and p.prompt == picks[i]
    # the order of each cross pair is the rng's coin, drawn after the prompts and before the labels
    flips = random.Random(5)
    flips.sample(range(6), 6)
    firsts = ["start" if flips.random() < 0.5 else "own" for _ in range(3)]
    assert [p.a.split()[0] for p in got.pairs[3:]] == firsts
    # share 0 (or no other sampler) is the plain sampling, pair for pair
    plain = sample_pairs(prompts, own, j, 6, random.Random(5))
    for kw in ({"other": start, "other_share": 0.0}, {"other_share": 0.5}):
        again = sample_pairs(prompts, own, j, 6, random.Random(5), **kw)
        assert [(p.a, p.b, p.label) for p in again.pairs] == [(p.a, p.b, p.label) for p in plain.pairs]
        assert again.other == 0
    with pytest.raises(PPOLMError, match=r"must be in \[0, 1\]"):
        sample_pairs(prompts, own, j, 6, random.Random(5), other=start, other_share=1.5)


def test_bad_sampler_and_scorer_are_one_line():
    with pytest.raises(PPOLMError, match="one text per prompt"):
        onpolicy_check(["p0"], lambda ps: ["x"], length_proxy, judge(), 1, random.Random(0))
    with pytest.raises(PPOLMError, match="non-finite"):
        onpolicy_check(["p0"], scripted_sampler, lambda ps, cs: torch.full((len(cs),), math.nan), judge(), 1,
                       random.Random(0))
    with pytest.raises(PPOLMError, match="no prompts"):
        onpolicy_check([], scripted_sampler, length_proxy, judge(), 1, random.Random(0))


def test_reward_model_scorer_scores_as_the_reward_model_trains(tiny_rm_dir, tiny_policy_dir):
    rm = RewardModel(str(tiny_rm_dir), dtype=torch.float32, device="cpu")
    rm.gain, rm.bias = 2.0, 0.5
    score = reward_model_scorer(rm)
    got = score(["Review a lamp.", "Hi"], ["A fine lamp.", "Hello there, friend."])
    # the layout of `ppolm reward`'s pairs: chat-templated prompt, response, EOS
    enc = encode_pairs([Pair("Review a lamp.", "A fine lamp.", "x"), Pair("Hi", "Hello there, friend.", "x")],
                       rm.tokenizer, True, 512)
    ids, mask = left_pad([c for c, _, _ in enc], rm.tokenizer.pad_token_id, "cpu")
    assert torch.allclose(got, rm.score_ids(ids, mask), atol=1e-6)

    # a tiny policy as the sampler: every pair is compared, tied or skipped
    tok = models.load_tokenizer(tiny_policy_dir)
    policy = models.load_causal_lm(tiny_policy_dir, tokenizer=tok)
    torch.manual_seed(0)
    sampler = policy_sampler(policy, tok, response_length=6, temperature=1.0)
    m = onpolicy_check(["Review a lamp.", "Review a kettle."], sampler, score, judge(), 6, random.Random(0)).metrics
    assert m["rm/onpolicy_pairs"] + m["rm/onpolicy_ties"] + m["rm/onpolicy_skipped"] == 6
    assert m["rm/onpolicy_pairs"] >= 1 and 0.0 <= m["rm/onpolicy_accuracy"] <= 1.0
    # with its own rng the sampler leaves torch's stream alone and repeats itself for the same seed
    state = torch.get_rng_state()
    first = policy_sampler(policy, tok, response_length=6, temperature=1.0, rng=random.Random(4))(["Hi"] * 4)
    assert torch.equal(torch.get_rng_state(), state)
    assert policy_sampler(policy, tok, response_length=6, temperature=1.0, rng=random.Random(4))(["Hi"] * 4) == first
    assert len(set(first)) > 1


# --------------------------------------------------------------------------------------- alarm


def check_rows(accuracy, se, every=5):
    """Per-step rows, with the on-policy check's metrics on every ``every``-th step."""
    out = []
    for i in range(every * (len(accuracy) - 1) + 1):
        r = {"step": i, "objective/kl": 0.5 * i}
        if i % every == 0:
            r.update({"rm/onpolicy_accuracy": accuracy[i // every], "rm/onpolicy_accuracy_se": se})
        out.append(r)
    return out


def test_reward_model_drift_fires_on_a_fall():
    # SE 0.05 at both ends: the drop must exceed 2 * hypot(0.05, 0.05) = 0.1414; 0.10 (step 10) does
    # not, 0.25 (step 15) does
    a = alarms.reward_model_drift(check_rows([0.80, 0.78, 0.70, 0.55], 0.05))
    assert a and a.name == "reward_model_drift" and a.step == 15
    assert a.values["baseline"] == 0.80 and a.values["accuracy"] == 0.55
    assert a.values["drop_limit"] == pytest.approx(2 * math.hypot(0.05, 0.05))
    assert "--rm-refresh-every" in a.message
    # steady within its noise: quiet
    assert alarms.reward_model_drift(check_rows([0.80, 0.77, 0.82, 0.70, 0.76], 0.05)) is None
    # a large check (SE 0.005): 0.04 is under the 0.05 floor, 0.06 is over it
    assert alarms.reward_model_drift(check_rows([0.80, 0.76], 0.005)) is None
    assert alarms.reward_model_drift(check_rows([0.80, 0.74], 0.005)).step == 5
    assert alarms.reward_model_drift(check_rows([0.80], 0.05)) is None  # nothing to compare yet


def test_reward_model_drift_in_check_all_and_live():
    drifting = check_rows([0.80, 0.78, 0.70, 0.55], 0.05)
    assert [a.name for a in alarms.check_all(drifting)] == ["reward_model_drift"]
    said: list[str] = []
    live = alarms.LiveAlarms(kl_target=None, emit=said.append)
    marked = [r["step"] for r in drifting if live(r["step"], {k: v for k, v in r.items() if k != "step"})]
    assert marked == [15] and said[0].startswith("warning: alarm reward_model_drift at step 15")
