"""Alarms on hand-made metric rows (each fires and stays quiet), and the HTML report of a tiny run."""

from __future__ import annotations

import base64
import json
import re

import pytest

from ppolm import alarms

# --------------------------------------------------------------------------------------- alarms


def rows(n=10, **series):
    """n metric rows with healthy defaults; a keyword overrides one metric with a list or a function of step."""
    healthy = {"response/length_mean": 20.0, "policy/entropy_avg": 1.5, "objective/kl": 2.0, "adv/var": 0.5,
               "val/vf_explained_var": 0.4}
    out = []
    for i in range(n):
        r = {"step": i, **healthy}
        for k, v in series.items():
            r[k] = v[i] if isinstance(v, list) else v(i) if callable(v) else v
        out.append(r)
    return out


def test_healthy_run_fires_nothing():
    assert alarms.check_all(rows(12), kl_target=6.0) == []


def test_length_drift():
    a = alarms.length_drift(rows(10, **{"response/length_mean": lambda i: 20 + 4 * i}))
    assert a and a.name == "length_drift" and a.step >= 3 and "longer" in a.message
    assert alarms.length_drift(rows(10, **{"response/length_mean": lambda i: 20 + 0.3 * i})) is None
    # relative change large but under the absolute floor of 4 tokens: quiet
    assert alarms.length_drift(rows(10, **{"response/length_mean": lambda i: 2 + 0.3 * i})) is None


def test_entropy_collapse():
    a = alarms.entropy_collapse(rows(10, **{"policy/entropy_avg": lambda i: 1.5 * 0.6 ** i}))
    assert a and a.name == "entropy_collapse" and a.values["entropy"] < 0.3 * a.values["baseline"]
    assert alarms.entropy_collapse(rows(10, **{"policy/entropy_avg": lambda i: 1.5 - 0.05 * i})) is None


def test_entropy_collapse_of_whole_responses():
    # per token steady (1.5 nats), but responses shrink: 39 -> 8 nats per response (a fall to a
    # fifth, as a run whose answers collapse onto a few near-certain tokens)
    total = [39.0, 39.0, 38.0, 30.0, 20.0, 12.0, 8.0, 8.0, 8.0, 8.0]
    a = alarms.entropy_collapse(rows(10, **{"objective/entropy": total}))
    # rolling means of 3: step 5 -> (30+20+12)/3 = 20.67 > 0.3 * 38.67 = 11.6; step 6 -> 13.33; step 7 -> 9.33
    assert a and a.step == 7 and a.values["entropy"] == pytest.approx(28 / 3)
    assert "nats/response" in a.message
    assert alarms.entropy_collapse(rows(10, **{"objective/entropy": [39.0] * 3 + [20.0] * 7})) is None


def test_live_alarms_warn_once_and_mark_the_row():
    said: list[str] = []
    live = alarms.LiveAlarms(kl_target=6.0, emit=said.append)
    marks = [live(r["step"], {k: v for k, v in r.items() if k != "step"})
             for r in rows(10, **{"objective/kl": lambda i: 2.0 if i < 4 else 15.0})]
    # KL above 2 x 6 from step 4 on: the third such step (6) fires, once
    assert [i for i, m in enumerate(marks) if m] == [6] and marks[6] == {"alarm/kl_runaway": 1.0}
    assert len(said) == 1 and said[0].startswith("warning: alarm kl_runaway at step 6")
    resumed = alarms.LiveAlarms(kl_target=6.0, emit=said.append, rows=live.rows[:8])
    assert resumed(8, {**live.rows[8]}) == {} and len(said) == 1  # fired before the resume: not again


def test_kl_runaway():
    a = alarms.kl_runaway(rows(10, **{"objective/kl": lambda i: 3.0 * i}), target=6.0)
    assert a and a.name == "kl_runaway" and a.values["limit"] == 12.0
    assert a.step == 7  # 15, 18, 21 > 12 at steps 5, 6, 7
    # two spikes are not a runaway; negative KL is a bug sign
    assert alarms.kl_runaway(rows(10, **{"objective/kl": [1, 20, 20, 1, 1, 1, 1, 1, 1, 1]}), target=6.0) is None
    neg = alarms.kl_runaway(rows(5, **{"objective/kl": [0, -0.5, -3, 0, 0]}), target=6.0)
    assert neg and neg.step == 2 and "negative" in neg.message


