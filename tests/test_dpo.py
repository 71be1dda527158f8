"""``ppolm dpo`` on tiny random models: log-probs and loss by hand, learning, LoRA reference, resume, bad input."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from ppolm import config, models, tiny
from ppolm.cli import main
from ppolm.dpo import DPOConfig, load_pair_examples, pair_logps, reference_logps, sequence_logps, train_dpo

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
WORDS = "the a cat dog sun tree river house blue green small big quick slow old new red road hill lamp".split()
MARKER = "kindly"
CPU = torch.device("cpu")


def marker_pairs(n, seed):
    """As tests/test_reward.py: the chosen response alone holds the marker word, the rejected one another
    word at a random place; same lengths, so only the word tells them apart."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 8))]
        chosen, rejected = list(words), list(words)
        chosen.insert(rng.randint(0, len(words)), MARKER)
        rejected.insert(rng.randint(0, len(words)), rng.choice(WORDS))
        rows.append({"prompt": f"Say something about item {i}.", "chosen": " ".join(chosen),
                     "rejected": " ".join(rejected)})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dpo_cfg(model_dir, data, out, **over):
    base = dict(model=str(model_dir), data=str(data), output_dir=str(out), epochs=2, batch_size=8, lr=1e-3,
                beta=0.5, quiet=True, precision="fp32", device="cpu")
    return config.build(DPOConfig, {**base, **over})


def full_forward_logps(model, ex):
    """log p(response | prompt) from the model's ordinary forward over the whole sequence: position t's
    logits predict token t + 1, so the response tokens n_prompt .. L-1 are read at n_prompt-1 .. L-2."""
    ids = torch.tensor([ex.ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)  # (L, V)
    return sum(float(logp[t - 1, ex.ids[t]]) for t in range(ex.n_prompt, len(ex.ids)))


def test_logps_and_loss_match_hand_computation(tiny_policy_dir, tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "Name a colour.", "chosen": "Blue, kindly.", "rejected": "A car."},
        {"prompt": [{"role": "user", "content": "Say hi"}], "chosen": "Hello there!", "rejected": "No"},
    ])
    pairs = load_pair_examples(str(data), tokenizer, True, 512)
    (c0, r0), (c1, r1) = pairs
    assert c0.ids[:c0.n_prompt] == r0.ids[:r0.n_prompt] and c0.n_prompt == r0.n_prompt  # one prompt, two answers
    assert tokenizer.decode(c0.ids[c0.n_prompt:]) == "Blue, kindly.<|im_end|>"  # the response + EOS only
    reference = models.load_causal_lm(tiny_policy_dir, tokenizer=tokenizer)
    policy = models.load_causal_lm(tiny_policy_dir, tokenizer=tokenizer)
    with torch.no_grad():
        policy.model.norm.weight.mul_(1.7)  # another policy: every log-prob moves
    pad = tokenizer.pad_token_id

    # the reference's cached log-probs = sums over response tokens of the plain forward's log-softmax
    ref = reference_logps(reference, pairs, 8, pad, CPU, "fp32", per_token=False)
    by_hand = [[full_forward_logps(reference, c), full_forward_logps(reference, r)] for c, r in pairs]
    assert ref.shape == (2, 2) and torch.allclose(ref.double(), torch.tensor(by_hand, dtype=torch.float64), atol=1e-3)
    # per-token means (IPO): divided by the response lengths (tokens + EOS)
    mean_ref = reference_logps(reference, pairs, 1, pad, CPU, "fp32", per_token=True)
    lengths = [[len(c.ids) - c.n_prompt, len(r.ids) - r.n_prompt] for c, r in pairs]
    assert torch.allclose(mean_ref.double(), torch.tensor(by_hand, dtype=torch.float64) / torch.tensor(lengths), atol=1e-4)

    pol = [[full_forward_logps(policy, c), full_forward_logps(policy, r)] for c, r in pairs]
    assert all(abs(p[0] - h[0]) > 0.05 for p, h in zip(pol, by_hand))
    beta = 0.5
    hs = [(p[0] - q[0]) - (p[1] - q[1]) for p, q in zip(pol, by_hand)]
    dpo_hand = sum(math.log1p(math.exp(-beta * h)) for h in hs) / 2  # -log sigmoid(beta h)
    ipo_hand = sum((h - 1 / (2 * beta)) ** 2 for h in hs) / 2  # (with sums, to check the formula)
    from ppolm.core import dpo_loss

    pc, pr = pair_logps(policy, pairs, pad, CPU, per_token=False)
    loss, rc, rr = dpo_loss(pc, pr, ref[:, 0], ref[:, 1], beta)
    assert loss.item() == pytest.approx(dpo_hand, abs=1e-3)
    assert rc.tolist() == pytest.approx([beta * (p[0] - q[0]) for p, q in zip(pol, by_hand)], abs=1e-3)
    assert rr.tolist() == pytest.approx([beta * (p[1] - q[1]) for p, q in zip(pol, by_hand)], abs=1e-3)
    assert dpo_loss(pc, pr, ref[:, 0], ref[:, 1], beta, loss_type="ipo")[0].item() == pytest.approx(ipo_hand,
                                                                                                    rel=1e-3)
    # one sequence at a time gives the same sums as the padded batch of four
    alone = torch.cat([sequence_logps(policy, [e], pad, CPU)[0] for e in (c0, c1, r0, r1)])
    assert torch.allclose(alone, torch.cat([pc, pr]), atol=1e-4)


