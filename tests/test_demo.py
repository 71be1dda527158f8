"""`ppolm demo` end to end on the tiny random model: stages, resume after Ctrl-C, bad input."""

from __future__ import annotations

import errno
import json

from ppolm import cli, demo, gold


def test_gold_judge_is_deterministic_and_penalises():
    good = "A lovely, reliable kettle. I really like it."
    assert gold.gold_judge([""], [good]) == gold.gold_judge([""], [good]) and gold.gold_score(good) > 0.5
    long = good + " " + " ".join(f"w{i}" for i in range(60))
    # 8 + 60 words, the 60 neutral and distinct: VADER's compound is unchanged, 56 words over the budget of 12
    assert abs(gold.gold_score(long) - (gold.gold_score(good) - 0.1 * 56)) < 1e-9
    # repetition: 5 bigrams, 1 distinct -> fraction 0.8 repeated, -1.5 * 0.8 = -1.2
    rep = "great great great great great great"
    assert abs(gold.gold_score(rep) - (gold._vader().polarity_scores(rep)["compound"] - 1.2)) < 1e-9
    assert gold.gold_score("   ") == -1.0
    assert gold.gold_judge(["p"], [[{"role": "assistant", "content": good}]]) == [gold.gold_score(good)]


def test_review_judge_adds_a_floor_on_length():
    # the long demo's rater: gold minus 0.2 per word short of 5 words; empty answers as gold (-1)
    for text, missing in (("Awesome.", 4), ("Awesome movie!", 3), ("A lovely, reliable kettle.", 1),
                          ("A lovely, reliable kettle. I really like it.", 0)):
        assert abs(gold.review_score(text) - (gold.gold_score(text) - 0.2 * missing)) < 1e-12, text
    assert gold.review_score("  ") == -1.0
    assert gold.review_judge(["p"], ["Awesome."]) == [gold.review_score("Awesome.")]
    assert gold.review_score("Awesome.") < gold.review_score("A lovely, reliable kettle. I really like it.")


def test_prompts_are_disjoint_between_train_and_held_out():
    train, held = gold.review_prompts(80, 24, seed=0)
    assert len(train) == 80 and len(held) == 24 and not set(train) & set(held)
    items = [f"'{t}'" for t in gold.FILMS] + gold.PRODUCTS

    def named(prompts):
        return {i for i in items if any(i in p for p in prompts)}

    assert named(train) and named(held) and not named(train) & named(held)


def test_demo_interrupt_resume_and_report(tiny_policy_dir, tmp_path, monkeypatch, capsys):
    import dataclasses

    # the quick preset, shrunk further for the tiny model: the stages and files are what is tested
    monkeypatch.setattr(demo, "QUICK", dataclasses.replace(demo.QUICK, train_prompts=8, eval_prompts=4,
                                                           response_length=6, rm_layers=1, policy_layers=1))
    out = tmp_path / "demo"
    args = ["demo", "--quick", "--model", str(tiny_policy_dir), "--output-dir", str(out), "--quiet",
            "--steps", "2", "--precision", "fp32"]
    real = demo.Demo.reward_model

    def ctrl_c(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo.Demo, "reward_model", ctrl_c)
    assert cli.main(args) == 130
    err = capsys.readouterr().err
    assert "interrupted during stage 'reward_model'" in err and "--resume" in err and "Traceback" not in err
    state = json.loads((out / "demo.json").read_text())
    assert state["done"] == ["task", "pairs"]
    pairs = [json.loads(x) for x in (out / "pairs_train.jsonl").read_text().splitlines()]
    assert pairs and {"prompt", "chosen", "rejected", "gold_chosen", "gold_rejected"} <= set(pairs[0])

    # an existing directory is refused without --overwrite/--resume
    assert cli.main(args) == 2
    assert "already exists" in capsys.readouterr().err

    monkeypatch.setattr(demo.Demo, "reward_model", real)
    assert cli.main(args + ["--resume"]) == 0
    err = capsys.readouterr().err
    assert "[2/6] pairs: already done" in err and "report:" in err
    state = json.loads((out / "demo.json").read_text())
    assert state["done"] == ["task", "pairs", "reward_model", "ppo", "confirm", "report"]
    # the best checkpoint scored again on fresh samples (1 per prompt in --quick): the gain is paired
    c = state["confirm"]
    assert c["n_prompts"] == 4 and c["samples_per_prompt"] == 1 and c["temperature"] == 0.7
    assert abs(c["gain"]["mean"] - (c["best"]["mean"] - c["before"]["mean"])) < 1e-9
    assert state["gold_gain"]["source"] == "fresh samples after PPO" and state["gold_gain"]["gain"] == c["gain"]["mean"]
    assert "fresh" in state["verdict"]
    assert 0 <= state["rm_accuracy"] <= 1 and set(state["gold"]) >= {"before", "end", "best"}
    assert state["gold"]["before"]["step"] == 0 and state["gold"]["end"]["step"] == 2
    assert "gold_gain" in state and (out / "best.json").is_file() and (out / "best").is_dir()
    html = (out / "report.html").read_text()
    assert "Gold judge" in html and "best-gold checkpoint" in html and "proxy_rm" in html



