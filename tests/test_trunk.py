"""Frozen layers shared by the reference, the reward model and a LoRA policy (ppolm/trunk.py): found by
comparing weights, stored once, run once, and the PPO step computes exactly what it computes
without the sharing."""

from __future__ import annotations

import pytest
import torch
from conftest import uneven_rollout

from ppolm import config, models, tiny, trunk
from ppolm import rollout as ro
from ppolm.ppo import held_out
from ppolm.ppo_config import PPOConfig
from ppolm.ppo_trainer import PPOTrainer
from ppolm.rewards import RewardModel

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 3


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A 3-layer tiny policy; reward models made from it as `ppolm reward --train-layers N` would leave
    them (lower layers untouched, the top ``N`` moved); and one from another seed (nothing shared)."""
    root = tmp_path_factory.mktemp("trunk")
    policy = tiny.build_tiny_model_dir(root / "policy", kind="causal", seed=0, num_layers=LAYERS)
    tok = models.load_tokenizer(policy)
    out = {"policy": policy,
           "other": tiny.build_tiny_model_dir(root / "other", kind="scalar", seed=1, num_layers=LAYERS)}
    for trained in (0, 1, 2):
        torch.manual_seed(trained)
        rm = models.load_scalar_model(policy, head_init="reward")
        with torch.no_grad():
            for layer in list(models.stack(rm)[1])[LAYERS - trained:]:
                for p in layer.parameters():
                    p.add_(0.05 * torch.randn_like(p))
        models.save_pretrained(rm, tok, root / f"rm{trained}")
        out[f"rm{trained}"] = root / f"rm{trained}"
    return out


batch = uneven_rollout


@pytest.mark.parametrize(("name", "want"), [("rm0", 3), ("rm1", 2), ("rm2", 1), ("other", 0)])
def test_shared_prefix_counts_equal_leading_layers(dirs, name, want):
    ref = models.load_causal_lm(dirs["policy"]).requires_grad_(False)
    rm = RewardModel(str(dirs[name]), dtype=torch.float32, device="cpu")
    assert trunk.shared_prefix(ref, rm.model) == want


@pytest.mark.parametrize("name", ["rm0", "rm1", "rm2"])
def test_reward_from_the_reference_pass_equals_the_full_forward(dirs, tokenizer, name):
    """The RM's score computed from the hidden state the reference recorded equals its own full
    forward pass, and after aliasing the RM holds no copy of the shared weights."""
    ref = models.load_causal_lm(dirs["policy"]).requires_grad_(False)
    rm = RewardModel(str(dirs[name]), dtype=torch.float32, device="cpu")
    roll = batch(tokenizer)
    want = rm.score_ids(roll.input_ids, roll.attention_mask)
    k = trunk.shared_prefix(ref, rm.model)
    per_layer = sum(p.numel() * 4 for p in models.stack(ref)[1][0].parameters())
    embed = models.stack(ref)[0].embed_tokens.weight
    assert trunk.alias(ref, rm.model, k) == embed.numel() * 4 + k * per_layer
    assert models.stack(rm.model)[0].embed_tokens.weight.data_ptr() == embed.data_ptr()
    assert trunk.alias(ref, rm.model, k) == 0  # idempotent
    with trunk.Recorder(ref, {k}).record() as found, torch.no_grad():
        ro.logprobs(ref, roll, 1.0)
    assert set(found) == {k}
    got = rm.score_ids(roll.input_ids, roll.attention_mask, k, found[k])
    assert torch.allclose(got, want, atol=1e-6), (got, want)
    assert torch.allclose(rm.score_ids(roll.input_ids, roll.attention_mask), want, atol=1e-6)  # still whole


def test_lora_on_top_layers_gives_a_policy_prefix(dirs):
    from peft import LoraConfig, get_peft_model

    def lora(target):
        return get_peft_model(models.load_causal_lm(dirs["policy"]),
                              LoraConfig(r=2, lora_alpha=4, target_modules=target, task_type="CAUSAL_LM"))

    assert trunk.policy_prefix(lora("layers.2.self_attn.q_proj,layers.2.mlp.up_proj".split(","))) == 2
    assert trunk.policy_prefix(lora("layers.1.mlp.up_proj,layers.2.mlp.up_proj".split(","))) == 1
    assert trunk.policy_prefix(lora("all-linear")) == 0
    assert trunk.policy_prefix(models.load_causal_lm(dirs["policy"])) == 0  # full fine-tuning: all trained


def cfg_for(dirs, out, share, **over):
    base = dict(model=str(dirs["policy"]), steps=2, batch_size=4, minibatches=1, ppo_epochs=2, response_length=6,
                output_dir=str(out), quiet=True, precision="fp32", save_every=100, critic_layers=1,
                share_trunk=share, seed=3, actor_lr=1e-3)
    base.update(over)
    return config.build(PPOConfig, base)


def run_steps(cfg, steps=2):
    trainer = PPOTrainer(cfg)
    rows = [trainer.step(s)[0] for s in range(steps)]
    return trainer, rows


KEYS = ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "val/vf_explained_var",
        "policy/approxkl_avg", "objective/entropy")


@pytest.mark.parametrize(("rm", "critic_layers", "lora"), [
    ("rm1", 1, ""),    # critic tap on the RM's own top layer (run in its branch)
    ("rm1", 2, ""),    # critic tap inside the shared part: moved to the reference's layer
    ("rm0", 0, ""),    # every RM layer shared (a random head on the base): only norm and head run
    ("rm2", 1, "layers.2.self_attn.q_proj,layers.2.mlp.down_proj"),  # LoRA on the top layer only
])
def test_ppo_steps_are_unchanged_by_sharing(dirs, tmp_path, rm, critic_layers, lora):
    """Two PPO steps with and without the shared trunk give the same metrics and the same weights."""
    over = dict(reward_model=[str(dirs[rm])], critic_layers=critic_layers)
    if lora:
        over.update(lora_r=4, lora_target=lora, actor_lr=1e-2)
    on, rows_on = run_steps(cfg_for(dirs, tmp_path / "on", True, **over))
    off, rows_off = run_steps(cfg_for(dirs, tmp_path / "off", False, **over))
    assert off.frozen.rm_start == [0] and off.frozen.policy_start == 0 and off.frozen.recorder is None
    assert on.frozen.rm_start == [{"rm0": 3, "rm1": 2, "rm2": 1}[rm]]
    assert on.frozen.policy_start == (2 if lora else 0)
    for a, b in zip(rows_on, rows_off):
        for key in KEYS:
            # (explained variance, 1 - var(residual)/var(return), magnifies rounding: relative)
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=2e-5), key
    for (n, p), (_, q) in zip(on.trained_parameters(), off.trained_parameters()):
        assert torch.allclose(p, q, atol=1e-5), n
    assert rows_on[1]["policy/approxkl_avg"] > 0  # and the policy did move
    # evaluation (reference pass, policy log-probs and RM score from the recorded states) agrees too
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text('{"prompt": "Say hi."}\n{"prompt": "Name a colour, please."}\n{"prompt": "Why?"}\n')
    for t in (on, off):
        t.eval_prompts = __import__("ppolm.data", fromlist=["x"]).load_prompts(
            str(prompts), t.tokenizer, chat_template=None, max_length=64, context_length=None, response_length=6)
    # The same weights in both (training left them equal only to 1e-5, and sampling by the inverse CDF
    # from a tiny random model's near-uniform distribution turns such differences into other tokens):
    # what differs below is only how the evaluation's passes run.
    with torch.no_grad():
        for (_, p), (_, q) in zip(on.trained_parameters(), off.trained_parameters()):
            q.copy_(p)
    ev_on, _ = held_out(on, 2)
    ev_off, _ = held_out(off, 2)
    for key in ("eval/score", "eval/kl"):
        assert ev_on[key] == pytest.approx(ev_off[key], abs=2e-5), key
