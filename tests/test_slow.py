"""The real embedded model (SmolLM2-135M-Instruct): PPO learns a simple rule-based reward.

Task: answer the built-in "write one sentence about ..." prompts concisely. Reward (a TRL-style
function): 1 - min(words, 40) / 40, so a 10-word answer scores 0.75 and a 40-word one 0. The
starting model answers in ~25-35 words (reward ~0.3); PPO (lr 1e-4, 2 epochs, the default KL settings, a
shared value head) shortens its answers within 8 steps of 8 rollouts. Measured on held-out
prompts before and after training (sampling with a fixed seed).
"""

from __future__ import annotations

import json

import pytest

from ppolm import config
from ppolm.ppo import train_ppo
from ppolm.ppo_config import PPOConfig

pytestmark = pytest.mark.slow

REWARD = '''
def concise(prompts, completions, **kwargs):
    return [1 - min(len(c.split()), 40) / 40 for c in completions]
'''

HELD_OUT = ["Write one sentence about a harbour.", "Describe a mountain lake in one short sentence.",
            "Write one sentence about a jazz concert.", "Say something nice about a teacher.",
            "Write one sentence about spring flowers.", "Describe a city at night in one short sentence.",
            "Write one sentence about a bakery.", "Say something nice about a neighbour."]


def test_ppo_on_embedded_model_raises_heldout_reward(tmp_path):
    (tmp_path / "r.py").write_text(REWARD)
    (tmp_path / "held.txt").write_text("\n".join(HELD_OUT) + "\n")
    out = tmp_path / "run"
    # Cheaper than the defaults so it fits a CI run on 2 AVX2 cores (~1 min a step in fp32): a value
    # head on the policy's trunk instead of a second 135M model, 2 epochs of one minibatch.
    cfg = config.build(PPOConfig, dict(reward_fn=[f"{tmp_path / 'r.py'}:concise"], steps=8, response_length=40,
                                       critic="shared", ppo_epochs=2, minibatches=1, actor_lr=1e-4,
                                       eval_prompts=str(tmp_path / "held.txt"), eval_every=8,
                                       output_dir=str(out), quiet=True, save_every=100))
    result = train_ppo(cfg)
    rows = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    before, after = rows[0], rows[-1]
    print("held-out reward before", before["eval/concise"], "+-", before["eval/concise_se"],
          "after", after["eval/concise"], "+-", after["eval/concise_se"], "KL", after["eval/kl"])
    margin = 2 * (before["eval/concise_se"] ** 2 + after["eval/concise_se"] ** 2) ** 0.5
    assert after["eval/concise"] > before["eval/concise"] + margin
    train = [r["objective/scores"] for r in result.metrics]
    assert sum(train[-3:]) / 3 > sum(train[:3]) / 3
