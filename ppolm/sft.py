"""Supervised fine-tuning (``ppolm sft``): the first stage of the InstructGPT pipeline.

A causal LM learns to continue each prompt with its demonstration. The loss counts response
tokens only: the prompt is context the model will always be given, so fitting it would spend
capacity on text the policy never has to produce. Each example is encoded exactly as PPO later
samples (chat template with the generation prompt, then the response and EOS), so the SFT model
starts PPO already ending its answers with EOS.

The small training helpers here (output dir, device, split, progress bar, optimiser) are shared
with :mod:`ppolm.reward_train`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from ppolm.errors import PPOLMError


@dataclass
class SFTConfig:
    """Everything an SFT run needs; ``train_sft(config.build(SFTConfig, {...}))`` from Python."""

    model: str = "smollm2-135m-instruct"
    """Model to fine-tune: a Hugging Face model directory, a .gguf file, or an embedded model name."""
    data: str | None = None
    """Demonstrations: .jsonl/.json/.parquet/.csv or a saved datasets directory, with 'prompt' + 'response' (or 'completion') columns, or a 'messages' chat list whose last turn is the assistant's answer."""
    eval_data: str | None = None
    """Held-out demonstrations for the eval loss; default: a seeded --eval-fraction of --data."""
    eval_fraction: float = 0.1
    """Fraction of --data held out when --eval-data is not given (0 = no eval)."""
    output_dir: str = "runs/sft"
    """Where the fine-tuned model (Hugging Face format, with tokenizer), metrics.jsonl and sft_config.yaml go."""
    epochs: int = 3
    """Passes over the training data."""
    batch_size: int = 8
    """Demonstrations per optimiser step."""
    lr: float = 2e-5
    """AdamW learning rate (full fine-tuning; LoRA wants ~10x more)."""
    lr_schedule: Literal["constant", "linear"] = "linear"
    """Constant, or linear decay to 0 over the run."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping (global norm)."""
    max_length: int = 512
    """Longest prompt+response in tokens; longer responses are cut (the cut ones lose their EOS)."""
    chat_template: bool = True
    """Apply the tokenizer's chat template to text prompts (messages always use it), as `ppolm ppo` does."""
    lora_r: int = 0
    """LoRA rank (peft); 0 = full fine-tuning."""
    lora_alpha: float = 32.0
    """LoRA scaling alpha."""
    lora_target: str = "all-linear"
    """LoRA target modules (peft syntax: 'all-linear' or comma-separated module names)."""
    merge_lora: bool = True
    """With LoRA, save the merged full model (loadable by `ppolm ppo --model`); off: save only the adapter."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """bf16: fp32 master weights with bf16 autocast; fp32: everything in float32."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device: auto picks cuda when available."""
    seed: int = 0
    """Random seed (data split, shuffling, LoRA init)."""
    overwrite: bool = False
    """Allow writing into an --output-dir that already holds files (they are replaced)."""
    quiet: bool = False
    """No progress bar; one log line per epoch instead."""
    trust_remote_code: bool = False
    """Allow model code shipped inside a model directory to run."""
    allow_pickle: bool = False
    """Accept pickle-based weights (.bin/.pt), which can run arbitrary code when loaded."""

    def validate(self) -> None:
        check_common(self)


