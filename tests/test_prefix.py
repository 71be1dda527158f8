"""The prompts' common beginning runs once per forward pass (ppolm/prefix.py): the split is found on
the left-padded layout, and hidden states, gradients, hooks and PPO steps are those of plain passes."""

from __future__ import annotations

import pytest
import torch

from ppolm import config, models, prefix, trunk
from ppolm import rollout as ro
from ppolm.ppo_config import PPOConfig
from ppolm.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

SHARED = list(range(100, 112))  # 12 common leading tokens


def batch(extra_rows=((7, 8, 9), (7,), (9, 9, 9, 9, 5))):
    """Three prompts = SHARED + their own tokens (lengths 15, 13, 17: left pads 2, 4, 0), with right-padded
    responses of lengths 3, 1 and 4."""
    prompts = [SHARED + list(r) for r in extra_rows]
    query, qmask = ro.left_pad(prompts, 0, "cpu")
    resp = torch.tensor([[5, 6, 2, 0], [2, 0, 0, 0], [8, 8, 8, 8]])
    rmask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    return ro.Rollout(query, qmask, resp, rmask, torch.tensor([True, True, False]))


def test_find_puts_each_rows_shared_columns_first():
    roll = batch().share_prefix()
    s = roll.split
    assert s is not None and s.length == 12  # the 13th token differs (8 vs 9, row 1 has 7 then ends)
    ids = roll.input_ids
    for i, pads in enumerate((2, 4, 0)):
        want = list(range(pads, pads + 12)) + list(range(pads)) + list(range(pads + 12, ids.shape[1]))
        assert s.perm[i].tolist() == want
        assert torch.equal(ids[i, s.perm[i, :12]], torch.tensor(SHARED))
        assert torch.equal(s.perm[i][s.inv[i]], torch.arange(ids.shape[1]))
    # stitch puts a (1, c) part and a (B, T - c) part back in the original columns
    order = ids.gather(1, s.perm)
    assert torch.equal(s.stitch(order[:1, :12], order[:, 12:]), ids)
    feats = torch.randn(3, ids.shape[1], 4)
    feats[:, :, 0] = ids  # a trailing dimension travels with its column
    shared_feats = feats.gather(1, s.perm[..., None].expand(-1, -1, 4))
    shared_feats[:, :12] = shared_feats[:1, :12]
    out = s.stitch(shared_feats[:1, :12], shared_feats[:, 12:])
    assert torch.equal(out[:, :, 0], ids)
    assert s.select(torch.tensor([2, 0])).perm.tolist() == s.perm[[2, 0]].tolist()


def test_find_refuses_short_or_single_prefixes():
    # the shared part keeps one token of the shortest prompt out: 8 + 1 tokens -> c = 8 (MIN_SHARED)
    assert batch(((1,), (2,), (3,))).share_prefix().split.length == 12
    short = [SHARED[:7] + [1, 2], SHARED[:7] + [3]]
    q, m = ro.left_pad(short, 0, "cpu")
    assert prefix.find(q, m, q.shape[1] + 2) is None  # 7 common tokens < MIN_SHARED
    q1, m1 = ro.left_pad([SHARED + [1]], 0, "cpu")
    assert prefix.find(q1, m1, q1.shape[1] + 2) is None  # one row: nothing to share
    same = [SHARED, SHARED]
    q2, m2 = ro.left_pad(same, 0, "cpu")
    assert prefix.find(q2, m2, q2.shape[1] + 2).length == 11  # identical prompts keep their last token


def test_forward_and_gradients_equal_the_plain_pass(tiny_policy_dir):
    model = models.load_causal_lm(tiny_policy_dir)
    plain, shared = batch(), batch().share_prefix()
    real = plain.attention_mask.bool()

    def run(roll):
        model.zero_grad()
        h = ro.response_hidden(model, roll)
        logp = ro.logprobs(model, roll, 0.7)
        (logp * roll.response_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        full = ro.backbone(model)(input_ids=roll.input_ids, attention_mask=roll.attention_mask,
                                  position_ids=models.position_ids_from_mask(roll.attention_mask),
                                  use_cache=False).last_hidden_state if roll.split is None else \
            prefix.forward(ro.backbone(model), roll.input_ids, roll.attention_mask, roll.split)
        return h.detach(), logp.detach(), grads, full.detach()

    h0, lp0, g0, f0 = run(plain)
    h1, lp1, g1, f1 = run(shared)
    assert torch.allclose(f0[real], f1[real], atol=1e-5)  # every real position, prompt included
    assert torch.allclose(h0, h1, atol=1e-5)
    assert torch.allclose(lp0, lp1, atol=1e-5)
    assert not torch.equal(lp0, torch.zeros_like(lp0))
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=1e-5, rtol=1e-4), n
    assert g0["model.embed_tokens.weight"][SHARED].abs().sum() > 0  # the shared tokens do get gradient


