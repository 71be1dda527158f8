"""``ppolm sft`` on tiny random models: response-only loss, data formats, learning, outputs, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from ppolm import config, models
from ppolm.cli import main
from ppolm.errors import PPOLMError
from ppolm.sft import SFTConfig, collate, load_demos, sft_loss, train_sft

# A memorisable set: the same few answers, one word each.
pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


MEMO = [{"prompt": f"Question {i}: what is the code word?", "response": "banana"} for i in range(6)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cfg(model_dir, data, out, **over):
    base = dict(model=str(model_dir), data=str(data), output_dir=str(out), epochs=2, batch_size=4, lr=1e-3,
                quiet=True, precision="fp32")
    return config.build(SFTConfig, {**base, **over})


def test_encoding_masks_the_prompt_and_ends_with_eos(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "Hi there", "response": "Hello!"},
        {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]},
        {"prompt": [{"role": "user", "content": "Hi there"}], "completion": [{"role": "assistant", "content": "Hello!"}]},
    ])
    a, b, c = load_demos(str(data), tokenizer, chat_template=True, max_length=512)
    assert a.ids == b.ids == c.ids and a.n_prompt == b.n_prompt  # the three formats encode identically
    text = tokenizer.decode(a.ids)
    assert text.startswith("<|im_start|>") and text.endswith("Hello!<|im_end|>")  # chat template, then EOS
    assert tokenizer.decode(a.ids[:a.n_prompt]).endswith("<|im_start|>assistant\n")  # generation prompt, as PPO
    ids, mask, loss_mask = collate([a, load_demos(str(data), tokenizer, False, 512)[0]], tokenizer.pad_token_id,
                                   torch.device("cpu"))
    assert loss_mask[0].tolist() == [0] * a.n_prompt + [1] * (len(a.ids) - a.n_prompt)
    assert (loss_mask <= mask).all()


def test_prompt_tokens_contribute_no_loss(tiny_policy_dir, tmp_path, tokenizer):
    """Change the prompt's own targets: the loss is unchanged (it never reads predictions of prompt tokens);
    the gradient reaching the hidden states at prompt-predicting positions is exactly zero."""
    model = models.load_causal_lm(tiny_policy_dir, tokenizer=tokenizer)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Tell me a colour please", "response": "Blue."}])
    (ex,) = load_demos(str(data), tokenizer, True, 512)
    ids, mask, loss_mask = collate([ex], tokenizer.pad_token_id, torch.device("cpu"))
    loss, n = sft_loss(model, ids, mask, loss_mask)
    assert n == len(ex.ids) - ex.n_prompt  # response tokens + EOS

    # the same loss, computed from full logits over response targets only
    logits = model(input_ids=ids, attention_mask=mask).logits[0, :-1]
    targets = ids[0, 1:]
    per_token = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    sel = loss_mask[0, 1:].bool()
    assert torch.allclose(loss, per_token[sel].sum(), atol=1e-4)
    # targets at prompt positions replaced by other tokens: the response-only loss does not move
    other = targets.clone()
    other[~sel] = (other[~sel] + 17) % logits.shape[-1]
    per_other = torch.nn.functional.cross_entropy(logits, other, reduction="none")
    assert torch.allclose(per_other[sel].sum(), loss, atol=1e-4)
    assert not torch.allclose(per_other.sum(), per_token.sum())  # (whereas a full-sequence loss would)

    grads = {}

    def keep_grad(module, inputs, output):  # the final hidden states' gradient
        output.register_hook(lambda g: grads.setdefault("h", g))

    handle = model.model.norm.register_forward_hook(keep_grad)
    loss, _ = sft_loss(model, ids, mask, loss_mask)
    loss.backward()
    handle.remove()
    g = grads["h"][0].abs().sum(-1)  # (T,)
    assert torch.all(g[:ex.n_prompt - 1] == 0) and torch.all(g[ex.n_prompt - 1:-1] > 0)


def test_sft_lowers_held_out_loss_and_saves_a_loadable_model(tiny_policy_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    data = write_jsonl(tmp_path / "memo.jsonl", MEMO)
    out = tmp_path / "sft"
    rows = train_sft(cfg(tiny_policy_dir, data, out, eval_data=str(data), epochs=6, batch_size=2, lr=3e-3,
                         lr_schedule="constant"))
    assert [r["epoch"] for r in rows] == list(range(7))
    assert rows[-1]["eval_loss"] < 0.5 * rows[0]["eval_loss"]
    assert all(r["tokens_per_s"] > 0 for r in rows[1:])
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in logged] == list(range(7))
    # plain transformers and ppolm (as `ppolm ppo --model` does) both load it, with its tokenizer
    AutoModelForCausalLM.from_pretrained(out)
    tok = models.load_tokenizer(out)
    model = models.load_causal_lm(out, tokenizer=tok)
    prompt = tok.apply_chat_template([{"role": "user", "content": MEMO[0]["prompt"]}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    gen = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    assert "banana" in tok.decode(gen[0, ids.shape[1]:])
    assert (out / "sft_config.yaml").is_file()


def test_seeded_split_parquet_and_datasets_dir(tiny_policy_dir, tmp_path):
    import datasets

    rows = [{"prompt": f"Say {w}", "response": w} for w in "red green blue cyan pink gold grey lime teal navy".split()]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "ds"))
    a = train_sft(cfg(tiny_policy_dir, tmp_path / "d.parquet", tmp_path / "a", epochs=1, eval_fraction=0.2))
    b = train_sft(cfg(tiny_policy_dir, tmp_path / "ds", tmp_path / "b", epochs=1, eval_fraction=0.2))
    assert a[0]["eval_loss"] == pytest.approx(b[0]["eval_loss"])  # same seeded held-out rows
    assert a[-1]["tokens"] == b[-1]["tokens"]


def test_lora_merged_and_adapter_only(tiny_policy_dir, tmp_path):
    from safetensors.torch import load_file

    data = write_jsonl(tmp_path / "memo.jsonl", MEMO)
    train_sft(cfg(tiny_policy_dir, data, tmp_path / "merged", lora_r=4, epochs=1, eval_fraction=0))
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    base = load_file(str(tiny_policy_dir / "model.safetensors"))
    assert set(merged) == set(base) and not all(torch.equal(merged[k], base[k]) for k in base)
    train_sft(cfg(tiny_policy_dir, data, tmp_path / "adapter", lora_r=4, epochs=1, eval_fraction=0,
                  merge_lora=False))
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


def run_cli(args, capsys):
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


@pytest.mark.parametrize("rows,needle", [
    ([{"prompt": "hi"}], "no 'response' column (columns: prompt)"),
    ([{"question": "hi", "answer": "yo"}], "no 'prompt' and 'response' column"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], "must end with an assistant turn"),
    ([{"prompt": "hi", "response": ""}], "'response' must be a non-empty string"),
    ([], "holds no rows"),
])
def test_bad_data_is_one_line_exit_2(tiny_policy_dir, tmp_path, capsys, rows, needle):
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    code, line = run_cli(["sft", "--model", str(tiny_policy_dir), "--data", str(data), "--output-dir",
                          str(tmp_path / "o"), "--quiet"], capsys)
    assert code == 2 and line.startswith("error: ") and needle in line, line


def test_output_dir_with_files_needs_overwrite(tiny_policy_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "memo.jsonl", MEMO)
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    args = ["sft", "--model", str(tiny_policy_dir), "--data", str(data), "--output-dir", str(out), "--quiet",
            "--epochs", "1", "--precision", "fp32"]
    code, line = run_cli(args, capsys)
    assert code == 2 and "--overwrite" in line
    code, _ = run_cli(args + ["--overwrite"], capsys)
    assert code == 0 and not (out / "keep.txt").exists() and (out / "config.json").is_file()


def test_missing_data_option(capsys):
    code, line = run_cli(["sft"], capsys)
    assert code == 2 and "--data FILE is required" in line
    with pytest.raises(PPOLMError, match="eval-fraction"):
        config.build(SFTConfig, {"data": "x.jsonl", "eval_fraction": 1.5})
    with pytest.raises(PPOLMError, match="holds the --model input"):  # --overwrite would delete the model first
        config.build(SFTConfig, {"data": "x.jsonl", "model": "runs/a", "output_dir": "runs/a", "overwrite": True})


@pytest.mark.parametrize("command", ["sft", "reward"])
def test_crash_safety_options_are_documented(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--save-every", "--keep-last", "--resume", "--max-skipped-updates"):
        assert flag in text
    assert "Write a resumable checkpoint every N optimiser steps" in text