def check_common(cfg: Any) -> None:
    """The validations SFT and reward training share; one line each."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise PPOLMError(msg)

    need(cfg.data is not None, "--data FILE is required: the training file (see `--help` for the columns)")
    need(cfg.epochs >= 1 and cfg.batch_size >= 1, "--epochs and --batch-size must be at least 1")
    need(cfg.lr > 0 and cfg.max_grad_norm > 0, "--lr and --max-grad-norm must be > 0")
    need(0 <= cfg.eval_fraction < 1, f"--eval-fraction must be in [0, 1); got {cfg.eval_fraction}")
    need(cfg.max_length >= 8, f"--max-length must be at least 8; got {cfg.max_length}")
    need(cfg.lora_r >= 0, f"--lora-r must be >= 0; got {cfg.lora_r}")
    out = Path(cfg.output_dir).expanduser().resolve()
    for name, p in (("--model", cfg.model), ("--data", cfg.data), ("--eval-data", cfg.eval_data)):
        if p is not None and (out == Path(p).expanduser().resolve() or out in Path(p).expanduser().resolve().parents):
            raise PPOLMError(f"--output-dir {cfg.output_dir} holds the {name} input, which writing there would "
                             "replace; choose another --output-dir")


# ------------------------------------------------------------------------- shared training helpers

def prepare_output_dir(out: Path, overwrite: bool) -> None:
    """Refuse to mix a new model with old files unless --overwrite (then the dir is emptied)."""
    if out.exists() and not out.is_dir():
        raise PPOLMError(f"--output-dir {out} is a file; choose a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise PPOLMError(f"--output-dir {out} already holds files; pass --overwrite to replace them "
                             "or choose a new directory")
        if (out / ".git").exists() or out.resolve() == Path.cwd().resolve() or out.resolve() == Path.home():
            raise PPOLMError(f"refusing to empty {out} (a repository, the working or home directory); "
                             "choose a dedicated --output-dir")
        for p in out.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PPOLMError(f"cannot create --output-dir {out} ({e.strerror}); choose a writable path") from None


def split_rows(rows: list[Any], fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """Seeded held-out split: (train, eval). At least one row each when there are two or more."""
    n_eval = 0 if fraction <= 0 or len(rows) < 2 else min(len(rows) - 1, max(1, round(len(rows) * fraction)))
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    return [rows[i] for i in perm[n_eval:]], [rows[i] for i in sorted(perm[:n_eval])]


def make_optimizer(params: list[torch.nn.Parameter], cfg: Any, total_steps: int):
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    decay = (lambda s: max(0.0, 1.0 - s / total_steps)) if cfg.lr_schedule == "linear" else (lambda s: 1.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, decay)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


class Bar:
    """A rich progress bar over optimiser steps (or nothing, with --quiet); same style as ppo."""

    def __init__(self, desc: str, total: int, quiet: bool):
        self.progress = None
        if not quiet:
            from rich import progress as rp

            self.progress = rp.Progress(rp.TextColumn("[bold]{task.description}"), rp.BarColumn(),
                                        rp.MofNCompleteColumn(), rp.TimeElapsedColumn(), rp.TextColumn("eta"),
                                        rp.TimeRemainingColumn(), rp.TextColumn("{task.fields[live]}"))
            self.progress.start()
            self.task = self.progress.add_task(desc, total=total, live="")

    def advance(self, live: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, advance=1, live=live)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def log_epoch(out: Path, row: dict[str, Any]) -> None:
    """Append one row to metrics.jsonl and print it as one line (it stays visible above the bar)."""
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    text = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
    print(text, file=sys.stderr, flush=True)


def apply_lora(model: Any, cfg: Any, task_type: str) -> Any:
    from peft import LoraConfig, get_peft_model

    targets: Any = cfg.lora_target if cfg.lora_target == "all-linear" else cfg.lora_target.split(",")
    return get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                            target_modules=targets, task_type=task_type))


# ------------------------------------------------------------------------------------ SFT data

@dataclass
class Example:
    ids: list[int]
    """Prompt then response token ids (the response ends with EOS unless it was cut)."""
    n_prompt: int
    """The first n_prompt ids are the prompt: they are context only, never a loss target."""


def parse_demo(row: dict[str, Any], where: str) -> tuple[Any, str]:
    """A row -> (prompt as text or chat list, response text)."""
    from ppolm.data import check_messages

    if row.get("messages") is not None:
        msgs = check_messages(row["messages"], where)
        if msgs[-1]["role"] != "assistant" or len(msgs) < 2:
            raise PPOLMError(f"{where}: 'messages' must end with an assistant turn (the demonstration) "
                             "after at least one user turn")
        return msgs[:-1], msgs[-1]["content"]
    resp_col = "response" if "response" in row else "completion" if "completion" in row else None
    if "prompt" not in row or resp_col is None:
        missing = " and ".join(f"'{c}'" for c, ok in (("prompt", "prompt" in row), ("response", resp_col))
                               if not ok)
        raise PPOLMError(f"{where} has no {missing} column (columns: {', '.join(map(str, row))}); a demonstration "
                         "needs 'prompt' + 'response' or a 'messages' chat list")
    prompt, response = row["prompt"], row[resp_col]
    if isinstance(prompt, list):
        prompt = check_messages(prompt, where)
    elif not isinstance(prompt, str) or not prompt.strip():
        raise PPOLMError(f"{where}: 'prompt' must be a non-empty string or a chat-message list")
    if isinstance(response, list):  # TRL conversational completion: [{"role": "assistant", ...}]
        response = check_messages(response, where)[-1]["content"]
    if not isinstance(response, str) or not response.strip():
        raise PPOLMError(f"{where}: '{resp_col}' must be a non-empty string")
    return prompt, response


def encode_response(prompt_ids: list[int], response: str, tok: Any, max_length: int, where: str) -> list[int]:
    """prompt + response + EOS, the response cut to fit ``max_length``; the same layout as a PPO rollout."""
    if len(prompt_ids) >= max_length:
        raise PPOLMError(f"{where}: the prompt is {len(prompt_ids)} tokens, not shorter than --max-length "
                         f"{max_length}; shorten it or raise --max-length")
    resp = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return (prompt_ids + resp)[:max_length]


def load_demos(path: str, tok: Any, chat_template: bool, max_length: int) -> list[Example]:
    from ppolm.data import encode_prompt, read_rows

    out = []
    for i, row in enumerate(read_rows(path, text_column="prompt"), start=1):
        where = f"{path} row {i}"
        prompt, response = parse_demo(row, where)
        p_ids = encode_prompt(prompt, tok, chat_template)
        out.append(Example(encode_response(p_ids, response, tok, max_length, where), len(p_ids)))
    return out


def collate(examples: list[Example], pad_id: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Right-pad -> (ids, attention_mask, loss_mask), each (B, T); loss_mask is 1 on response tokens."""
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        n = len(e.ids)
        ids[i, :n] = torch.tensor(e.ids)
        mask[i, :n] = 1
        loss_mask[i, e.n_prompt:n] = 1
    return ids.to(device), mask.to(device), loss_mask.to(device)


