"""The top-layers critic on a shared frozen trunk (ppolm/critic.py): exact values, only the top layers
train, the saved critic is a whole model, and the PPO loop uses it with a reward model, a reference
and LoRA."""

from __future__ import annotations

import pytest
import torch
from conftest import uneven_rollout
from safetensors.torch import load_file

from ppolm import config, critic, models, tiny
from ppolm import rollout as ro
from ppolm.ppo import train_ppo
from ppolm.ppo_config import PPOConfig
from ppolm.ppo_trainer import PPOTrainer
from ppolm.rewards import RewardModel

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def deep_dirs(tmp_path_factory):
    """A 3-layer tiny policy and reward model (so that 1 or 2 top layers leave a shared trunk)."""
    root = tmp_path_factory.mktemp("deep")
    return (tiny.build_tiny_model_dir(root / "policy", kind="causal", seed=0, num_layers=3),
            tiny.build_tiny_model_dir(root / "rm", kind="scalar", seed=1, num_layers=3))


batch = uneven_rollout


@pytest.mark.parametrize("n", [1, 2])
def test_values_equal_the_full_critic(deep_dirs, tokenizer, n):
    """Values from the top n layers fed by the reward model's tapped trunk equal a whole critic's."""
    _, rm_dir = deep_dirs
    rm = RewardModel(str(rm_dir), dtype=torch.float32, device="cpu")
    built = critic.build(rm_dir, rm.model, n, head_init="keep", dtype=torch.float32, device="cpu")
    assert built is not None
    trunk_critic, tap = built
    roll = batch(tokenizer)
    with tap.capture():
        score = rm.score_ids(roll.input_ids, roll.attention_mask)
    assert tap.hidden is not None and tap.hidden.shape == (2, roll.input_ids.shape[1], 64)
    mine = trunk_critic(tap.hidden, roll.attention_mask)
    full = models.load_scalar_model(rm_dir, head_init="keep")
    want = models.scalar_forward(full, roll.input_ids, roll.attention_mask)
    real = roll.attention_mask.bool()
    assert torch.allclose(mine[real], want[real], atol=1e-5)
    # the value at the last real token is the reward model's own (raw) score: same weights, same head
    last = roll.attention_mask.shape[1] - 1 - roll.attention_mask.flip(1).argmax(1)
    assert torch.allclose(mine.gather(1, last[:, None]).squeeze(1) * rm.gain + rm.bias, score, atol=1e-5)


def test_only_top_layers_are_trainable_and_whole_model_round_trips(deep_dirs, tokenizer):
    _, rm_dir = deep_dirs
    rm = RewardModel(str(rm_dir), dtype=torch.float32, device="cpu")
    trunk_critic, tap = critic.build(rm_dir, rm.model, 1, head_init="keep", dtype=torch.float32, device="cpu")
    names = [n for n, p in trunk_critic.named_parameters() if p.requires_grad]
    assert names and all(".layers.0." in n or ".norm." in n or "score" in n for n in names)
    per_layer = sum(p.numel() for p in models.load_scalar_model(rm_dir).model.layers[0].parameters())
    trained = sum(p.numel() for n, p in trunk_critic.named_parameters() if p.requires_grad)
    assert trained == per_layer + 64 + 64  # one layer, the final norm, the head (64 -> 1, no bias)
    with torch.no_grad():  # "train": move the top layer and the head
        for _, p in trunk_critic.named_parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn_like(p))
    roll = batch(tokenizer)
    with tap.capture():
        rm.score_ids(roll.input_ids, roll.attention_mask)
    mine = trunk_critic(tap.hidden, roll.attention_mask)
    full = trunk_critic.full_model(str(rm_dir))
    assert len(full.model.layers) == 3
    want = models.scalar_forward(full, roll.input_ids, roll.attention_mask)
    real = roll.attention_mask.bool()
    assert torch.allclose(mine[real], want[real], atol=1e-5)
    src = load_file(str(rm_dir / "model.safetensors"))
    got = full.state_dict()
    assert torch.equal(got["model.layers.1.mlp.up_proj.weight"], src["model.layers.1.mlp.up_proj.weight"])
    assert not torch.equal(got["model.layers.2.mlp.up_proj.weight"], src["model.layers.2.mlp.up_proj.weight"])


