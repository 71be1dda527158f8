"""Supervised fine-tuning (``ppolm sft``): the first stage of the InstructGPT pipeline.

A causal LM learns to continue each prompt with its demonstration. The loss counts response
tokens only: the prompt is context the model will always be given, so fitting it would spend
capacity on text the policy never has to produce. Each example is encoded exactly as PPO later
samples (chat template with the generation prompt, then the response and EOS), so the SFT model
starts PPO already ending its answers with EOS.

The optimiser loop and its helpers (split, progress bar, optimiser, :class:`ppolm.trainloop.TrainLoop`:
checkpoints, ``--resume``, Ctrl-C/SIGTERM, the non-finite guard) are in :mod:`ppolm.trainloop`,
shared with :mod:`ppolm.reward_train` and :mod:`ppolm.dpo`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ppolm import atomic, checkpoint, distributed, models
from ppolm.config_sections import PolicyTrainOptions
from ppolm.data import check_messages, encode_prompt, read_rows
from ppolm.errors import PPOLMError
from ppolm.models import output_logits, position_ids_from_mask
from ppolm.rollout import backbone
from ppolm.rundir import OutputDir
from ppolm.runtime import resolve_device, resolve_precision, seed_everything
from ppolm.trainloop import (
    TrainLoop,
    apply_lora,
    autocast,
    check_common,
    commit_output_dir,
    make_optimizer,
    parallel,
    saveable,
    split_rows,
)


@dataclass
class SFTConfig(PolicyTrainOptions):
    """Everything an SFT run needs; ``train_sft(config.build(SFTConfig, {...}))`` from Python."""

    model: str = "smollm2-135m-instruct"
    """Model to fine-tune: a Hugging Face model directory, a .gguf file, or an embedded model name."""
    data: str | None = None
    """Demonstrations (.jsonl/.json/.parquet/.csv or a datasets directory): 'prompt' + 'response' (or 'completion'), or 'messages'. more: docs/pipeline.md"""
    eval_data: str | None = None
    """Held-out demonstrations for the eval loss; default: a seeded --eval-fraction of --data."""
    output_dir: str = "runs/sft"
    """Where the fine-tuned model (Hugging Face format, with tokenizer), metrics.jsonl and sft_config.yaml go."""
    epochs: int = 3
    """Passes over the training data."""
    batch_size: int = 8
    """Demonstrations per optimiser step."""
    lr: float = 2e-5
    """AdamW learning rate (full fine-tuning; LoRA wants ~10x more)."""
    max_length: int = 512
    """Longest prompt+response in tokens; longer responses are cut (the cut ones lose their EOS)."""

    def validate(self) -> None:
        check_common(self)


# ------------------------------------------------------------------------------------ SFT data

@dataclass
class Example:
    ids: list[int]
    """Prompt then response token ids (the response ends with EOS unless it was cut)."""
    n_prompt: int
    """The first n_prompt ids are the prompt: they are context only, never a loss target."""


def parse_demo(row: dict[str, Any], where: str) -> tuple[Any, str]:
    """A row -> (prompt as text or chat list, response text)."""

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


def response_logits(model: Any, ids: torch.Tensor, mask: torch.Tensor, loss_mask: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits at the positions that predict a response token: (logits (N, V) float32, targets (N,),
    sel (B, T - 1) bool), N = the number of response tokens (ids, mask, loss_mask: (B, T) from :func:`collate`).

    The LM head runs only on the positions that predict a response token (position t predicts
    token t + 1), so prompt tokens are never targets and no (B, T, V) logits are materialised.
    The N rows follow ``sel`` in row-major order, so ``sel.nonzero()[:, 0]`` is the sequence of each.
    """

    hidden = backbone(model)(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                             use_cache=False).last_hidden_state
    sel = loss_mask[:, 1:].bool()
    # (N, V) fp32 logits through the model's own output path (models.output_logits)
    return output_logits(model, hidden[:, :-1][sel]), ids[:, 1:][sel], sel


