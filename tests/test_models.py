"""Tests for ppolm.models: loading, PAD/EOS policy, scalar heads, left padding, errors."""

from __future__ import annotations

import errno
import math
import time

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from ppolm.errors import PPOLMError
from ppolm.models import (
    EMBEDDED_DEFAULT,
    cache_dir,
    disable_dropout,
    ensure_pad_token,
    has_scalar_head,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    position_ids_from_mask,
    resize_embeddings_if_needed,
    resolve_model_dir,
    save_pretrained,
    scalar_forward,
)
from ppolm.tiny import build_tiny_model_dir

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _chat_ids(tok, text="What is the capital of France?"):
    ids = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return list(ids)


def test_tiny_dir_loads_with_plain_transformers_and_generates(tiny_policy_dir, tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_policy_dir)
    plain_tok = AutoTokenizer.from_pretrained(tiny_policy_dir)
    assert plain_tok.pad_token_id != plain_tok.eos_token_id
    ids = torch.tensor([_chat_ids(tokenizer)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert out.shape[0] == 1 and ids.shape[1] < out.shape[1] <= ids.shape[1] + 5


def test_tiny_dir_is_deterministic(tmp_path, tiny_policy_dir):
    again = build_tiny_model_dir(tmp_path / "again", kind="causal", seed=0)
    a, b = load_file(tiny_policy_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["model.embed_tokens.weight"].shape == (49152, 64)


def test_tokenizer_pad_eos_and_chat_template(tokenizer):
    assert tokenizer.chat_template
    assert tokenizer.padding_side == "left"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 0
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    ids = _chat_ids(tokenizer)
    assert tokenizer.pad_token_id not in ids
    assert tokenizer.eos_token_id in ids  # the template's own end-of-turn tokens stay unmasked
    batch = tokenizer(["hi", "a much longer prompt here"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, 0].item() == tokenizer.pad_token_id and batch["attention_mask"][0, 0] == 0


def test_ensure_pad_token_adds_pad_when_no_candidate(tiny_policy_dir):
    tok = load_tokenizer(tiny_policy_dir)
    tok.eos_token = "<|endoftext|>"  # now <|endoftext|> and unk both equal eos
    tok.pad_token = "<|endoftext|>"
    ensure_pad_token(tok)
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id == 49152
    model = load_causal_lm(tiny_policy_dir, tokenizer=tok)
    assert model.get_input_embeddings().num_embeddings == 49153
    resize_embeddings_if_needed(model, tok)  # idempotent
    assert model.get_input_embeddings().num_embeddings == 49153


def test_load_causal_lm_sets_pad_eval_and_no_dropout(tiny_policy_dir):
    model = load_causal_lm(tiny_policy_dir)
    assert not model.training
    assert model.config.pad_token_id == 0 and model.generation_config.pad_token_id == 0
    assert model.generation_config.eos_token_id == 2
    assert all(m.p == 0 for m in model.modules() if isinstance(m, nn.Dropout))
    assert all(v == 0.0 for k, v in vars(model.config).items() if k.endswith("dropout"))


def test_disable_dropout_everywhere():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        attention_dropout=0.3,
    )
    model = LlamaForCausalLM(cfg)
    model.extra = nn.Sequential(nn.Dropout(0.5), nn.Dropout1d(0.2))
    disable_dropout(model)
    assert all(m.p == 0 for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd))
    assert model.config.attention_dropout == 0.0
    assert all(layer.self_attn.attention_dropout == 0.0 for layer in model.model.layers)


def test_value_head_is_zero(tiny_policy_dir, tokenizer):
    model = load_scalar_model(tiny_policy_dir, head_init="value")
    assert torch.count_nonzero(model.score.weight) == 0
    batch = tokenizer(["hello there", "hi"], padding=True, return_tensors="pt")
    with torch.no_grad():
        values = scalar_forward(model, batch["input_ids"], batch["attention_mask"])
    assert values.shape == batch["input_ids"].shape and values.dtype == torch.float32
    assert torch.count_nonzero(values) == 0
    assert model.config.num_labels == 1 and model.config.pad_token_id == 0 and not model.training


def test_reward_head_std(tiny_policy_dir):
    torch.manual_seed(0)
    model = load_scalar_model(tiny_policy_dir, head_init="reward")
    expected = 1 / math.sqrt(64 + 1)
    assert abs(model.score.weight.std().item() - expected) / expected < 0.25


def test_keep_without_head_raises(tiny_policy_dir):
    assert not has_scalar_head(tiny_policy_dir)
    with pytest.raises(PPOLMError, match="no scalar head"):
        load_scalar_model(tiny_policy_dir, head_init="keep")


def test_scalar_model_dir_keeps_head(tiny_rm_dir):
    assert has_scalar_head(tiny_rm_dir)
    saved = load_file(tiny_rm_dir / "model.safetensors")["score.weight"]
    model = load_scalar_model(tiny_rm_dir)
    assert torch.equal(model.score.weight.detach(), saved)
    assert model.score.weight.abs().sum() > 0


def test_save_reload_matches_hf_pooling(tiny_policy_dir, tokenizer, tmp_path):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(1)
    model = load_scalar_model(tiny_policy_dir, head_init="reward")
    save_pretrained(model, tokenizer, tmp_path / "rm")
    assert has_scalar_head(tmp_path / "rm") and not list((tmp_path / "rm").glob("*.bin"))
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    ours = load_scalar_model(tmp_path / "rm")
    for text in ["What is the capital of France?", "Tell me a joke about cats, please."]:
        ids = torch.tensor([_chat_ids(tokenizer, text)])
        mask = torch.ones_like(ids)
        with torch.no_grad():
            want = hf(input_ids=ids, attention_mask=mask).logits[0, 0]
            got = scalar_forward(model, ids, mask)[0, -1]
            got_reloaded = scalar_forward(ours, ids, mask)[0, -1]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_reloaded, want, atol=1e-5, rtol=1e-5)


def test_left_padding_invariance(tiny_rm_dir, tokenizer):
    model = load_scalar_model(tiny_rm_dir)
    texts = ["Hi!", "Write a short poem about the sea and the wind."]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
        )
        for t in texts
    ]
    batch = tokenizer(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
    assert batch["attention_mask"][0, 0] == 0  # the short one is left-padded
    with torch.no_grad():
        padded = scalar_forward(model, batch["input_ids"], batch["attention_mask"])[:, -1]
        for i, prompt in enumerate(prompts):
            ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
            alone = scalar_forward(model, ids, torch.ones_like(ids))[0, -1]
            torch.testing.assert_close(padded[i], alone, atol=1e-5, rtol=0)


def test_position_ids_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_scalar_forward_peft_wrapped(tiny_rm_dir, tokenizer):
    from peft import LoraConfig, get_peft_model

    model = load_scalar_model(tiny_rm_dir)
    ids = torch.tensor([_chat_ids(tokenizer)])
    with torch.no_grad():
        base = scalar_forward(model, ids, torch.ones_like(ids))
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS"))
    with torch.no_grad():
        lora = scalar_forward(wrapped, ids, torch.ones_like(ids))
    torch.testing.assert_close(lora, base)  # LoRA B starts at zero


def test_cache_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PPOLM_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda d: d / "does-not-exist", ["not found"]),
        (lambda d: d, ["config.json"]),
        (lambda d: (_write(d / "config.json", b"{}"), d)[1], ["no weights"]),
        (
            lambda d: (_write(d / "config.json", b"{}"), _write(d / "pytorch_model.bin", b"x"), d)[2],
            ["pickle", "allow_pickle"],
        ),
        (lambda d: _write(d / "x.gguf", bytes(range(100))), ["GGUF"]),
        (lambda d: _write(d / "y.gguf", b"GGUF" + bytes(range(96))), ["GGUF"]),
        (lambda d: _write(d / "weights.txt", b"x"), ["not a .gguf"]),
        (lambda d: "smollm2-135m-instruc", ["unknown model", "did you mean 'smollm2-135m-instruct'"]),
    ],
    ids=[
        "missing",
        "no-config",
        "no-weights",
        "pickle",
        "junk-gguf",
        "corrupt-gguf",
        "not-gguf",
        "unknown-name",
    ],
)
def test_resolve_errors(tmp_path, monkeypatch, make, words):
    monkeypatch.setenv("PPOLM_CACHE", str(tmp_path / "cache"))
    (tmp_path / "m").mkdir()
    spec = make(tmp_path / "m")
    with pytest.raises(PPOLMError) as info:
        resolve_model_dir(spec)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message
    leftovers = list((tmp_path / "cache").rglob(".tmp-*"))
    assert not leftovers