def test_advantage_explosion():
    # baseline 0.5 (first 3 steps); rolling means of 3 from step 5: (0.6 + 0.7 + 140) / 3 = 47.1 < 50,
    # then (0.7 + 140 + 140) / 3 = 93.6 > 100 * 0.5 = 50 at step 6
    a = alarms.advantage_explosion(rows(9, **{"adv/var": [0.5, 0.5, 0.5, 0.6, 0.7, 140.0, 140.0, 0.5, 0.5]}))
    assert a and a.step == 6 and a.values["adv_var"] == pytest.approx(280.7 / 3)
    # one batch at 140 (280x) is not an explosion: the rolling mean peaks at (0.6 + 0.7 + 140) / 3 < 50
    assert alarms.advantage_explosion(rows(9, **{"adv/var": [0.5, 0.5, 0.5, 0.6, 0.7, 140.0, 0.5, 0.5, 0.5]})) is None
    # steady growth to 10x, as a rising beta gives: quiet
    assert alarms.advantage_explosion(rows(12, **{"adv/var": lambda i: 0.5 + 0.5 * i})) is None
    inf = alarms.advantage_explosion(rows(4, **{"adv/var": [0.5, "inf", 0.5, 0.5]}))
    assert inf and inf.step == 1
    # a rare reward: three unearned batches (KL penalty only, 2e-4) then hits at 0.03: quiet, as
    # the tied batches make no baseline; counting them, the first hits would be 150x it
    rare = rows(10, **{"adv/var": lambda i: 2e-4 if i < 3 else 0.03, "adv/tied": lambda i: 1.0 if i < 3 else 0.0})
    assert alarms.advantage_explosion(rare) is None
    assert alarms.advantage_explosion([{k: v for k, v in r.items() if k != "adv/tied"} for r in rare]).step == 5


def test_value_not_learning():
    # judged from the 6th step on, over the 5 steps up to it: steps 1-5 average -0.2 + 0.03 = -0.17
    a = alarms.value_not_learning(rows(8, **{"val/vf_explained_var": lambda i: -0.2 + 0.01 * i}))
    assert a and a.name == "value_not_learning" and a.step == 5
    # a critic that learns: steps 1-5 average -0.3 + 0.45 = 0.15, later windows more
    assert alarms.value_not_learning(rows(8, **{"val/vf_explained_var": lambda i: -0.3 + 0.15 * i})) is None
    # one that learns late (steps 1-5 average -0.05, steps 3-7 +0.25): the first step at which the
    # rule held, the step the live check marks, which the finished run's report then also shows
    late = rows(8, **{"val/vf_explained_var": lambda i: -0.5 + 0.15 * i})
    assert alarms.value_not_learning(late).step == 5
    live = alarms.LiveAlarms(kl_target=None, emit=lambda msg: None)
    marked = [r["step"] for r in late if live(r["step"], {k: v for k, v in r.items() if k != "step"})]
    assert marked == [5] and [a.step for a in alarms.check_all(late)] == [5]
    assert alarms.value_not_learning(rows(4, **{"val/vf_explained_var": -1.0})) is None  # too early to say
    assert "--critic-lr" in a.message and "--critic-zero-head" not in a.message
    far = alarms.value_not_learning(rows(8, **{"val/vf_explained_var": lambda i: -7.0 + 0.5 * i}))
    assert far.step == 5 and "--critic-zero-head" in far.message  # mean of steps 1-5: -5.5
    # batches with all scores tied (adv/tied 1) do not count: here every third, at -3, would pull
    # the mean of the last 5 below 0; without them it is 0.25 (and 6 rows are needed to judge)
    tied = rows(18, **{"val/vf_explained_var": lambda i: -3.0 if i % 3 == 0 else 0.25,
                       "adv/tied": lambda i: 1.0 if i % 3 == 0 else 0.0})
    assert alarms.value_not_learning(tied) is None
    assert alarms.value_not_learning([{k: v for k, v in r.items() if k != "adv/tied"} for r in tied]).name \
        == "value_not_learning"
    assert alarms.value_not_learning(tied[:8]) is None  # 5 untied rows: too early to say


