"""The option groups of ppolm/config_sections.py: one docstring per shared option, shown by every
command that inherits it; flat saved configs (the YAML a run directory holds) still build and resume."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest
import yaml

from ppolm import config, config_sections, rundir
from ppolm.cli import COMMANDS, build_parser
from ppolm.dpo import DPOConfig
from ppolm.reward_train import RewardTrainConfig
from ppolm.sft import SFTConfig

SECTIONS = [c for _, c in inspect.getmembers(config_sections, inspect.isclass)
            if c.__module__ == config_sections.__name__ and dataclasses.is_dataclass(c)]


def command_classes() -> dict[str, type]:
    out = {}
    for name, (spec, _, _) in COMMANDS.items():
        module, _, cls = spec.partition(":")
        out[name] = getattr(importlib.import_module(module), cls)
    return out


def help_text(command: str, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "10000")  # one line per option: docstrings are not wrapped
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_each_shared_docstring_is_in_the_help_of_every_command_that_inherits_it(capsys, monkeypatch):
    checked = set()
    for command, cls in command_classes().items():
        sections = [s for s in SECTIONS if issubclass(cls, s)]
        if not sections:
            continue
        text = help_text(command, capsys, monkeypatch)
        own = inspect.get_annotations(cls)  # fields the command redeclares keep their own wording
        for section in sections:
            for name, doc in config.field_docs(section).items():
                if name in own:
                    continue
                assert config.field_docs(cls)[name] == doc
                assert f"{doc} [" in text, (command, name)
                checked.add((command, name))
    assert {c for c, _ in checked} >= {"sft", "reward", "dpo", "eval", "reward-eval"}
    assert ("sft", "allow_pickle") in checked and ("dpo", "merge_lora") in checked


def test_sections_write_each_docstring_once():
    for section in SECTIONS:
        declared = inspect.get_annotations(section)  # none in a group of groups (PolicyTrainOptions)
        assert set(declared) <= set(config.field_docs(section)), section
    names = [n for s in SECTIONS for n in inspect.get_annotations(s)]
    assert len(names) == len(set(names))


# sft_config.yaml as written before the options moved into sections (flat keys, that order),
# with some values changed from their defaults.
OLD_SFT_YAML = """\
model: smollm2-135m-instruct
data: pairs.jsonl
eval_data: null
eval_fraction: 0.2
output_dir: runs/sft
epochs: 3
batch_size: 8
lr: 2.0e-05
lr_schedule: constant
weight_decay: 0.0
max_grad_norm: 1.0
max_length: 256
chat_template: true
lora_r: 8
lora_alpha: 32.0
lora_target: all-linear
merge_lora: false
precision: fp32
device: cpu
seed: 3
save_every: 50
keep_last: 2
resume: false
overwrite: false
max_skipped_updates: 3
quiet: true
trust_remote_code: false
allow_pickle: true
"""

ADDED_KEYS = {"dist_timeout", "fsdp"}
"""Options added since (a saved config without them still builds, with their defaults, and resumes)."""
ADDED_TO = {RewardTrainConfig: {"init_from"}}
"""Options added since to one command only."""

OLD_KEYS = {
    RewardTrainConfig: "model data eval_data eval_fraction output_dir epochs batch_size lr lr_schedule weight_decay "
    "max_grad_norm max_length margin_column center_coef train_layers group_by_prompt trunk_cache lora_r lora_alpha "
    "lora_target chat_template normalize norm_source norm_policy norm_prompts norm_samples norm_response_length "
    "norm_temperature precision device seed save_every keep_last resume overwrite max_skipped_updates quiet "
    "trust_remote_code allow_pickle",
    DPOConfig: "model data eval_data eval_fraction output_dir epochs batch_size lr lr_schedule weight_decay "
    "max_grad_norm max_length beta loss_type label_smoothing chat_template lora_r lora_alpha lora_target merge_lora "
    "precision device seed save_every keep_last resume overwrite max_skipped_updates quiet trust_remote_code "
    "allow_pickle",
}


def test_a_flat_config_saved_before_builds_and_resumes(tmp_path):
    path = tmp_path / "sft_config.yaml"
    path.write_text(OLD_SFT_YAML)
    saved = yaml.safe_load(OLD_SFT_YAML)
    cfg = config.build(SFTConfig, config.flatten_overrides(SFTConfig, config.load_yaml(path), "sft"))
    assert (cfg.lora_r, cfg.merge_lora, cfg.precision, cfg.seed, cfg.quiet, cfg.allow_pickle, cfg.max_length,
            cfg.eval_fraction, cfg.lr_schedule) == (8, False, "fp32", 3, True, True, 256, 0.2, "constant")
    now = config.to_dict(cfg)
    # the same flat keys and values, plus the options added since: --resume accepts the run
    assert set(now) == set(saved) | ADDED_KEYS and {k: now[k] for k in saved} == saved
    assert rundir.config_difference(saved, now) == ""
    config.save_yaml(cfg, tmp_path / "again.yaml")
    again = yaml.safe_load((tmp_path / "again.yaml").read_text())
    assert {k: again[k] for k in saved} == saved


@pytest.mark.parametrize("cls", list(OLD_KEYS), ids=lambda c: c.__name__)
def test_saved_keys_are_unchanged(cls):
    keys = OLD_KEYS[cls].split()
    added = ADDED_KEYS | ADDED_TO.get(cls, set())
    cfg = config.build(cls, {"data": "pairs.jsonl"})
    assert set(config.to_dict(cfg)) == set(keys) | added
    assert len(keys) + len(added) == len(config.leaf_fields(cls))
    # a file with every old key builds; the values round-trip
    cfg2 = config.build(cls, config.flatten_overrides(cls, config.to_dict(cfg), "x"))
    assert config.to_dict(cfg2) == config.to_dict(cfg)


# ppo_config.yaml's model section as written before ModelConfig took the shared options.
OLD_PPO_MODEL_SECTION = """\
model:
  model: smollm2-135m-instruct
  critic: separate
  critic_init: reward
  critic_zero_head: false
  critic_layers: 4
  share_trunk: true
  share_prefix: true
  lora_r: 4
  lora_alpha: 16.0
  lora_target: q_proj,v_proj
  device: cpu
  precision: fp32
  trust_remote_code: false
  allow_pickle: true