def sft_loss(model: Any, ids: torch.Tensor, mask: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over response tokens, and their count.

    The LM head runs only on the positions that predict a response token (position t predicts
    token t + 1), so prompt tokens are never targets and no (B, T, V) logits are materialised.
    """
    from ppolm.models import position_ids_from_mask
    from ppolm.rollout import backbone, lm_head

    hidden = backbone(model)(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                             use_cache=False).last_hidden_state
    sel = loss_mask[:, 1:].bool()
    logits = lm_head(model)(hidden[:, :-1][sel]).float()  # (N, V)
    return F.cross_entropy(logits, ids[:, 1:][sel], reduction="sum"), int(sel.sum())


@torch.no_grad()
def eval_loss(model: Any, examples: list[Example], batch_size: int, pad_id: int, device: torch.device,
              precision: str) -> float:
    """Mean per-token loss over the response tokens of ``examples``."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        with autocast(device, precision):
            s, n = sft_loss(model, *collate(examples[i:i + batch_size], pad_id, device))
        total, count = total + float(s), count + n
    return total / max(count, 1)


# ------------------------------------------------------------------------------------ training

def train_sft(cfg: SFTConfig) -> list[dict[str, Any]]:
    """Fine-tune as configured and save the model; returns the metrics rows (one per epoch, epoch 0 = before)."""
    from ppolm import config, models
    from ppolm.ppo import resolve_device, resolve_precision, seed_everything

    cfg.validate()
    out = Path(cfg.output_dir)
    prepare_output_dir(out, cfg.overwrite)
    device = resolve_device(cfg.device)
    cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, device))  # 'auto' -> bf16|fp32
    seed_everything(cfg.seed)
    tok = models.load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle)
    train = load_demos(cfg.data, tok, cfg.chat_template, cfg.max_length)  # type: ignore[arg-type]
    if cfg.eval_data:
        held = load_demos(cfg.eval_data, tok, cfg.chat_template, cfg.max_length)
    else:
        train, held = split_rows(train, cfg.eval_fraction, cfg.seed)
    if not train:
        raise PPOLMError(f"{cfg.data} leaves no training rows after the held-out split; add rows or lower --eval-fraction")
    model = models.load_causal_lm(cfg.model, dtype=torch.float32, device=device, tokenizer=tok,
                                  trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle)
    if cfg.lora_r > 0:
        model = apply_lora(model, cfg, "CAUSAL_LM")
    config.save_yaml(cfg, out / "sft_config.yaml")
    steps_per_epoch = math.ceil(len(train) / cfg.batch_size)
    opt, sched = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg, steps_per_epoch * cfg.epochs)
    pad = tok.pad_token_id

    rows = []
    if held:
        rows.append({"epoch": 0, "eval_loss": eval_loss(model, held, cfg.batch_size, pad, device, cfg.precision)})
        log_epoch(out, rows[-1])
    bar = Bar("sft", steps_per_epoch * cfg.epochs, cfg.quiet)
    gen = torch.Generator().manual_seed(cfg.seed)
    try:
        for epoch in range(1, cfg.epochs + 1):
            model.train()
            t0, tokens, loss_sum, loss_n = time.perf_counter(), 0, 0.0, 0
            order = torch.randperm(len(train), generator=gen).tolist()
            for b in range(0, len(order), cfg.batch_size):
                ids, mask, loss_mask = collate([train[j] for j in order[b:b + cfg.batch_size]], pad, device)
                with autocast(device, cfg.precision):
                    s, n = sft_loss(model, ids, mask, loss_mask)
                loss = s / max(n, 1)
                value = loss.item()
                if not math.isfinite(value):
                    raise PPOLMError(f"the training loss became {value} in epoch {epoch}; lower --lr "
                                     "or use --precision fp32")
                loss.backward()
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.max_grad_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                tokens += int(mask.sum())
                loss_sum, loss_n = loss_sum + value * n, loss_n + n
                bar.advance(f"epoch {epoch}  loss {value:.3f}")
            dt = time.perf_counter() - t0
            row: dict[str, Any] = {"epoch": epoch, "train_loss": loss_sum / max(loss_n, 1)}
            if held:
                row["eval_loss"] = eval_loss(model, held, cfg.batch_size, pad, device, cfg.precision)
            row.update(tokens=tokens, tokens_per_s=tokens / dt, time_s=dt)
            rows.append(row)
            log_epoch(out, row)
    finally:
        bar.close()
    save_model(model, tok, out, merge=cfg.merge_lora)
    return rows


def save_model(model: Any, tok: Any, out: Path, merge: bool) -> None:
    """Save in Hugging Face format (safetensors) with the tokenizer; LoRA is merged unless ``merge`` is off."""
    from transformers.utils import logging as hf_logging

    from ppolm.models import save_pretrained

    hf_logging.disable_progress_bar()  # transformers' "Writing model shards" bar
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise PPOLMError(f"non-finite weights in {name}; not saving them; lower --lr")
    if hasattr(model, "merge_and_unload") and merge:
        model = model.merge_and_unload()
    save_pretrained(model, tok, out)


def run(cfg: SFTConfig) -> int:
    rows = train_sft(cfg)
    last = rows[-1]
    held = f", held-out loss {rows[0]['eval_loss']:.3f} -> {last['eval_loss']:.3f}" if "eval_loss" in last else ""
    print(f"done: {cfg.epochs} epochs{held}; model saved to {cfg.output_dir} "
          f"(use it with `ppolm reward --model {cfg.output_dir}` or `ppolm ppo --model {cfg.output_dir}`)")
    return 0