def test_all_layers_or_unsupported_gives_no_trunk_critic(deep_dirs):
    _, rm_dir = deep_dirs
    rm = RewardModel(str(rm_dir), dtype=torch.float32, device="cpu")
    for n in (0, 3, 7):
        assert critic.build(rm_dir, rm.model, n, head_init="keep") is None


def cfg_for(policy, out, **over):
    base = dict(model=str(policy), steps=2, batch_size=4, minibatches=1, ppo_epochs=2, response_length=6,
                output_dir=str(out), quiet=True, precision="fp32", save_every=1, critic_layers=1)
    base.update(over)
    return config.build(PPOConfig, base)


def test_ppo_with_reward_model_trunk(deep_dirs, tmp_path):
    """PPO trains the critic's top layer only; critic/ is a whole model whose lower layers are the RM's."""
    from transformers import AutoModelForSequenceClassification

    policy, rm_dir = deep_dirs
    out = tmp_path / "run"
    result = train_ppo(cfg_for(policy, out, reward_model=[str(rm_dir)]))
    assert all(torch.isfinite(torch.tensor(r["loss/value_avg"])) for r in result.metrics)
    saved = load_file(str(out / "critic" / "model.safetensors"))
    src = load_file(str(rm_dir / "model.safetensors"))
    for k in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.1.mlp.down_proj.weight"):
        assert torch.equal(saved[k], src[k]), k
    assert not torch.equal(saved["model.layers.2.mlp.down_proj.weight"], src["model.layers.2.mlp.down_proj.weight"])
    assert not torch.equal(saved["score.weight"], src["score.weight"])
    AutoModelForSequenceClassification.from_pretrained(out / "critic")  # loads with plain transformers


@pytest.mark.parametrize("lora_r", [0, 4])
def test_ppo_critic_from_policy_taps_the_reference(deep_dirs, tmp_path, lora_r):
    """With reward functions only, the critic starts from the policy and shares the reference's trunk
    (with LoRA: the policy's base with its adapter disabled); the tapped hidden state is the initial
    policy's, not the trained policy's."""
    policy, _ = deep_dirs
    reward = tmp_path / "r.py"
    reward.write_text("def n(prompts, completions, **kw):\n    return [len(c) / 10 for c in completions]\n")
    cfg = cfg_for(policy, tmp_path / "run", reward_fn=[f"{reward}:n"], lora_r=lora_r, actor_lr=1e-2)
    trainer = PPOTrainer(cfg)
    assert trainer.tap is not None and trainer.critic_source[1] == "value"
    for step in range(2):
        trainer.step(step)
    roll = batch(trainer.tokenizer)
    trainer.tap.hidden = None
    with trainer.tap.capture():
        trainer.frozen.reference_logprobs(roll)
    fresh = models.load_causal_lm(policy)
    want = {}
    fresh.model.layers[2].register_forward_pre_hook(lambda m, a: want.setdefault("h", a[0]))
    ro.logprobs(fresh, roll, 1.0)
    assert torch.allclose(trainer.tap.hidden, want["h"], atol=1e-6)
    # and the trained policy's own hidden state there differs (the tap is not reading the policy)
    got = {}
    h = models.stack(trainer.policy)[1][2].register_forward_pre_hook(lambda m, a: got.setdefault("h", a[0]))
    with torch.no_grad():
        ro.logprobs(trainer.policy, roll, 1.0)
    h.remove()
    assert not torch.allclose(got["h"], want["h"], atol=1e-4)


