"""Reward-model refresh (ppolm/rm_refresh.py, and ppolm/rm_guard.py in a loop) on tiny models: it learns
the judge's rule from fresh pairs, resumes bit-identically from a checkpoint, saves a loadable reward
model, refreshes ensembles."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from ppolm import checkpoint, config, trainloop
from ppolm.errors import PPOLMError
from ppolm.judge import Judge
from ppolm.pairs import Pair
from ppolm.reward_train import RewardTrainConfig, train_reward
from ppolm.rewards import NORM_FILE, RewardModel, read_norm
from ppolm.rm_check import reward_model_scorer
from ppolm.rm_guard import GuardOptions, RewardModelGuard
from ppolm.rm_refresh import (
    RefreshConfig,
    RewardModelRefresher,
    original_pairs,
    refresh_ensemble,
)
from ppolm.tiny import build_tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

WORDS = "the a cat dog sun tree river house blue green small big quick slow old new red road hill lamp".split()
MARKER = "kindly"
PROMPTS = [f"Say something about item {i}." for i in range(12)]


class WordSampler:
    """A stand-in policy: 3-6 random words, the marker among them half the time; each call (a round)
    draws from its own seeded stream, so a resumed run gets the same answers as an uninterrupted one."""

    def __init__(self, seed: int = 0, round: int = 0):
        self.seed, self.round = seed, round

    def __call__(self, prompts):
        rng = random.Random(f"{self.seed}-{self.round}")
        self.round += 1
        out = []
        for _ in prompts:
            words = [rng.choice(WORDS) for _ in range(rng.randint(3, 6))]
            if rng.random() < 0.5:
                words.insert(rng.randint(0, len(words)), MARKER)
            out.append(" ".join(words))
        return out


def marker_judge():
    def count_marker(prompts, completions, **kwargs):
        return [float(c.split().count(MARKER)) for c in completions]

    return Judge(spec="count_marker", fn=count_marker, kind="pointwise")


def replay_pairs(n=16, seed=5):
    """Original pairs with nothing to learn from: chosen and rejected are random word lists."""
    rng = random.Random(seed)
    return [Pair(f"Describe thing {i}.", " ".join(rng.choices(WORDS, k=4)), " ".join(rng.choices(WORDS, k=5)))
            for i in range(n)]


def cfg(**over):
    return RefreshConfig(**{**dict(lr=3e-3, batch_size=8, train_layers=1, seed=0), **over})


def test_refresh_learns_the_fresh_pairs_and_grows_the_buffer(tiny_rm_dir):
    r = RewardModelRefresher(tiny_rm_dir, pairs=replay_pairs(), cfg=cfg())
    frozen = {n: p.detach().clone() for n, p in r.model.named_parameters() if not p.requires_grad}
    trained = {n: p.detach().clone() for n, p in r.trained.items()}
    judge = marker_judge()
    rec = r.refresh(PROMPTS, WordSampler(), judge, 48, 40)
    added = int(rec["rm_refresh/pairs_added"])
    assert added >= 12 and len(r.fresh) == added and rec["rm_refresh/buffer_pairs"] == 16 + added
    assert rec["rm_refresh/judge_calls"] == judge.calls == added + rec["rm_refresh/ties"]
    assert rec["rm_refresh/steps"] == 40 and rec["rm_refresh/round"] == 1
    assert all(MARKER in p.chosen.split() and MARKER not in p.rejected.split() for p in r.fresh)
    # a noise-free judge, a rule the tiny model can read: the fresh pairs end up ranked right
    assert rec["rm_refresh/fresh_accuracy_after"] >= max(rec["rm_refresh/fresh_accuracy_before"], 0.9), rec
    assert all(not torch.equal(p, trained[n]) for n, p in r.trained.items() if n.startswith("score"))
    assert any(not torch.equal(p, trained[n]) for n, p in r.trained.items() if not n.startswith("score"))
    assert all(torch.equal(p, frozen[n]) for n, p in r.model.named_parameters() if not p.requires_grad)
    # re-normalised: mean 0, std 1 on the reference texts (by default the original pairs' responses)
    s = r.scores([p for p, _ in r.reference], [t for _, t in r.reference])
    assert len(r.reference) == 32 and abs(float(s.mean())) < 1e-5 and float(s.std(unbiased=False)) == \
        pytest.approx(1.0, abs=1e-5)
    # a second refresh replays the first one's pairs
    rec2 = r.refresh(PROMPTS, WordSampler(round=1), judge, 16, 4)
    assert rec2["rm_refresh/round"] == 2 and rec2["rm_refresh/buffer_pairs"] == 16 + added + \
        rec2["rm_refresh/pairs_added"] and rec2["rm_refresh/judge_calls_total"] == judge.calls


def run_two_refreshes(rm_dir, tmp_path, options, interrupt: bool):
    """Two refreshes; with ``interrupt`` the refresher is saved to a real checkpoint after the first,
    rebuilt from scratch and restored before the second."""
    r = RewardModelRefresher(rm_dir, pairs=replay_pairs(), cfg=cfg(**options))
    first = r.refresh(PROMPTS, WordSampler(), marker_judge(), 24, 5)
    if interrupt:
        tensors, meta = r.state_dict()
        checkpoint.save(tmp_path / "ckpt", 3, tensors, {"rm_refresh": meta}, keep_last=1)
        del r
        _, tensors, meta = checkpoint.load_latest(tmp_path / "ckpt")
        r = RewardModelRefresher(rm_dir, pairs=replay_pairs(), cfg=cfg(**options))
        r.load_state_dict(tensors, meta["rm_refresh"])
    second = r.refresh(PROMPTS, WordSampler(round=1), marker_judge(), 24, 5)
    return r, first, second


@pytest.mark.parametrize("options", [{}, {"lora_r": 4, "lr": 1e-2}], ids=["top-layer", "lora"])
def test_resume_across_a_refresh_is_bit_identical(tiny_rm_dir, tmp_path, options):
    a, a1, a2 = run_two_refreshes(tiny_rm_dir, tmp_path, options, interrupt=False)
    b, b1, b2 = run_two_refreshes(tiny_rm_dir, tmp_path, options, interrupt=True)
    for rec in (a1, a2, b1, b2):
        rec.pop("rm_refresh/seconds")
    assert a1 == b1 and a2 == b2
    assert a.trained.keys() == b.trained.keys() and all(torch.equal(a.trained[n], b.trained[n]) for n in a.trained)
    assert (a.gain, a.bias, a.fresh, a.rng.getstate()) == (b.gain, b.bias, b.fresh, b.rng.getstate())
    sa, sb = a.opt.state_dict()["state"], b.opt.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)
    if options:
        assert any("lora_" in n for n in a.trained)


def test_state_from_another_setup_is_refused(tiny_rm_dir, tmp_path):
    r = RewardModelRefresher(tiny_rm_dir, pairs=replay_pairs(), cfg=cfg())
    tensors, meta = r.state_dict()
    other = RewardModelRefresher(tiny_rm_dir, pairs=replay_pairs(8), cfg=cfg())
    with pytest.raises(PPOLMError, match="original pairs"):
        other.load_state_dict(tensors, meta)
    lora = RewardModelRefresher(tiny_rm_dir, pairs=replay_pairs(), cfg=cfg(lora_r=4))
    with pytest.raises(PPOLMError, match="other parameters"):
        lora.load_state_dict(tensors, meta)
    another = build_tiny_model_dir(tmp_path / "another", kind="scalar", seed=2)
    with pytest.raises(PPOLMError, match="not the one the checkpoint's refresh started from"):
        RewardModelRefresher(another, pairs=replay_pairs(), cfg=cfg()).load_state_dict(tensors, meta)
    with pytest.raises(PPOLMError, match="being refreshed"):
        r.save(tiny_rm_dir)


@pytest.mark.parametrize("options", [{}, {"lora_r": 4, "lr": 1e-2}], ids=["top-layer", "lora"])
def test_saved_refresh_loads_as_a_reward_model_and_scores_alike(tiny_rm_dir, tmp_path, options):
    r = RewardModelRefresher(tiny_rm_dir, pairs=replay_pairs(), cfg=cfg(**options))
    r.refresh(PROMPTS, WordSampler(), marker_judge(), 24, 6)
    out = r.save(tmp_path / "refreshed")
    assert read_norm(out) == (r.gain, r.bias)
    assert json.loads((out / NORM_FILE).read_text())["refreshes"] == 1
    prompts, texts = PROMPTS[:4], WordSampler(seed=9)(PROMPTS[:4])
    loaded = RewardModel(str(out), dtype=torch.float32, device="cpu")
    assert torch.allclose(reward_model_scorer(loaded)(prompts, texts), r.scores(prompts, texts), atol=1e-5)
    # the frozen model PPO holds takes the refreshed weights; untouched tensors stay the same objects
    frozen = RewardModel(str(tiny_rm_dir), dtype=torch.float32, device="cpu")
    embed = frozen.model.model.embed_tokens.weight
    assert not torch.allclose(reward_model_scorer(frozen)(prompts, texts), r.scores(prompts, texts), atol=1e-3)
    assert r.load_into(frozen) > 0 and frozen.model.model.embed_tokens.weight is embed
    assert torch.allclose(reward_model_scorer(frozen)(prompts, texts), r.scores(prompts, texts), atol=1e-5)
    r.save(out)  # an earlier save is replaced
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(PPOLMError, match="other files"):
        r.save(tmp_path / "other")
    assert (tmp_path / "other" / "notes.txt").read_text() == "keep me"


def test_ensemble_members_share_one_labelling(tiny_rm_dir):
    members = [RewardModelRefresher(tiny_rm_dir, pairs=replay_pairs(), cfg=cfg(seed=s)) for s in (0, 1)]
    heads = [m.model.score.weight.detach().clone() for m in members]
    judge = marker_judge()
    rec = refresh_ensemble(members, PROMPTS, WordSampler(), judge, 24, 4)
    labelled = rec["rm_refresh/pairs_added"] + rec["rm_refresh/ties"]
    assert judge.calls == labelled  # once, not once per member
    assert all(m.fresh == members[0].fresh and len(m.fresh) == rec["rm_refresh/pairs_added"] for m in members)
    assert all(not torch.equal(m.model.score.weight, h) for m, h in zip(members, heads))
    name = tiny_rm_dir.name
    per = [rec[f"rm_refresh/{name}_{i}/fresh_accuracy_after"] for i in (0, 1)]
    assert rec["rm_refresh/fresh_accuracy_after"] == pytest.approx(sum(per) / 2)


def test_options_and_pairs_come_from_the_reward_models_config(tiny_policy_dir, tmp_path):
    rng = random.Random(0)
    rows = [{"prompt": f"Say something about item {i}.", "chosen": f"{MARKER} " + " ".join(rng.choices(WORDS, k=4)),
             "rejected": " ".join(rng.choices(WORDS, k=5))} for i in range(20)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in rows))
    out = tmp_path / "rm"
    train_reward(config.build(RewardTrainConfig, dict(
        model=str(tiny_policy_dir), data=str(data), output_dir=str(out), epochs=1, batch_size=4, lr=2e-3,
        train_layers=1, eval_fraction=0.25, seed=3, quiet=True, precision="fp32", normalize=True,
        norm_source="pairs")))
    rc = RefreshConfig.from_reward_model(out, batch_size=2)
    assert (rc.lr, rc.train_layers, rc.batch_size, rc.seed, rc.lora_r) == (2e-3, 1, 2, 3, 0)
    train, held = original_pairs(out)
    assert len(train) + len(held) == 20 and len(held) == 5
    # the same held-out pairs, in the same order, as `ppolm reward` held out and scored
    scored = [json.loads(x) for x in (out / "eval_scores.jsonl").read_text().splitlines()]
    r = RewardModelRefresher(out, pairs=train, cfg=rc)
    raw = r.raw_scores([p.prompt for p in held], [p.chosen for p in held])
    assert torch.allclose(raw, torch.tensor([s["score_chosen"] for s in scored]), atol=1e-4)
    with pytest.raises(PPOLMError, match="unknown refresh option 'lrr'"):
        RefreshConfig.from_reward_model(out, lrr=1.0)
    with pytest.raises(PPOLMError, match="fresh_fraction"):
        RefreshConfig(fresh_fraction=0.0).validate()
    assert original_pairs(tmp_path) == ([], [])


WORKER = '''
import json, random, sys
from dataclasses import asdict
import torch
from ppolm import distributed
from ppolm.judge import Judge
from ppolm.pairs import Pair
from ppolm.rm_check import sharded_sampler
from ppolm.rm_refresh import RefreshConfig, RewardModelRefresher

torch.set_num_threads(1)
rm_dir, out = sys.argv[1], sys.argv[2]
distributed.init("cpu", 120)
rank = distributed.rank()
words = "the a cat dog sun tree river house blue green".split()

def sampler(prompts):  # each process its own stream; its answers carry its rank
    rng = random.Random(rank)
    return [" ".join([f"r{rank}"] + rng.choices(words, k=3) + (["kindly"] if rng.random() < 0.5 else []))
            for _ in prompts]

asked = []
def count(prompts, completions, **kwargs):
    asked.append(len(completions))
    return [float(c.split().count("kindly")) for c in completions]

pairs = [Pair(f"q{i}", " ".join(random.Random(i).choices(words, k=4)), " ".join(random.Random(-i).choices(words, k=5)))
         for i in range(8)]
r = RewardModelRefresher(rm_dir, pairs=pairs, cfg=RefreshConfig(lr=3e-3, batch_size=4, train_layers=1))
start = distributed.checksum(r.trained.values())
judge = Judge("count", count, "pointwise")
rec = r.refresh([f"p{i}" for i in range(8)], sharded_sampler(sampler), judge, 16, 4)
rec.pop("rm_refresh/seconds")
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump({"start": start, "end": distributed.checksum(r.trained.values()), "norm": [r.gain, r.bias],
               "fresh": [asdict(p) for p in r.fresh], "record": rec, "asked": sum(asked), "calls": judge.calls,
               "rng": r.rng.random()}, f)
distributed.shutdown()
'''


def test_refresh_under_torchrun_keeps_the_processes_equal(tiny_rm_dir, tmp_path):
    from test_distributed import torchrun

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    done = torchrun(2, [str(script), str(tiny_rm_dir), str(tmp_path)])
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert one["end"] != one["start"]  # it trained
    for key in ("end", "norm", "fresh", "record", "calls", "rng"):
        assert one[key] == two[key], key
    # the judge was asked once, by process 0, about pairs both processes sampled
    assert one["asked"] > 0 and two["asked"] == 0 and one["calls"] == one["record"]["rm_refresh/judge_calls"]
    texts = [t for p in one["fresh"] for t in (p["chosen"], p["rejected"])]
    assert any(t.startswith("r0 ") for t in texts) and any(t.startswith("r1 ") for t in texts)


def test_guard_checks_and_refreshes_in_a_loop_and_resumes_bit_identically(tiny_policy_dir, tmp_path):
    """The calls a PPO run makes (check at evaluations, refresh every 2 updates, checkpoint, resume),
    on a tiny policy: a run rebuilt from a checkpoint after a refresh ends where an unbroken one does."""
    from ppolm import models

    rng = random.Random(0)
    rows = [{"prompt": f"Say something about item {i}.", "chosen": " ".join(rng.choices(WORDS, k=6)),
             "rejected": " ".join(rng.choices(WORDS, k=2))} for i in range(16)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in rows))
    rm_dir = tmp_path / "rm"
    train_reward(config.build(RewardTrainConfig, dict(
        model=str(tiny_policy_dir), data=str(data), output_dir=str(rm_dir), epochs=1, batch_size=4, lr=2e-3,
        train_layers=1, eval_fraction=0.25, quiet=True, precision="fp32", norm_source="pairs")))
    longer = Judge(spec="chars", fn=lambda prompts, completions, **kw: [float(len(c)) for c in completions],
                   kind="pointwise")
    probe = (PROMPTS[:3], ["a cat", "the old red road", "sun"])

    def build():
        rm = RewardModel(str(rm_dir), dtype=torch.float32, device="cpu")
        tok = models.load_tokenizer(tiny_policy_dir)
        policy = models.load_causal_lm(tiny_policy_dir, tokenizer=tok)
        guard = RewardModelGuard([rm], longer, GuardOptions(check_pairs=6, refresh_every=2, refresh_pairs=8,
                                                            refresh_steps=3), seed=0, device="cpu")
        return rm, guard, guard.sampler(policy, tok, response_length=6, temperature=1.0)

    def run(interrupt: bool):
        rm, guard, sampler = build()
        start = reward_model_scorer(rm)(*probe)
        log = []
        for step in range(5):
            row = {}
            if guard.check_due(step, evaluating=step % 2 == 0):
                row.update(guard.check(PROMPTS, sampler))
            if guard.refresh_due(step):
                row.update(guard.refresh(PROMPTS, sampler))
            log.append({k: v for k, v in row.items() if not k.startswith(("time/", "memory/")) and not k.endswith("seconds")})
            if interrupt and step == 2:  # killed after the first refresh's checkpoint; a new process resumes
                tensors, meta = guard.state_dict()
                checkpoint.save(tmp_path / "ckpt", step, tensors, {"guard": meta}, keep_last=1)
                rm, guard, sampler = build()
                _, tensors, meta = checkpoint.load_latest(tmp_path / "ckpt")
                guard.load_state_dict(tensors, meta["guard"])
        return log, start, reward_model_scorer(rm)(*probe), guard

    a_log, a_start, a_end, a = run(False)
    b_log, _, b_end, b = run(True)
    assert a_log == b_log and torch.equal(a_end, b_end) and a.judge.calls == b.judge.calls
    assert [("rm/onpolicy_accuracy" in r, "rm_refresh/round" in r) for r in a_log] == \
        [(True, False), (False, False), (True, True), (False, False), (True, True)]
    assert a_log[4]["rm_refresh/round"] == 2 and a_log[0]["rm/heldout_pairs"] == 4
    assert not torch.allclose(a_start, a_end)  # PPO's frozen model scores as the refreshed one
    saved = a.save(tmp_path / "run")
    assert saved == [tmp_path / "run" / "reward_model_refreshed"]
    again = RewardModel(str(saved[0]), dtype=torch.float32, device="cpu")
    assert torch.allclose(reward_model_scorer(again)(*probe), a_end, atol=1e-5)


def test_original_pairs_of_several_data_files(tmp_path):
    """A reward model trained on several --data files (labelling rounds) replays them all, in order;
    a missing one is named."""
    files = []
    for r, n in ((0, 3), (1, 2)):
        f = tmp_path / f"round{r}.jsonl"
        f.write_text("".join(json.dumps({"prompt": f"p{r}{i}", "chosen": f"c{r}{i}", "rejected": f"r{r}{i}"}) + "\n"
                             for i in range(n)))
        files.append(str(f))
    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "reward_config.yaml").write_text(f"data:\n- {files[0]}\n- {files[1]}\neval_fraction: 0.0\nseed: 0\n")
    train, held = original_pairs(rm)
    assert [p.prompt for p in train] == ["p00", "p01", "p02", "p10", "p11"] and held == []
    (rm / "reward_config.yaml").write_text(f"data:\n- {files[0]}\n- {files[1]}\neval_fraction: 0.4\nseed: 5\n")
    train, held = original_pairs(rm)
    names = ["p00", "p01", "p02", "p10", "p11"]
    keep, out = trainloop.split_rows(list(range(5)), 0.4, 5)  # `ppolm reward`'s split of the concatenation
    assert [p.prompt for p in train] == [names[i] for i in keep] and [p.prompt for p in held] == [names[i] for i in out]
    assert len(held) == 2
    Path(files[1]).unlink()
    with pytest.raises(PPOLMError, match="round1.jsonl"):
        original_pairs(rm)
