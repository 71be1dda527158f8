"""Supervised fine-tuning (``ppolm sft``): the first stage of the InstructGPT pipeline.

A causal LM learns to continue each prompt with its demonstration. The loss counts response
tokens only: the prompt is context the model will always be given, so fitting it would spend
capacity on text the policy never has to produce. Each example is encoded exactly as PPO later
samples (chat template with the generation prompt, then the response and EOS), so the SFT model
starts PPO already ending its answers with EOS.

The training helpers here (output dir, split, progress bar, optimiser, and :class:`TrainLoop`:
checkpoints, ``--resume``, Ctrl-C/SIGTERM, the non-finite guard) are shared with
:mod:`ppolm.reward_train`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from ppolm import checkpoint
from ppolm.errors import FLOAT32_MAX, PPOLMError
from ppolm.runtime import RUN_CONTROL, config_difference, prepare_output_dir, write_config  # noqa: F401  (shared)


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
    """Constant, or linear decay to 0 over the run (--resume then needs the same --epochs; a constant schedule lets --resume add epochs)."""
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
    save_every: int = 50
    """Write a resumable checkpoint every N optimiser steps (and at the end, and on Ctrl-C/SIGTERM)."""
    keep_last: int = 2
    """Keep only the newest K checkpoints."""
    resume: bool = False
    """Continue from the newest valid checkpoint in --output-dir (same options as the run it continues)."""
    overwrite: bool = False
    """Allow writing into an --output-dir that already holds files (they are replaced once the data and model have loaded)."""
    max_skipped_updates: int = 3
    """Abort after this many consecutive updates skipped for a non-finite (NaN/inf) loss or gradient."""
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
    need(cfg.lr <= FLOAT32_MAX, f"--lr {cfg.lr:g} is too large for float32 (the optimiser's type); use a value "
         f"<= {FLOAT32_MAX:.3g} (typical: 1e-6 .. 1e-3)")
    need(0 <= cfg.eval_fraction < 1, f"--eval-fraction must be in [0, 1); got {cfg.eval_fraction}")
    need(cfg.max_length >= 8, f"--max-length must be at least 8; got {cfg.max_length}")
    need(cfg.lora_r >= 0, f"--lora-r must be >= 0; got {cfg.lora_r}")
    for name, v in (("save-every", cfg.save_every), ("keep-last", cfg.keep_last),
                    ("max-skipped-updates", cfg.max_skipped_updates)):
        need(v >= 1, f"--{name} must be at least 1; got {v}")
    need(not (cfg.resume and cfg.overwrite), "--resume and --overwrite exclude each other; pick one")
    out = Path(cfg.output_dir).expanduser().resolve()
    for name, p in (("--model", cfg.model), ("--data", cfg.data), ("--eval-data", cfg.eval_data)):
        if p is not None and (out == Path(p).expanduser().resolve() or out in Path(p).expanduser().resolve().parents):
            raise PPOLMError(f"--output-dir {cfg.output_dir} holds the {name} input, which writing there would "
                             "replace; choose another --output-dir")


# ------------------------------------------------------------------------- shared training helpers

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

    def __init__(self, desc: str, total: int, quiet: bool, done: int = 0):
        self.progress = None
        if not quiet:
            from rich import progress as rp

            self.progress = rp.Progress(rp.TextColumn("[bold]{task.description}"), rp.BarColumn(),
                                        rp.MofNCompleteColumn(), rp.TimeElapsedColumn(), rp.TextColumn("eta"),
                                        rp.TimeRemainingColumn(), rp.TextColumn("{task.fields[live]}"))
            self.progress.start()
            self.task = self.progress.add_task(desc, total=total, completed=done, live="")

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


def write_rows(out: Path, rows: list[dict[str, Any]]) -> None:
    """Replace metrics.jsonl with ``rows`` atomically (a resumed run starts from its checkpoint's rows)."""
    path = out / "metrics.jsonl"
    tmp = path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)


def apply_lora(model: Any, cfg: Any, task_type: str) -> Any:
    from peft import LoraConfig, get_peft_model

    targets: Any = cfg.lora_target if cfg.lora_target == "all-linear" else cfg.lora_target.split(",")
    return get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                            target_modules=targets, task_type=task_type))