def eval_rows(gold, proxy, se=0.02):
    return [{"step": 5 * i, "eval/rm": p, "eval/gold_judge": g, "eval/gold_judge_se": se}
            for i, (g, p) in enumerate(zip(gold, proxy))]


def test_over_optimisation():
    a = alarms.over_optimisation(eval_rows([0.1, 0.4, 0.5, 0.3], [0.0, 1.0, 2.0, 3.0]),
                                 proxy="eval/rm", gold="eval/gold_judge")
    assert a and a.step == 15 and a.values["peak_step"] == 10 and a.values["gold_now"] == 0.3
    # gold falls but only within noise: quiet
    assert alarms.over_optimisation(eval_rows([0.1, 0.4, 0.5, 0.48], [0, 1, 2, 3]),
                                    proxy="eval/rm", gold="eval/gold_judge") is None
    # gold falls but the proxy falls too (not Goodhart, just a worse policy): quiet
    assert alarms.over_optimisation(eval_rows([0.1, 0.4, 0.5, 0.3], [0, 1, 2, 1.5]),
                                    proxy="eval/rm", gold="eval/gold_judge") is None
    # check_all only runs it when both names are given; rows without eval metrics are skipped
    mixed = rows(16) + eval_rows([0.1, 0.4, 0.5, 0.3], [0.0, 1.0, 2.0, 3.0])
    assert [x.name for x in alarms.check_all(mixed, proxy="eval/rm", gold="eval/gold_judge")] == ["over_optimisation"]
    assert alarms.check_all(mixed) == []


def test_watcher_prints_each_alarm_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    bad = rows(10, **{"policy/entropy_avg": lambda i: 1.5 * 0.5 ** i})
    path.write_text("".join(json.dumps(r) + "\n" for r in bad[:2]))
    said: list[str] = []
    w = alarms.AlarmWatcher(path, lambda r: alarms.check_all(r), emit=said.append)
    assert w.poll() == []
    path.write_text("".join(json.dumps(r) + "\n" for r in bad))
    assert [a.name for a in w.poll()] == ["entropy_collapse"]
    assert w.poll() == [] and len(said) == 1 and said[0].startswith("warning: alarm entropy_collapse")


# --------------------------------------------------------------------------------------- report


@pytest.fixture(scope="module")
def tiny_run(tiny_policy_dir, tiny_rm_dir, tmp_path_factory):
    """A 3-step PPO run of the tiny model against the tiny RM, evaluated with a gold judge."""
    from ppolm import config
    from ppolm.ppo import train_ppo
    from ppolm.ppo_config import PPOConfig

    tmp = tmp_path_factory.mktemp("report")
    evalp = tmp / "eval.jsonl"
    evalp.write_text("".join(json.dumps({"prompt": f"Review the film number {i}."}) + "\n" for i in range(4)))
    out = tmp / "run"
    cfg = config.build(PPOConfig, dict(
        model=str(tiny_policy_dir), reward_model=[str(tiny_rm_dir)], steps=3, batch_size=4, minibatches=2,
        ppo_epochs=1, response_length=8, output_dir=str(out), quiet=True, precision="fp32", save_every=10,
        sample_every=1, eval_prompts=str(evalp), eval_every=2, eval_reward_fn=["ppolm.gold:gold_judge"],
        best_metric="eval/gold_judge"))
    train_ppo(cfg)
    return out


def test_ppo_warns_live_and_records_alarms(tiny_policy_dir, tmp_path, capfd):
    # a KL target far below what any update produces: KL runs away within the first steps. The k3
    # estimate is never negative and is positive once the policy has moved; k1's, over 4 responses
    # of 8 tokens, can land near 0 on a step whose samples both models happen to rate alike.
    from ppolm import config
    from ppolm.ppo import train_ppo
    from ppolm.ppo_config import PPOConfig

    cfg = config.build(PPOConfig, dict(
        model=str(tiny_policy_dir), reward_fn=["ppolm.builtin_rewards:positive_sentiment"], steps=5, batch_size=4,
        ppo_epochs=4, response_length=8, output_dir=str(tmp_path / "run"), quiet=True, precision="fp32",
        actor_lr=1e-2, kl_target=1e-4, save_every=10, temperature=0.7, kl_estimator="k3"))
    result = train_ppo(cfg)
    fired = [r["step"] for r in result.metrics if r.get("alarm/kl_runaway") == 1.0]
    assert len(fired) == 1
    assert f"warning: alarm kl_runaway at step {fired[0]}" in capfd.readouterr().err


