"""The helpers of bench/grpo_vs_trl.py and bench/phases.py: prompts, reward, step statistics, phase
timers and floors, by hand on real files and a real (tiny) autograd graph."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import grpo_vs_trl  # noqa: E402
import phases  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def test_bench_prompts_come_from_the_peer_topics_else_the_builtin_prompts(tmp_path, monkeypatch):
    peer = tmp_path / "trl_ppo_baseline.py"
    peer.write_text('import os\nTOPICS = [\n    "the ocean", "tea",\n]\nassert len(TOPICS) == 2\n')
    monkeypatch.setattr(grpo_vs_trl, "PEER", peer)
    assert grpo_vs_trl.bench_prompts() == ["Write one sentence about the ocean.", "Write one sentence about tea."]
    monkeypatch.setattr(grpo_vs_trl, "PEER", tmp_path / "absent.py")
    builtin = Path(__file__).resolve().parents[1] / "ppolm" / "data" / "prompts.jsonl"
    expected = [json.loads(x)["prompt"] for x in builtin.read_text().splitlines() if x.strip()]
    assert grpo_vs_trl.bench_prompts() == expected and len(expected) > 8


def test_length_reward_reads_text_and_chat_completions_alike():
    chat = [[{"role": "assistant", "content": "abcd"}], [{"role": "assistant", "content": ""}]]
    assert grpo_vs_trl.length_reward(["p", "q"], chat) == [0.04, 0.0]
    assert grpo_vs_trl.length_reward(["p"], ["x" * 150], completion_ids=[[1]]) == [1.5]


def test_steady_leaves_out_the_warmup_steps():
    assert grpo_vs_trl.steady([9.0, 2.0, 4.0], 1) == pytest.approx(3.0)
    assert grpo_vs_trl.steady([9.0, 2.0, 4.0], 2) == pytest.approx(4.0)
    assert grpo_vs_trl.steady([9.0], 1) is None


def test_summarise_takes_medians_per_system_and_ppolm_over_trl():
    runs = [{"system": "ppolm", "s_per_step": 2.0, "peak_rss_mb": 1000.0},
            {"system": "trl", "s_per_step": 4.0, "peak_rss_mb": 4000.0},
            {"system": "ppolm", "s_per_step": 3.0, "peak_rss_mb": 1200.0},
            {"system": "trl", "s_per_step": 6.0, "peak_rss_mb": 2000.0},
            {"system": "trl", "error": "exit 1", "s_per_step": None}]  # a failed run is left out
    s = grpo_vs_trl.summarise(runs)
    assert s["ppolm"] == {"s_per_step": 2.5, "peak_rss_mb": 1100.0}
    assert s["trl"] == {"s_per_step": 5.0, "peak_rss_mb": 3000.0}
    assert s["s_per_step_ratio"] == 0.5 and s["peak_rss_mb_ratio"] == pytest.approx(0.367)
    assert grpo_vs_trl.summarise(runs[:1])["s_per_step_ratio"] is None  # no TRL run: no ratio


def test_result_line_is_the_last_json_object_of_a_child():
    out = ("{'loss': 0.1, 'grad_norm': 2.0}\n"  # TRL's Trainer prints its logs as Python dicts
           '{"system": "trl", "step_s": [1.0]}\n{"other": 1}\nnot json\n')
    assert grpo_vs_trl.result_line(out) == {"system": "trl", "step_s": [1.0]}
    assert grpo_vs_trl.result_line("{'loss': 0.1}\n") is None


def test_grpo_bench_refuses_steps_that_leave_nothing_after_warmup(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["grpo_vs_trl.py", "--only", "ppolm", "--steps", "1"])
    with pytest.raises(SystemExit) as e:
        grpo_vs_trl.main()
    assert e.value.code == 2 and "leaves no step after --warmup 1" in capsys.readouterr().err


def test_split_intervals_gives_each_label_the_time_up_to_its_events():
    events = [(3.0, "policy"), (1.5, "critic"), (2.0, "critic"), (4.0, "policy")]  # unsorted on purpose
    assert phases.split_intervals(1.0, 5.0, events) == pytest.approx({"critic": 1.0, "policy": 2.0, "other": 1.0})
    assert phases.split_intervals(1.0, 2.0, []) == {"other": 1.0}
    # an event outside the window is clamped into it
    assert phases.split_intervals(1.0, 2.0, [(0.5, "a"), (9.0, "b")]) == pytest.approx({"a": 0.0, "b": 1.0,
                                                                                           "other": 0.0})


def test_phase_clock_counts_a_nested_call_of_one_phase_once():
    ticks = iter([10.0, 14.0, 20.0, 20.5])  # the clock is read on entering and leaving the outer call only
    clock = phases.PhaseClock(now=lambda: next(ticks))
    with clock.timing("a"):  # 10 .. 14
        with clock.timing("a"):  # inside: not added again
            pass
    with clock.timing("b"):  # 20 .. 20.5
        pass
    assert clock.take() == {"a": 4.0, "b": 0.5}
    assert clock.take() == {}


def test_phase_clock_wraps_a_method_without_changing_its_result():
    class Engine:
        def run(self, x: int) -> int:
            return x + 1

    engine, clock = Engine(), phases.PhaseClock()
    assert clock.wrap(engine, "run", "work") and engine.run(2) == 3 and engine.run(3) == 4
    assert set(clock.take()) == {"work"}
    assert not clock.wrap(engine, "missing", "work") and not clock.wrap(None, "run", "work")


def test_backward_split_labels_each_models_gradient_time():
    torch.manual_seed(0)
    policy, critic = torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)
    split = phases.BackwardSplit({"policy_bwd": list(policy.parameters()), "critic_bwd": list(critic.parameters())})
    try:
        x = torch.randn(32, 64)
        t = time.perf_counter()
        (policy(x).square().mean() + critic(x).mean()).backward()
        wall = time.perf_counter() - t
        got = split.take()
    finally:
        split.restore()
    assert torch.Tensor.backward is split.original
    assert {"policy_bwd", "critic_bwd"} <= set(got) <= {"policy_bwd", "critic_bwd", "other"}
    assert all(v >= 0 for v in got.values()) and sum(got.values()) <= wall
    assert policy.weight.grad is not None and critic.weight.grad is not None  # the gradients are still computed
    assert split.take() == {}


def test_flops_and_decode_floor_by_hand():
    # 2 * 10 params * 3 tokens + 4 * 2 layers * 4 width * 3^2 * 1 row + 2 * 4 * 5 vocab * 2 scored tokens
    assert phases.forward_flops(10, 3, 2, 4, 3, 1, vocab=5, head_tokens=2) == 60 + 288 + 80
    assert phases.forward_flops(10, 3, 2, 4, 3, 1) == 60 + 288
    assert phases.decode_floor_s(1000, 32, 1e3) == pytest.approx(32.0)


def test_phase_rows_divide_by_each_floor_and_sum_them_for_the_step():
    seconds = {"rollout": 4.0, "reference": 1.0, "step": 12.0, "other": 0.5}
    floors = {"decode_bw": 2.0, "lm_fwd_nograd": 0.5, "adam_policy": 1.0}
    rows = {label: rest for label, *rest in phases.phase_rows(seconds, floors)}
    assert rows["rollout (decode, step 1)"] == [4.0, 2.0, 2.0]
    assert rows["reference forward"] == [1.0, 0.5, 2.0]
    assert rows["optimiser step: policy"] == [None, 1.0, None]  # not timed: no ratio
    assert rows["everything else"] == [0.5, None, None]
    assert rows["whole step"] == [12.0, 3.5, pytest.approx(12.0 / 3.5)]
    no_floors = {label: rest for label, *rest in phases.phase_rows(seconds, {})}
    assert no_floors["whole step"] == [12.0, None, None]
