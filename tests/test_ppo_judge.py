"""``ppolm ppo --judge``: the reward model's on-policy check and refresh inside PPO runs (ppolm/ppo.py
with ppolm/rm_guard.py), on a micro policy and a micro reward model trained by ``ppolm reward``: the
metrics rows, the refreshed reward model, resume across a refresh, a run left unchanged by a check,
and one error line per bad option."""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from ppolm import config, docs_gen, tracking
from ppolm.cli import main
from ppolm.reward_train import RewardTrainConfig, train_reward
from ppolm.tiny import build_tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

JUDGE_FILE = '''
def length(prompts, completions, **kwargs):
    """Longer answers are better (characters)."""
    return [float(len(c)) for c in completions]
'''
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
WORDS = "the a cat dog sun tree river house blue green small big quick slow old new red road".split()


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("micro"), kind="causal", seed=0, num_layers=1,
                                hidden_size=16, heads=2, kv_heads=1, intermediate_size=32)


@pytest.fixture(scope="module")
def judge_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("judge") / "judge.py"
    p.write_text(JUDGE_FILE)
    return p


@pytest.fixture(scope="module")
def rm_dir(micro_dir, tmp_path_factory):
    """A reward model from ``ppolm reward`` on 16 pairs (longer answer chosen), its top layer trained."""
    tmp = tmp_path_factory.mktemp("rm")
    rng = random.Random(0)
    rows = [{"prompt": f"Say something about item {i}.", "chosen": " ".join(rng.choices(WORDS, k=6)),
             "rejected": " ".join(rng.choices(WORDS, k=2))} for i in range(16)]
    (tmp / "pairs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    train_reward(config.build(RewardTrainConfig, dict(
        model=str(micro_dir), data=str(tmp / "pairs.jsonl"), output_dir=str(tmp / "rm"), epochs=1, batch_size=4,
        lr=2e-3, train_layers=1, eval_fraction=0.25, seed=3, quiet=True, precision="fp32", norm_source="pairs")))
    return tmp / "rm"


def args(model, rm, out, steps=3, extra=()):
    return ["ppo", "--model", str(model), "--reward-model", str(rm), "--steps", str(steps), "--batch-size", "4",
            "--minibatches", "2", "--ppo-epochs", "1", "--response-length", "8", "--precision", "fp32",
            "--device", "cpu", "--save-every", "1", "--keep-last", "2", "--sample-every", "1", "--quiet",
            "--critic-layers", "1", "--output-dir", str(out), *extra]


def rows(path, drop=("time/", "memory/")):
    """The metrics rows without wall times."""
    return [{k: v for k, v in r.items() if not k.startswith(drop) and k != "rm_refresh/seconds"}
            for r in tracking.read_jsonl(path)]


def tensors(root):
    return {f.relative_to(root): f.read_bytes() for f in sorted(root.rglob("*.safetensors"))
            if "checkpoints" not in f.parts}


def test_check_every_step_logs_agreement_and_changes_nothing_else(micro_dir, rm_dir, judge_file, tmp_path):
    """Each step's row holds the check of the policy that sampled it: an accuracy in [0, 1] with its
    binomial SE; the run is otherwise the same bytes as one without --judge (its own random stream)."""
    a, b = tmp_path / "a", tmp_path / "b"
    check = ["--judge", f"{judge_file}:length", "--rm-check-every", "1", "--rm-check-pairs", "6"]
    assert main(args(micro_dir, rm_dir, a, extra=check)) == 0
    got = tracking.read_jsonl(a / "metrics.jsonl")
    assert len(got) == 3
    for r in got:
        p, n = r["rm/onpolicy_accuracy"], r["rm/onpolicy_pairs"]
        assert 0 <= p <= 1 and 1 <= n <= 6 and r["rm/onpolicy_judge_calls"] == n + r["rm/onpolicy_ties"]
        assert r["rm/onpolicy_accuracy_se"] == pytest.approx(math.sqrt(p * (1 - p) / n))
        assert 0 <= r["rm/heldout_accuracy"] <= 1 and r["rm/heldout_pairs"] == 4  # 16 pairs, a quarter held out
    assert not (a / "reward_model_refreshed").exists()  # checked, never refreshed
    assert main(args(micro_dir, rm_dir, b)) == 0
    assert rows(a / "metrics.jsonl", ("time/", "memory/", "rm/")) == rows(b / "metrics.jsonl")
    assert tensors(a) == tensors(b) and len(tensors(a)) >= 2