def test_report_of_a_tiny_run(tiny_run):
    from ppolm.report import write_report

    (tiny_run / "demo.json").write_text(json.dumps({
        "task": "Write a short positive review.", "judge": "VADER minus penalties", "rm_accuracy": 0.7,
        "rm_accuracy_n": 20, "gold": {"before": {"mean": 0.1, "se": 0.05}, "best": {"mean": 0.4, "se": 0.05,
                                                                                     "step": 2, "kl": 1.5}}}))
    path = write_report(tiny_run)
    assert path == tiny_run / "report.html"
    html = path.read_text()
    pngs = sorted(p.name for p in (tiny_run / "plots").glob("*.png"))
    for name in ("rewards_vs_step.png", "rewards_vs_kl.png", "kl_beta.png", "entropy.png", "clip_approxkl.png",
                 "explained_variance.png", "length.png"):
        assert name in pngs
    # self-contained: every image is inline base64 PNG, nothing is fetched
    imgs = re.findall(r'<img src="([^"]+)"', html)
    assert len(imgs) == len(pngs)
    for src in imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert "http://" not in html and "https://" not in html.replace("https://arxiv.org", "")
    for text in ("gold_judge", "Alarms", "Config", "Write a short positive review.", "kl_coef", "0.700"):
        assert text in html, text
    assert "Review the film number" in html  # held-out samples table


def test_report_without_gold_or_eval(tiny_policy_dir, tmp_path):
    """Any `ppolm ppo` run: no eval, no gold columns; the CLI regenerates the report."""
    from ppolm import cli, config
    from ppolm.ppo import train_ppo
    from ppolm.ppo_config import PPOConfig

    out = tmp_path / "plain"
    train_ppo(config.build(PPOConfig, dict(model=str(tiny_policy_dir), steps=2, batch_size=2, minibatches=1,
                                           reward_fn=["ppolm.builtin_rewards:positive_sentiment"],
                                           ppo_epochs=1, response_length=6, output_dir=str(out), quiet=True,
                                           precision="fp32", save_every=10)))
    assert cli.main(["report", "--run-dir", str(out)]) == 0
    html = (out / "report.html").read_text()
    text = re.sub(r'src="data:[^"]+"', "", html).replace(str(out.resolve()), "")
    assert "gold" not in text.lower()
    assert (out / "plots" / "rewards_vs_step.png").is_file()


def hand_run(tmp_path, evals, metrics=None):
    from ppolm.report import Run

    cfg = {"reward": {"reward_fn": ["r.py:words"]},
           "run": {"eval_reward_fn": ["ppolm.gold:gold_judge", "j.py:brevity"]}}
    return Run(tmp_path, metrics or [], evals, [], [], cfg, {"step": 4, "metric": "eval/gold_judge"}, None)


