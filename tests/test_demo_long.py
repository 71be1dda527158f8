"""`ppolm demo --overoptimisation` end to end on the tiny random model: the static and the
refreshed run, the on-policy checks, the confirmation on fresh samples, the report."""

from __future__ import annotations

import dataclasses
import json

from ppolm import cli, demo, demo_long, tracking


def test_long_demo_runs_static_and_refreshed_proxy(tiny_policy_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "QUICK", dataclasses.replace(demo.QUICK, train_prompts=8, eval_prompts=4,
                                                           response_length=6, rm_layers=1, policy_layers=1))
    monkeypatch.setattr(demo_long, "LONG_QUICK", dataclasses.replace(demo_long.LONG_QUICK, steps=4, eval_every=2,
                                                                     refresh_every=2, refresh_pairs=4,
                                                                     refresh_steps=2, check_pairs=4))
    out = tmp_path / "demo"
    args = ["demo", "--quick", "--overoptimisation", "--model", str(tiny_policy_dir), "--output-dir", str(out),
            "--quiet", "--precision", "fp32", "--threads", "1"]
    code, err = cli.main(args), capsys.readouterr().err
    assert code == 0, err[-3000:]
    state = json.loads((out / "demo.json").read_text())
    assert state["done"] == ["task", "pairs", "reward_model", "ppo", "refresh", "confirm", "report"]

    # the same PPO settings and KL budget; only the refreshed run refreshes, both check the proxy
    static_cfg, refresh_cfg = (out / "config.yaml").read_text(), (out / "refresh" / "config.yaml").read_text()
    for line in ("kl_target: 30.0", "steps: 4", "judge: ppolm.gold:review_judge", "rm_check_pairs: 4"):
        assert line in static_cfg and line in refresh_cfg, line
    assert "rm_refresh_every: 0" in static_cfg and "rm_refresh_every: 2" in refresh_cfg
    assert "rm_refresh_start_share: 0.5" in refresh_cfg  # half of each refresh's pairs against the start
    assert [r["rm_refresh/start_pairs"] for r in tracking.read_jsonl(out / "refresh" / "metrics.jsonl")
            if "rm_refresh/round" in r] == [2, 2]
    assert (out / "refresh" / "reward_model_refreshed").is_dir() and not (out / "reward_model_refreshed").exists()

    long = state["overoptimisation"]
    static, refresh = long["runs"]["static"], long["runs"]["refresh"]
    assert static["refreshes"] == 0 and static["refresh_judge_calls"] == 0
    assert refresh["refreshes"] == 2 and 0 < refresh["refresh_judge_calls"] <= 2 * 4
    assert static["check_judge_calls"] > 0 and refresh["check_judge_calls"] > 0  # a check at each evaluation
    for run in state["comparison"].values():
        assert [p["step"] for p in run["points"]] == [0, 2, 4]
        assert all(0 <= p["agreement"] <= 1 for p in run["points"] if p["agreement"] is not None)
        assert run["best"]["gold"] == max(p["gold"] for p in run["points"])

    # every policy scored on the same fresh prompts; the differences are paired, per prompt
    c = long["confirm"]
    assert set(c["scores"]) == set(demo_long.POLICIES) and c["n_prompts"] == 4 and c["samples_per_prompt"] == 1
    s = c["scores"]
    for got, a, b in ((c["refresh_minus_static"]["best"], "static_best", "refresh_best"),
                      (c["fall_after_best"]["static"], "static_end", "static_best"),
                      (c["gain"]["refresh"], "before", "refresh_best")):
        assert abs(got["mean"] - (s[b]["mean"] - s[a]["mean"])) < 1e-9
    assert state["confirm"]["gain"] == c["gain"]["static"]  # the demo's own verdict reads the static run
    assert "Refreshed best minus static best" in long["verdict"]

    html = (out / "report.html").read_text()
    assert "Static proxy against refreshed proxy" in html and "static_vs_refreshed" in html
    assert "<td>refreshed proxy</td>" in html and (out / "refresh" / "report.html").is_file()

    # resuming the long demo without --overoptimisation is refused in one line
    assert cli.main([a for a in args if a != "--overoptimisation"] + ["--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "overoptimisation=True" in err[0]


def test_long_demo_refuses_algorithms(tmp_path, capsys):
    assert cli.main(["demo", "--overoptimisation", "--algorithms", "ppo,grpo", "--output-dir",
                     str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--overoptimisation" in err[0] and not (tmp_path / "d").exists()


def test_verdict_says_better_worse_or_no_difference():
    """The verdict's last sentence follows the paired difference against ±2 SE, sign included."""
    from ppolm.demo_long import REFRESH, verdict

    def state(diff: float, se: float) -> dict:
        score = {"mean": 0.1, "se": 0.05, "n": 32}
        return {"confirm": {"scores": {k: score for k in ("before", "static_best", "static_end", "refresh_best",
                                                          "refresh_end")},
                            "fall_after_best": {"static": {"mean": 0.3, "se": 0.1}, REFRESH: {"mean": 0.0, "se": 0.1}},
                            "refresh_minus_static": {"best": {"mean": diff, "se": se}}, "n_prompts": 32},
                "runs": {REFRESH: {"refresh_judge_calls": 96, "refreshes": 2}}}

    comparison = {"ppo": {"best": {"step": 3, "kl": 1.0}}, REFRESH: {"best": {"step": 6, "kl": 2.0}}}
    assert verdict(state(0.30, 0.1), comparison).endswith("did better, by more than twice its standard error.")
    assert verdict(state(-0.30, 0.1), comparison).endswith("did worse, by more than twice its standard error.")
    assert verdict(state(-0.15, 0.1), comparison).endswith("no difference beyond twice its standard error.")
    text = verdict(state(0.30, 0.1), comparison)
    assert "gold fell after its peak (-0.300 ± 0.100)" in text  # static: best − end = 0.3 > 2 × 0.1
    assert "96 judge labels over 2 refreshes" in text