def test_dpo_learns_the_marker_and_saves_a_loadable_policy(tiny_policy_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    train = write_jsonl(tmp_path / "train.jsonl", marker_pairs(64, seed=0))
    held = write_jsonl(tmp_path / "held.jsonl", marker_pairs(32, seed=1))
    out = tmp_path / "dpo"
    rows = train_dpo(dpo_cfg(tiny_policy_dir, train, out, eval_data=str(held)))
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    first, last = rows[0], rows[-1]
    # before training the policy is the reference: every implicit reward is 0, the loss log 2
    assert first["eval/rewards/chosen"] == first["eval/rewards/margins"] == 0.0
    assert first["eval/loss"] == pytest.approx(math.log(2), abs=1e-6) and first["eval/rewards/accuracies"] == 0.0
    assert last["eval/rewards/accuracies"] >= 0.9 and last["eval/rewards/margins"] > 0.2, last
    assert last["eval/loss"] < first["eval/loss"] - 0.1 and last["loss"] < rows[1]["loss"]
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected"):
        assert math.isfinite(last[key]) and math.isfinite(last[f"eval/{key}"]), key
    assert last["rewards/margins"] == pytest.approx(last["rewards/chosen"] - last["rewards/rejected"], abs=1e-6)
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in logged] == [0, 1, 2] and "eval/rewards/accuracies" in logged[-1]
    assert (out / "dpo_config.yaml").is_file()
    # the weights changed, and the saved policy is the one evaluated last
    before, after = load_file(str(tiny_policy_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(before) == set(after) and not all(torch.equal(before[k], after[k]) for k in before)
    AutoModelForCausalLM.from_pretrained(out)
    tok = models.load_tokenizer(out)
    saved = models.load_causal_lm(out, tokenizer=tok)
    pairs = load_pair_examples(str(held), tok, True, 512)
    c, _ = pair_logps(saved, pairs, tok.pad_token_id, CPU, per_token=False)
    assert c.mean().item() == pytest.approx(last["eval/logps/chosen"], abs=1e-3)


def test_lora_reference_is_the_model_with_the_adapter_disabled(tiny_policy_dir, tmp_path, tokenizer):
    from ppolm.trainloop import apply_lora

    data = write_jsonl(tmp_path / "p.jsonl", marker_pairs(4, seed=3))
    pairs = load_pair_examples(str(data), tokenizer, True, 512)
    pad = tokenizer.pad_token_id
    base = models.load_causal_lm(tiny_policy_dir, tokenizer=tokenizer)
    base_logps = reference_logps(base, pairs, 8, pad, CPU, "fp32", per_token=False)
    cfg = dpo_cfg(tiny_policy_dir, data, tmp_path / "o", lora_r=4)
    peft_model = apply_lora(models.load_causal_lm(tiny_policy_dir, tokenizer=tokenizer), cfg, "CAUSAL_LM")
    with torch.no_grad():  # an adapter that has learned something (peft starts with B = 0)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    c, r = pair_logps(peft_model, pairs, pad, CPU, per_token=False)
    assert not torch.allclose(torch.stack([c, r], 1), base_logps, atol=1e-2)  # the adapter is on for training
    assert torch.allclose(reference_logps(peft_model, pairs, 8, pad, CPU, "fp32", per_token=False), base_logps,
                          atol=1e-5)


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_micro")
    return {"model": tiny.build_tiny_model_dir(root / "micro", kind="causal", seed=0, num_layers=1, hidden_size=16,
                                                 heads=2, kv_heads=1, intermediate_size=32),
            "pairs": write_jsonl(root / "pairs.jsonl", marker_pairs(16, seed=4)),
            "held": write_jsonl(root / "held.jsonl", marker_pairs(4, seed=5))}


def cli_args(micro, out, epochs, extra=()):
    return ["dpo", "--model", str(micro["model"]), "--data", str(micro["pairs"]), "--eval-data", str(micro["held"]),
            "--epochs", str(epochs), "--batch-size", "2", "--lr", "1e-2", "--lr-schedule", "constant",
            "--precision", "fp32", "--device", "cpu", "--save-every", "3", "--quiet", "--output-dir", str(out),
            *extra]


@pytest.mark.parametrize("extra", [["--loss-type", "ipo"], ["--lora-r", "4", "--label-smoothing", "0.1"]],
                         ids=["ipo", "lora-cdpo"])
def test_resume_is_bit_identical(micro, tmp_path, extra):
    """Two epochs in one run, or one epoch then --resume for the second (constant learning rate, so the
    total may grow): the same model bytes and metrics rows."""
    from safetensors.torch import load_file

    from ppolm import tracking

    def rows(path):
        return [{k: v for k, v in r.items() if k not in ("time_s", "tokens_per_s")}
                for r in tracking.read_jsonl(path / "metrics.jsonl")]

    a, b = tmp_path / "a", tmp_path / "b"
    assert main(cli_args(micro, a, 2, extra)) == 0
    assert main(cli_args(micro, b, 1, extra)) == 0
    assert main(cli_args(micro, b, 2, [*extra, "--resume"])) == 0
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert rows(a) == rows(b) and [r["epoch"] for r in rows(a)] == [0, 1, 2]
    start = load_file(str(micro["model"] / "model.safetensors"))
    end = load_file(str(a / "model.safetensors"))
    assert not all(torch.equal(start[k], end[k]) for k in start)  # it trained (so equal bytes mean something)


def test_nan_loss_is_skipped_counted_and_kept_out_of_the_means(micro, tmp_path, capsys, monkeypatch):
    """No input of finite log-probs makes the DPO loss NaN, so the third training batch's loss is made NaN
    in-process; the model, data, optimiser and checkpoints are the real run."""
    import ppolm.core
    from ppolm import tracking

    real, calls = ppolm.core.dpo_loss, {"n": 0}

    def nan_third(pc, *args, **kwargs):
        loss, rc, rr = real(pc, *args, **kwargs)
        if pc.requires_grad:  # a training step (evaluation runs without grad)
            calls["n"] += 1
            if calls["n"] == 3:
                return loss * float("nan"), rc * float("nan"), rr
        return loss, rc, rr

    monkeypatch.setattr(ppolm.core, "dpo_loss", nan_third)
    out = tmp_path / "run"
    assert main(cli_args(micro, out, 1)) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "update 3 (epoch 1): non-finite loss (nan); update skipped" in err, err
    (_, row) = tracking.read_jsonl(out / "metrics.jsonl")
    assert row["guard/skipped_updates"] == 1
    assert all(math.isfinite(row[k]) for k in ("loss", "rewards/chosen", "rewards/margins", "eval/loss"))


def test_help_lists_the_dpo_options(capsys):
    with pytest.raises(SystemExit):
        main(["dpo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--beta", "--loss-type {sigmoid,ipo}", "--label-smoothing", "--lora-r", "--eval-data",
                 "--save-every", "--resume", "--overwrite", "--max-skipped-updates"):
        assert flag in text, flag
    assert "KL strength" in text


@pytest.mark.parametrize("extra, expect", [
    pytest.param(None, r"row 1: 'chosen' equals 'rejected', so the pair prefers nothing", id="chosen-equals-rejected"),
    pytest.param(["--beta", "0"], r"--beta must be > 0; got 0\.0", id="beta-zero"),
    pytest.param(["--label-smoothing", "0.5"], r"--label-smoothing must be in \[0, 0\.5\)", id="smoothing-half"),
    pytest.param(["--label-smoothing", "-0.1"], r"--label-smoothing must be in \[0, 0\.5\)", id="smoothing-negative"),
])
def test_bad_input_is_one_line_exit_2(micro, tmp_path, extra, expect):
    import re

    data = micro["pairs"]
    if extra is None:
        data = write_jsonl(tmp_path / "same.jsonl", [{"prompt": "hi", "chosen": "same answer",
                                                      "rejected": "same answer"}])
    out = tmp_path / "out"
    argv = ["dpo", "--model", str(micro["model"]), "--data", str(data), "--output-dir", str(out), "--device", "cpu",
            "--precision", "fp32", "--quiet", *(extra or [])]
    p = subprocess.run([sys.executable, "-m", "ppolm.cli", *argv], env=ENV, capture_output=True, text=True,
                       timeout=300)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert len(errors) == 1 and re.search(expect, errors[0]), p.stderr
    assert not out.exists()  # checked before anything is written
