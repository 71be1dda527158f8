"""``ppolm reward`` / ``reward-eval`` on tiny random models: learning, normalisation, outputs, PPO use, bad input."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from ppolm import config, models
from ppolm.cli import main
from ppolm.pairs import encode_pairs, load_pairs
from ppolm.reward_train import (
    RewardTrainConfig,
    evaluate_pairs,
    normalize_reward_model,
    reference_scores,
    train_reward,
)
from ppolm.rewards import NORM_FILE, RewardModel, read_norm

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


WORDS = "the a cat dog sun tree river house blue green small big quick slow old new red road hill lamp".split()
MARKER = "kindly"


def marker_pairs(n, seed):
    """Pairs whose chosen response alone contains the marker word; same lengths, so only the word tells."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 8))]
        chosen = list(words)
        chosen.insert(rng.randint(0, len(words)), MARKER)
        rejected = list(words)
        rejected.insert(rng.randint(0, len(words)), rng.choice(WORDS))
        rows.append({"prompt": f"Say something about item {i}.", "chosen": " ".join(chosen),
                     "rejected": " ".join(rejected)})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rm_cfg(model_dir, data, out, **over):
    base = dict(model=str(model_dir), data=str(data), output_dir=str(out), epochs=2, batch_size=8, lr=3e-3,
                train_layers=1, quiet=True, precision="fp32", norm_samples=16, norm_response_length=8)
    return config.build(RewardTrainConfig, {**base, **over})


@pytest.fixture(scope="module")
def trained(tiny_policy_dir, tmp_path_factory):
    """A tiny RM trained from the tiny *causal* policy (as from `ppolm sft`), plus its data."""
    root = tmp_path_factory.mktemp("rm")
    train = write_jsonl(root / "train.jsonl", marker_pairs(64, seed=0))
    held = write_jsonl(root / "held.jsonl", marker_pairs(32, seed=1))
    rows = train_reward(rm_cfg(tiny_policy_dir, train, root / "rm_a", eval_data=str(held)))
    return {"dir": root / "rm_a", "rows": rows, "train": train, "held": held, "root": root}


def test_marker_pairs_reach_high_held_out_accuracy(trained):
    rows = trained["rows"]
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    assert rows[0]["eval_accuracy"] < 0.8 and rows[-1]["eval_accuracy"] >= 0.9, rows
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    logged = [json.loads(x) for x in (trained["dir"] / "metrics.jsonl").read_text().splitlines()]
    assert all({"eval_accuracy", "eval_loss"} <= set(r) for r in logged)
    assert (trained["dir"] / "reward_config.yaml").is_file()


def test_output_loads_in_plain_transformers_and_ranks_as_ppolm(trained, tokenizer):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    d = trained["dir"]
    hf = AutoModelForSequenceClassification.from_pretrained(d).eval()
    hf_tok = AutoTokenizer.from_pretrained(d)
    assert hf_tok.get_vocab() == tokenizer.get_vocab()
    rm = RewardModel(str(d), dtype=torch.float32, device="cpu")
    gain, bias = read_norm(d)
    assert (gain, bias) != (1.0, 0.0)
    encoded = encode_pairs(load_pairs(str(trained["held"]))[:6], rm.tokenizer, True, 512)
    for c, r, _ in encoded:
        raw = [hf(input_ids=torch.tensor([x])).logits[0, 0].item() for x in (c, r)]
        ours = [rm.score_ids(torch.tensor([x]), torch.ones(1, len(x), dtype=torch.long)).item() for x in (c, r)]
        assert ours == pytest.approx([gain * v + bias for v in raw], abs=1e-4)  # a monotone affine map
        assert (raw[0] > raw[1]) == (ours[0] > ours[1])


def test_normalisation_gives_mean_0_std_1_on_reference_samples(tiny_rm_dir, tiny_policy_dir, tmp_path):
    rm_dir = tmp_path / "rm"
    shutil.copytree(tiny_rm_dir, rm_dir)
    prompts = ["Tell me a story.", "What is the weather like?", [{"role": "user", "content": "Hello!"}]]
    kw = dict(response_length=8, seed=3, precision="fp32")
    gain, bias = normalize_reward_model(rm_dir, str(tiny_policy_dir), prompts, 24, device="cpu", **kw)
    stored = json.loads((rm_dir / NORM_FILE).read_text())
    assert stored["gain"] == gain and stored["bias"] == bias and stored["n_samples"] == 24
    rm = RewardModel(str(rm_dir), dtype=torch.float32, device="cpu")  # loads with the normalisation applied
    same = reference_scores(rm, str(tiny_policy_dir), prompts, 24, **kw)
    assert same.mean().item() == pytest.approx(0.0, abs=1e-4)
    assert same.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)
    fresh = reference_scores(rm, str(tiny_policy_dir), prompts, 32, **{**kw, "seed": 4})  # new samples
    assert abs(fresh.mean().item()) < 0.6 and 0.5 < fresh.std().item() < 1.6