"""


def test_ppo_model_section_keeps_its_saved_shape():
    from ppolm.ppo_config import PPOConfig

    saved = yaml.safe_load(OLD_PPO_MODEL_SECTION)
    overrides = config.flatten_overrides(PPOConfig, {**saved, "reward_fn": ["m:f"]}, "ppo")
    cfg = config.build(PPOConfig, overrides)
    assert (cfg.model.lora_r, cfg.model.lora_alpha, cfg.model.lora_target, cfg.model.allow_pickle) == \
        (4, 16.0, "q_proj,v_proj", True)
    now = config.to_dict(cfg)
    added = {"fsdp": False, "ref_model": None, "critic_model": None}  # options added since, at their defaults
    assert now["model"] == {**saved["model"], **added}  # same nested keys and values
    assert rundir.config_difference(saved, now) == ""


def test_a_reward_run_saved_with_one_data_file_resumes_now_that_data_repeats():
    from ppolm.reward_train import RewardTrainConfig

    now = config.to_dict(config.build(RewardTrainConfig, {"data": ["pairs.jsonl"]}))
    assert now["data"] == ["pairs.jsonl"]
    saved = {**now, "data": "pairs.jsonl"}  # reward_config.yaml written while --data took one file
    assert rundir.config_difference(saved, now) == ""
    assert rundir.config_difference({**now, "data": "other.jsonl"}, now) == \
        "data: 'other.jsonl' then, ['pairs.jsonl'] now"


def test_ppo_shares_the_run_options_of_the_other_commands():
    from ppolm.config_sections import RunControl, TrainRunControl
    from ppolm.ppo_config import RunConfig

    shared = {f.name: (f.default, f.metadata) for f in dataclasses.fields(RunControl)}
    for cls in (RunConfig, TrainRunControl):
        assert issubclass(cls, RunControl)
        assert {f.name: (f.default, f.metadata) for f in dataclasses.fields(cls) if f.name in shared} == shared
    assert config.option_help(RunConfig, "seed") == config.option_help(TrainRunControl, "seed")