def test_check_at_evaluations_goes_to_eval_jsonl_and_the_next_step(micro_dir, rm_dir, judge_file, tmp_path):
    """Without --rm-check-every the check runs with each held-out evaluation: eval.jsonl's row at u
    updates, and the metrics row of step u (the last evaluation's in eval.jsonl only)."""
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about the {w}."}) + "\n" for w in WORDS[:6]))
    out = tmp_path / "run"
    assert main(args(micro_dir, rm_dir, out, steps=2, extra=["--judge", f"{judge_file}:length", "--rm-check-pairs",
                                                              "4", "--eval-prompts", str(prompts), "--eval-every", "1"])) == 0
    ev, m = tracking.read_jsonl(out / "eval.jsonl"), tracking.read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in ev] == [0, 1, 2] and all(0 <= r["rm/onpolicy_accuracy"] <= 1 for r in ev)
    for r, e in zip(m, ev):  # step u's row holds the check after u updates
        assert r["rm/onpolicy_accuracy"] == e["rm/onpolicy_accuracy"]
        assert r["rm/onpolicy_pairs"] == e["rm/onpolicy_pairs"]
    for rows_, names in ((ev, docs_gen.EVAL_METRICS), (m, docs_gen.PPO_METRICS)):  # every name documented
        patterns = [re.escape(n).replace("<source>", "[^/]+").replace("<name>", "[a-z_]+") for n in names]
        assert {k for r in rows_ for k in r if not any(re.fullmatch(p, k) for p in patterns)} == set()