def test_demo_compares_algorithms_head_to_head(tiny_policy_dir, tmp_path, monkeypatch, capsys):
    """--algorithms ppo,grpo,dpo: each trains in its own process on the same task and held-out
    prompts; demo.json tabulates each one's evaluations, best gold, wall time and peak memory; the
    report shows the comparison."""
    import dataclasses

    monkeypatch.setattr(demo, "QUICK", dataclasses.replace(demo.QUICK, train_prompts=8, eval_prompts=4,
                                                           response_length=6, rm_layers=1, policy_layers=1))
    out = tmp_path / "demo"
    args = ["demo", "--quick", "--model", str(tiny_policy_dir), "--output-dir", str(out), "--quiet",
            "--steps", "2", "--precision", "fp32", "--algorithms", "ppo,grpo,dpo", "--threads", "1"]
    code, err = cli.main(args), capsys.readouterr().err
    assert code == 0, err[-3000:]
    state = json.loads((out / "demo.json").read_text())
    assert state["done"] == ["task", "pairs", "reward_model", "ppo", "grpo", "dpo", "confirm", "report"]
    comp = state["comparison"]
    assert list(comp) == ["ppo", "grpo", "dpo"]
    for name, c in comp.items():
        assert len(c["points"]) >= 2 and c["points"][0]["step"] == 0, name  # the start and later evaluations
        assert all(isinstance(p[k], float) for p in c["points"] for k in ("gold", "proxy", "kl")), name
        assert c["best"]["gold"] == max(p["gold"] for p in c["points"])
        assert c["wall_s"] > 0 and c["peak_rss_mb"] > 100, name  # its own process's figures
    assert len(comp["dpo"]["points"]) == demo_settings_epochs() + 1  # before training and after each epoch
    grpo_cfg = (out / "grpo" / "config.yaml").read_text()
    assert "advantage: grpo" in grpo_cfg and "samples_per_prompt: 4" in grpo_cfg
    assert not (out / "grpo" / "critic").exists() and (out / "critic").is_dir()  # GRPO trains no critic
    html = (out / "report.html").read_text()
    assert "PPO and its alternatives" in html and "algorithms_vs_kl" in html
    assert all(f"<td>{n}</td>" in html for n in ("ppo", "grpo", "dpo"))
    # unknown names and a list without ppo: one line each
    for bad, needle in (("ppo,gpro", "unknown 'gpro'"), ("grpo,dpo", "must include ppo")):
        assert cli.main(["demo", "--output-dir", str(tmp_path / "x"), "--algorithms", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0]


def demo_settings_epochs() -> int:
    from ppolm.compare import DPO_SETTINGS

    return DPO_SETTINGS["epochs"]


def test_no_space_is_one_line(tmp_path, monkeypatch, capsys):
    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(demo.Demo, "task", full)
    assert cli.main(["demo", "--quick", "--output-dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: no space left on device") and "Traceback" not in "".join(err)


def test_gold_gain_uses_the_paired_standard_error(tmp_path):
    """Same prompts before and after: the gain's SE is that of the per-prompt differences (hand-computed)."""
    rows = []
    for step, golds in ((0, [0.1, 0.5, -0.2]), (4, [0.4, 0.6, 0.2])):
        for p, g in zip(["a", "b", "c"], golds):
            rows.append({"step": step, "prompt": p, "response": "r", "scores": {"gold_judge": g}, "score": g, "kl": 0})
    (tmp_path / "eval_samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = demo.Demo(demo.DemoConfig(output_dir=str(tmp_path)))
    diffs = d.paired_gold_differences(4)
    assert [round(x, 6) for x in diffs] == [0.3, 0.1, 0.4]
    # mean 0.8/3, sd sqrt(((0.3-m)^2 + (0.1-m)^2 + (0.4-m)^2) / 2) = 0.152753, se = sd / sqrt(3) = 0.088192
    s = demo.mean_se(diffs)
    assert abs(s["mean"] - 0.8 / 3) < 1e-9 and abs(s["se"] - 0.0881917) < 1e-6
