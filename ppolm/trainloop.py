"""The optimiser loop that ``ppolm sft``, ``ppolm reward`` and ``ppolm dpo`` share, and its helpers.

:class:`TrainLoop` runs epochs of seeded minibatches through a command's step function with the
non-finite guard, checkpoints, ``--resume`` and Ctrl-C/SIGTERM handling of the scaffold every
training command shares (ppolm/scaffold.py; ``ppolm ppo`` runs its steps in it too, ppolm/ppo.py);
the helpers are the validations, held-out split, optimiser, progress bar, metrics rows and LoRA
set-up the three commands have in common.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ppolm import atomic, checkpoint, distributed, models, runtime, scaffold
from ppolm.errors import FLOAT32_MAX, PPOLMError
from ppolm.rundir import OutputDir


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
    need(cfg.dist_timeout > 0, f"--dist-timeout must be > 0 seconds; got {cfg.dist_timeout}")
    need(not cfg.fsdp or distributed.launched_world_size() > 1,
         "--fsdp shards the model over the processes of a torchrun job: launch with torchrun --nproc-per-node N "
         "(N >= 2) -m ppolm ..., or drop --fsdp")
    out = Path(cfg.output_dir).expanduser().resolve()
    for name, p in (("--model", cfg.model), ("--data", cfg.data), ("--eval-data", cfg.eval_data)):
        if p is not None and (out == Path(p).expanduser().resolve() or out in Path(p).expanduser().resolve().parents):
            raise PPOLMError(f"--output-dir {cfg.output_dir} holds the {name} input, which writing there would "
                             "replace; choose another --output-dir")


def split_rows(rows: list[Any], fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """Seeded held-out split: (train, eval). At least one row each when there are two or more."""
    n_eval = 0 if fraction <= 0 or len(rows) < 2 else min(len(rows) - 1, max(1, round(len(rows) * fraction)))
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    return [rows[i] for i in perm[n_eval:]], [rows[i] for i in sorted(perm[:n_eval])]


def parallel(model: Any, cfg: Any, device: torch.device) -> Any:
    """How a training step computes with ``model``: ``forward(fn, *args)`` returns ``fn(*args)``, run
    inside a module DDP (several processes) or FSDP2 (``--fsdp``) wraps (ppolm/distributed.py).
    Call it before building the optimiser: FSDP replaces the parameters by their shards."""
    through = distributed.Through(model)
    if getattr(cfg, "fsdp", False):
        return distributed.fsdp(through, [model])
    return distributed.ddp(through, device)


def saveable(model: Any, cfg: Any, tok: Any, kind: str = "causal") -> Any:
    """The model to save at the end: ``model`` itself, or with ``--fsdp`` (its weights sharded over
    the processes) a fresh copy of ``cfg.model`` (a causal LM, or a ``kind="scalar"`` reward model;
    LoRA included) holding the gathered full weights, on process 0 (None on the others). Every
    process must call this."""
    if not getattr(cfg, "fsdp", False):
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not distributed.is_main():
        return None
    load = dict(dtype=torch.float32, device=torch.device("cpu"), tokenizer=tok, trust_remote_code=cfg.trust_remote_code,
                allow_pickle=cfg.allow_pickle)
    if kind == "scalar":
        copy = models.load_scalar_model(cfg.model, head_init="reward", **load)
    else:
        copy = models.load_causal_lm(cfg.model, **load)
    if cfg.lora_r > 0:
        copy = apply_lora(copy, cfg, "SEQ_CLS" if kind == "scalar" else "CAUSAL_LM")
    copy.load_state_dict(state)
    return copy


def commit_output_dir(out: OutputDir, cfg: Any) -> None:
    """Once the inputs have loaded: empty (--overwrite) and create --output-dir and write the config,
    on process 0 only."""
    if not distributed.is_main():
        return
    try:
        out.commit(cfg)
    except OSError as e:
        raise checkpoint.disk_error(e, out.out) from None


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
    """Append one row to metrics.jsonl and print it as one line (it stays visible above the bar);
    process 0 only, with several."""
    if not distributed.is_main():
        return
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    text = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
    print(text, file=sys.stderr, flush=True)


def write_rows(out: Path, rows: list[dict[str, Any]]) -> None:
    """Replace metrics.jsonl with ``rows`` atomically (a resumed run starts from its checkpoint's rows);
    process 0 only, with several."""
    if not distributed.is_main():
        return
    atomic.write_text(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def apply_lora(model: Any, cfg: Any, task_type: str) -> Any:
    from peft import LoraConfig, get_peft_model

    targets: Any = cfg.lora_target if cfg.lora_target == "all-linear" else cfg.lora_target.split(",")
    return get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                            target_modules=targets, task_type=task_type))


StepFn = Callable[[list[int], Callable[..., Any]], tuple[torch.Tensor, int, dict[str, int]]]
"""(this process's training rows of one batch, ``forward``) -> (the loss averaged over the rows' units,
the number of units (tokens, pairs, prompts) it averages over, counters to add up). The step computes
everything that needs gradients as ``forward(fn, *args)`` (= ``fn(*args)``, under DDP with several
processes: ppolm/distributed.py)."""


class TrainLoop:
    """The optimiser loop of sft, reward and dpo, on the shared scaffold (ppolm/scaffold.py).

    * data order: one seeded permutation per epoch (drawn in sequence from ``seed``);
    * the non-finite guard: a NaN/inf loss or gradient skips that update (the schedule still
      advances), is counted in ``guard/skipped_updates``, warns once per cause, and aborts after
      ``--max-skipped-updates`` consecutive skips; non-finite weights are never saved;
    * checkpoints every ``--save-every`` optimiser steps, at the end and on Ctrl-C/SIGTERM
      (:func:`ppolm.checkpoint.save`: atomic, manifest with checksums, the newest ``--keep-last``),
      holding the trained parameters (those with ``requires_grad``), optimiser and scheduler
      state, the position in the data order, the running epoch sums, every RNG state and the
      epoch rows so far; ``--resume`` continues bit for bit from the newest valid one;
    * several processes (torchrun): every process draws the same data order and takes every N-th
      row of each batch; the model trains under DDP, each loss is scaled to its share of the
      global batch's average (so the gradient is one process's on the whole batch), the epoch
      sums are all-reduced, and process 0 alone writes.
    """

    def __init__(self, cfg: Any, out: Path, model: Any, opt: torch.optim.Optimizer, sched: Any, n_train: int,
                 desc: str, step_fn: StepFn, epoch_row: Callable[[int, dict[str, Any]], dict[str, Any]],
                 first_row: Callable[[], dict[str, Any] | None], forward: Any):
        self.cfg, self.out, self.model, self.opt, self.sched = cfg, out, model, opt, sched
        self.n_train, self.desc = n_train, desc
        self.step_fn, self.epoch_row, self.first_row = step_fn, epoch_row, first_row
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.device = next(model.parameters()).device
        self.forward = forward  # parallel(model, cfg, device)
        self.steps_per_epoch = math.ceil(n_train / cfg.batch_size)
        self.total = self.steps_per_epoch * cfg.epochs
        self.step = 0  # optimiser steps done (skipped ones included)
        self.rows: list[dict[str, Any]] = []
        self.acc: dict[str, Any] = {}
        self.order: list[int] = []
        self.guard = scaffold.Guard()

    # --------------------------------------------------------------------------- state
    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {f"model.{n}": distributed.full(p) for n, p in self.named}
        t_opt, m_opt = checkpoint.optimizer_state(self.opt, "opt")
        t_rng, m_rng = scaffold.rng_state()
        tensors.update(t_opt | t_rng)
        mid_epoch = self.step % self.steps_per_epoch != 0
        meta = {"next_step": self.step, "world_size": distributed.world_size(), "epochs_done": self.step // self.steps_per_epoch,
                "batch_in_epoch": self.step % self.steps_per_epoch, "n_train": self.n_train,
                "batch_size": self.cfg.batch_size, "order": self.order if mid_epoch else None,
                "epoch_sums": self.acc if mid_epoch else None, "rows": self.rows, "opt": m_opt,
                "sched": self.sched.state_dict(), "rng": m_rng, **self.guard.state_dict()}
        return tensors, meta

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        if meta["n_train"] != self.n_train:
            raise distributed.RankError(f"the training data has {self.n_train} rows now but had {meta['n_train']} when the "
                             "checkpoint was written; resume with the same --data, or start again with --overwrite")
        with torch.no_grad():
            for n, p in self.named:
                p.copy_(distributed.shard_like(tensors[f"model.{n}"], p))
        checkpoint.load_optimizer_state(self.opt, "opt", tensors, meta["opt"])
        self.sched.load_state_dict(meta["sched"])
        checkpoint.set_rng_state(tensors, meta["rng"], distributed.rank())
        self.step, self.rows = meta["next_step"], meta["rows"]
        self.acc, self.order = meta["epoch_sums"] or {}, meta["order"] or []
        self.guard.load_state_dict(meta)

    def save_checkpoint(self) -> None:
        scaffold.save_checkpoint(self.out, self.step, self.state, self.cfg.keep_last)

    # --------------------------------------------------------------------------- one update

    def update(self, loss: torch.Tensor, scale: float = 1.0) -> float | None:
        """Backward, clip and step; skip the update on a non-finite loss or gradient (on any process:
        they all skip). ``scale``: this process's share of the global average
        (:func:`ppolm.distributed.scale_to_global`). The loss value, or None."""
        value = loss.item()
        cause = None
        if distributed.any_flag(not math.isfinite(value), self.device):
            cause, key = f"non-finite loss ({value if not math.isfinite(value) else 'on another process'})", "loss"
        else:
            (loss * scale).backward()  # DDP averages the processes' gradients
            norm = distributed.full(torch.nn.utils.clip_grad_norm_([p for _, p in self.named], self.cfg.max_grad_norm))
            if torch.isfinite(norm):
                self.opt.step()
            else:
                cause, key = "non-finite gradient", "grad"
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()  # a skipped update still advances the schedule, as an applied one would
        self.guard.count(int(cause is not None))
        if cause is None:
            return value
        epoch = self.step // self.steps_per_epoch + 1
        self.guard.skip(f"update {self.step + 1} (epoch {epoch}): {cause}", key)
        return None

    def global_sums(self, acc: dict[str, Any]) -> dict[str, Any]:
        """The epoch's sums over every process (its own time_s kept); ``acc`` itself on one process."""
        if distributed.world_size() == 1:
            return acc
        mine = {k: v for k, v in acc.items() if isinstance(v, (int, float)) and k != "time_s"}
        kinds: dict[str, bool] = {}  # name -> is an integer count (a process may lack a name)
        for seen in distributed.gather_objects({k: isinstance(v, int) for k, v in mine.items()}):
            for k, is_int in seen.items():
                kinds[k] = kinds.get(k, True) and is_int
        keys = sorted(kinds)
        total = distributed.all_sum_floats([mine.get(k, 0) for k in keys], self.device)
        out = dict(acc)
        for k, v in zip(keys, total):
            out[k] = int(round(v)) if kinds[k] else v
        return out

    # --------------------------------------------------------------------------- the loop
    def run(self) -> bool:
        """Train to the end (True) or until Ctrl-C/SIGTERM (False, after saving a checkpoint)."""
        cfg, out = self.cfg, self.out
        scaffold.allow_skipped_scheduler_steps()
        if cfg.resume:
            scaffold.resume(out, self.load_state)
        bar = None
        with runtime.stop_on_signal() as stop:
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
                    # several processes: every N-th row each; one with no row (a short last batch)
                    # runs one row at weight 0, since every process must take part in each update
                    share = idx[distributed.rank()::distributed.world_size()]
                    loss, n, counters = self.step_fn(share or idx[:1], self.forward)
                    if not share:
                        n, counters = 0, {}
                    n_global = distributed.all_sum_floats([n], self.device)[0]
                    value = self.update(loss, distributed.scale_to_global(n, n_global))
                    if value is not None:
                        self.acc["loss_sum"] += value * n
                        self.acc["loss_n"] += n
                    for k, v in counters.items():
                        self.acc[k] = self.acc.get(k, 0) + v
                    self.acc["time_s"] += time.perf_counter() - t0
                    self.step += 1
                    bar.advance(f"epoch {epochs_done + 1}  loss {loss.item():.3f}")
                    self.guard.check(self.named, cfg.max_skipped_updates, last="", when=f"update {self.step}",
                                     advice="lower --lr or use --precision fp32, check the data, then continue "
                                            "from the last checkpoint with --resume",
                                     weights_advice="Lower --lr and continue from the last checkpoint with --resume")
                    if self.step % self.steps_per_epoch == 0:
                        acc = self.global_sums(self.acc)
                        row = self.epoch_row(epochs_done + 1, acc)
                        row.update(tokens=acc["tokens"], tokens_per_s=acc["tokens"] / max(acc["time_s"], 1e-9),
                                   time_s=acc["time_s"])
                        row["guard/skipped_updates"] = self.guard.skipped_total
                        self.rows.append(row)
                        log_epoch(out, row)
                    stopping = distributed.any_flag(stop["requested"], self.device)  # all stop together
                    if self.step % cfg.save_every == 0 or self.step == self.total or stopping:
                        self.save_checkpoint()
                    if stopping:
                        stop["requested"] = True
                        break
            except OSError as e:
                raise checkpoint.disk_error(e, out) from None
            finally:
                if bar is not None:
                    bar.close()
        distributed.write_rank_summary(
            lambda: {"step": self.step, "weights": distributed.checksum(distributed.local(p) for _, p in self.named)})
        if self.step < self.total:
            print(f"interrupted after step {self.step} of {self.total}; checkpoint saved. Continue with the same "
                  "command plus --resume", file=sys.stderr, flush=True)
            return False
        return True
