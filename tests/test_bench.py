"""bench/learning.py's helpers: the reward-vs-KL frontier by hand, and deleting a scored run's
weights without touching the logs its tables read (on a real micro PPO run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ppolm.cli import main
from ppolm.tiny import build_tiny_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import learning  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def test_frontier_is_the_best_window_within_the_budget():
    # (reward, KL) per step; windows of 2: means (0.15, 2), (0.25, 5), (0.35, 9), (0.4, 11)
    traj = [(0.1, 1.0), (0.2, 3.0), (0.3, 7.0), (0.4, 11.0), (0.4, 11.0)]
    assert learning.frontier(traj, 6.0, window=2) == pytest.approx((0.25, 5.0))
    assert learning.frontier(traj, 9.0, window=2) == pytest.approx((0.35, 9.0))
    assert learning.frontier(traj, 12.0, window=2) == pytest.approx((0.4, 11.0))
    assert learning.frontier(traj, 1.5, window=2) is None  # no window's mean KL within 1.5
    assert learning.frontier(traj[:1], 12.0, window=2) is None  # shorter than a window
    # equal rewards: the window that spent less KL
    assert learning.frontier([(0.5, 4.0), (0.5, 4.0), (0.5, 2.0)], 6.0, window=2) == pytest.approx((0.5, 3.0))


def test_curve_is_every_window_mean_in_order():
    traj = [(0.1, 1.0), (0.2, 3.0), (0.3, 7.0), (0.4, 11.0)]
    flat = lambda path: [x for point in path for x in point]  # noqa: E731
    assert flat(learning.curve(traj, window=2)) == pytest.approx([0.15, 2.0, 0.25, 5.0, 0.35, 9.0])
    assert flat(learning.curve(traj, window=4)) == pytest.approx([0.25, 5.5])
    assert learning.curve(traj[:1], window=2) == []


def test_common_budget_is_the_largest_kl_every_path_reached():
    a = [(0.1 * i, 1.5 * i) for i in range(10)]  # 8-step mean KLs 5.25, 6.75, 8.25
    b = [(0.05 * i, 2.0 * i) for i in range(9)]  # 7.0, 9.0
    assert learning.common_budget([a, b], 24.0) == pytest.approx(8.25)
    assert learning.common_budget([a, b], 8.0) == pytest.approx(8.0)  # capped at twice the target
    assert learning.common_budget([b], 24.0) == pytest.approx(9.0)
    assert learning.common_budget([a, b[:5]], 24.0) is None  # a run shorter than a window has no path
    # read at that budget, each run's best window within it
    assert learning.frontier(a, 8.25) == pytest.approx((0.55, 8.25))
    assert learning.frontier(b, 8.25) == pytest.approx((0.175, 7.0))


def test_frontier_plot_draws_both_systems_logs_and_the_held_out_points(tmp_path):
    # a ppolm run's metrics.jsonl, a TRL run's log_history.json (per-token kl x mean length), and a
    # run whose logs are gone (held-out point only)
    ppo = tmp_path / "exclaim__ppo-defaults"
    ppo.mkdir()
    ppo.joinpath("metrics.jsonl").write_text("".join(
        json.dumps({"objective/scores": 0.1 * i, "objective/kl": 1.5 * i}) + "\n" for i in range(10)))
    grpo = tmp_path / "exclaim__grpo-lr5e-5"
    grpo.mkdir()
    grpo.joinpath("log_history.json").write_text(json.dumps(
        [{"reward": 0.05 * i, "kl": 0.1 * i, "completions/mean_length": 20.0} for i in range(9)]))
    results = {"exclaim/start": {"reward": 0.02, "kl": 0.0},
               "exclaim/ppo-defaults": {"reward": 0.8, "kl": 14.0},
               "exclaim/grpo-lr5e-5": {"reward": 0.4, "kl": 15.0},
               "keyword/start": {"reward": 0.0, "kl": 0.0},
               "keyword/ppo-defaults": {"reward": 0.1, "kl": 6.0}}
    # the GRPO path: one window of 8 steps, reward mean 0.175 at KL 0.35 x 20 = 7
    path = learning.curve(learning.trajectory(grpo))
    assert [x for point in path for x in point] == pytest.approx([0.175, 7.0, 0.225, 9.0])
    png = learning.plot_frontiers(tmp_path, results, (12.0, 24.0))
    assert png == tmp_path / "frontier.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # nothing but starting points: no figure
    assert learning.plot_frontiers(tmp_path / "none", {"exclaim/start": {"reward": 0.0, "kl": 0.0}},
                                   (12.0, 24.0)) is None


def test_drop_weights_keeps_the_logs_of_a_scored_run(tmp_path):
    model = build_tiny_model_dir(tmp_path / "micro", kind="causal", seed=0, num_layers=1, hidden_size=16,
                                 heads=2, kv_heads=1, intermediate_size=32)
    reward = tmp_path / "r.py"
    reward.write_text("def words(prompts, completions, **kw):\n    return [len(c.split()) / 10 for c in completions]\n")
    run = tmp_path / "run"
    # the options bench/learning.py trains with: one checkpoint, at the last step
    assert main(["ppo", "--model", str(model), "--reward-fn", f"{reward}:words", "--steps", "2", "--batch-size", "4",
                 "--response-length", "8", "--precision", "fp32", "--device", "cpu", "--save-every", "2",
                 "--keep-last", "1", "--quiet", "--output-dir", str(run)]) == 0
    files = [f for f in run.rglob("*") if f.is_file()]
    model_dirs = {run / d for d in ("policy", "critic", "checkpoints")}
    assert all(d.is_dir() for d in model_dirs)
    assert any(f.name.endswith(learning.WEIGHT_SUFFIXES) for f in (run / "checkpoints").rglob("*"))
    logs = {f: f.read_bytes() for f in files if not any(d in f.parents for d in model_dirs)}
    assert {"metrics.jsonl", "samples.jsonl", "config.yaml"} <= {f.name for f in logs}
    assert any(f.name.startswith("events.out.tfevents") for f in logs)
    size = sum(f.stat().st_size for f in files if f not in logs)
    traj = learning.trajectory(run)

    assert learning.drop_weights(run) == size > 0

    assert not any(d.exists() for d in model_dirs)  # no model folder left without its weights
    assert {f: f.read_bytes() for f in run.rglob("*") if f.is_file()} == logs  # every log, byte for byte
    assert learning.trajectory(run) == traj and len(traj) == 2


def test_drop_weights_keeps_a_model_folder_at_the_top_without_its_weights(tmp_path):
    # a TRL run: the model's files and log_history.json side by side in the run folder
    save_file({"w": torch.ones(4, 4)}, str(tmp_path / "model.safetensors"))
    torch.save({"step": 1}, tmp_path / "training_args.bin")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "log_history.json").write_text('[{"reward": 0.5, "kl": 0.1, "completions/mean_length": 20}]')
    size = (tmp_path / "model.safetensors").stat().st_size + (tmp_path / "training_args.bin").stat().st_size

    assert learning.drop_weights(tmp_path) == size
    assert sorted(f.name for f in tmp_path.iterdir()) == ["config.json", "log_history.json"]
    assert learning.trajectory(tmp_path) == [(0.5, 2.0)]


def test_an_out_dir_of_another_response_length_is_refused_untouched(tmp_path, monkeypatch):
    # scores of 32-token answers and of 48-token ones are different experiments: one --out, one length
    results = tmp_path / "results.json"
    results.write_text('{"exclaim/start": {"reward": 0.02, "se": 0.01, "kl": 0.0, "wall_s": 0.0}}')
    before = results.read_bytes()
    monkeypatch.setattr(sys, "argv", ["learning.py", "--out", str(tmp_path), "--tasks", "exclaim",
                                      "--systems", "ppo", "--response-length", "48"])
    with pytest.raises(SystemExit) as stop:
        learning.main()
    assert "holds runs of --response-length 32" in str(stop.value)
    assert "--response-length 32 or another --out" in str(stop.value)
    assert results.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_seeds_pair_runs_of_one_answer_length_only(tmp_path):
    import learning_seeds

    # one seed on one machine at two answer lengths: two tasks for the pairing, neither overwriting the other
    for length, rewards in ((32, (0.1, 0.3)), (48, (0.5, 0.9))):
        out = tmp_path / f"len{length}"
        entries = {"exclaim/start": {"reward": 0.0, "response_length": length}}
        for system, top in zip(("ppo-defaults", "grpo-lr5e-5"), rewards):
            entries[f"exclaim/{system}"] = {"seed": 0, "machine": "cpu", "response_length": length}
            run = out / f"exclaim__{system}"
            run.mkdir(parents=True)
            rows = [{"objective/scores": top * (i >= 8), "objective/kl": 1.0 + 20.0 * (i >= 8)} for i in range(16)]
            (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        (out / "results.json").write_text(json.dumps(entries))
    runs = learning_seeds.collect([tmp_path], (6.0, 24.0))
    # a window of 8 steps holding k of the last 8 (KL 21) has mean KL 1 + 2.5 k: within 6 nats k <= 2,
    # reward 2/8 of the run's top; within 24 the last 8, the top
    expected = {("exclaim", "ppo-defaults"): [0.025, 0.1], ("exclaim", "grpo-lr5e-5"): [0.075, 0.3],
                ("exclaim@48", "ppo-defaults"): [0.125, 0.5], ("exclaim@48", "grpo-lr5e-5"): [0.225, 0.9]}
    assert set(runs) == set(expected)
    for key, cells in expected.items():
        assert list(runs[key]) == [(0, "cpu")] and runs[key][(0, "cpu")] == pytest.approx(cells)


def test_refresh_search_links_a_long_demo_without_its_refreshed_run(tmp_path):
    """bench/refresh_search.py shares the static run by hard links, leaves out what the redone stages
    write, marks those stages to redo with the variant's sizes, and never touches the source."""
    import refresh_search

    src, dst = tmp_path / "src", tmp_path / "dst"
    for rel in ("proxy_rm/model.safetensors", "best/policy_adapter/adapter.bin", "refresh/metrics.jsonl",
                "plots/gold.png", "report.html", "eval.jsonl"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(rel)
    state = {"seed": 2, "quick": False, "done": ["task", "pairs", "reward_model", "ppo", "refresh", "confirm", "report"],
             "overoptimisation": {"sizes": {"refresh_pairs": 48}, "confirm": {}, "runs": {}}, "verdict": "v",
             "comparison": {}, "costs": {"ppo": 1, "refresh": 2}}
    (src / "demo.json").write_text(json.dumps(state))
    before = {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}
    refresh_search.link_run(src, dst, refresh_search.parse_set(["refresh_start_share=0.5", "refresh_pairs=96"]))
    for rel in ("proxy_rm/model.safetensors", "best/policy_adapter/adapter.bin", "eval.jsonl"):
        assert (dst / rel).stat().st_ino == (src / rel).stat().st_ino
    assert not any((dst / rel).exists() for rel in ("refresh", "plots", "report.html"))
    got = json.loads((dst / "demo.json").read_text())
    assert got["done"] == ["task", "pairs", "reward_model", "ppo"] and "verdict" not in got
    assert got["overoptimisation"] == {"sizes": {"refresh_pairs": 96, "refresh_start_share": 0.5}}
    assert got["costs"] == {"ppo": 1}
    assert {p: p.read_bytes() for p in src.rglob("*") if p.is_file()} == before
    with pytest.raises(SystemExit, match="refresh_"):
        refresh_search.parse_set(["steps=3"])
