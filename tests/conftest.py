"""Shared fixtures: tiny random Llama models that use the real SmolLM2 tokenizer.

The tests use the real user cache (``$PPOLM_CACHE`` or ``~/.cache/ppolm``) on purpose: the SmolLM2
tokenizer (and, for the slow tests, the dequantised model) is extracted from the embedded GGUF once
(~10 s for the tokenizer, ~40 s for the model) and reused by every later run.
"""

from __future__ import annotations

import pytest
import torch

from ppolm.models import load_tokenizer
from ppolm.tiny import build_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    """A tiny causal Llama (2 layers, hidden 64, vocab 49152), seed 0."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_policy"), kind="causal", seed=0)


@pytest.fixture(scope="session")
def tiny_rm_dir(tmp_path_factory):
    """A tiny LlamaForSequenceClassification (num_labels=1, reward-initialised head), seed 1."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_rm"), kind="scalar", seed=1)


@pytest.fixture(scope="session")
def tokenizer(tiny_policy_dir):
    """The SmolLM2 tokenizer as ppolm loads it: left padding, PAD = <|endoftext|> (0), EOS = <|im_end|> (2)."""
    return load_tokenizer(tiny_policy_dir)


@pytest.fixture()
def one_thread():
    """One torch thread: tiny models gain nothing from more, and on a busy 2-core machine OpenMP
    threads of several processes spin against each other (5-15x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def uneven_rollout(tok):
    """Two left-padded prompts of different lengths, with right-padded responses of lengths 4 and 2
    (shared by the critic and trunk tests)."""
    from ppolm import rollout as ro

    a = tok("Hello there, how are you today?", add_special_tokens=False)["input_ids"]
    b = tok("Hi", add_special_tokens=False)["input_ids"]
    query, qmask = ro.left_pad([a, b], tok.pad_token_id, "cpu")
    resp = torch.tensor([[5, 6, 7, 2], [8, 2, 0, 0]])
    rmask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    return ro.Rollout(query, qmask, resp, rmask, torch.tensor([True, True]))
