"""bf16 computes what fp32 computes, up to rounding, where PPO's maths depends on it.

PPO's invariants hold in bf16 as in fp32 (tiny models, bf16 emulated where the CPU lacks it):
until the first update the policy and its reference run the same operations on the same numbers
(per-token KL 0 and importance ratio 1, for full fine-tuning and LoRA on the top layers), and the
sampler and the training pass read the same fp32 output head.
"""

from __future__ import annotations

import pytest
import torch

from ppolm import config, core, models, runtime
from ppolm import rollout as ro
from ppolm.ppo import run as run_ppo
from ppolm.ppo_config import PPOConfig
from ppolm.ppo_trainer import PPOTrainer

REWARD = "def words(prompts, completions, **kw):\n    return [min(len(c.split()), 10) / 10 for c in completions]\n"


def trainer(model_dir, tmp_path, **over) -> PPOTrainer:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "r.py").write_text(REWARD)
    base = dict(model=str(model_dir), reward_fn=[f"{tmp_path / 'r.py'}:words"], steps=1, batch_size=4,
                response_length=8, output_dir=str(tmp_path / "run"), quiet=True, precision="bf16",
                critic_layers=0)
    return PPOTrainer(config.build(PPOConfig, {**base, **over}))


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_first_step_kl_is_zero_and_ratio_one_in_bf16(tiny_policy_dir, tiny_rm_dir, tmp_path, one_thread, lora):
    # LoRA on the top layer only: the policy then starts from the reference pass's hidden state
    # (trunk sharing) and its reference must take the same path. A learning rate too small to move
    # a bf16 weight keeps the policy at the reference through the epoch, so every minibatch's
    # ratio (recomputed in other batch shapes than the old log-probs) must stay 1.
    over = dict(lora_r=lora, lora_target="layers.1.self_attn.q_proj,layers.1.mlp.down_proj") if lora else {}
    t = trainer(tiny_policy_dir, tmp_path, reward_model=[str(tiny_rm_dir)], reward_model_weight=0.0,
                minibatches=2, ppo_epochs=1, actor_lr=1e-12, **over)
    assert next(p for p in t.policy.parameters() if not p.requires_grad or not lora).dtype == torch.bfloat16
    if lora:
        assert t.policy_start == 1
        assert all(p.dtype == torch.float32 for p in t.learner.actor_params)  # adapters train in fp32
    metrics, _ = t.step(0)
    tokens = metrics["response/length_mean"]
    assert abs(metrics["objective/kl"]) / tokens < 1e-3  # per token
    assert abs(metrics["val/ratio"] - 1) < 1e-3
    assert metrics["policy/approxkl_avg"] < 1e-6


def test_sampler_and_training_log_probs_agree(tiny_policy_dir, tmp_path, one_thread):
    for prec, tol in (("fp32", 1e-4), ("bf16", 2e-2)):
        t = trainer(tiny_policy_dir, tmp_path / prec, precision=prec, overwrite=True)
        torch.manual_seed(0)
        prompts = [p.ids for p in t.prompt_batch(0)]
        roll = ro.generate(t.policy, prompts, pad_id=t.pad_id, eos_id=t.eos_id, max_new_tokens=8, temperature=0.7)
        roll.share_prefix()
        with torch.no_grad():
            train = ro.logprobs(t.policy, roll, 0.7)
        mask = roll.response_mask.float()
        gap = core.masked_mean((train - roll.sample_logprobs).abs(), mask).item()
        assert gap < tol, (prec, gap)


def test_step_reports_the_sampler_gap(tiny_policy_dir, tmp_path, one_thread):
    t = trainer(tiny_policy_dir, tmp_path, precision="fp32")
    metrics, _ = t.step(0)
    assert 0 <= metrics["policy/sampler_logprob_gap"] < 1e-4