def test_allow_pickle(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    assert resolve_model_dir(tmp_path, allow_pickle=True) == tmp_path


def test_no_space_left_is_a_one_line_error(tmp_path):
    from ppolm.models import _atomic_dir

    with pytest.raises(PPOLMError, match="no space left on device.*PPOLM_CACHE"):
        with _atomic_dir(tmp_path / "out"):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert not list(tmp_path.iterdir())  # neither a half cache nor a temp dir


def test_embedded_tokenizer_needs_no_model_conversion():
    tok = load_tokenizer(EMBEDDED_DEFAULT)  # from the tokenizer cache when the model is not converted yet
    assert (tok.eos_token_id, tok.pad_token_id, tok.padding_side) == (2, 0, "left")


@pytest.mark.slow
def test_embedded_model_answers_paris():
    t0 = time.perf_counter()
    tok = load_tokenizer(EMBEDDED_DEFAULT)
    model = load_causal_lm(EMBEDDED_DEFAULT, tokenizer=tok)
    first = time.perf_counter() - t0
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0
    batch = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=24, do_sample=False)
    answer = tok.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
    t0 = time.perf_counter()
    load_causal_lm(EMBEDDED_DEFAULT, tokenizer=load_tokenizer(EMBEDDED_DEFAULT))
    print(
        f"\nembedded model: first load {first:.1f} s, cached load {time.perf_counter() - t0:.1f} s; answer: {answer!r}"
    )