StepFn = Callable[[list[int]], tuple[torch.Tensor, int, dict[str, int]]]
"""Training rows of one batch -> (mean loss, its weight in the epoch's train_loss, counters to add up)."""


class TrainLoop:
    """The optimiser loop SFT and reward training share, crash-safe like ``ppolm ppo``.

    * data order: one seeded permutation per epoch (drawn in sequence from ``seed``);
    * the non-finite guard: a NaN/inf loss or gradient skips that update (the schedule still
      advances), is counted in ``guard/skipped_updates``, warns once per cause, and aborts after
      ``--max-skipped-updates`` consecutive skips; non-finite weights are never saved;
    * checkpoints every ``--save-every`` optimiser steps, at the end and on Ctrl-C/SIGTERM
      (:func:`ppolm.checkpoint.save`: atomic, manifest with checksums, the newest ``--keep-last``),
      holding the trained parameters (those with ``requires_grad``), optimiser and scheduler
      state, the position in the data order, the running epoch sums, every RNG state and the
      epoch rows so far; ``--resume`` continues bit for bit from the newest valid one.
    """

    def __init__(self, cfg: Any, out: Path, model: Any, opt: torch.optim.Optimizer, sched: Any, n_train: int,
                 desc: str, step_fn: StepFn, epoch_row: Callable[[int, dict[str, Any]], dict[str, Any]],
                 first_row: Callable[[], dict[str, Any] | None]):
        self.cfg, self.out, self.model, self.opt, self.sched = cfg, out, model, opt, sched
        self.n_train, self.desc = n_train, desc
        self.step_fn, self.epoch_row, self.first_row = step_fn, epoch_row, first_row
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.steps_per_epoch = math.ceil(n_train / cfg.batch_size)
        self.total = self.steps_per_epoch * cfg.epochs
        self.step = 0  # optimiser steps done (skipped ones included)
        self.rows: list[dict[str, Any]] = []
        self.acc: dict[str, Any] = {}
        self.order: list[int] = []
        self.skipped_total = self.consecutive_skips = 0
        self.skip_cause = ""
        self.warned: set[str] = set()

    # --------------------------------------------------------------------------- state
    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {f"model.{n}": p for n, p in self.named}
        t_opt, m_opt = checkpoint.optimizer_state(self.opt, "opt")
        t_rng, m_rng = checkpoint.rng_state()
        tensors.update(t_opt | t_rng)
        mid_epoch = self.step % self.steps_per_epoch != 0
        meta = {"next_step": self.step, "epochs_done": self.step // self.steps_per_epoch,
                "batch_in_epoch": self.step % self.steps_per_epoch, "n_train": self.n_train,
                "batch_size": self.cfg.batch_size, "order": self.order if mid_epoch else None,
                "epoch_sums": self.acc if mid_epoch else None, "rows": self.rows, "opt": m_opt,
                "sched": self.sched.state_dict(), "rng": m_rng, "skipped_total": self.skipped_total,
                "consecutive_skips": self.consecutive_skips}
        return tensors, meta

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        if meta["n_train"] != self.n_train:
            raise PPOLMError(f"the training data has {self.n_train} rows now but had {meta['n_train']} when the "
                             "checkpoint was written; resume with the same --data, or start again with --overwrite")
        with torch.no_grad():
            for n, p in self.named:
                p.copy_(tensors[f"model.{n}"])
        checkpoint.load_optimizer_state(self.opt, "opt", tensors, meta["opt"])
        self.sched.load_state_dict(meta["sched"])
        checkpoint.set_rng_state(tensors, meta["rng"])
        self.step, self.rows = meta["next_step"], meta["rows"]
        self.acc, self.order = meta["epoch_sums"] or {}, meta["order"] or []
        self.skipped_total, self.consecutive_skips = meta["skipped_total"], meta["consecutive_skips"]

    def resume(self) -> None:
        found = checkpoint.load_latest(self.out / "checkpoints")
        if not found:
            print(f"no checkpoint in {self.out}; starting from step 0", file=sys.stderr)
            return
        path, tensors, meta = found
        try:
            self.load_state(tensors, meta)
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            raise PPOLMError(f"checkpoint {path} does not match this model or version ({type(e).__name__}: "
                             f"{str(e)[:120]}); resume with the same options, or start again with --overwrite"
                             ) from None
        print(f"resuming from {path} (step {self.step})", file=sys.stderr)

    def save_checkpoint(self) -> None:
        tensors, meta = self.state()
        checkpoint.save(self.out / "checkpoints", self.step, tensors, meta, self.cfg.keep_last)

    # --------------------------------------------------------------------------- one update
    def warn_once(self, key: str, msg: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            checkpoint.warn(msg)

    def update(self, loss: torch.Tensor) -> float | None:
        """Backward, clip and step; skip the update on a non-finite loss or gradient. The loss value, or None."""
        value = loss.item()
        cause = None
        if not math.isfinite(value):
            cause, key = f"non-finite loss ({value})", "loss"
        else:
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_([p for _, p in self.named], self.cfg.max_grad_norm)
            if torch.isfinite(norm):
                self.opt.step()
            else:
                cause, key = "non-finite gradient", "grad"
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()  # a skipped update still advances the schedule, as an applied one would
        if cause is None:
            self.consecutive_skips = 0
            return value
        self.skipped_total += 1
        self.consecutive_skips += 1
        epoch = self.step // self.steps_per_epoch + 1
        self.skip_cause = f"update {self.step + 1} (epoch {epoch}): {cause}"
        self.warn_once(key, f"{self.skip_cause}; update skipped (counted in guard/skipped_updates)")
        return None

    # --------------------------------------------------------------------------- the loop
    def run(self) -> bool:
        """Train to the end (True) or until Ctrl-C/SIGTERM (False, after saving a checkpoint)."""
        cfg, out = self.cfg, self.out
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        if cfg.resume:
            self.resume()
        stop = {"requested": False}

        def on_signal(signum: int, frame: Any) -> None:
            if stop["requested"]:
                raise KeyboardInterrupt
            stop["requested"] = True
            print("\nstopping after this step to save a checkpoint (Ctrl-C again to abort without saving)",
                  file=sys.stderr, flush=True)

        handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} \
            if threading.current_thread() is threading.main_thread() else {}
        bar = None
        try:
            write_rows(out, self.rows)  # a resumed run redoes the rows after its checkpoint: never twice
            if self.step == 0 and not self.rows:
                first = self.first_row()
                if first is not None:
                    self.rows.append(first)
                    log_epoch(out, first)
            gen = torch.Generator().manual_seed(cfg.seed)
            for _ in range(self.step // self.steps_per_epoch):  # the orders of the epochs already done
                torch.randperm(self.n_train, generator=gen)
            if self.step % self.steps_per_epoch and \
                    torch.randperm(self.n_train, generator=gen).tolist() != self.order:  # resumed mid-epoch
                raise PPOLMError("the checkpoint's data order differs from this run's; resume with the same --data, "
                                 "--seed and --eval-fraction, or start again with --overwrite")
            bar = Bar(self.desc, self.total, cfg.quiet, done=min(self.step, self.total))
            self.model.train()
            while self.step < self.total:
                epochs_done, b = divmod(self.step, self.steps_per_epoch)
                if b == 0:
                    self.order = torch.randperm(self.n_train, generator=gen).tolist()
                    self.acc = {"loss_sum": 0.0, "loss_n": 0, "tokens": 0, "time_s": 0.0}
                    self.model.train()
                t0 = time.perf_counter()
                idx = self.order[b * cfg.batch_size:(b + 1) * cfg.batch_size]
                loss, n, counters = self.step_fn(idx)
                value = self.update(loss)
                if value is not None:
                    self.acc["loss_sum"] += value * n
                    self.acc["loss_n"] += n
                for k, v in counters.items():
                    self.acc[k] = self.acc.get(k, 0) + v
                self.acc["time_s"] += time.perf_counter() - t0
                self.step += 1
                bar.advance(f"epoch {epochs_done + 1}  loss {loss.item():.3f}")
                if self.consecutive_skips >= cfg.max_skipped_updates:
                    raise PPOLMError(f"{self.consecutive_skips} consecutive updates skipped (last: {self.skip_cause});"
                                     " lower --lr or use --precision fp32, check the data, then continue from the "
                                     "last checkpoint with --resume")
                bad = checkpoint.first_non_finite(self.named)
                if bad:
                    raise PPOLMError(f"non-finite weights in {bad} after update {self.step}; nothing saved from "
                                     "it. Lower --lr and continue from the last checkpoint with --resume")
                if self.step % self.steps_per_epoch == 0:
                    acc = self.acc
                    row = self.epoch_row(epochs_done + 1, acc)
                    row.update(tokens=acc["tokens"], tokens_per_s=acc["tokens"] / max(acc["time_s"], 1e-9),
                               time_s=acc["time_s"])
                    row["guard/skipped_updates"] = self.skipped_total
                    self.rows.append(row)
                    log_epoch(out, row)
                if self.step % cfg.save_every == 0 or self.step == self.total or stop["requested"]:
                    self.save_checkpoint()
                if stop["requested"]:
                    break
        except OSError as e:
            raise checkpoint.disk_error(e, out) from None
        finally:
            if bar is not None:
                bar.close()
            for s, h in handlers.items():
                signal.signal(s, h)
        if self.step < self.total:
            print(f"interrupted after step {self.step} of {self.total}; checkpoint saved. Continue with the same "
                  "command plus --resume", file=sys.stderr, flush=True)
            return False
        return True


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


def response_logits(model: Any, ids: torch.Tensor, mask: torch.Tensor, loss_mask: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits at the positions that predict a response token: (logits (N, V) float32, targets (N,),
    sel (B, T - 1) bool), N = the number of response tokens (ids, mask, loss_mask: (B, T) from :func:`collate`).

    The LM head runs only on the positions that predict a response token (position t predicts
    token t + 1), so prompt tokens are never targets and no (B, T, V) logits are materialised.
    The N rows follow ``sel`` in row-major order, so ``sel.nonzero()[:, 0]`` is the sequence of each.
    """
    from ppolm.models import output_logits, position_ids_from_mask
    from ppolm.rollout import backbone

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
    from ppolm import models
    from ppolm.runtime import refuse_data_parallel, resolve_device, resolve_precision, seed_everything

    refuse_data_parallel()
    cfg.validate()
    out = Path(cfg.output_dir)
    device = resolve_device(cfg.device)
    cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, device))  # 'auto' -> bf16|fp32
    prepare_output_dir(out, cfg, "sft_config.yaml")  # checks only: nothing changes before the inputs loaded
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
    prepare_output_dir(out, cfg, "sft_config.yaml", commit=True)
    try:
        write_config(cfg, out / "sft_config.yaml")
    except OSError as e:
        raise checkpoint.disk_error(e, out) from None
    steps_per_epoch = math.ceil(len(train) / cfg.batch_size)
    opt, sched = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg, steps_per_epoch * cfg.epochs)
    pad = tok.pad_token_id

    def first_row() -> dict[str, Any] | None:
        return {"epoch": 0, "eval_loss": eval_loss(model, held, cfg.batch_size, pad, device, cfg.precision)} \
            if held else None

    def step_fn(idx: list[int]) -> tuple[torch.Tensor, int, dict[str, int]]:
        ids, mask, loss_mask = collate([train[j] for j in idx], pad, device)
        with autocast(device, cfg.precision):
            s, n = sft_loss(model, ids, mask, loss_mask)
        return s / max(n, 1), n, {"tokens": int(mask.sum())}

    def epoch_row(epoch: int, acc: dict[str, Any]) -> dict[str, Any]:
        row: dict[str, Any] = {"epoch": epoch, "train_loss": acc["loss_sum"] / acc["loss_n"] if acc["loss_n"] else None}
        if held:
            row["eval_loss"] = eval_loss(model, held, cfg.batch_size, pad, device, cfg.precision)
        return row

    loop = TrainLoop(cfg, out, model, opt, sched, len(train), "sft", step_fn, epoch_row, first_row)
    if not loop.run():
        return loop.rows, False
    save_model(model, tok, out, merge=cfg.merge_lora)
    return loop.rows, True


def save_model(model: Any, tok: Any, out: Path, merge: bool) -> None:
    """Save in Hugging Face format (safetensors) with the tokenizer; LoRA is merged unless ``merge`` is off.

    The files are written to a temporary directory, flushed, then moved over the old ones one by one, so
    a full disk or a permission problem leaves the previous files (and the checkpoints) as they were."""
    from transformers.utils import logging as hf_logging

    from ppolm.models import save_pretrained

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
        save_pretrained(model, tok, tmp)
        files = sorted(f for f in tmp.iterdir() if f.is_file())
        for f in files:
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        for f in files:
            os.replace(f, out / f.name)
        fd = os.open(out, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
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