def test_master_weights_accumulate_updates_below_bf16_resolution():
    # bf16 has 8 significant bits: 1.5 + 1e-3 rounds back to 1.5. A hundred such steps on the fp32
    # masters move them to 1.6 (up to their dither), and the bf16 weights follow: each is 1.59375 or
    # 1.6015625 (the bf16 values either side of 1.6, 2**-7 apart), 1.6 on average.
    w = torch.nn.Parameter(torch.full((4096,), 1.5, dtype=torch.bfloat16))
    mw = runtime.MasterWeights([w])
    assert mw.params[0].dtype == torch.float32 and mw.params[0] is not w
    opt = torch.optim.SGD(mw.params, lr=1e-3)
    for _ in range(100):
        (-(w.float()).sum()).backward()  # gradient -1 on every element
        mw.grads_to_master()
        assert w.grad is None and torch.equal(mw.params[0].grad, -torch.ones(4096))
        opt.step()
        opt.zero_grad(set_to_none=True)
        mw.copy_to_model()
    assert (mw.params[0] - 1.6).abs().max() < 2**-8 + 1e-5  # 0.1 moved, dither at most half a step
    assert set(w.float().unique().tolist()) == {1.59375, 1.6015625}
    assert abs(w.float().mean().item() - 1.6) < 3e-4  # 5 standard errors of 4096 roundings
    naive = torch.full((3,), 1.5, dtype=torch.bfloat16)
    for _ in range(100):
        naive += 1e-3
    assert torch.equal(naive, torch.full((3,), 1.5, dtype=torch.bfloat16))  # what bf16 alone would keep


def test_dithered_masters_let_bf16_weights_follow_a_move_below_half_a_step():
    # A move of 0.3 bf16 steps (2**-7 at 1.5): a master copied exactly from its bf16 weight rounds
    # back to 1.5 (the bf16 model does not move at all); dithered masters round up in 30 % of the
    # weights, so the bf16 weights move by the update on average.
    step = 2**-7
    w = torch.nn.Parameter(torch.full((20000,), 1.5, dtype=torch.bfloat16))
    mw = runtime.MasterWeights([w], seed=3)
    with torch.no_grad():
        mw.params[0].add_(0.3 * step)
        mw.copy_to_model()
    up = (w.float() == 1.5 + step).float().mean().item()
    assert set(w.float().unique().tolist()) == {1.5, 1.5 + step}
    assert abs(up - 0.3) < 0.02  # 0.3 +- 6 standard errors
    exact = torch.full((20000,), 1.5) + 0.3 * step
    assert torch.equal(exact.bfloat16(), torch.full((20000,), 1.5, dtype=torch.bfloat16))  # undithered


def test_dither_keeps_each_bf16_weight_and_spreads_its_master_over_the_rounding_cell():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(200000, generator=g) * 0.05).bfloat16()
    w[:10] = 0.0
    w[10] = -0.0
    m = runtime.dithered(w, torch.Generator().manual_seed(1))
    assert m.dtype == torch.float32 and torch.equal(m.bfloat16(), w)  # the model's weights unchanged
    assert torch.equal(m[:11], torch.zeros(11))
    assert torch.equal(m, runtime.dithered(w, torch.Generator().manual_seed(1)))  # one seed, one dither
    exp = (w.float().abs().view(torch.int32) & 0x7F800000).view(torch.float32)  # 2**exponent
    u = ((m - w.float()) / (exp * 2**-7))[11:]  # in bf16 steps (the cells at a power of two aside)
    mid = (w.float().abs() != exp)[11:]
    assert u.abs().max() < 0.5 and abs(u[mid].mean().item()) < 0.003
    assert abs(u[mid].std().item() - 12**-0.5) < 0.003  # a uniform draw over one step: sd 1/sqrt(12)


def test_master_weights_accumulate_gradients_in_fp32():
    w = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
    mw = runtime.MasterWeights([w])
    for g in (1.0, 1e-3, 1e-3):  # in bf16, 1 + 1e-3 + 1e-3 stays 1
        (w.float() * g).sum().backward()
        mw.grads_to_master()
    small = torch.tensor(1e-3, dtype=torch.bfloat16).item()  # each gradient arrives in bf16: 0.00099945...
    assert mw.params[0].grad.item() == 1 + 2 * small
    f32 = torch.nn.Parameter(torch.zeros(1))
    assert runtime.MasterWeights([f32]).params[0] is f32  # fp32 weights are their own master