@pytest.mark.parametrize("critic_layers", [1, 0])
def test_critic_starts_as_the_normalised_reward_model(deep_dirs, tmp_path, critic_layers):
    """A critic initialised from a normalised RM predicts, at the last real token, the RM's normalised
    score (gain folded into its head, bias as a trained scalar), not the raw head output."""
    import shutil

    from ppolm.rewards import write_norm

    policy, rm_dir = deep_dirs
    rm_norm = tmp_path / "rm"
    shutil.copytree(rm_dir, rm_norm)
    write_norm(rm_norm, 2.5, -0.75)
    trainer = PPOTrainer(cfg_for(policy, tmp_path / "run", reward_model=[str(rm_norm)], critic_layers=critic_layers))
    assert (trainer.tap is not None) == (critic_layers == 1)
    roll = batch(trainer.tokenizer)
    with torch.no_grad():
        want = trainer.rewarder.models[0].score_ids(roll.input_ids, roll.attention_mask)
        if trainer.tap is not None:  # values at every position (B, P + R)
            values = trainer.critic(trainer.frozen.trunk_hidden(roll), roll.attention_mask)
        else:
            values = models.scalar_forward(trainer.critic, roll.input_ids, roll.attention_mask)
        values = values + trainer.value_bias
        _, _, window = trainer.learner.forward_train(roll, False, trainer.frozen.trunk_hidden(roll) if trainer.tap else None)
    last = roll.query.shape[1] + roll.lengths - 1  # the last real token, where the RM reads its score
    assert torch.allclose(values.gather(1, last[:, None]).squeeze(1), want, atol=1e-5)
    p, r = roll.query.shape[1], roll.response.shape[1]
    assert torch.allclose(window, values[:, p - 1:p - 1 + r], atol=1e-6)  # the PPO window: V before each token
    assert float(trainer.value_bias) == -0.75
    assert "critic.value_bias" in dict(trainer.trained_parameters())


def test_saved_critic_keeps_the_value_bias(deep_dirs, tmp_path):
    import json
    import shutil

    from ppolm.rewards import write_norm

    policy, rm_dir = deep_dirs
    rm_norm = tmp_path / "rm"
    shutil.copytree(rm_dir, rm_norm)
    write_norm(rm_norm, 1.5, 0.25)
    out = tmp_path / "run"
    train_ppo(cfg_for(policy, out, reward_model=[str(rm_norm)], steps=1))
    saved = json.loads((out / "critic" / "ppolm_value.json").read_text())["bias"]
    assert saved != 0.25 and abs(saved - 0.25) < 0.1  # trained with the critic, from the RM's bias


@pytest.mark.parametrize("critic_layers", [1, 0])
def test_zero_head_critic_keeps_the_reward_models_layers(deep_dirs, tmp_path, critic_layers):
    """--critic-zero-head: the critic's layers are the RM's, its head is zero and it has no bias, so its
    first values are all 0 (explained variance exactly 0 on the first step), and it still learns."""
    policy, rm_dir = deep_dirs
    trainer = PPOTrainer(cfg_for(policy, tmp_path / "run", reward_model=[str(rm_dir)], critic_layers=critic_layers,
                                 critic_zero_head=True))
    assert trainer.critic_from_rm and trainer.value_bias is None
    inner = models._unwrap(trainer.critic.model if trainer.tap is not None else trainer.critic)
    assert torch.count_nonzero(inner.score.weight) == 0
    rm = models.load_scalar_model(rm_dir, head_init="keep")
    top_rm = models.stack(rm)[1][-1].mlp.up_proj.weight
    top_critic = models.stack(trainer.critic.model if trainer.tap is not None else trainer.critic)[1][-1].mlp.up_proj.weight
    assert torch.equal(top_critic, top_rm)  # initialised from the reward model
    m0, _ = trainer.step(0)
    assert m0["val/vf_explained_var"] == pytest.approx(0.0, abs=1e-6)
    assert torch.count_nonzero(inner.score.weight) > 0  # the head trained
