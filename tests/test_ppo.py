"""The PPO trainer on tiny random models: the loop runs, learns something, and writes usable outputs."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from safetensors.torch import load_file

from ppolm import config, core
from ppolm import rollout as ro
from ppolm.errors import PPOLMError
from ppolm.ppo import held_out, train_ppo
from ppolm.ppo import run as run_ppo
from ppolm.ppo_config import PPOConfig
from ppolm.ppo_trainer import PPOTrainer

REWARD_FILE = '''
def words(prompts, completions, **kwargs):
    """Number of words, capped: rewards longer answers."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [min(len(t.split()), 10) / 10 for t in texts]

def minus_three(prompts, completions, **kwargs):
    """A constant: added to another reward, it shifts every score by -3 (a reward model's offset)."""
    return [-3.0] * len(completions)

def minus_six(prompts, completions, **kwargs):
    """A larger constant offset."""
    return [-6.0] * len(completions)

def nothing(prompts, completions, **kwargs):
    """A reward no response earns."""
    return [0.0] * len(completions)

CALLS = []

def mastered(prompts, completions, **kwargs):
    """Every other response earns it in the first batch, every response afterwards."""
    CALLS.append(len(completions))
    return [float(i % 2) for i in range(len(completions))] if len(CALLS) == 1 else [1.0] * len(completions)

CLIMB = []

def climbing(prompts, completions, **kwargs):
    """A reward a policy climbs: each batch's mean 50 above the last (-100, -50, 0, ...), its
    answers 0, 2, 4, ... apart around it."""
    CLIMB.append(len(completions))
    return [-100.0 + 50.0 * (len(CLIMB) - 1) + 2.0 * i for i in range(len(completions))]

ONCE = []

def once(prompts, completions, **kwargs):
    """Every other response earns it in the first batch, no response afterwards."""
    ONCE.append(len(completions))
    return [float(i % 2) for i in range(len(completions))] if len(ONCE) == 1 else [0.0] * len(completions)

def seen(prompts, completions, answer, **kwargs):
    """Checks the TRL convention: one extra-column value per completion."""
    assert len(answer) == len(completions)
    return [1.0 if a == "yes" else 0.0 for a in answer]