def test_train_layers_freezes_the_lower_layers(tiny_policy_dir, trained, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "top1"
    train_reward(rm_cfg(tiny_policy_dir, trained["train"], out, train_layers=1, epochs=1, normalize=False))
    before, after = load_file(str(tiny_policy_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for k, v in after.items():
        if k.startswith("score."):
            continue
        changed = not torch.equal(before[k], v)
        assert changed == (k.startswith("model.layers.1.") or k == "model.norm.weight"), k


def test_lora_margin_and_centring(tiny_policy_dir, trained, tmp_path):
    rows = marker_pairs(24, seed=5)
    for r in rows:
        r["margin"] = 1.0
    data = write_jsonl(tmp_path / "m.jsonl", rows)
    pairs = load_pairs(str(data))
    assert all(p.margin == 1.0 for p in pairs)
    assert all(p.margin == 0.0 for p in load_pairs(str(data), margin_column=None))
    out = tmp_path / "lora"
    res = train_reward(rm_cfg(tiny_policy_dir, data, out, lora_r=4, center_coef=0.1, epochs=1, normalize=False))
    assert "eval_accuracy" in res[-1]
    assert not (out / NORM_FILE).exists() and models.has_scalar_head(out)
    rm = RewardModel(str(out), dtype=torch.float32, device="cpu")
    enc = encode_pairs(pairs, rm.tokenizer, True, 512)
    with_m = evaluate_pairs(lambda s: rm.score_texts([rm.tokenizer.decode(x) for x in s]), enc, 8)
    no_m = evaluate_pairs(lambda s: rm.score_texts([rm.tokenizer.decode(x) for x in s]),
                          [(c, r, 0.0) for c, r, _ in enc], 8)
    assert with_m["accuracy"] == no_m["accuracy"] and with_m["loss"] > no_m["loss"]


def test_ppo_runs_with_the_trained_rm_and_an_ensemble_of_two(trained, tiny_policy_dir, tmp_path):
    from ppolm.ppo import train_ppo
    from ppolm.ppo_config import PPOConfig

    rm_b = trained["root"] / "rm_b"
    if not rm_b.exists():
        train_reward(rm_cfg(tiny_policy_dir, trained["train"], rm_b, epochs=1, seed=1, train_layers=0,
                            normalize=False))
    base = dict(model=str(tiny_policy_dir), steps=1, batch_size=4, minibatches=1, ppo_epochs=1, response_length=6,
                quiet=True, precision="fp32", prompts=str(trained["held"]))
    one = train_ppo(config.build(PPOConfig, {**base, "reward_model": [str(trained["dir"])],
                                             "output_dir": str(tmp_path / "p1")}))
    assert "reward/rm_a" in one.metrics[0]
    two = train_ppo(config.build(PPOConfig, {**base, "reward_model": [str(trained["dir"]), str(rm_b)],
                                             "reward_ensemble": "min", "output_dir": str(tmp_path / "p2")}))
    m = two.metrics[0]
    assert {"reward/rm/rm_a", "reward/rm/rm_b", "reward/ensemble_min"} <= set(m)
    assert m["reward/ensemble_min"] <= min(m["reward/rm/rm_a"], m["reward/rm/rm_b"]) + 1e-6


def test_reward_eval_cli(trained, capsys, tmp_path):
    out = tmp_path / "r.json"
    code = main(["reward-eval", "--reward-model", str(trained["dir"]), "--data", str(trained["held"]),
                 "--output", str(out), "--precision", "fp32"])
    line = capsys.readouterr().out
    assert code == 0 and "accuracy" in line
    r = json.loads(out.read_text())
    assert r["n"] == 32 and r["accuracy"] == pytest.approx(trained["rows"][-1]["eval_accuracy"])


def cli_error(args, capsys):
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("rows,needle", [
    ([{"prompt": "p", "chosen": "same", "rejected": "same"}], "'chosen' equals 'rejected'"),
    ([{"prompt": "p", "chosen": "a"}], "no 'rejected' column (columns: prompt, chosen)"),
    ([{"prompt": "p", "good": "a", "bad": "b"}], "no 'chosen' or 'rejected' column"),
    ([{"chosen": "a", "rejected": "b"}], "add a 'prompt' column"),
    ([{"prompt": "p", "chosen": "a", "rejected": "b", "margin": "big"}], "'margin' must be a number"),
    ([], "holds no rows"),
])
def test_bad_pairs_are_one_line_exit_2(tiny_policy_dir, tmp_path, capsys, rows, needle):
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    line = cli_error(["reward", "--model", str(tiny_policy_dir), "--data", str(data), "--output-dir",
                      str(tmp_path / "o"), "--quiet"], capsys)
    assert needle in line, line


def test_reward_model_without_scalar_head(tiny_policy_dir, trained, tmp_path, capsys):
    line = cli_error(["reward-eval", "--reward-model", str(tiny_policy_dir), "--data", str(trained["held"])], capsys)
    assert "no scalar head" in line and "ppolm reward" in line
    line = cli_error(["ppo", "--model", str(tiny_policy_dir), "--reward-model", str(tiny_policy_dir),
                      "--output-dir", str(tmp_path / "p"), "--steps", "1", "--quiet"], capsys)
    assert "no scalar head" in line


def test_chat_list_pairs(tmp_path, tokenizer):
    conv = [{"role": "user", "content": "Hi"}]
    data = write_jsonl(tmp_path / "c.jsonl", [
        {"chosen": conv + [{"role": "assistant", "content": "Hello!"}],
         "rejected": conv + [{"role": "assistant", "content": "Go away."}]},
        {"prompt": conv, "chosen": [{"role": "assistant", "content": "Hello!"}],
         "rejected": [{"role": "assistant", "content": "Go away."}]},
        {"prompt": "Hi", "chosen": "Hello!", "rejected": "Go away."},
    ])
    a, b, c = encode_pairs(load_pairs(str(data)), tokenizer, True, 512)
    assert a == b == c
    assert tokenizer.decode(a[0]).endswith("<|im_start|>assistant\nHello!<|im_end|>")


@pytest.mark.parametrize("layers", [0, 1])
def test_trunk_cache_trains_the_same_model_as_recomputing(tiny_policy_dir, trained, tmp_path, layers):
    """With the lower layers frozen, training the top ones on the cached trunk output gives the same
    weights (to float rounding) and held-out accuracy as running the whole model every step."""
    from safetensors.torch import load_file

    runs = {}
    for cache in (True, False):
        out = tmp_path / f"cache_{cache}"
        rows = train_reward(rm_cfg(tiny_policy_dir, trained["train"], out, eval_data=str(trained["held"]),
                                   train_layers=layers, trunk_cache=cache, normalize=False))
        runs[cache] = (rows, load_file(str(out / "model.safetensors")))
    (rows_c, w_c), (rows_r, w_r) = runs[True], runs[False]
    assert [r["eval_accuracy"] for r in rows_c] == [r["eval_accuracy"] for r in rows_r]
    for a, b in zip(rows_c, rows_r):  # the same losses, to float rounding
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-3, abs=1e-5)
    start = load_file(str(tiny_policy_dir / "model.safetensors"))
    moved = 0
    for k, v in w_c.items():
        if k in start and not torch.equal(v, start[k]):
            moved += 1
            # Adam turns rounding-level gradient differences into lr-sized steps on a few near-zero
            # entries, so compare the difference with how far training moved the tensor
            diff, travel = (v - w_r[k]).abs(), (v - start[k]).abs()
            assert diff.median() < 1e-3 * travel.median() + 1e-7, (k, diff.median(), travel.median())
        else:
            assert torch.allclose(v, w_r[k], atol=1e-6), k
    assert moved == (0 if layers == 0 else 10)  # head only; or layer 1's 9 tensors and the final norm


def test_normalise_on_the_pairs_and_write_held_out_scores(tiny_policy_dir, trained, tmp_path):
    """--norm-source pairs: over every distinct chosen/rejected text of the data and eval data, the
    normalised scores (full forward of the saved model) have mean 0 and std 1; eval_scores.jsonl holds
    the final model's raw scores of each held-out pair, in order, and its accuracy is the last row's."""
    from ppolm.rollout import left_pad

    out = tmp_path / "rm"
    rows = train_reward(rm_cfg(tiny_policy_dir, trained["train"], out, eval_data=str(trained["held"]),
                               norm_source="pairs"))
    norm = json.loads((out / NORM_FILE).read_text())
    assert norm["source"] == "pairs" and rows[-1]["norm_gain"] == pytest.approx(norm["gain"])
    tok = models.load_tokenizer(out)
    train = encode_pairs(load_pairs(str(trained["train"])), tok, True, 512)
    held = encode_pairs(load_pairs(str(trained["held"])), tok, True, 512)
    texts = list(dict.fromkeys(tuple(x) for c, r, _ in train + held for x in (c, r)))
    assert norm["n_samples"] == len(texts)
    rm = RewardModel(str(out), dtype=torch.float32, device="cpu")
    got = []
    for i in range(0, len(texts), 16):
        ids, mask = left_pad([list(x) for x in texts[i:i + 16]], tok.pad_token_id, "cpu")
        got.append(rm.score_ids(ids, mask))
    s = torch.cat(got)
    assert abs(float(s.mean())) < 1e-3 and float(s.std(unbiased=False)) == pytest.approx(1.0, abs=1e-3)
    scored = [json.loads(x) for x in (out / "eval_scores.jsonl").read_text().splitlines()]
    assert len(scored) == len(held) == 32
    assert sum(r["correct"] for r in scored) / 32 == pytest.approx(rows[-1]["eval_accuracy"])
    c, r, _ = held[0]
    ids, mask = left_pad([c, r], tok.pad_token_id, "cpu")
    raw = (rm.score_ids(ids, mask) - rm.bias) / rm.gain
    assert raw.tolist() == pytest.approx([scored[0]["score_chosen"], scored[0]["score_rejected"]], abs=1e-4)


def ranked_pairs(n_prompts, seed):
    """K = 3 responses per prompt, the one with the marker ranked first: its 2 pairs, plus one
    between the other two (chosen at random, so that pair carries no signal)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n_prompts):
        base = [[rng.choice(WORDS) for _ in range(rng.randint(4, 8))] for _ in range(3)]
        best = " ".join(base[0][:2] + [MARKER] + base[0][2:])
        a, b = " ".join(base[1]), " ".join(base[2])
        prompt = f"Describe thing {i}."
        rows += [{"prompt": prompt, "chosen": best, "rejected": a}, {"prompt": prompt, "chosen": best, "rejected": b},
                 {"prompt": prompt, "chosen": a, "rejected": b}]
    return rows


def test_group_by_prompt_scores_each_response_once_and_learns(tiny_policy_dir, tmp_path, tokenizer):
    """--group-by-prompt: a step runs each distinct response of its prompts once (the epoch's token
    count is that of the distinct texts, half that of pair by pair with K = 3), and the marker
    is learnt as well as pair by pair."""
    train = write_jsonl(tmp_path / "k3.jsonl", ranked_pairs(32, seed=3))
    held = write_jsonl(tmp_path / "held.jsonl", marker_pairs(32, seed=1))
    rows = {}
    for group in (True, False):
        rows[group] = train_reward(rm_cfg(tiny_policy_dir, train, tmp_path / f"g{group}", eval_data=str(held),
                                          group_by_prompt=group, batch_size=4 if group else 12, epochs=3,
                                          normalize=False))
    enc = encode_pairs(load_pairs(str(train)), tokenizer, True, 512)
    pair_tokens = sum(len(c) + len(r) for c, r, _ in enc)
    distinct_tokens = sum(len(x) for x in {tuple(x) for c, r, _ in enc for x in (c, r)})
    assert distinct_tokens * 2 == pair_tokens  # each text is in 2 of its prompt's 3 pairs: 3 texts, not 6
    assert rows[False][1]["tokens"] == pair_tokens
    assert rows[True][1]["tokens"] == distinct_tokens
    # 8 steps of 4 prompts (12 pairs) per epoch either way; both learn the marker
    assert rows[True][-1]["eval_accuracy"] >= 0.9 and rows[False][-1]["eval_accuracy"] >= 0.9, rows


def test_group_by_prompt_with_unique_prompts_trains_as_pair_by_pair(tiny_policy_dir, trained, tmp_path):
    """Each pair its own prompt: a group is one pair and the loss is the plain mean, so the two modes
    give the same losses and accuracies (to float rounding)."""
    runs = [train_reward(rm_cfg(tiny_policy_dir, trained["train"], tmp_path / f"u{g}", eval_data=str(trained["held"]),
                                group_by_prompt=g, normalize=False)) for g in (True, False)]
    for a, b in zip(*runs):
        assert a["eval_accuracy"] == b["eval_accuracy"]
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-4, abs=1e-6)
        if "train_loss" in a:
            assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4, abs=1e-6)