def test_bf16_run_saves_fp32_weights_from_the_masters(tiny_policy_dir, tmp_path, one_thread):
    from safetensors.torch import load_file

    t = trainer(tiny_policy_dir, tmp_path, steps=2, actor_lr=1e-3, critic="shared")
    run_ppo(t)
    saved = load_file(str(tmp_path / "run" / "policy" / "model.safetensors"))
    masters = dict(t.trained_parameters())
    w = saved["model.layers.0.mlp.up_proj.weight"]
    assert w.dtype == torch.float32
    assert torch.equal(w, masters["policy.model.layers.0.mlp.up_proj.weight"].detach())


def test_auto_precision_says_what_it_picked_and_why(capsys):
    ok, why = runtime.native_bf16(torch.device("cpu"))
    flags = open("/proc/cpuinfo").read().split()
    assert ok == ("avx512_bf16" in flags or "amx_bf16" in flags)
    runtime._SAID.clear()
    chosen = runtime.resolve_precision("auto", torch.device("cpu"))
    assert chosen == ("bf16" if ok else "fp32")
    assert capsys.readouterr().err == ""  # said when the first model loads, not before
    runtime.announce()
    err = capsys.readouterr().err
    assert f"precision: {chosen} on cpu (auto: " in err and why in err
    # a later stage asking for the precision already chosen says nothing; another precision is said
    assert runtime.resolve_precision(chosen, torch.device("cpu")) == chosen
    runtime.announce()
    assert capsys.readouterr().err == ""
    other = "fp32" if chosen == "bf16" else "bf16"
    assert runtime.resolve_precision(other, torch.device("cpu")) == other
    runtime.announce()
    assert f"precision: {other} on cpu (as asked)" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# The output path: log-probs come from what the model's own forward computes after its LM head.

def _tiny(kind: str):
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
        PhiConfig,
        PhiForCausalLM,
    )

    small = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    if kind == "phi":  # its LM head has a bias
        model = PhiForCausalLM(PhiConfig(**small))
        with torch.no_grad():
            model.lm_head.bias.normal_(0, 1.0)
    elif kind == "granite":  # logits divided by logits_scaling
        model = GraniteForCausalLM(GraniteConfig(**small, logits_scaling=4.0))
    else:  # Gemma-2: final soft-capping tanh(x / c) * c, with c small enough to bite
        model = Gemma2ForCausalLM(Gemma2Config(**small, head_dim=8, final_logit_softcapping=0.5))
    return model.eval()


@pytest.mark.parametrize("kind", ["phi", "granite", "gemma2"])
def test_output_logits_are_the_models_own(kind, one_thread):
    model = _tiny(kind)
    ids = torch.tensor([[5, 17, 99, 3, 42, 7]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask).logits
        hidden = ro.backbone(model)(input_ids=ids, attention_mask=mask).last_hidden_state
        mine = models.output_logits(model, hidden)
        bare = model.lm_head(hidden / 0.7)  # the head alone on h / T: right only for a plain linear head
    assert torch.allclose(mine, own, atol=1e-5)
    assert not torch.allclose(bare, own / 0.7, atol=1e-3)  # the model's output path matters here
    models.check_output_path(model)
    roll = ro.Rollout(ids[:, :3], mask[:, :3], ids[:, 3:], mask[:, 3:], torch.tensor([False]))
    with torch.no_grad():
        lp = ro.logprobs(model, roll, 0.7)
    want = torch.log_softmax(own[:, 2:5] / 0.7, -1).gather(-1, ids[:, 3:, None]).squeeze(-1)
    assert torch.allclose(lp, want, atol=1e-5)


def test_a_model_with_an_unknown_output_transform_is_refused(one_thread):
    from transformers import LlamaConfig, LlamaForCausalLM

    from ppolm.errors import PPOLMError

    class DoubledLogits(LlamaForCausalLM):  # a model whose forward does more after its head
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    models.check_output_path(LlamaForCausalLM(cfg).eval())
    with pytest.raises(PPOLMError, match="changes its logits after the LM head"):
        models.check_output_path(DoubledLogits(cfg).eval())