'''


@pytest.fixture()
def reward_file(tmp_path):
    p = tmp_path / "my_rewards.py"
    p.write_text(REWARD_FILE)
    return p


def make_cfg(model_dir, out, reward_file, **over):
    base = dict(model=str(model_dir), reward_fn=[f"{reward_file}:words"], steps=2, batch_size=4, minibatches=2,
                ppo_epochs=2, response_length=8, output_dir=str(out), quiet=True, precision="fp32", save_every=1)
    base.update(over)
    return config.build(PPOConfig, base)


def test_two_steps_change_weights_and_write_outputs(tiny_policy_dir, tiny_rm_dir, tmp_path, reward_file):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    before_policy = load_file(str(tiny_policy_dir / "model.safetensors"))
    before_critic = load_file(str(tiny_rm_dir / "model.safetensors"))
    out = tmp_path / "run"
    cfg = make_cfg(tiny_policy_dir, out, reward_file, reward_model=[str(tiny_rm_dir)], steps=3)
    result = train_ppo(cfg)

    assert [r["step"] for r in result.metrics] == [0, 1, 2]
    names = ["objective/kl", "objective/kl_coef", "objective/entropy", "objective/non_score_reward",
             "objective/rlhf_reward", "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg",
             "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg", "val/vf_explained_var", "adv/var",
             "response/length_mean", "val/num_eos_tokens", "lr", "time/rollout_s", "time/score_s",
             "time/train_s", "time/step_s", "step", "reward/words", "reward/tiny_rm0"]
    for row in result.metrics:
        for n in names:
            assert n in row and row[n] is not None and math.isfinite(row[n]), (n, row.get(n))

    # outputs: HF directories that plain transformers loads; the critic starts from the RM
    policy = AutoModelForCausalLM.from_pretrained(out / "policy")
    critic = AutoModelForSequenceClassification.from_pretrained(out / "critic")
    after_policy = load_file(str(out / "policy" / "model.safetensors"))
    after_critic = load_file(str(out / "critic" / "model.safetensors"))
    changed = [k for k in before_policy if not torch.equal(before_policy[k], after_policy[k])]
    assert len(changed) > len(before_policy) // 2
    assert not torch.equal(before_critic["score.weight"], after_critic["score.weight"])
    ids = torch.tensor([[1, 2, 3]])
    assert policy.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 6)
    assert critic(ids).logits.shape == (1, 1)
    for f in ("config.yaml", "metrics.jsonl", "samples.jsonl"):
        assert (out / f).is_file()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "checkpoints" / "step-000003" / "manifest.json").is_file()
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {0, 2} and set(samples[0]) >= {"prompt", "response", "score", "kl"}
    saved = config.load_yaml(out / "config.yaml")
    assert saved["algo"]["ppo_epochs"] == 2 and saved["reward"]["reward_model"] == [str(tiny_rm_dir)]


def test_kl_is_zero_on_first_rollout(tiny_policy_dir, tmp_path, reward_file):
    """Policy == reference before any update, so the per-token KL is exactly 0 (fp32)."""
    cfg = make_cfg(tiny_policy_dir, tmp_path / "run", reward_file, steps=1)
    trainer = PPOTrainer(cfg)
    metrics, _ = trainer.step(0)
    assert abs(metrics["objective/kl"]) < 1e-6
    assert abs(metrics["objective/non_score_reward"]) < 1e-6
    # one PPO epoch of one minibatch: ratio exactly 1, no clipping
    cfg1 = make_cfg(tiny_policy_dir, tmp_path / "run1", reward_file, steps=1, ppo_epochs=1, minibatches=1)
    m1, _ = PPOTrainer(cfg1).step(0)
    assert m1["val/ratio"] == pytest.approx(1.0, abs=1e-6) and m1["policy/clipfrac_avg"] == 0.0


def test_bf16_first_rollout_kl_is_small(tiny_policy_dir, tmp_path, reward_file):
    cfg = make_cfg(tiny_policy_dir, tmp_path / "run", reward_file, steps=1, precision="bf16")
    metrics, _ = PPOTrainer(cfg).step(0)
    assert abs(metrics["objective/kl"]) < 0.05 * cfg.generation.response_length


def test_truncate_after_eos_masks_uneven_lengths():
    eos, pad = 2, 0
    resp = torch.tensor([[5, 6, 2, 7, 8],    # stops at position 2
                         [5, 2, 2, 9, 9],    # first EOS at 1; the second is padding
                         [5, 6, 7, 8, 9]])   # never stops
    out, mask, ended = ro.truncate_after_eos(resp, eos, pad)
    assert out.tolist() == [[5, 6, 2, 0, 0], [5, 2, 0, 0, 0], [5, 6, 7, 8, 9]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert ended.tolist() == [True, True, False]


def test_score_lands_on_last_real_token_with_uneven_lengths():
    """Shaped rewards: -beta*kl everywhere real, the score only at each row's last real token."""
    roll = ro.Rollout(query=torch.tensor([[0, 4, 5], [3, 4, 5]]), query_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
                      response=torch.tensor([[7, 2, 0, 0], [7, 8, 9, 2]]),
                      response_mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]),
                      ended=torch.tensor([True, True]))
    # the last real token's column in input_ids: P + length - 1 (P=3: columns 3+2-1 and 3+4-1)
    assert (roll.query.shape[1] + roll.lengths - 1).tolist() == [4, 6]
    mask = roll.response_mask.float()
    kl = torch.full((2, 4), 0.5) * mask
    rewards, non_score = core.shape_rewards(torch.tensor([1.0, -2.0]), kl, 0.1, mask)
    # -0.1*0.5 = -0.05 per real token; +1 at column 1 of row 0, -2 at column 3 of row 1
    assert torch.allclose(rewards, torch.tensor([[-0.05, 0.95, 0.0, 0.0], [-0.05, -0.05, -0.05, -2.05]]))
    assert torch.allclose(non_score, torch.tensor([[-0.05, -0.05, 0.0, 0.0], [-0.05] * 4]))


def test_reward_model_reads_last_real_token_despite_padding(tiny_rm_dir):
    from ppolm.rewards import RewardModel

    rm = RewardModel(str(tiny_rm_dir), dtype=torch.float32, device="cpu")
    a, b = [11, 12, 13, 14, 15], [21, 22, 23]
    alone = [rm.score_ids(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long)).item() for s in (a, b)]
    # b left-padded by 1 (prompt) and right-padded by 1 (response): [0, 21, 22 | 23, 0]
    ids = torch.tensor([a, [0, 21, 22, 23, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    both = rm.score_ids(ids, mask)
    assert both.tolist() == pytest.approx(alone, abs=1e-5)


def test_trl_convention_chat_prompts_and_extra_columns(tiny_policy_dir, tmp_path, reward_file):
    data = tmp_path / "prompts.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Say {w}."}], "answer": "yes" if i % 2 else "no"}
            for i, w in enumerate(["hi", "yes", "no", "ok"])]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = tmp_path / "seen.py"
    seen.write_text(
        "import json\n"
        "def check(prompts, completions, answer, **kw):\n"
        f"    open({str(tmp_path / 'log.json')!r}, 'a').write(json.dumps([prompts, completions, answer]) + '\\n')\n"
        "    return [1.0 if a == 'yes' else 0.0 for a in answer]\n")
    cfg = make_cfg(tiny_policy_dir, tmp_path / "run", reward_file, steps=1, prompts=str(data),
                   reward_fn=[f"{seen}:check", f"{reward_file}:words"], reward_fn_weights=[2.0, 0.5])
    metrics, _ = PPOTrainer(cfg).step(0)
    prompts, completions, answers = json.loads((tmp_path / "log.json").read_text().splitlines()[0])
    assert all(isinstance(p, list) and p[0]["role"] == "user" for p in prompts)
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions)
    assert sorted(answers) == ["no", "no", "yes", "yes"]
    assert metrics["reward/check"] == pytest.approx(0.5)
    assert metrics["objective/scores"] == pytest.approx(2.0 * 0.5 + 0.5 * metrics["reward/words"], abs=1e-6)


def test_missing_eos_and_length_penalties(tiny_policy_dir, tmp_path, reward_file):
    cfg = make_cfg(tiny_policy_dir, tmp_path / "run", reward_file, steps=1, missing_eos_penalty=-3.0,
                   length_penalty=0.25)
    metrics, samples = PPOTrainer(cfg).step(0)
    # the random tiny model never emits EOS in 8 tokens: score = -3 - 0.25*8 = -5 for all
    assert metrics["response/length_mean"] == 8 and metrics["val/num_eos_tokens"] == 0
    assert [s["score"] for s in samples] == pytest.approx([-5.0] * 4)
    # with a budget of 5 free tokens only 3 are penalised: -3 - 0.25 * (8 - 5) = -3.75
    cfg = make_cfg(tiny_policy_dir, tmp_path / "run3", reward_file, steps=1, missing_eos_penalty=-3.0,
                   length_penalty=0.25, length_budget=5)
    _, samples = PPOTrainer(cfg).step(0)
    assert [s["score"] for s in samples] == pytest.approx([-3.75] * 4)
    with pytest.raises(PPOLMError, match="ignore-eos"):
        make_cfg(tiny_policy_dir, tmp_path / "run2", reward_file, ignore_eos=True, missing_eos_penalty=-1.0)


def experiences(trainer, steps):
    """Run ``steps`` steps and return the Experience each update received."""
    seen = []
    update = trainer.learner.update

    def spy(exp, *args, **kwargs):
        seen.append(exp)
        return update(exp, *args, **kwargs)

    trainer.learner.update = spy
    for step in range(steps):
        trainer.step(step)
    return seen


def test_lora_trains_only_the_adapters(tiny_policy_dir, tiny_rm_dir, tmp_path, reward_file):
    out = tmp_path / "run"
    trainer = PPOTrainer(make_cfg(tiny_policy_dir, out, reward_file, lora_r=4, steps=1,
                                  reward_model=[str(tiny_rm_dir)]))
    names = [n for n, _ in trainer.trained_parameters() if n.startswith("policy.")]
    assert names and all("lora_" in n for n in names)
    before = {n: p.detach().clone() for n, p in trainer.trained_parameters()}
    trainer.step(0)
    assert any(not torch.equal(before[n], p) for n, p in trainer.trained_parameters() if n.startswith("policy."))
    run_ppo(trainer)
    assert (out / "policy_adapter" / "adapter_config.json").is_file() and (out / "policy" / "model.safetensors").is_file()


def test_shared_critic_is_a_value_head_on_the_policy(tiny_policy_dir, tmp_path, reward_file):
    out = tmp_path / "run"
    trainer = PPOTrainer(make_cfg(tiny_policy_dir, out, reward_file, critic="shared", steps=1))
    assert trainer.critic is None and trainer.value_head is not None
    assert [n for n, _ in trainer.trained_parameters() if n.startswith("critic.")] == ["critic.weight", "critic.bias"]
    run_ppo(trainer)
    assert (out / "critic" / "value_head.safetensors").is_file() and not (out / "critic" / "config.json").exists()


def test_kl_in_loss_leaves_the_kl_out_of_the_rewards(tiny_policy_dir, tmp_path, reward_file):
    """Step 1 (the policy has moved: KL > 0): with --kl-in reward every token but the last carries
    -beta * KL; with --kl-in loss none does (the KL is a term of the loss instead)."""
    def before_last(kl_in):
        cfg = make_cfg(tiny_policy_dir, tmp_path / kl_in, reward_file, kl_in=kl_in, actor_lr=1e-2, steps=2)
        exp = experiences(PPOTrainer(cfg), 2)[1]
        last = torch.zeros_like(exp.mask).scatter_(1, (exp.roll.lengths - 1).clamp(min=0)[:, None], 1.0)
        return float((exp.rewards * exp.mask * (1 - last)).abs().sum()), float(exp.kl.abs().sum())

    in_reward, kl = before_last("reward")
    assert kl > 0 and in_reward > 0
    assert before_last("loss")[0] == 0.0


def test_kl_estimator_k3_is_what_the_experience_holds(tiny_policy_dir, tmp_path, reward_file):
    cfg = make_cfg(tiny_policy_dir, tmp_path / "run", reward_file, kl_estimator="k3", actor_lr=1e-2, steps=2)
    exp = experiences(PPOTrainer(cfg), 2)[1]
    want = core.kl_penalty(exp.old_logprobs, exp.ref_logprobs, "k3") * exp.mask
    k1 = core.kl_penalty(exp.old_logprobs, exp.ref_logprobs, "k1") * exp.mask
    assert torch.equal(exp.kl, want) and not torch.allclose(exp.kl, k1)


def test_entropy_bonus_changes_the_update(tiny_policy_dir, tmp_path, reward_file):
    def weights(entropy_coef):
        trainer = PPOTrainer(make_cfg(tiny_policy_dir, tmp_path / f"e{entropy_coef}", reward_file,
                                      entropy_coef=entropy_coef, steps=1))
        trainer.step(0)
        return [p.detach().clone() for p in trainer.learner.actor_params]

    plain, bonus = weights(0.0), weights(0.5)
    assert any(not torch.equal(a, b) for a, b in zip(plain, bonus))


def test_fixed_kl_coefficient_stays_put(tiny_policy_dir, tmp_path, reward_file):
    """A KL above a tiny target moves an adaptive beta (test_adaptive_kl_moves_beta); a fixed one stays."""
    rows = train_ppo(make_cfg(tiny_policy_dir, tmp_path / "run", reward_file, adaptive_kl=False, kl_target=1e-9,
                              steps=3)).metrics
    assert rows[2]["objective/kl"] > 0
    assert [r["objective/kl_coef"] for r in rows] == [0.01, 0.01, 0.01]


def test_whiten_rewards_divides_the_rewards_by_their_std(tiny_policy_dir, tmp_path, reward_file):
    def rewards(whiten):
        cfg = make_cfg(tiny_policy_dir, tmp_path / str(whiten), reward_file, whiten_rewards=whiten, steps=1)
        return experiences(PPOTrainer(cfg), 1)[0]

    plain, whitened = rewards(False), rewards(True)
    torch.testing.assert_close(whitened.rewards, core.masked_whiten(plain.rewards, plain.mask, shift_mean=False))
    assert not torch.allclose(whitened.rewards, plain.rewards)


def test_adaptive_kl_moves_beta(tiny_policy_dir, tmp_path, reward_file):
    """The horizon counts PPO updates, whatever the batch size. The first step's KL is 0 (policy =
    reference); KL above a tiny target from the second step on: beta x 1.2 per update (horizon 1,
    the default). KL below a large target: beta stays at its floor (--kl-coef by default), or with
    --kl-coef-min 0 shrinks by (1 - 0.2 / 10) per update at horizon 10; with --kl-coef-max it climbs
    no higher than that."""
    up = train_ppo(make_cfg(tiny_policy_dir, tmp_path / "up", reward_file, kl_target=1e-9, steps=3)).metrics
    beta = [r["objective/kl_coef"] for r in up]
    assert beta[0] == beta[1] == 0.01 and beta[2] == pytest.approx(0.01 * 1.2)
    held = train_ppo(make_cfg(tiny_policy_dir, tmp_path / "floor", reward_file, kl_target=100.0)).metrics
    assert held[0]["objective/kl_coef"] == held[1]["objective/kl_coef"] == 0.01
    free = train_ppo(make_cfg(tiny_policy_dir, tmp_path / "free", reward_file, kl_target=100.0, kl_horizon=10,
                              kl_coef_min=0.0)).metrics
    assert free[1]["objective/kl_coef"] == pytest.approx(free[0]["objective/kl_coef"] * (1 - 0.2 / 10))
    # --kl-coef-max 0.011: the same climb as "up" stops at the ceiling (0.012 -> 0.011). Each row's
    # beta replayed from the previous row's KL: x (1 +- 0.2), within [floor 0.01, ceiling 0.011].
    capped = train_ppo(make_cfg(tiny_policy_dir, tmp_path / "capped", reward_file, kl_target=1e-9, steps=4,
                                kl_coef_max=0.011)).metrics
    want = [0.01]
    for row in capped[:-1]:
        want.append(min(0.011, max(0.01, want[-1] * (1.2 if row["objective/kl"] > 1e-9 else 0.8))))
    assert [r["objective/kl_coef"] for r in capped] == pytest.approx(want)
    assert capped[2]["objective/kl_coef"] == pytest.approx(0.011)
    # left to its default the ceiling is 0.48 / --kl-target, recorded in config.yaml: far above any
    # beta of "up" at its tiny target
    assert yaml.safe_load((tmp_path / "up" / "config.yaml").read_text())["kl"]["kl_coef_max"] == pytest.approx(4.8e8)


@pytest.mark.parametrize("options, want", [
    ({}, 0.04),  # 0.48 / 12
    ({"kl_target": 6.0}, 0.08),
    ({"kl_target": 3.0}, 0.16),
    ({"kl_coef_max": 0.2}, 0.2),  # given: kept
    ({"kl_coef_max": "inf"}, math.inf),  # no ceiling, as Ziegler et al.
    ({"kl_coef": 0.03, "kl_coef_min": 0.02}, 0.04),
    ({"kl_coef": 0.05}, math.inf),  # a hand-set beta above 0.04: no ceiling rather than a fixed beta
    ({"kl_coef": 0.01, "kl_coef_min": 0.09}, math.inf),  # a floor above it
    ({"score_scale": "none"}, math.inf),  # raw scores: beta is in the reward's own unknown units
    ({"score_scale": "std"}, math.inf),
    ({"kl_in": "loss"}, math.inf),
    ({"adaptive_kl": False}, math.inf),
    ({"advantage": "grpo"}, math.inf),
    ({"advantage": "reinforce++"}, math.inf),
])
def test_default_kl_coef_max_is_the_target_penalty_over_the_target(options, want):
    """--kl-coef-max left to its default: 0.48 / --kl-target (ppo_config.KL_PENALTY_AT_TARGET) for
    GAE on scores under --score-scale auto with the KL in the reward, where that lies above beta's
    start and floor; no ceiling (inf) otherwise."""
    cfg = config.build(PPOConfig, {"reward_fn": ["x.py:f"], **options})
    cfg.validate()
    cfg = cfg.resolve()
    assert cfg.kl.kl_coef_max == pytest.approx(want)


def test_kl_lr_boost_scales_the_actor_lr_by_the_kl_budget_left(tiny_policy_dir, tmp_path, reward_file):
    """--kl-lr-boost B: each update's actor lr is --actor-lr * clip(--kl-target / KL, 1, B), KL the
    previous batch's mean; the first update (no KL yet) takes B. The critic's lr is untouched, and
    with B 1 (the default) the actor's lr is the plain one."""
    lr, target = 1e-3, 0.5
    rows = train_ppo(make_cfg(tiny_policy_dir, tmp_path / "boost", reward_file, steps=4, actor_lr=lr,
                              kl_target=target, kl_lr_boost=3.0)).metrics
    assert rows[0]["lr"] == pytest.approx(3 * lr)
    for prev, row in zip(rows, rows[1:]):
        kl = prev["objective/kl"]
        want = 3.0 if kl <= 0 else min(3.0, max(1.0, target / kl))
        assert row["lr"] == pytest.approx(lr * want, rel=1e-6), (kl, row["lr"])
        assert row["lr/critic"] == pytest.approx(rows[0]["lr/critic"])
    assert len({round(r["lr"] / lr, 6) for r in rows}) > 1  # the KL moved the lr off its first value
    plain = train_ppo(make_cfg(tiny_policy_dir, tmp_path / "plain", reward_file, steps=2, actor_lr=lr)).metrics
    assert [r["lr"] for r in plain] == [pytest.approx(lr)] * 2


def test_tied_scores_give_the_policy_no_step(tiny_policy_dir, tiny_rm_dir, tmp_path, reward_file):
    """--tied-scores zero: a batch whose scores are all equal and no higher than the run's mean
    score (here a reward nobody earns) has advantages 0, so the policy's weights stay exactly where
    they were (its Adam moments stay 0) while the critic still learns; keep: the critic's error and
    the KL penalty, whitened, move the policy. A zeroed batch leaves the KL controller's beta where
    it was (its penalty had no gradient to act through), here below the target where it would fall.
    Batches whose scores differ, or tie above the mean, train the same under both."""
    before = load_file(str(tiny_policy_dir / "model.safetensors"))
    critic_before = load_file(str(tiny_rm_dir / "model.safetensors"))

    def run(name: str, tied: str, fn: str):
        # the critic starts from the reward model (its head scores the responses, not their
        # returns of 0), which adds nothing to the score (weight 0)
        rows = train_ppo(make_cfg(tiny_policy_dir, tmp_path / name, reward_file, steps=3, tied_scores=tied,
                                  reward_fn=[f"{reward_file}:{fn}"], reward_model=[str(tiny_rm_dir)],
                                  reward_model_weight=0.0, kl_coef_min=0.001)).metrics
        return rows, load_file(str(tmp_path / name / "policy" / "model.safetensors")), \
            load_file(str(tmp_path / name / "critic" / "model.safetensors"))

    rows, policy, critic = run("zero", "zero", "nothing")
    assert [r["adv/tied"] for r in rows] == [1.0, 1.0, 1.0] and [r["adv/unearned"] for r in rows] == [1.0] * 3
    assert all(torch.equal(before[k], policy[k]) for k in before)
    assert not torch.equal(critic["score.weight"], critic_before["score.weight"])
    assert [r["objective/kl_coef"] for r in rows] == [0.01] * 3  # KL 0 < target: beta would fall
    rows_k, kept, _ = run("keep", "keep", "nothing")
    assert sum(not torch.equal(before[k], kept[k]) for k in before) > len(before) // 2
    assert [r["objective/kl_coef"] for r in rows_k] == pytest.approx([0.01, 0.008, 0.0064])  # x (1 - 0.2)
    # Scores 0, 1, 0, 1 (mean 0.5), then all 1: tied from the second batch on, but above the run's
    # mean score (0.75, then 0.83): earned alike, so their KL penalty still trains the policy and
    # zero trains exactly as keep.
    rows_z, mastered_z, _ = run("mastered-zero", "zero", "mastered")
    rows_k, mastered_k, _ = run("mastered-keep", "keep", "mastered")
    assert [r["adv/tied"] for r in rows_z] == [0.0, 1.0, 1.0] and [r["adv/unearned"] for r in rows_z] == [0.0] * 3
    assert all(torch.equal(mastered_z[k], mastered_k[k]) for k in mastered_z)


def test_tied_scores_skip_holds_the_policy_between_signals(tiny_policy_dir, tmp_path, reward_file):
    """--tied-scores skip: after a batch with a signal (scores 0, 1, 0, 1), the unearned batches
    that follow (all 0, below the running mean 0.5) do not step the policy's optimiser, so three
    updates leave the policy exactly where the first left it, and its AdamW has counted only the
    first batch's steps; zero lets Adam's momentum keep moving it through them. The critic learns
    in both."""
    def run(name: str, tied: str, steps: int):
        cfg = make_cfg(tiny_policy_dir, tmp_path / name, reward_file, steps=steps, tied_scores=tied,
                       reward_fn=[f"{reward_file}:once"])
        trainer = PPOTrainer(cfg)
        rows = run_ppo(trainer).metrics
        state = trainer.learner.actor_opt.state[trainer.learner.actor_params[0]]
        return rows, load_file(str(tmp_path / name / "policy" / "model.safetensors")), \
            load_file(str(tmp_path / name / "critic" / "model.safetensors")), int(state["step"])

    _, p1, c1, n1 = run("skip-1", "skip", 1)
    rows, p3, c3, n3 = run("skip-3", "skip", 3)
    assert [r["adv/unearned"] for r in rows] == [0.0, 1.0, 1.0]
    assert n1 == n3 == 4  # minibatches 2 x ppo epochs 2, in the first batch only
    assert all(torch.equal(p1[k], p3[k]) for k in p1)
    assert any(not torch.equal(c1[k], c3[k]) for k in c1)
    _, z3, _, nz = run("zero-3", "zero", 3)
    assert nz == 12 and sum(not torch.equal(p1[k], z3[k]) for k in p1) > len(p1) // 2


def test_grad_norms_are_logged_before_clipping(tiny_policy_dir, tmp_path, reward_file):
    """policy/grad_norm and val/grad_norm are the mean over the update's optimiser steps of the
    global gradient norm each optimiser is handed, before --max-grad-norm clips it: with a clip
    that never binds they equal the norms measured in the optimisers' pre-step hooks; with one
    that binds the same first update logs the same norms while the optimisers see norms of
    --max-grad-norm."""
    def run(name: str, max_norm: float):
        cfg = make_cfg(tiny_policy_dir, tmp_path / name, reward_file, steps=1, max_grad_norm=max_norm)
        trainer = PPOTrainer(cfg)
        seen: dict[str, list[float]] = {"policy": [], "critic": []}
        for key, opt in (("policy", trainer.learner.actor_opt), ("critic", trainer.learner.critic_opt)):
            def hook(o, args, kwargs, key=key):
                grads = [p.grad.double() for group in o.param_groups for p in group["params"] if p.grad is not None]
                seen[key].append(float(torch.sqrt(sum((g * g).sum() for g in grads))))
            opt.register_step_pre_hook(hook)
        metrics, _ = trainer.step(0)
        return metrics, seen

    free, seen = run("free", 1e9)
    assert len(seen["policy"]) == len(seen["critic"]) == 4  # minibatches 2 x ppo epochs 2
    assert free["policy/grad_norm"] == pytest.approx(sum(seen["policy"]) / 4, rel=1e-5)
    assert free["val/grad_norm"] == pytest.approx(sum(seen["critic"]) / 4, rel=1e-5)
    assert free["policy/grad_norm"] > 1e-4 and free["val/grad_norm"] > 1e-4
    clipped, seen = run("clipped", 1e-4)
    assert all(x == pytest.approx(1e-4, rel=1e-3) for x in seen["policy"] + seen["critic"])
    # logged: the gradients' own norms, far above the clip
    assert clipped["policy/grad_norm"] > 1e-3 and clipped["val/grad_norm"] > 1e-3


def test_critic_adam_eps_sets_the_critic_optimiser_only(tiny_policy_dir, tiny_rm_dir, tmp_path, reward_file):
    """--critic-adam-eps gives the separate critic's AdamW its own epsilon (default 1e-8, the
    policy's --adam-eps 1e-5; None: the policy's), each optimiser its own learning rate; a
    non-positive epsilon is refused before any model loads."""
    cfg = make_cfg(tiny_policy_dir, tmp_path / "a", reward_file, reward_model=[str(tiny_rm_dir)])
    trainer = PPOTrainer(cfg)
    assert [g["eps"] for g in trainer.learner.actor_opt.param_groups] == [1e-5]
    assert [g["eps"] for g in trainer.learner.critic_opt.param_groups] == [1e-8]
    # ... beside their own learning rates (--actor-lr 2e-5, --critic-lr 1e-4)
    assert [g["lr"] for g in trainer.learner.actor_opt.param_groups] == [2e-5]
    assert [g["lr"] for g in trainer.learner.critic_opt.param_groups] == [1e-4]
    cfg = make_cfg(tiny_policy_dir, tmp_path / "b", reward_file, reward_model=[str(tiny_rm_dir)],
                   critic_adam_eps=None, adam_eps=1e-6)
    trainer = PPOTrainer(cfg)
    assert [g["eps"] for g in trainer.learner.actor_opt.param_groups] == [1e-6]
    assert [g["eps"] for g in trainer.learner.critic_opt.param_groups] == [1e-6]
    with pytest.raises(PPOLMError, match="--critic-adam-eps must be > 0"):
        make_cfg(tiny_policy_dir, tmp_path / "c", reward_file, critic_adam_eps=0.0)


def test_actor_adam_beta1_sets_the_policy_optimiser_only(tiny_policy_dir, tiny_rm_dir, tmp_path, reward_file):
    """--actor-adam-beta1 sets the policy's Adam beta1 (default 0.9, PyTorch's); the critic keeps
    (0.9, 0.999); outside [0, 1) it is refused before any model loads."""
    trainer = PPOTrainer(make_cfg(tiny_policy_dir, tmp_path / "a", reward_file, reward_model=[str(tiny_rm_dir)]))
    assert [g["betas"] for g in trainer.learner.actor_opt.param_groups] == [(0.9, 0.999)]
    trainer = PPOTrainer(make_cfg(tiny_policy_dir, tmp_path / "b", reward_file, reward_model=[str(tiny_rm_dir)],
                                  actor_adam_beta1=0.0))
    assert [g["betas"] for g in trainer.learner.actor_opt.param_groups] == [(0.0, 0.999)]
    assert [g["betas"] for g in trainer.learner.critic_opt.param_groups] == [(0.9, 0.999)]
    for bad in (1.0, -0.1):
        with pytest.raises(PPOLMError, match="--actor-adam-beta1 must be in"):
            make_cfg(tiny_policy_dir, tmp_path / "c", reward_file, actor_adam_beta1=bad)


def test_actor_lr_warmup_ramps_the_policy_lr_only(tiny_policy_dir, tmp_path, reward_file):
    """--actor-lr-warmup N: update i of the first N takes (i + 1) / N of --actor-lr (from a share F,
    --actor-lr-warmup-from: F + (1 - F)(i + 1) / N), then the full lr; the critic's lr does not
    warm up. A negative count or a share outside [0, 1] is refused before any model loads."""
    rows = train_ppo(make_cfg(tiny_policy_dir, tmp_path / "a", reward_file, steps=4, actor_lr=3e-5,
                              actor_lr_warmup=3, save_every=100)).metrics
    assert [r["lr"] for r in rows] == pytest.approx([1e-5, 2e-5, 3e-5, 3e-5])
    assert [r["lr/critic"] for r in rows] == pytest.approx([1e-4] * 4)
    # with --lr-schedule linear the two multiply: (i + 1) / N times 1 - i / steps
    rows = train_ppo(make_cfg(tiny_policy_dir, tmp_path / "b", reward_file, steps=4, actor_lr=3e-5,
                              actor_lr_warmup=2, lr_schedule="linear", save_every=100)).metrics
    assert [r["lr"] for r in rows] == pytest.approx([3e-5 * 0.5 * 1.0, 3e-5 * 1.0 * 0.75, 3e-5 * 0.5, 3e-5 * 0.25])
    # --actor-lr-warmup-from F: the ramp starts from F of the lr, F + (1 - F)(i + 1) / N
    rows = train_ppo(make_cfg(tiny_policy_dir, tmp_path / "d", reward_file, steps=3, actor_lr=3e-5,
                              actor_lr_warmup=2, actor_lr_warmup_from=0.5, save_every=100)).metrics
    assert [r["lr"] for r in rows] == pytest.approx([3e-5 * 0.75, 3e-5, 3e-5])
    with pytest.raises(PPOLMError, match="--actor-lr-warmup must be >= 0"):
        make_cfg(tiny_policy_dir, tmp_path / "c", reward_file, actor_lr_warmup=-1)
    with pytest.raises(PPOLMError, match="--actor-lr-warmup-from must be in"):
        make_cfg(tiny_policy_dir, tmp_path / "c", reward_file, actor_lr_warmup_from=1.5)


def test_scaled_scores_make_the_kl_coefficient_independent_of_the_reward_scale(tiny_policy_dir, tmp_path,
                                                                               reward_file):
    """--score-scale std divides each score by the running std of every score so far: the reward
    x 1/8 (--reward-fn-weights) then trains the same policy as the reward itself. auto (the
    default) does so only outside the spread [0.05, 0.5]: x 2^-7 and x 2^-10 (spreads ~1e-3 and
    ~1e-4) both come to 0.05 and train the same policy, while the raw scores (none) part. The
    weights are powers of two, so that each scaled score is the same float bit for bit (scaling by
    2^k commutes with rounding): the runs must then be identical, not merely close (a weight of 0.1
    leaves rounding-level differences that can flip a sampled token on some CPUs)."""
    def policy(name: str, **over) -> dict[str, torch.Tensor]:
        rows = train_ppo(make_cfg(tiny_policy_dir, tmp_path / name, reward_file, steps=3, kl_coef=0.5,
                                  adaptive_kl=False, **over)).metrics
        assert rows[0]["objective/scores"] > 0  # the tiny model's 8 tokens hold words
        return load_file(str(tmp_path / name / "policy" / "model.safetensors")), rows

    def worst(a: dict, b: dict) -> float:
        return max((a[k] - b[k]).abs().max().item() for k in a)

    (one, rows1), (eighth, rows8) = policy("one", score_scale="std"), policy("eighth", score_scale="std",
                                                                             reward_fn_weights=[2 ** -3])
    assert worst(one, eighth) == 0
    assert [r["objective/score_scale"] * 2 ** -3 for r in rows1] == [r["objective/score_scale"] for r in rows8]
    assert rows1[0]["objective/score_scale"] != 1.0
    (small, rows_s), (smaller, rows_ss) = policy("small", reward_fn_weights=[2 ** -7]), \
        policy("smaller", reward_fn_weights=[2 ** -10])
    assert worst(small, smaller) == 0
    assert rows_s[0]["objective/score_scale"] < 0.05 and rows_s[0]["objective/score_scale"] == \
        8 * rows_ss[0]["objective/score_scale"]
    (raw, _), (raw_smaller, _) = policy("raw", score_scale="none", reward_fn_weights=[2 ** -7]), \
        policy("raw-smaller", score_scale="none", reward_fn_weights=[2 ** -10])
    assert worst(raw, raw_smaller) > 1e-5


def test_the_score_unit_follows_the_spread_within_batches_not_the_climb(tiny_policy_dir, tmp_path, reward_file):
    """A reward whose batch means climb by 50 an update while the answers of a batch lie 0, 2, 4, 6
    around their mean (variance (9 + 1 + 1 + 9) / 4 = 5): the score unit stays at sqrt(5) / 0.5
    (--score-scale auto, a spread above 0.5 brought to 0.5) at every step, however far the means
    have moved apart (their running std is ~40 after three batches), so the progress does not
    shrink the differences between answers below the KL penalty."""
    trainer = PPOTrainer(make_cfg(tiny_policy_dir, tmp_path / "climb", reward_file, steps=3,
                                  reward_fn=[f"{reward_file}:climbing"]))
    rows = run_ppo(trainer).metrics
    assert [r["objective/scores"] for r in rows] == pytest.approx([-97.0, -47.0, 3.0])
    assert [r["objective/score_scale"] for r in rows] == pytest.approx([math.sqrt(5) / 0.5] * 3, rel=1e-9)
    close_std = math.sqrt(((-97.0 + 47.0) ** 2 + 0.0 + (3.0 + 47.0) ** 2) / 3 + 5.0)  # between + within
    assert trainer.state.score_scale.std == pytest.approx(close_std, rel=1e-9) and close_std > 40


def test_centered_scores_make_ppo_independent_of_the_reward_offset(tiny_policy_dir, tmp_path, reward_file):
    """--score-center running subtracts the running mean of every score so far before GAE: words - 3
    (a second reward function adding -3 to each score) then trains the same policy as words alone,
    and the mean it subtracts is the mean of every score logged. Without it (none) the two part:
    the zero-initialised critic takes the offset for a signal until it has learnt it."""
    def policy(name: str, center: str, offset: bool) -> tuple[dict[str, torch.Tensor], list[dict]]:
        fns = [f"{reward_file}:words"] + ([f"{reward_file}:minus_three"] if offset else [])
        trainer = PPOTrainer(make_cfg(tiny_policy_dir, tmp_path / name, reward_file, steps=3, reward_fn=fns,
                                      score_center=center))
        rows = run_ppo(trainer).metrics
        steps_mean = sum(r["objective/scores"] for r in rows) / len(rows)  # equal batches: mean of means
        assert trainer.state.score_scale.mean == pytest.approx(steps_mean, rel=1e-6)
        return load_file(str(tmp_path / name / "policy" / "model.safetensors")), rows

    def worst(a: dict, b: dict) -> float:
        return max((a[k] - b[k]).abs().max().item() for k in a)

    (plain, rows), (shifted, rows3) = policy("c", "running", False), policy("c3", "running", True)
    assert rows[0]["objective/scores"] > 0.1  # the tiny model's 8 tokens hold words
    assert [r["objective/scores"] - 3 for r in rows] == pytest.approx([r["objective/scores"] for r in rows3],
                                                                     abs=1e-5)
    assert worst(plain, shifted) < 1e-5  # float rounding of (s - 3) - (mean - 3) against s - mean
    (raw, _), (raw3, _) = policy("n", "none", False), policy("n3", "none", True)
    assert worst(raw, raw3) > 1e-4


def test_default_score_center_brings_any_large_offset_to_the_same_edge(tiny_policy_dir, tmp_path, reward_file):
    """--score-center auto (the default) subtracts the running mean's part beyond two running stds
    from 0: words - 3 and words - 6 both lie far beyond, so both are brought to mean + 2 std and
    train the same policy (the std is the same, the offset is gone), each step logging
    objective/score_center = mean + 2 std of every score so far (mean < 0). Under none they part."""
    def policy(name: str, center: str, offset: str) -> tuple[PPOTrainer, dict[str, torch.Tensor], list[dict]]:
        trainer = PPOTrainer(make_cfg(tiny_policy_dir, tmp_path / name, reward_file, steps=3,
                                      reward_fn=[f"{reward_file}:words", f"{reward_file}:{offset}"],
                                      **({} if center == "default" else {"score_center": center})))
        rows = run_ppo(trainer).metrics
        return trainer, load_file(str(tmp_path / name / "policy" / "model.safetensors")), rows

    def worst(a: dict, b: dict) -> float:
        return max((a[k] - b[k]).abs().max().item() for k in a)

    (t3, p3, rows3), (t6, p6, rows6) = policy("a3", "default", "minus_three"), policy("a6", "default", "minus_six")
    assert t3.cfg.reward.score_center == "auto"
    assert [r["objective/scores"] - 3 for r in rows3] == pytest.approx([r["objective/scores"] for r in rows6],
                                                                      abs=1e-5)
    assert worst(p3, p6) < 1e-5
    for t, rows in ((t3, rows3), (t6, rows6)):
        mean, std = t.state.score_scale.mean, t.state.score_scale.std
        assert mean < -2 and 0 < std < 0.5
        assert rows[-1]["objective/score_center"] == pytest.approx(mean + 2 * std, rel=1e-9)
    assert rows6[-1]["objective/score_center"] == pytest.approx(rows3[-1]["objective/score_center"] - 3, abs=1e-6)
    (_, n3, rows_n), (_, n6, _) = policy("n3", "none", "minus_three"), policy("n6", "none", "minus_six")
    assert "objective/score_center" not in rows_n[0]
    assert worst(n3, n6) > 1e-4


def test_a_critic_that_keeps_the_reward_models_head_meets_the_scores_in_their_units(tiny_policy_dir, tiny_rm_dir,
                                                                                    tmp_path, reward_file):
    """A reward model whose scores sit at 50 with a spread of ~20 (its stored bias and gain): the
    critic started from its head (--critic-init reward, the default) predicts them as they come,
    so its output v counts as the value (v - center) / unit, with the center and unit the scores
    get. On the first step (KL 0) the returns are then (raw returns - center) / unit and so are
    the values: every value error is the raw one over the unit, and the value loss of the first
    update (one epoch, one minibatch: the rollout's own values) is that of --score-center none
    --score-scale none over unit squared."""
    import shutil

    rm = tmp_path / "rm50"
    shutil.copytree(tiny_rm_dir, rm)
    (rm / "ppolm_reward.json").write_text(json.dumps({"gain": 40.0, "bias": 50.0}))

    def run(name: str, **over) -> tuple[PPOTrainer, list[dict]]:
        trainer = PPOTrainer(make_cfg(tiny_policy_dir, tmp_path / name, reward_file, steps=1, ppo_epochs=1,
                                      minibatches=1, reward_model=[str(rm)], **over))
        return trainer, run_ppo(trainer).metrics

    kept, rows = run("kept")
    assert kept.critic_in_score_units and kept.cfg.reward.score_center == "auto"
    mean, std = kept.state.score_scale.mean, kept.state.score_scale.std
    assert rows[0]["objective/score_center"] == pytest.approx(mean - 2 * std, rel=1e-9) and mean > 45
    unit = rows[0]["objective/score_scale"]
    assert unit > 10
    _, raw = run("raw", score_center="none", score_scale="none")
    assert rows[0]["loss/value_avg"] == pytest.approx(raw[0]["loss/value_avg"] / unit ** 2, rel=1e-4)
    zeroed, _ = run("zero", critic_zero_head=True)
    assert not zeroed.critic_in_score_units


def test_ptx_mix_and_target_kl(tiny_policy_dir, tmp_path, reward_file):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog.\nA stitch in time saves nine.\n")
    result = train_ppo(make_cfg(tiny_policy_dir, tmp_path / "run", reward_file, ptx_coef=0.5,
                                ptx_data=str(corpus), target_kl=1e-12, steps=1))
    row = result.metrics[0]
    assert row["loss/ptx_avg"] > 0 and row["ppo/epochs"] == 1  # stopped after the first epoch


def test_ptx_draws_leave_the_minibatch_shuffles_as_they_were(tiny_policy_dir, tmp_path, reward_file, monkeypatch):
    """The PPO-ptx microbatches come from their own generator: with --ptx-coef on, every shuffle of
    the minibatches (both epochs') is the one the run without it draws."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog.\nA stitch in time saves nine.\n")
    real = torch.randperm

    def shuffles(**over):
        drawn = []

        def recording(*args, **kwargs):
            drawn.append(real(*args, **kwargs))
            return drawn[-1]

        monkeypatch.setattr(torch, "randperm", recording)
        cfg = make_cfg(tiny_policy_dir, tmp_path / str(len(over)), reward_file, steps=1, ppo_epochs=2, **over)
        metrics, _ = PPOTrainer(cfg).step(0)
        monkeypatch.setattr(torch, "randperm", real)
        return drawn, metrics

    plain, _ = shuffles()
    mixed, metrics = shuffles(ptx_coef=0.5, ptx_data=str(corpus))
    assert metrics["loss/ptx_avg"] > 0 and len(plain) >= 2
    assert len(mixed) == len(plain) and all(torch.equal(a, b) for a, b in zip(plain, mixed))


def test_a_non_finite_reward_names_its_source():
    from ppolm.ppo_trainer import non_finite_cause

    nan, inf = float("nan"), float("inf")
    parts = {"reward/words": torch.tensor([1.0, nan]), "reward/rm": torch.tensor([0.5, 0.5])}
    assert non_finite_cause(parts, torch.tensor([1.5, nan])) == "non-finite reward (NaN/inf) from words"
    # every source finite, the penalised score not (a penalty overflowed): the penalties
    finite = {"reward/words": torch.tensor([-3e38, 1.0])}
    assert non_finite_cause(finite, torch.tensor([-inf, 1.0])) == "non-finite reward (NaN/inf) from penalties"
    # this process's scores all finite: another process's reward stopped the update
    assert non_finite_cause(finite, torch.tensor([1.0, 1.0])) == "non-finite reward (NaN/inf) from another process's reward"


def test_update_kl_max_shrinks_the_step_by_the_root_of_the_kl_ratio(tiny_policy_dir, tmp_path, reward_file):
    """--update-kl-max: the update's measured k2 is logged; a limit above it leaves the step as it is,
    a limit of a quarter of it halves the step, sqrt((K / 4) / K), weight for weight."""
    def one_update(limit, name):
        trainer = PPOTrainer(make_cfg(tiny_policy_dir, tmp_path / name, reward_file, steps=1, update_kl_max=limit))
        before = [p.detach().clone() for p in trainer.learner.actor_params]
        metrics, _ = trainer.step(0)
        return metrics, [p.detach() - b for p, b in zip(trainer.learner.actor_params, before)]

    free, free_delta = one_update(None, "free")
    assert "policy/update_kl" not in free
    wide, wide_delta = one_update(1e9, "wide")
    kl = wide["policy/update_kl"]
    assert kl > 0 and wide["policy/update_scale"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(free_delta, wide_delta))  # the extra pass changes nothing
    tight, tight_delta = one_update(kl / 4, "tight")
    assert tight["policy/update_kl"] == pytest.approx(kl, rel=1e-6)
    assert tight["policy/update_scale"] == pytest.approx(0.5, rel=1e-6)
    for a, b in zip(free_delta, tight_delta):
        torch.testing.assert_close(b, 0.5 * a, rtol=1e-4, atol=1e-7)


def test_config_yaml_and_cli_override(tmp_path):
    import argparse

    from ppolm.config import add_arguments, from_cli

    f = tmp_path / "c.yaml"
    f.write_text("algo:\n  ppo_epochs: 3\nbatch-size: 16\nminibatches: 4\n")
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    add_arguments(p, PPOConfig)
    cfg = from_cli(PPOConfig, p.parse_args(["--config", str(f), "--minibatches", "8", "--no-whiten-advantages",
                                            "--reward-fn", "ppolm.builtin_rewards:positive_sentiment"]), "ppo")
    assert (cfg.algo.ppo_epochs, cfg.algo.batch_size, cfg.algo.minibatches) == (3, 16, 8)
    assert cfg.algo.whiten_advantages is False and cfg.minibatch_size == 2


def test_help_documents_every_option(capsys):
    from ppolm.cli import build_parser
    from ppolm.config import leaf_fields

    with pytest.raises(SystemExit):
        build_parser().parse_args(["ppo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in leaf_fields(PPOConfig):
        flag = "--" + name.replace("_", "-")
        assert flag in text, flag
    assert "Number of PPO iterations" in text and "default: 40" in text


def test_heldout_eval_with_eval_only_scorer_and_best_checkpoint(tiny_policy_dir, tmp_path, reward_file):
    held = tmp_path / "held.txt"
    held.write_text("Say something.\nName a colour.\nCount to three.\n")
    gold = tmp_path / "gold.py"
    gold.write_text("def gold(prompts, completions, **kw):\n    return [-abs(len(c) - 20) / 10 for c in completions]\n")
    out = tmp_path / "run"
    cfg = make_cfg(tiny_policy_dir, out, reward_file, steps=3, eval_prompts=str(held), eval_every=2,
                   eval_reward_fn=[f"{gold}:gold"], best_metric="eval/gold")
    train_ppo(cfg)
    rows = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 2, 3]  # before training, every 2 updates, after the last
    for r in rows:
        assert {"eval/gold", "eval/gold_se", "eval/words", "eval/score", "eval/kl", "eval/length_mean"} <= set(r)
        assert r["eval/score"] == pytest.approx(r["eval/words"], abs=1e-6)  # the gold judge is eval-only
    assert rows[0]["eval/kl"] == pytest.approx(0.0, abs=1e-5)
    samples = [json.loads(x) for x in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 9 and set(samples[0]["scores"]) == {"words", "gold"}
    best = json.loads((out / "best.json").read_text())
    assert best["value"] == max(r["eval/gold"] for r in rows)
    assert best["step"] == max(rows, key=lambda r: r["eval/gold"])["step"]
    assert (out / "best" / "policy" / "model.safetensors").is_file()


@pytest.mark.parametrize("lora", [False, True])
def test_a_best_first_evaluation_keeps_the_starting_weights(tiny_policy_dir, tmp_path, reward_file, lora):
    """The first evaluation (before any update) is logged after the first step, so that nothing is
    written before a step succeeded; a best policy found there must still be the starting one: the
    model itself (full fine-tuning) or an adapter whose B matrices are still zero (LoRA)."""
    held = tmp_path / "held.txt"
    held.write_text("Say something.\nName a colour.\n")
    const = tmp_path / "const.py"
    const.write_text("def const(prompts, completions, **kw):\n    return [0.5] * len(completions)\n")
    out = tmp_path / "run"
    train_ppo(make_cfg(tiny_policy_dir, out, reward_file, steps=2, eval_prompts=str(held), actor_lr=1e-3,
                       eval_reward_fn=[f"{const}:const"], best_metric="eval/const", lora_r=4 if lora else 0))
    assert json.loads((out / "best.json").read_text())["step"] == 0  # a constant never improves
    if lora:
        adapter = load_file(str(out / "best" / "policy_adapter" / "adapter_model.safetensors"))
        final = load_file(str(out / "policy_adapter" / "adapter_model.safetensors"))
        b = [k for k in adapter if "lora_B" in k]
        assert b and all(adapter[k].abs().max() == 0 for k in b)
        assert any(final[k].abs().max() > 0 for k in b)
        return
    start = load_file(str(tiny_policy_dir / "model.safetensors"))
    best = load_file(str(out / "best" / "policy" / "model.safetensors"))
    final = load_file(str(out / "policy" / "model.safetensors"))
    assert set(best) == set(start)
    assert all(best[k].dtype == torch.float32 and torch.equal(best[k], start[k]) for k in start)
    assert any(not torch.equal(final[k], start[k]) for k in start)


def test_rng_devices_are_the_device_in_use():
    from ppolm.runtime import rng_devices

    assert rng_devices(torch.device("cpu")) == []
    assert rng_devices(torch.device("cuda", 1)) == [1]
    if torch.cuda.is_available():
        assert rng_devices(torch.device("cuda")) == [torch.cuda.current_device()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seeded_rng_restores_the_cuda_generator():
    from ppolm.runtime import seeded_rng

    dev = torch.device("cuda")
    before = torch.cuda.get_rng_state(dev)
    with seeded_rng(7, dev):
        a = torch.rand(3, device=dev)
    with seeded_rng(7, dev):
        assert torch.equal(torch.rand(3, device=dev), a)
    assert torch.equal(torch.cuda.get_rng_state(dev), before)


@pytest.mark.usefixtures("one_thread")
def test_heldout_eval_restores_every_generator_it_seeds(tiny_policy_dir, tmp_path, reward_file, monkeypatch):
    """evaluate() samples with its own seed and leaves the training RNG stream as it was: it seeds
    only the generators it forks (CPU, and the CUDA device in use), never every CUDA device."""
    held = tmp_path / "held.txt"
    held.write_text("Say something.\nName a colour.\nCount to three.\n")
    trainer = PPOTrainer(make_cfg(tiny_policy_dir, tmp_path / "run", reward_file, eval_prompts=str(held),
                                  eval_batch_size=2, response_length=4, device="cpu"))
    seeded_all = []
    real = torch.cuda.manual_seed_all
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda s: (seeded_all.append(s), real(s))[1])
    before = torch.get_rng_state()
    first, rows = held_out(trainer, 0)
    assert torch.equal(torch.get_rng_state(), before)
    assert seeded_all == []  # torch.manual_seed would reseed every CUDA device, which fork_rng did not fork
    torch.rand(7)  # move the training stream: the evaluation does not depend on it
    again, rows2 = held_out(trainer, 0)
    assert again == first and rows2 == rows


@pytest.mark.usefixtures("one_thread")
def test_heldout_score_has_the_training_penalties(tiny_policy_dir, tmp_path, monkeypatch):
    """eval/score is objective/scores' definition: the sources' weighted sum minus the length
    penalty (the missing-EOS penalty goes through the same function); eval/<source> stays raw."""
    rewards = tmp_path / "r.py"
    rewards.write_text("def one(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    held = tmp_path / "held.txt"
    held.write_text("Say something.\nName a colour.\nCount to three.\n")
    # every response is exactly 6 tokens (--ignore-eos): 4 beyond the budget of 2, at 0.1 each
    cfg = make_cfg(tiny_policy_dir, tmp_path / "run", rewards, reward_fn=[f"{rewards}:one"], steps=1,
                   ppo_epochs=1, response_length=6, ignore_eos=True, length_penalty=0.1, length_budget=2,
                   eval_prompts=str(held), eval_batch_size=2)
    trainer = PPOTrainer(cfg)
    metrics, rows = held_out(trainer, 0)
    assert metrics["eval/one"] == pytest.approx(1.0)
    assert metrics["eval/score"] == pytest.approx(1.0 - 0.1 * 4, abs=1e-6)  # 0.6
    assert [r["score"] for r in rows] == pytest.approx([0.6] * 3, abs=1e-6)
    train, _ = trainer.step(0)
    assert train["objective/scores"] == pytest.approx(0.6, abs=1e-6) and train["reward/one"] == 1.0


def old_prompt_indices(n, b, seed, step):
    """The prompt order as first defined: row i of the run is position i mod n of pass i // n's permutation."""
    out = []
    for i in range(step * b, step * b + b):
        epoch, j = divmod(i, n)
        out.append(int(torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))[j]))
    return out


def test_prompt_order_is_unchanged_and_draws_each_permutation_once(monkeypatch):
    from ppolm.data import PromptOrder

    # 5 prompts, batches of 3: steps 0..6 cross four passes over the data, some mid-batch
    order = PromptOrder(5, seed=2)
    assert [order.indices(s, 3) for s in range(7)] == [old_prompt_indices(5, 3, 2, s) for s in range(7)]
    # resume-safe: a fresh order asked for step 4 first gives the same rows
    assert PromptOrder(5, seed=2).indices(4, 3) == old_prompt_indices(5, 3, 2, 4)
    # a batch larger than the prompt set takes several passes in one step
    assert PromptOrder(2, seed=0).indices(1, 5) == old_prompt_indices(2, 5, 0, 1)

    calls = []
    real = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: (calls.append(a[0]), real(*a, **k))[1])
    big = PromptOrder(100_000, seed=0)
    rows = [big.indices(s, 8) for s in range(100)]
    assert calls == [100_000]  # one permutation for the pass, not one per row (800)
    assert len({i for r in rows for i in r}) == 800  # a permutation: no prompt twice within a pass


def test_critic_lam_sets_the_value_targets_only(tiny_policy_dir, tiny_rm_dir, tmp_path, reward_file):
    """--critic-lam 1 (decoupled GAE): the critic's targets are the rewards still to come (gamma 1),
    whatever the critic predicts, while the policy's advantages keep --lam 0.95; the recorded
    experience is the trainer's own, checked against core.gae and a hand-written reward-to-go."""
    cfg = make_cfg(tiny_policy_dir, tmp_path / "a", reward_file, reward_model=[str(tiny_rm_dir)],
                   reward_model_weight=0.0, critic_lam=1.0, whiten_advantages=False, steps=1)
    trainer = PPOTrainer(cfg)
    seen = []
    real_update = trainer.learner.update

    def recording_update(exp, *args, **kwargs):
        seen.append(exp)
        return real_update(exp, *args, **kwargs)

    trainer.learner.update = recording_update
    trainer.step(0)
    exp = seen[0]
    m = exp.mask.float()
    assert float(exp.values.abs().sum()) > 0  # a critic whose values are not 0: lambda matters
    to_go = torch.flip(torch.cumsum(torch.flip(exp.rewards.float() * m, [1]), 1), [1]) * m
    torch.testing.assert_close(exp.returns, to_go, atol=1e-5, rtol=0)
    adv, ret = core.gae(exp.rewards, exp.values, exp.mask, 1.0, 0.95)
    torch.testing.assert_close(exp.advantages, adv)
    assert float((ret - exp.returns).abs().max()) > 1e-3  # lambda 0.95 targets would differ
    with pytest.raises(PPOLMError, match="--critic-lam must be in"):
        make_cfg(tiny_policy_dir, tmp_path / "b", reward_file, critic_lam=1.5)
