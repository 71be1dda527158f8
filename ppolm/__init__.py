"""ppolm: RLHF with Proximal Policy Optimisation for language models.

The pipeline of InstructGPT (SFT -> reward model -> PPO) with the implementation details
that decide whether PPO works, on a laptop CPU or a GPU.

From Python, each command is a config and a function::

    from ppolm import PPOConfig, config, train_ppo
    result = train_ppo(config.build(PPOConfig, {"reward_fn": ["my_rewards.py:fn"], "steps": 20}))

``SFTConfig``/``train_sft``, ``RewardTrainConfig``/``train_reward`` and ``DPOConfig``/``train_dpo``
alike. ``import ppolm`` stays light: each name loads its module on first use (``import ppolm.core``
needs only torch).

The modules, from the bottom layer up (a module imports only from layers below it; the test
tests/test_layers.py keeps the graph free of cycles):

1. ``errors``, ``core`` (the maths, torch only), ``atomic`` (atomic writes), ``config_sections``,
   ``builtin_rewards``, ``tracking``, ``demo_sizes``, ``memory`` (peak memory per phase);
2. ``runtime`` (device, precision, seeds, signals), ``config``, ``data``, ``models`` (loading and
   saving models), ``gold``;
3. ``distributed`` (torchrun), ``checkpoint``, ``rundir`` (the output-directory guard), ``scaffold``
   (the run every training command shares), ``prefix``, ``critic``, ``trunk``, ``rollout``, ``rewards``,
   ``remote`` (reward services over HTTP), ``judge`` (judges: functions and LLMs), ``tiny`` (tiny
   random models for tests and benchmarks);
4. the commands: ``trainloop`` with ``sft``, ``pairs`` (preference-pair files), ``reward_train``,
   ``dpo``; ``evaluate``; ``serve_rm``; ``label_store`` and ``label``; the reward model's checks
   against a judge, ``rm_check``, ``rm_refresh``, ``rm_guard``; PPO as ``ppo_config``, ``ppo_models``,
   ``frozen``, ``actor_critic``, ``advantages``, ``ppo_learner``, ``ppo_metrics``, ``ppo_trainer`` (one
   step), ``ppo_outputs`` and ``ppo`` (the run);
5. ``alarms``, ``compare``, ``report``, ``demo`` and its long mode ``demo_long``, ``docs_gen``, and ``cli``
   on top.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_API = {
    "PPOConfig": "ppolm.ppo_config",
    "train_ppo": "ppolm.ppo",
    "SFTConfig": "ppolm.sft",
    "train_sft": "ppolm.sft",
    "RewardTrainConfig": "ppolm.reward_train",
    "train_reward": "ppolm.reward_train",
    "DPOConfig": "ppolm.dpo",
    "train_dpo": "ppolm.dpo",
}
"""The public names and the modules that define them (loaded on first use)."""

__all__ = [*_API, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'ppolm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
