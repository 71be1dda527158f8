"""Tiny random models for tests and benchmarks: a two-layer Llama with the real SmolLM2 tokenizer,
as a policy or as a reward model, written as a model directory any ppolm command loads."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from ppolm import models


def build_tiny_model_dir(
    path,
    *,
    kind: Literal["causal", "scalar"] = "causal",
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int = 128,
) -> Path:
    """Write a tiny random Llama with the real SmolLM2 tokenizer (deterministic for a seed) to ``path``."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    tok = models.smollm2_tokenizer()
    tok.padding_side = "left"
    models.ensure_pad_token(tok)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        num_labels=1,
    )
    torch.manual_seed(seed)
    if kind == "causal":
        model = LlamaForCausalLM(config)
        model.generation_config = GenerationConfig(
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )
    elif kind == "scalar":
        model = LlamaForSequenceClassification(config)
        models.init_head(model.score, "reward")
    else:
        raise ValueError(f"kind must be 'causal' or 'scalar', not {kind!r}")
    models.save_pretrained(model, tok, path)
    return Path(path)