def test_refresh_changes_the_reward_model_and_resumes_bit_identically(micro_dir, rm_dir, judge_file, tmp_path):
    """--rm-refresh-every 1: each step's row has the refresh's record, the pairs buffer grows, the
    refreshed reward model (reward_model_refreshed/) differs from the original in its trained layers;
    a run stopped after a refresh and resumed ends with the same bytes as an unbroken one."""
    a, b = tmp_path / "a", tmp_path / "b"
    opts = ["--judge", f"{judge_file}:length", "--rm-refresh-every", "1", "--rm-refresh-pairs", "6",
            "--rm-refresh-steps", "2", "--rm-check-every", "1", "--rm-check-pairs", "4"]
    assert main(args(micro_dir, rm_dir, a, extra=opts)) == 0
    got = tracking.read_jsonl(a / "metrics.jsonl")
    added = [r["rm_refresh/pairs_added"] for r in got]
    assert all(n >= 1 for n in added)
    assert [r["rm_refresh/buffer_pairs"] for r in got] == [12 + sum(added[:i + 1]) for i in range(3)]
    assert [r["rm_refresh/round"] for r in got] == [1, 2, 3]
    new = load_file(a / "reward_model_refreshed" / "model.safetensors")
    old = load_file(rm_dir / "model.safetensors")
    assert new.keys() == old.keys()
    changed = {k for k in new if not (new[k] == old[k]).all()}
    assert any(k.startswith("score") for k in changed) and len(changed) < len(new)  # top layer and head only
    # stopped after the refresh of step 2, resumed for the third
    assert main(args(micro_dir, rm_dir, b, steps=2, extra=opts)) == 0
    assert main(args(micro_dir, rm_dir, b, steps=3, extra=[*opts, "--resume"])) == 0
    assert rows(a / "metrics.jsonl") == rows(b / "metrics.jsonl")
    assert tensors(a) == tensors(b)
    # SIGTERM once the first refresh's row is written: the run stops after its current step, with a checkpoint
    c = tmp_path / "c"
    proc = subprocess.Popen([sys.executable, "-m", "ppolm.cli", *args(micro_dir, rm_dir, c, extra=opts)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not (c / "metrics.jsonl").exists() or not (c / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.monotonic() - t0 < 120, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert "interrupted after step" in err, err[-2000:]  # (after a refresh: one follows every step)
    assert main(args(micro_dir, rm_dir, c, extra=[*opts, "--resume"])) == 0
    assert rows(a / "metrics.jsonl") == rows(c / "metrics.jsonl")
    assert tensors(a) == tensors(c)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_refresh_against_the_starting_policy(micro_dir, rm_dir, judge_file, tmp_path, lora):
    """--rm-refresh-start-share 0.5: half of each refresh's 6 pairs set the policy's answer against the
    starting policy's (the frozen reference; with LoRA the policy with its adapter disabled); the run
    differs from one without it only in the refresh, and resumes bit-identically."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    opts = ["--judge", f"{judge_file}:length", "--rm-refresh-every", "1", "--rm-refresh-pairs", "6",
            "--rm-refresh-steps", "2", "--rm-check-pairs", "0", *(["--lora-r", "2"] if lora else [])]
    share = ["--rm-refresh-start-share", "0.5"]
    assert main(args(micro_dir, rm_dir, a, steps=2, extra=[*opts, *share])) == 0
    got = tracking.read_jsonl(a / "metrics.jsonl")
    assert [r["rm_refresh/start_pairs"] for r in got] == [3, 3]
    assert all(r["rm_refresh/pairs_added"] >= 1 for r in got)
    assert main(args(micro_dir, rm_dir, b, steps=2, extra=[*opts, "--rm-refresh-start-share", "0"])) == 0
    plain = tracking.read_jsonl(b / "metrics.jsonl")
    assert [r["rm_refresh/start_pairs"] for r in plain] == [0, 0]
    # the first step's rollout and update come before any refresh: the same in both runs
    before = {k: v for k, v in got[0].items() if not k.startswith(("time/", "memory/", "rm_refresh/", "perf/"))}
    assert before == {k: v for k, v in plain[0].items() if not k.startswith(("time/", "memory/", "rm_refresh/", "perf/"))}
    assert main(args(micro_dir, rm_dir, c, steps=1, extra=[*opts, *share])) == 0
    assert main(args(micro_dir, rm_dir, c, steps=2, extra=[*opts, *share, "--resume"])) == 0
    assert rows(a / "metrics.jsonl") == rows(c / "metrics.jsonl")
    assert tensors(a) == tensors(c)


@pytest.mark.parametrize("extra, message", [
    (["--rm-refresh-every", "2"], "--rm-refresh-every needs --judge SPEC"),
    (["--rm-check-every", "2"], "--rm-check-every needs --judge SPEC"),
    (["--judge", "JUDGE", "--rm-refresh-every", "-1"], "--rm-refresh-every must be >= 0; got -1"),
    (["--judge", "JUDGE", "--rm-refresh-every", "2", "--rm-refresh-pairs", "0"],
     "--rm-refresh-every needs --rm-refresh-pairs >= 1 and --rm-refresh-steps >= 1"),
    (["--judge", "JUDGE", "--rm-check-every", "1", "--judge-temperature", "-0.5"], "--judge-temperature must be >= 0"),
    (["--judge", "JUDGE"], "--judge is never used"),
    (["--judge", "JUDGE", "--rm-refresh-every", "2", "--rm-refresh-start-share", "1.5"],
     "--rm-refresh-start-share must be in [0, 1]"),
    (["--judge", "nowhere.py:fn", "--rm-check-every", "1"], "nowhere.py"),
], ids=["refresh-no-judge", "check-no-judge", "negative", "no-pairs", "temperature", "unused", "start-share",
     "missing-file"])
def test_bad_judge_options_give_one_error_line(micro_dir, rm_dir, judge_file, tmp_path, capsys, extra, message):
    out = tmp_path / "run"
    extra = [f"{judge_file}:length" if x == "JUDGE" else x for x in extra]
    assert main(args(micro_dir, rm_dir, out, extra=extra)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("error:") == 1 and "Traceback" not in err
    assert not out.exists()


def test_judge_needs_a_reward_model(micro_dir, judge_file, tmp_path, capsys):
    out = tmp_path / "run"
    a = ["ppo", "--model", str(micro_dir), "--reward-fn", f"{judge_file}:length", "--judge", f"{judge_file}:length",
         "--rm-check-every", "1", "--output-dir", str(out)]
    assert main(a) == 2
    err = capsys.readouterr().err
    assert "error: --judge checks and refreshes a reward model: give --reward-model DIR" in err
    assert not out.exists()


@pytest.mark.parametrize("over", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_check_and_refresh_under_torchrun_keep_the_processes_equal(micro_dir, rm_dir, judge_file, tmp_path, over):
    """2 processes: each samples its share of the check's and refresh's answers (with --fsdp, from the
    gathered policy), process 0 asks the judge; every process ends with the same weights and metrics,
    and the refreshed model is written once."""
    out, summary = tmp_path / "run", tmp_path / "sum"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ppolm",
           *args(micro_dir, rm_dir, out, steps=2, extra=["--judge", f"{judge_file}:length", "--rm-check-every", "1",
                                                        "--rm-check-pairs", "4", "--rm-refresh-every", "1",
                                                        "--rm-refresh-pairs", "4", "--rm-refresh-steps", "2",
                                                        "--rm-refresh-start-share", "0.5", *over])]
    p = subprocess.run(cmd, env={**ENV, "PPOLM_RANK_SUMMARY": str(summary)}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = tracking.read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in got] == [0, 1] and all(r["rm_refresh/pairs_added"] >= 1 for r in got)
    assert all(0 <= r["rm/onpolicy_accuracy"] <= 1 for r in got) and all(r["rm_refresh/start_pairs"] == 2 for r in got)
    # (with --fsdp the checksums are of the gathered weights, equal by construction: the rows are the check)
    one, two = (json.loads((summary / f"rank{r}.json").read_text()) for r in (0, 1))
    assert one["weights"] == two["weights"] and one["last_row"] == two["last_row"]
    assert (out / "reward_model_refreshed" / "model.safetensors").exists()


def test_resume_needs_the_same_judge_options(micro_dir, rm_dir, judge_file, tmp_path, capsys):
    """The check's and refresh's state is in the checkpoint: --resume with other --judge/--rm-* options
    is refused with one line, the run's files untouched."""
    out = tmp_path / "run"
    opts = ["--judge", f"{judge_file}:length", "--rm-check-every", "1", "--rm-check-pairs", "2"]
    assert main(args(micro_dir, rm_dir, out, steps=1, extra=opts)) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(args(micro_dir, rm_dir, out, steps=2, extra=[*opts, "--rm-check-pairs", "3", "--resume"])) == 2
    err = capsys.readouterr().err
    assert "error: --output-dir" in err and "rm_check_pairs: 2 then, 3 now" in err and "Traceback" not in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


TURNCOAT = '''
import os

import torch

from ppolm.rewards import RewardModel
from ppolm.rm_check import reward_model_scorer

STATE = {"seen": 0}


def turncoat(prompts, completions, **kwargs):
    """The proxy's own scores for the first check's answers, their opposite afterwards."""
    if "score" not in STATE:
        STATE["score"] = reward_model_scorer(RewardModel(os.environ["TURNCOAT_RM"], dtype=torch.float32, device="cpu"))
    flip = STATE["seen"] >= int(os.environ["TURNCOAT_AFTER"])
    STATE["seen"] += len(completions)
    scores = STATE["score"](list(prompts), list(completions)).tolist()
    return [-s if flip else s for s in scores]
'''


def test_drift_alarm_fires_live_when_the_judge_turns(micro_dir, rm_dir, tmp_path, monkeypatch, capsys):
    """A judge that agrees with the proxy at the first check (accuracy 1) and disagrees from then on
    (accuracy 0): reward_model_drift fires at the second step, warned once and marked in its row."""
    judge = tmp_path / "turncoat.py"
    judge.write_text(TURNCOAT)
    monkeypatch.setenv("TURNCOAT_RM", str(rm_dir))
    monkeypatch.setenv("TURNCOAT_AFTER", "8")  # the first check's 4 pairs
    out = tmp_path / "run"
    assert main(args(micro_dir, rm_dir, out, steps=2, extra=["--judge", f"{judge}:turncoat", "--rm-check-every", "1",
                                                              "--rm-check-pairs", "4"])) == 0
    got = tracking.read_jsonl(out / "metrics.jsonl")
    assert [(r["rm/onpolicy_accuracy"], r["rm/onpolicy_accuracy_se"]) for r in got] == [(1.0, 0.0), (0.0, 0.0)]
    assert "alarm/reward_model_drift" not in got[0] and got[1]["alarm/reward_model_drift"] == 1
    assert capsys.readouterr().err.count("warning: alarm reward_model_drift at step 1") == 1
