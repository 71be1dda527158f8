"""Async reward functions (TRL's convention, ``async def``): awaited, several at once, beside the
synchronous ones; their errors are one line, as a synchronous function's; a PPO run takes them."""

from __future__ import annotations

import asyncio
import time

import pytest

from ppolm import config
from ppolm.errors import PPOLMError
from ppolm.ppo import train_ppo
from ppolm.ppo_config import PPOConfig
from ppolm.rewards import Rewarder, RewardFunction, load_reward_fn
from ppolm.tiny import build_tiny_model_dir

REWARDS = '''
import asyncio

async def slow_length(prompts, completions, **kwargs):
    await asyncio.sleep(0.5)
    return [float(len(c)) for c in completions]

async def slow_one(prompts, completions, label, **kwargs):
    await asyncio.sleep(0.5)
    return [1.0 if x == "yes" else 0.0 for x in label]

def quick(prompts, completions, **kwargs):
    return [10.0] * len(completions)

async def broken(prompts, completions, **kwargs):
    await asyncio.sleep(0)
    raise ValueError("the checker crashed")

async def short(prompts, completions, **kwargs):
    return [1.0]

class Scorer:
    async def __call__(self, prompts, completions, **kwargs):
        return [2.0] * len(completions)

scorer = Scorer()
'''


@pytest.fixture()
def fns(tmp_path):
    f = tmp_path / "async_rewards.py"
    f.write_text(REWARDS)
    return {n: RewardFunction(n, load_reward_fn(f"{f}:{n}"), w)
            for n, w in (("slow_length", 1.0), ("slow_one", 2.0), ("quick", 0.5), ("broken", 1.0), ("short", 1.0),
                         ("scorer", 1.0))}


def run(rewarder, completions, **columns):
    return rewarder.score(model_inputs=None, prompts=["p"] * len(completions), completions=completions,
                          columns=columns)


def test_two_async_functions_run_concurrently(fns):
    rewarder = Rewarder([], [fns["slow_length"], fns["quick"], fns["slow_one"]])
    assert fns["slow_length"].is_async and not fns["quick"].is_async
    t0 = time.perf_counter()
    total, parts = run(rewarder, ["ab", "abcd"], label=["yes", "no"])
    wall = time.perf_counter() - t0
    assert wall < 0.9  # two sleeps of 0.5 s, awaited together
    assert list(parts) == ["reward/slow_length", "reward/quick", "reward/slow_one"]  # sources in order
    assert parts["reward/slow_length"].tolist() == [2.0, 4.0] and parts["reward/slow_one"].tolist() == [1.0, 0.0]
    assert total.tolist() == [2.0 + 5.0 + 2.0, 4.0 + 5.0 + 0.0]


def test_async_callable_object_and_direct_call(fns):
    assert fns["scorer"].is_async
    assert run(Rewarder([], [fns["scorer"]]), ["a"])[0].tolist() == [2.0]
    assert fns["slow_length"](["p"], ["abc"], {}).tolist() == [3.0]  # called directly, outside a loop


def test_inside_a_running_event_loop(fns):
    """From code that already runs a loop (a notebook), scoring runs on a loop of its own."""
    async def caller():
        return run(Rewarder([], [fns["slow_length"]]), ["xyz"])[0].tolist()

    assert asyncio.run(caller()) == [3.0]


def test_async_errors_are_one_line(fns):
    with pytest.raises(PPOLMError, match="reward function 'broken' raised ValueError: the checker crashed"):
        run(Rewarder([], [fns["slow_length"], fns["broken"]]), ["a"])
    with pytest.raises(PPOLMError, match="reward function 'short' returned 1 values for 2 completions"):
        run(Rewarder([], [fns["short"]]), ["a", "b"])


def test_ppo_with_an_async_reward_function(tmp_path):
    f = tmp_path / "r.py"
    f.write_text(REWARDS)
    policy = build_tiny_model_dir(tmp_path / "policy", kind="causal", seed=0, num_layers=1, hidden_size=16, heads=2,
                                  kv_heads=1, intermediate_size=32)
    cfg = config.build(PPOConfig, dict(model=str(policy), steps=2, batch_size=4, minibatches=1, ppo_epochs=1,
                                       response_length=4, output_dir=str(tmp_path / "run"), quiet=True,
                                       precision="fp32", device="cpu", save_every=10,
                                       reward_fn=[f"{f}:slow_length", f"{f}:quick"]))
    result = train_ppo(cfg)
    assert len(result.metrics) == 2
    for row in result.metrics:
        assert row["reward/quick"] == 10.0 and row["reward/slow_length"] >= 0
        assert row["objective/scores"] == pytest.approx(row["reward/slow_length"] + 10.0, abs=1e-4)