def test_hooks_capture_the_stitched_state(tiny_policy_dir, tiny_rm_dir):
    """The trunk recorder fires twice under the split (shared part, then the rest) and keeps the
    stitched (B, T, d) state, which equals the plain pass's; an RM scores the same from it."""
    model = models.load_causal_lm(tiny_policy_dir).requires_grad_(False)
    plain, shared = batch(), batch().share_prefix()
    rec = trunk.Recorder(model, {1, 2})
    got = {}
    for name, roll in (("plain", plain), ("shared", shared)):
        with rec.record() as found, torch.no_grad():
            ro.logprobs(model, roll, 1.0)
        got[name] = found
    real = plain.attention_mask.bool()
    for k in (1, 2):
        assert got["shared"][k].shape == got["plain"][k].shape
        assert torch.allclose(got["shared"][k][real], got["plain"][k][real], atol=1e-5), k
    rm = models.load_scalar_model(tiny_rm_dir, head_init="keep")
    with torch.no_grad():
        a = models.scalar_forward(rm, plain.input_ids, plain.attention_mask)
        b = models.scalar_forward(rm, shared.input_ids, shared.attention_mask, split=shared.split)
    assert torch.allclose(a[real], b[real], atol=1e-5)


@pytest.mark.parametrize("n", [0, 1])
def test_reward_trunk_cache_runs_the_shared_beginning_once(tiny_rm_dir, monkeypatch, n):
    """ppolm reward's trunk cache: texts of one chat template share their beginning, which runs once
    per batch; the cached states (entering the top n layers, or the final one at the last token)
    equal a plain pass's over each text alone."""
    from ppolm import critic
    from ppolm.reward_train import TrunkCache

    rm = models.load_scalar_model(tiny_rm_dir, head_init="keep").requires_grad_(False)
    texts = [SHARED + [7, 8, 9, 2], SHARED + [7, 2], SHARED + [9, 9, 9, 9, 5, 2], SHARED + [4, 4, 2]]
    splits = []
    real_find = prefix.find
    monkeypatch.setattr(prefix, "find", lambda *a: splits.append(real_find(*a)) or splits[-1])
    cache = TrunkCache(rm, n, texts, 0, torch.device("cpu"), "fp32", batch_size=4)
    assert len(splits) == 1 and splits[0] is not None and splits[0].length == 12
    backbone, layers = models.stack(rm)
    tap = critic.Tap(layers[len(layers) - n if n else 0])
    for x in texts:
        with torch.no_grad(), tap.capture():
            out = backbone(input_ids=torch.tensor([x]), use_cache=False).last_hidden_state
        want = tap.hidden[0] if n else out[0, -1:]  # (T, d) entering layer L - n, or the final state
        assert torch.allclose(cache.hidden[tuple(x)], want, atol=1e-5), (n, x)


@pytest.mark.parametrize("over", [
    dict(critic_layers=1),                                  # full fine-tuning, critic tapping the RM
    dict(critic_layers=0, critic_init="policy"),            # a full separate critic (its own pass)
    dict(lora_r=4, lora_target="all-linear", actor_lr=1e-3),  # LoRA: the reference is the adapter-free policy
])
def test_ppo_steps_are_unchanged_by_prefix_sharing(tiny_policy_dir, tiny_rm_dir, tmp_path, over):
    """Two PPO steps on the built-in chat prompts (the template's system prompt is shared) with and
    without --share-prefix give the same metrics and the same weights."""
    def cfg(out, share):
        base = dict(model=str(tiny_policy_dir), reward_model=[str(tiny_rm_dir)], steps=2, batch_size=4,
                    minibatches=2, ppo_epochs=2, response_length=6, output_dir=str(tmp_path / out), quiet=True,
                    precision="fp32", save_every=100, share_prefix=share, seed=5, actor_lr=1e-3,
                    # below 1: a tiny random model's near-uniform distribution, sampled by inverse
                    # CDF, would turn rounding-level weight differences into other tokens
                    temperature=0.7)
        base.update(over)
        return config.build(PPOConfig, base)

    runs = {}
    for share in (True, False):
        t = PPOTrainer(cfg(f"s{share}", share))
        runs[share] = (t, [t.step(s)[0] for s in range(2)])
    on, off = runs[True][0], runs[False][0]
    q, m = ro.left_pad([p.ids for p in on.prompt_batch(0)], on.pad_id, "cpu")
    assert prefix.find(q, m, q.shape[1] + 6).length >= 20  # the system prompt and more
    for a, b in zip(runs[True][1], runs[False][1]):
        for key in ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "policy/approxkl_avg",
                    "objective/entropy", "val/vf_explained_var"):
            assert a[key] == pytest.approx(b[key], abs=5e-5), key
    for (n, p), (_, q_) in zip(on.trained_parameters(), off.trained_parameters()):
        assert torch.allclose(p, q_, atol=2e-5), (n, (p - q_).abs().max())
    assert runs[True][1][1]["policy/approxkl_avg"] > 0