def test_reward_vs_kl_has_one_panel_per_reward_ordered_by_kl(tmp_path):
    """Gao et al.'s plot: each reward against KL on its own scale, points in KL order labelled by step
    (the KL of these evaluations is not monotone in the step)."""
    from ppolm.report import make_plots, reward_vs_kl_panels

    kls = {0: 0.0, 2: 3.0, 4: 1.0, 6: 5.0}
    evals = [{"step": s, "eval/kl": kl, "eval/score": 0.1 * s, "eval/score_se": 0.01, "eval/words": 0.1 * s,
              "eval/gold_judge": -0.5 * s, "eval/gold_judge_se": 0.02, "eval/brevity": float(s == 2)}
             for s, kl in kls.items()]
    panels = reward_vs_kl_panels(hand_run(tmp_path, evals))
    # the proxy (trained-on score), then the eval-only scorers, gold first; not the training source words
    assert [p["key"] for p in panels] == ["eval/score", "eval/gold_judge", "eval/brevity"]
    for p in panels:
        assert [pt["step"] for pt in p["points"]] == [0, 4, 2, 6]  # KL 0, 1, 3, 5
        assert [pt["kl"] for pt in p["points"]] == [0.0, 1.0, 3.0, 5.0]
    assert [pt["y"] for pt in panels[1]["points"]] == [0.0, -2.0, -1.0, -3.0]
    assert [pt["se"] for pt in panels[1]["points"]] == [0.02] * 4 and panels[2]["points"][0]["se"] == 0.0
    plots = make_plots(hand_run(tmp_path, evals), tmp_path / "plots")
    assert plots["rewards_vs_kl"][1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reward_vs_kl_without_held_out_uses_the_training_batches(tmp_path):
    from ppolm.report import reward_vs_kl_panels

    metrics = [{"step": s, "objective/kl": kl, "objective/scores": y} for s, kl, y in
               ((0, 0.5, 1.0), (1, 0.2, 2.0), (2, None, 3.0), (3, 0.9, 4.0))]
    (panel,) = reward_vs_kl_panels(hand_run(tmp_path, [], metrics))
    assert panel["key"] == "objective/scores"
    assert [(pt["step"], pt["kl"], pt["y"]) for pt in panel["points"]] == [(1, 0.2, 2.0), (0, 0.5, 1.0), (3, 0.9, 4.0)]


def test_report_refuses_a_non_run(tmp_path, capsys):
    from ppolm import cli

    assert cli.main(["report", "--run-dir", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "nope" in err and "Traceback" not in err


@pytest.mark.parametrize("metrics, expect", [
    (b"\xff\xfe\x00", r"metrics\.jsonl is not UTF-8 text, so not a ppolm metrics file"),
    (b"", r"metrics\.jsonl holds no finished step yet"),
    (b"[1, 2]\n", r"holds rows without objective/scores, so .* is not a ppolm PPO run"),
    (b'{"epoch": 1, "train_loss": 0.5}\n', r"holds rows without objective/scores, so .* is not a ppolm PPO run"),
])
def test_report_refuses_what_is_not_a_ppo_run(tmp_path, capsys, metrics, expect):
    """Damaged metrics and the run directories of other commands (sft writes epoch rows): one error
    line, and no report.html or plots/ written into them."""
    import re

    from ppolm import cli

    (tmp_path / "metrics.jsonl").write_bytes(metrics)
    assert cli.main(["report", "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and re.search(expect, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_onpolicy_agreement_is_plotted_against_kl(tmp_path):
    """--judge's check: rm/onpolicy_accuracy (with its SE) in KL order, from the evaluations when they
    hold it, else from the steps' rows; no plot without a check."""
    from ppolm.report import make_plots, onpolicy_vs_kl

    metrics = [{"step": s, "objective/kl": kl, "objective/scores": 0.0, "rm/onpolicy_accuracy": acc,
                "rm/onpolicy_accuracy_se": 0.05, "rm/heldout_accuracy": 0.8} for s, kl, acc in
               ((0, 0.0, 0.8), (1, 2.0, 0.6), (2, 1.0, 0.7))]
    check = onpolicy_vs_kl(hand_run(tmp_path, [], metrics))
    assert [(p["step"], p["kl"], p["y"], p["se"]) for p in check["onpolicy"]] == [
        (0, 0.0, 0.8, 0.05), (2, 1.0, 0.7, 0.05), (1, 2.0, 0.6, 0.05)]
    assert [p["se"] for p in check["heldout"]] == [0.0] * 3
    evals = [{"step": 0, "eval/kl": 0.1, "eval/score": 0.0, "rm/onpolicy_accuracy": 0.9}]
    assert [(p["kl"], p["y"]) for p in onpolicy_vs_kl(hand_run(tmp_path, evals, metrics))["onpolicy"]] == [(0.1, 0.9)]
    plots = make_plots(hand_run(tmp_path, [], metrics), tmp_path / "plots")
    assert plots["rm_agreement_vs_kl"][1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "rm_agreement_vs_kl" not in make_plots(hand_run(tmp_path, [], [{k: v for k, v in r.items()
                                                                            if not k.startswith("rm/")} for r in metrics]),
                                                  tmp_path / "plots2")
