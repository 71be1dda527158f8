"""PPO's alternatives in the same engine (--advantage, --samples-per-prompt, --loss-agg, clip-higher,
dual-clip) on tiny random models: each estimator trains, the critic-free ones build and write no
critic, groups are adjacent rows of one prompt, and a step's advantages are the core functions of
its scores."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from safetensors.torch import load_file

from ppolm import config, core
from ppolm import rollout as ro
from ppolm.checkpoint import load_latest
from ppolm.ppo import run as run_ppo
from ppolm.ppo import train_ppo
from ppolm.ppo_config import PPOConfig
from ppolm.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

REWARD_FILE = '''
def words(prompts, completions, **kwargs):
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [min(len(t.split()), 10) / 10 for t in texts]
'''

ESTIMATORS = ["grpo", "dr-grpo", "rloo", "reinforce++", "reinforce++-baseline", "remax"]
CRITIC_METRICS = ("loss/value_avg", "val/clipfrac_avg", "val/vf_explained_var", "lr/critic")


@pytest.fixture()
def reward_file(tmp_path):
    p = tmp_path / "rewards.py"
    p.write_text(REWARD_FILE)
    return p


def make_cfg(model_dir, out, reward_file, **over):
    base = dict(model=str(model_dir), reward_fn=[f"{reward_file}:words"], steps=2, batch_size=4, minibatches=2,
                ppo_epochs=1, response_length=8, output_dir=str(out), quiet=True, precision="fp32", save_every=1,
                sample_every=1, temperature=1.0)
    base.update(over)
    return config.build(PPOConfig, base)


@pytest.mark.parametrize("advantage", ESTIMATORS)
def test_critic_free_estimator_trains_and_writes_no_critic(tiny_policy_dir, tiny_rm_dir, tmp_path, reward_file,
                                                           advantage):
    before = load_file(str(tiny_policy_dir / "model.safetensors"))
    out = tmp_path / "run"
    # a reward model too: it must not turn into a critic
    cfg = make_cfg(tiny_policy_dir, out, reward_file, advantage=advantage, samples_per_prompt=2,
                   reward_model=[str(tiny_rm_dir)], clip_eps_high=0.28, dual_clip=3.0)
    result = train_ppo(cfg)
    assert [r["step"] for r in result.metrics] == [0, 1]
    for row in result.metrics:
        for k, v in row.items():
            if isinstance(v, float):
                assert math.isfinite(v), (advantage, k, v)
        assert not any(k in row for k in CRITIC_METRICS), row.keys()
        assert "policy/dual_clipfrac_avg" in row
    after = load_file(str(out / "policy" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert not (out / "critic").exists()
    _, tensors, meta = load_latest(out / "checkpoints")
    assert "critic_opt" not in meta and not any(k.startswith("critic") for k in tensors)
    saved = config.load_yaml(out / "config.yaml")
    kl_in = "reward" if advantage.startswith("reinforce++") else "loss"
    assert saved["kl"]["kl_in"] == kl_in
    assert saved["algo"]["loss_agg"] == ("seq-mean-token-sum-norm" if advantage == "dr-grpo" else "token-mean")
    assert saved["kl"]["kl_coef_max"] == math.inf  # the default ceiling is GAE's only


def test_critic_free_run_resumes(tiny_policy_dir, tmp_path, reward_file):
    out = tmp_path / "run"
    train_ppo(make_cfg(tiny_policy_dir, out, reward_file, advantage="rloo", samples_per_prompt=2, steps=1))
    result = train_ppo(make_cfg(tiny_policy_dir, out, reward_file, advantage="rloo", samples_per_prompt=2, steps=2,
                                resume=True))
    assert [r["step"] for r in result.metrics] == [0, 1]


def test_gae_defaults_unchanged(tiny_policy_dir, tmp_path, reward_file):
    """The new options at their gae defaults give the very same run as leaving them out."""
    plain = train_ppo(make_cfg(tiny_policy_dir, tmp_path / "a", reward_file))
    explicit = train_ppo(make_cfg(tiny_policy_dir, tmp_path / "b", reward_file, advantage="gae",
                                  samples_per_prompt=1, loss_agg="token-mean", kl_in="reward"))

    def clean(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rows]

    assert clean(plain.metrics) == clean(explicit.metrics)
    assert "val/vf_explained_var" in plain.metrics[0] and (tmp_path / "a" / "critic").is_dir()


def test_groups_are_adjacent_rows_of_one_prompt(tiny_policy_dir, tmp_path, reward_file):
    cfg = make_cfg(tiny_policy_dir, tmp_path / "run", reward_file, advantage="grpo", samples_per_prompt=2,
                   batch_size=8, minibatches=1)
    trainer = PPOTrainer(cfg)
    for step in range(3):
        batch = trainer.prompt_batch(step)
        assert len(batch) == 8
        pairs = [batch[i:i + 2] for i in range(0, 8, 2)]
        assert all(a is b for a, b in pairs)
        assert len({id(a) for a, _ in pairs}) == 4  # four different prompts
    assert trainer.group_ids().tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    result = run_ppo(trainer)
    rows = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    for step in (0, 1):
        prompts = [r["prompt"] for r in rows if r["step"] == step]
        assert len(prompts) == 8 and all(prompts[i] == prompts[i + 1] for i in range(0, 8, 2))
    assert len(result.metrics) == 2


def captured_experience(trainer):
    """Run step 0 and return the Experience its update received."""
    seen = {}
    update = trainer.learner.update

    def spy(exp, *args, **kwargs):
        seen["exp"] = exp
        return update(exp, *args, **kwargs)

    trainer.learner.update = spy
    trainer.step(0)
    return seen["exp"]


@pytest.mark.parametrize("advantage", ["grpo", "dr-grpo", "rloo"])
def test_step_advantages_are_the_core_function_of_its_scores(tiny_policy_dir, tmp_path, reward_file, advantage):
    cfg = make_cfg(tiny_policy_dir, tmp_path / "run", reward_file, advantage=advantage, samples_per_prompt=2,
                   batch_size=8, minibatches=1, response_length=12)
    trainer = PPOTrainer(cfg)
    exp = captured_experience(trainer)
    gid = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    want = {"grpo": lambda s: core.grpo_advantages(s, gid), "dr-grpo": lambda s: core.grpo_advantages(s, gid, scale=False),
            "rloo": lambda s: core.rloo_advantages(s, gid)}[advantage](exp.scores)
    torch.testing.assert_close(exp.advantages, want.float()[:, None] * exp.mask)
    # the KL is in the loss (k3), not in the reward
    assert trainer.cfg.kl.kl_in == "loss" and torch.equal(exp.rewards.sum(1), exp.scores.float())
    assert cfg.kl.kl_in == "auto"  # resolve() gave the trainer a resolved copy; the caller's config is as it was


def test_reinforce_pp_advantages(tiny_policy_dir, tmp_path, reward_file):
    for advantage in ("reinforce++", "reinforce++-baseline"):
        cfg = make_cfg(tiny_policy_dir, tmp_path / advantage, reward_file, advantage=advantage,
                       samples_per_prompt=2, batch_size=8, minibatches=1, kl_coef=0.1)
        exp = captured_experience(PPOTrainer(cfg))
        gid = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        base = core.group_baseline(exp.scores, gid) if advantage.endswith("baseline") else exp.scores
        rewards, _ = core.shape_rewards(base, exp.kl, cfg.kl.kl_coef, exp.mask)
        want = core.masked_whiten(core.reinforce_pp_returns(rewards, exp.mask, cfg.algo.gamma), exp.mask)
        torch.testing.assert_close(exp.advantages, want)


def test_remax_baseline_is_the_greedy_score(tiny_policy_dir, tmp_path, reward_file, monkeypatch):
    cfg = make_cfg(tiny_policy_dir, tmp_path / "run", reward_file, advantage="remax", samples_per_prompt=2,
                   minibatches=1)
    trainer = PPOTrainer(cfg)
    calls = []
    generate = ro.generate

    def spy(*args, **kw):
        roll = generate(*args, **kw)
        calls.append((kw.get("greedy", False), roll))
        return roll

    monkeypatch.setattr(ro, "generate", spy)
    exp = captured_experience(trainer)
    assert [g for g, _ in calls] == [False, True] and calls[1][1].response.shape[0] == 2  # one per prompt
    greedy = calls[1][1]
    greedy_scores = trainer.penalise(trainer.frozen.score(greedy, trainer.prompt_batch(0)[::2])[0], greedy)
    want = core.remax_advantages(exp.scores, greedy_scores.repeat_interleave(2))
    torch.testing.assert_close(exp.advantages, want.float()[:, None] * exp.mask)


def test_greedy_generation_is_argmax(tiny_policy_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_policy_dir).eval()
    ids = tokenizer("Hello there", add_special_tokens=False)["input_ids"]
    roll = ro.generate(model, [ids], pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, max_new_tokens=6,
                       temperature=0.7, greedy=True, ignore_eos=True)
    torch.manual_seed(123)
    again = ro.generate(model, [ids], pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, max_new_tokens=6,
                        temperature=0.7, greedy=True, ignore_eos=True)
    assert torch.equal(roll.response, again.response)
    logits = model(torch.tensor([ids + roll.response[0].tolist()])).logits[0, len(ids) - 1:-1]
    logits[:, tokenizer.eos_token_id] = -math.inf
    assert roll.response[0].tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("over, expect", [
    (dict(advantage="grpo", samples_per_prompt=1),
     r"--advantage grpo compares the responses to one prompt: give --samples-per-prompt 2"),
    (dict(advantage="rloo", samples_per_prompt=3), r"--batch-size 4 is not divisible by --samples-per-prompt 3"),
    (dict(advantage="remax", top_k=1), r"--advantage remax with --top-k 1"),
    (dict(dual_clip=1.0), r"--dual-clip must be > 1; got 1\.0"),
    (dict(clip_eps_high=0.0), r"--clip-eps-high must be > 0; got 0\.0"),
    (dict(update_kl_max=0.0), r"--update-kl-max must be > 0 \(or none\); got 0\.0"),
])
def test_bad_estimator_options(tmp_path, reward_file, over, expect):
    from ppolm.errors import PPOLMError

    with pytest.raises(PPOLMError, match=expect):
        make_cfg("unused-model", tmp_path / "run", reward_file, **over)


def test_minibatches_may_split_a_group(tiny_policy_dir, tmp_path, reward_file):
    cfg = make_cfg(tiny_policy_dir, tmp_path / "run", reward_file, advantage="grpo", samples_per_prompt=4,
                   minibatches=4, steps=1)
    assert all(math.isfinite(v) for v in train_ppo(cfg).metrics[0].values() if isinstance(v, float))


def test_critic_free_with_lora_or_critic_shared_and_eval(tiny_policy_dir, tmp_path, reward_file):
    """LoRA and --critic shared combine with a critic-free estimator (no critic, no value head is
    built), and the held-out evaluation runs."""
    evals = tmp_path / "eval.jsonl"
    evals.write_text("".join(json.dumps({"prompt": f"Tell me about {w}."}) + "\n" for w in ("cats", "rain")))
    for i, over in enumerate([dict(lora_r=4), dict(critic="shared")]):
        out = tmp_path / f"run{i}"
        cfg = make_cfg(tiny_policy_dir, out, reward_file, advantage="reinforce++-baseline", samples_per_prompt=2,
                       eval_prompts=str(evals), eval_every=1, **over)
        trainer = PPOTrainer(cfg)
        assert trainer.critic is None and trainer.value_head is None and trainer.learner.critic_opt is None
        result = run_ppo(trainer)
        assert len(result.metrics) == 2 and (out / "eval.jsonl").is_file()
        assert not (out / "critic").exists()
    assert (tmp_path / "run0" / "policy_adapter").is_dir()


def test_group_estimators_default_to_groups_of_four(tiny_policy_dir, tmp_path, reward_file):
    """--advantage grpo (rloo, ...) without --samples-per-prompt samples each prompt 4 times (a batch
    of 8: 2 prompts x 4); gae and the other estimators keep 1; config.yaml records the choice."""
    for advantage, want in (("grpo", 4), ("rloo", 4), ("reinforce++-baseline", 4), ("gae", 1), ("remax", 1)):
        cfg = config.build(PPOConfig, {"advantage": advantage, "reward_fn": ["x.py:f"], "batch_size": 8})
        cfg.validate()
        cfg = cfg.resolve()
        assert cfg.algo.samples_per_prompt == want, advantage
    out = tmp_path / "run"
    train_ppo(make_cfg(tiny_policy_dir, out, reward_file, advantage="grpo", batch_size=8, minibatches=1, steps=1))
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["algo"]["samples_per_prompt"] == 4
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    prompts = [json.dumps(r["prompt"]) for r in rows]
    assert len(rows) == 8 and len(set(prompts)) == 2 and prompts[:4] == [prompts[0]] * 4