def sft_loss(model: Any, ids: torch.Tensor, mask: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over response tokens (:func:`response_logits`), and their count."""
    logits, targets, sel = response_logits(model, ids, mask, loss_mask)
    return F.cross_entropy(logits, targets, reduction="sum"), int(sel.sum())


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
    """Fine-tune as configured and save the model; returns the metrics rows (one per epoch, epoch 0 = before).

    Stopped by Ctrl-C/SIGTERM, it saves a checkpoint and returns the rows so far without saving the model
    (continue with ``resume=True``)."""
    return _train_sft(cfg)[0]


def _train_sft(cfg: SFTConfig) -> tuple[list[dict[str, Any]], bool]:
    cfg.validate()
    out = Path(cfg.output_dir)
    device = resolve_device(cfg.device)
    cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, device))  # 'auto' -> bf16|fp32
    out_dir = OutputDir(out, "sft_config.yaml")
    out_dir.check(cfg)  # checks only: nothing changes before the inputs loaded
    seed_everything(cfg.seed)
    tok = models.load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle)
    train = load_demos(cfg.data, tok, cfg.chat_template, cfg.max_length)  # type: ignore[arg-type]
    if cfg.eval_data:
        held = load_demos(cfg.eval_data, tok, cfg.chat_template, cfg.max_length)
    else:
        train, held = split_rows(train, cfg.eval_fraction, cfg.seed)
    if not train:
        raise PPOLMError(f"{cfg.data} leaves no training rows after the held-out split; add rows or lower --eval-fraction")
    device = distributed.init(cfg.device, cfg.dist_timeout)  # torchrun: join the others (ppolm/distributed.py)
    model = models.load_causal_lm(cfg.model, dtype=torch.float32, device=device, tokenizer=tok,
                                  trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle)
    if cfg.lora_r > 0:
        model = apply_lora(model, cfg, "CAUSAL_LM")
    commit_output_dir(out_dir, cfg)
    forward = parallel(model, cfg, device)  # DDP/FSDP with several processes
    steps_per_epoch = math.ceil(len(train) / cfg.batch_size)
    opt, sched = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg, steps_per_epoch * cfg.epochs)
    pad = tok.pad_token_id

    def held_loss() -> float:
        with torch.no_grad():  # (DDP: a forward without grad expects no backward)
            return forward(eval_loss, model, held, cfg.batch_size, pad, device, cfg.precision)

    def first_row() -> dict[str, Any] | None:
        return {"epoch": 0, "eval_loss": held_loss()} if held else None

    def step_fn(idx: list[int], forward: Any) -> tuple[torch.Tensor, int, dict[str, int]]:
        ids, mask, loss_mask = collate([train[j] for j in idx], pad, device)
        with autocast(device, cfg.precision):
            s, n = forward(sft_loss, model, ids, mask, loss_mask)
        return s / max(n, 1), n, {"tokens": int(mask.sum())}

    def epoch_row(epoch: int, acc: dict[str, Any]) -> dict[str, Any]:
        row: dict[str, Any] = {"epoch": epoch, "train_loss": acc["loss_sum"] / acc["loss_n"] if acc["loss_n"] else None}
        if held:
            row["eval_loss"] = held_loss()
        return row

    loop = TrainLoop(cfg, out, model, opt, sched, len(train), "sft", step_fn, epoch_row, first_row, forward)
    if not loop.run():
        return loop.rows, False

    final = saveable(model, cfg, tok)
    if distributed.is_main():
        save_model(final, tok, out, merge=cfg.merge_lora)
    distributed.barrier()
    return loop.rows, True


def save_model(model: Any, tok: Any, out: Path, merge: bool) -> None:
    """Save in Hugging Face format (safetensors) with the tokenizer; LoRA is merged unless ``merge`` is off.

    The files are written to a temporary directory, flushed, then moved over the old ones one by one, so
    a full disk or a permission problem leaves the previous files (and the checkpoints) as they were."""
    from transformers.utils import logging as hf_logging


    hf_logging.disable_progress_bar()  # transformers' "Writing model shards" bar
    bad = checkpoint.first_non_finite(model.named_parameters())
    if bad:
        raise PPOLMError(f"non-finite weights in {bad}; not saving them; lower --lr")
    if hasattr(model, "merge_and_unload") and merge:
        model = model.merge_and_unload()
    for stale in out.glob(".tmp-model-*"):  # left by a process killed while saving
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out / f".tmp-model-{os.getpid()}"
    try:
        tmp.mkdir()
        with atomic.safetensors_os_errors(tmp):
            models.save_pretrained(model, tok, tmp)
        files = sorted(f for f in tmp.iterdir() if f.is_file())
        for f in files:
            atomic.fsync_file(f)
        for f in files:
            os.replace(f, out / f.name)
        atomic.fsync_dir(out)
    except OSError as e:
        raise checkpoint.disk_error(e, out, "the final model") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(cfg: SFTConfig) -> int:
    rows, finished = _train_sft(cfg)
    if not finished:
        return 130
    last = rows[-1]
    held = f", held-out loss {rows[0]['eval_loss']:.3f} -> {last['eval_loss']:.3f}" if "eval_loss" in last else ""
    print(f"done: {cfg.epochs} epochs{held}; model saved to {cfg.output_dir} "
          f"(use it with `ppolm reward --model {cfg.output_dir}` or `ppolm ppo --model {cfg.output_dir}`)")
    return 0
