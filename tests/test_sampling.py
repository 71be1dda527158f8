"""ppolm's decode loop (ppolm/rollout.py): inverse-CDF sampling with temperature, top-k and top-p, checked
against hand-computed distributions, and the cached decode (with the shared-prefix prefill) against
Hugging Face's greedy generate."""

from __future__ import annotations

import math

import pytest
import torch

from ppolm import models
from ppolm import rollout as ro

pytestmark = pytest.mark.usefixtures("one_thread")

P = torch.tensor([0.1, 0.2, 0.3, 0.4])
N = 40_000


def freqs(temperature=1.0, top_p=1.0, top_k=0, logits=None):
    torch.manual_seed(0)
    rows = (P.log() if logits is None else logits).expand(N, -1)
    tok = ro.sample_next(rows, temperature, top_p, top_k)
    return torch.bincount(tok, minlength=4).float() / N


@pytest.mark.parametrize(("kwargs", "want"), [
    ({}, [0.1, 0.2, 0.3, 0.4]),
    ({"temperature": 0.5}, [0.01 / 0.3, 0.04 / 0.3, 0.09 / 0.3, 0.16 / 0.3]),  # p^2, renormalised
    ({"top_k": 2}, [0, 0, 3 / 7, 4 / 7]),
    ({"top_p": 0.5}, [0, 0, 3 / 7, 4 / 7]),  # 0.4 < 0.5, so 0.3 joins; then 0.7 >= 0.5
    ({"top_p": 0.3}, [0, 0, 0, 1]),           # the most likely token alone already reaches 0.3
    ({"top_p": 0.75}, [0, 0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9]),
])
def test_sample_next_draws_the_filtered_distribution(kwargs, want):
    got = freqs(**kwargs)
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float), atol=0.01), got  # 4 SE at N = 40 000


def test_a_token_of_probability_zero_is_never_drawn():
    logits = torch.tensor([-math.inf, 0.0, -math.inf, 5.0])
    got = freqs(logits=logits)
    assert got[0] == 0 and got[2] == 0
    assert got[1] == pytest.approx(1 / (1 + math.e ** 5), abs=0.003)


def prompts(tok, shared: bool):
    head = "You are a careful assistant who answers in one short sentence. " if shared else ""
    texts = [head + "Name a fruit.", head + "Why is the sky blue, really?", head + "Hi"]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.mark.parametrize("shared", [True, False])
def test_decode_equals_hugging_face_greedy(tiny_policy_dir, tokenizer, shared):
    """At a temperature near 0 the sampler is argmax: the cached decode (shared-prefix prefill or
    not) gives Hugging Face's greedy tokens for left-padded prompts of different lengths."""
    from ppolm import prefix

    model = models.load_causal_lm(tiny_policy_dir).eval()
    ids = prompts(tokenizer, shared)
    query, qmask = ro.left_pad(ids, tokenizer.pad_token_id, "cpu")
    assert (prefix.find(query, qmask, query.shape[1]) is not None) == shared
    roll = ro.generate(model, ids, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, max_new_tokens=6,
                       temperature=1e-6, ignore_eos=True)
    with torch.no_grad():
        want = model.generate(input_ids=query, attention_mask=qmask, max_new_tokens=6, min_new_tokens=6,
                              do_sample=False, pad_token_id=tokenizer.pad_token_id)[:, query.shape[1]:]
    assert torch.equal(roll.response, want)
    assert roll.response.shape == (3, 6) and bool(roll.response_mask.all()) and not bool(roll.ended.any())


def test_ignore_eos_never_draws_eos_and_stops_at_the_length(tiny_policy_dir, tokenizer):
    model = models.load_causal_lm(tiny_policy_dir).eval()
    eos = tokenizer.eos_token_id
    with torch.no_grad():  # make EOS the most likely next token everywhere
        model.get_output_embeddings().weight[eos] = 50 * model.get_output_embeddings().weight[eos].sign()
    ids = prompts(tokenizer, True)
    roll = ro.generate(model, ids, pad_id=0, eos_id=eos, max_new_tokens=5, temperature=1.0, ignore_eos=True)
    assert roll.response.shape == (3, 5) and not bool((roll.response == eos).any())
    # without it every row stops at once: EOS first, nothing after
    roll = ro.generate(model, ids, pad_id=0, eos_id=eos, max_new_tokens=5, temperature=1.0)
    assert roll.response.shape[1] == 1 and bool((roll.response[:, 0] == eos).all()) and bool(roll.ended.all())
