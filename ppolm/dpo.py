"""Direct preference optimisation (``ppolm dpo``): the policy fitted to preference pairs, no reward model.

DPO (Rafailov et al. 2023, https://arxiv.org/abs/2305.18290) reads the KL-regularised RLHF
objective backwards: its optimal policy defines an implicit reward
r(x, y) = beta * (log pi(y|x) - log pi_ref(y|x)), and the Bradley-Terry likelihood of the pairs
under that reward is the loss (:func:`ppolm.core.dpo_loss`). So one supervised pass over the pairs
replaces reward-model training, sampling and PPO. ``--loss-type ipo`` is IPO (Azar et al. 2023,
https://arxiv.org/abs/2310.12036); ``--label-smoothing`` is conservative DPO.

The pairs file, its checks and the chat-template encoding are those of ``ppolm reward``
(:mod:`ppolm.reward_train`): each response is encoded as PPO samples it (templated prompt,
response, EOS) and only its tokens count in a log-probability, never the prompt's. The reference
is the starting model (with LoRA: the model with its adapter disabled); its log-probabilities of
every chosen and rejected response are computed once before training, so training runs only the
policy. The optimiser loop, checkpoints, ``--resume`` and the non-finite guard are
:class:`ppolm.trainloop.TrainLoop`, as for ``ppolm sft`` and ``ppolm reward``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ppolm import core, distributed, models, sft, trainloop
from ppolm.config_sections import PolicyTrainOptions
from ppolm.errors import PPOLMError
from ppolm.pairs import encode_pairs_with_prompts, load_pairs
from ppolm.rundir import OutputDir
from ppolm.runtime import resolve_device, resolve_precision, seed_everything

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
"""Per-pair means logged each epoch (TRL's names), besides the loss; held-out ones with an ``eval/`` prefix."""


@dataclass
class DPOConfig(PolicyTrainOptions):
    """Everything a DPO run needs; ``train_dpo(config.build(DPOConfig, {...}))`` from Python."""

    model: str = "smollm2-135m-instruct"
    """Policy to train, and the reference it is held to (usually `ppolm sft`'s output): a model directory, a .gguf file, or an embedded name."""
    data: str | None = None
    """Preference pairs in `ppolm reward`'s format: 'prompt', 'chosen', 'rejected' (text, or chat lists ending with the assistant turn)."""
    eval_data: str | None = None
    """Held-out pairs for the eval/ metrics; default: a seeded --eval-fraction of --data."""
    output_dir: str = "runs/dpo"
    """Where the trained policy (Hugging Face format, with tokenizer), metrics.jsonl and dpo_config.yaml go."""
    epochs: int = 1
    """Passes over the pairs."""
    batch_size: int = 8
    """Pairs per optimiser step."""
    lr: float = 1e-6
    """AdamW learning rate (full fine-tuning; LoRA wants ~10-100x more)."""
    beta: float = 0.1
    """KL strength: the implicit reward is beta * (log pi - log pi_ref); smaller lets the policy move further from the reference."""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO's -log sigmoid(beta * h); ipo: (h - 1/(2 beta))^2 on per-token average log-probs (as TRL), h = the chosen-minus-rejected log-ratio gap."""
    label_smoothing: float = 0.0
    """Conservative DPO: the assumed probability that a pair's label is flipped, in [0, 0.5) (sigmoid only)."""
    lora_r: int = 0
    """LoRA rank (peft); 0 = full fine-tuning. With LoRA the reference is the model with the adapter disabled."""

    def validate(self) -> None:
        trainloop.check_common(self)
        if not self.beta > 0:  # (also rejects nan)
            raise PPOLMError(f"--beta must be > 0; got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise PPOLMError(f"--label-smoothing must be in [0, 0.5) (the probability that a label is flipped); "
                             f"got {self.label_smoothing}")
        if self.loss_type == "ipo" and self.label_smoothing:
            raise PPOLMError("--label-smoothing applies to --loss-type sigmoid only; drop it for ipo")


# ------------------------------------------------------------------------------------ log-probabilities

PairExamples = tuple[sft.Example, sft.Example]
"""(chosen, rejected): prompt + response + EOS ids, the first n_prompt being the prompt."""


def load_pair_examples(path: str, tok: Any, chat_template: bool, max_length: int) -> list[PairExamples]:
    """Read, check (one line per problem, as `ppolm reward`) and encode a pairs file."""

    encoded = encode_pairs_with_prompts(load_pairs(path, margin_column=None), tok, chat_template, max_length, path)
    return [(sft.Example(c, n), sft.Example(r, n)) for n, c, r, _ in encoded]


def sequence_logps(model: Any, examples: list[sft.Example], pad_id: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(response | prompt) of each example, summed over its response tokens (EOS included),
    and the number of those tokens: ((N,) float32, (N,) float32). Prompt tokens never count."""
    ids, mask, loss_mask = sft.collate(examples, pad_id, device)
    logits, targets, sel = sft.response_logits(model, ids, mask, loss_mask)
    token_logps = core.logprobs_from_logits(logits, targets)  # (n_tokens,)
    rows = sel.nonzero()[:, 0]
    sums = torch.zeros(len(examples), dtype=torch.float32, device=token_logps.device).index_add(0, rows, token_logps)
    return sums, sel.sum(-1).float()


def pair_logps(model: Any, batch: list[PairExamples], pad_id: int, device: torch.device, per_token: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) log-probabilities, (B,) each: sums over response tokens, or their per-token
    means with ``per_token`` (IPO). Chosen and rejected run as one batch of 2B sequences."""
    sums, counts = sequence_logps(model, [c for c, _ in batch] + [r for _, r in batch], pad_id, device)
    logps = sums / counts if per_token else sums
    return logps[:len(batch)], logps[len(batch):]


@torch.no_grad()
def reference_logps(model: Any, pairs: list[PairExamples], batch_size: int, pad_id: int, device: torch.device,
                    precision: str, per_token: bool) -> torch.Tensor:
    """The reference's (chosen, rejected) log-probabilities of every pair: (N, 2) float32 on the CPU.

    Called once, before training, on the starting model; with LoRA the adapter is disabled, so the
    reference stays the base model whatever the adapter has learned."""
    model.eval()
    off = model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()
    out = []
    with off:
        for i in range(0, len(pairs), batch_size):
            with trainloop.autocast(device, precision):
                c, r = pair_logps(model, pairs[i:i + batch_size], pad_id, device, per_token)
            out.append(torch.stack([c, r], dim=1).float().cpu())
    return torch.cat(out) if out else torch.zeros(0, 2)


def metric_sums(loss: torch.Tensor, logp_c: torch.Tensor, logp_r: torch.Tensor, reward_c: torch.Tensor,
                reward_r: torch.Tensor) -> dict[str, float]:
    """Sums over the batch of the per-pair :data:`METRICS` (divided by the pair count at the epoch's end)."""
    n = len(logp_c)
    return {"rewards/chosen": float(reward_c.sum()), "rewards/rejected": float(reward_r.sum()),
            "rewards/accuracies": float((reward_c > reward_r).float().sum()),
            "rewards/margins": float((reward_c - reward_r).sum()), "logps/chosen": float(logp_c.detach().sum()),
            "logps/rejected": float(logp_r.detach().sum()), "loss": float(loss.detach()) * n}


@torch.no_grad()
def evaluate(model: Any, pairs: list[PairExamples], ref: torch.Tensor, cfg: DPOConfig, pad_id: int,
             device: torch.device) -> dict[str, float]:
    """The loss and :data:`METRICS` of the current policy on ``pairs``, means over pairs, keys ``eval/...``."""
    model.eval()
    total: dict[str, float] = {}
    for i in range(0, len(pairs), cfg.batch_size):
        with trainloop.autocast(device, cfg.precision):
            c, r = pair_logps(model, pairs[i:i + cfg.batch_size], pad_id, device, cfg.loss_type == "ipo")
        ref_b = ref[i:i + cfg.batch_size].to(c.device)
        loss, rc, rr = core.dpo_loss(c, r, ref_b[:, 0], ref_b[:, 1], cfg.beta, cfg.label_smoothing, cfg.loss_type)
        for k, v in metric_sums(loss, c, r, rc, rr).items():
            total[k] = total.get(k, 0.0) + v
    return {f"eval/{k}": v / len(pairs) for k, v in total.items()}


# ------------------------------------------------------------------------------------ training

def train_dpo(cfg: DPOConfig) -> list[dict[str, Any]]:
    """Train the policy on the pairs and save it; returns the metrics rows (one per epoch, epoch 0 = before).

    Stopped by Ctrl-C/SIGTERM, it saves a checkpoint and returns the rows so far without saving the model
    (continue with ``resume=True``)."""
    return _train_dpo(cfg)[0]


def _train_dpo(cfg: DPOConfig, on_epoch: Any = None) -> tuple[list[dict[str, Any]], bool]:
    """``on_epoch(epoch, model)``, when given, runs before training (epoch 0) and after each epoch,
    on every process (``ppolm demo --algorithms`` scores the policy on held-out prompts there)."""

    cfg.validate()
    out = Path(cfg.output_dir)
    device = resolve_device(cfg.device)
    cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, device))  # 'auto' -> bf16|fp32
    out_dir = OutputDir(out, "dpo_config.yaml")
    out_dir.check(cfg)  # checks only: nothing changes before the inputs load
    seed_everything(cfg.seed)
    tok = models.load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle)
    train = load_pair_examples(cfg.data, tok, cfg.chat_template, cfg.max_length)  # type: ignore[arg-type]
    if cfg.eval_data:
        held = load_pair_examples(cfg.eval_data, tok, cfg.chat_template, cfg.max_length)
    else:
        train, held = trainloop.split_rows(train, cfg.eval_fraction, cfg.seed)
    if not train:
        raise PPOLMError(f"{cfg.data} leaves no training pairs after the held-out split; add rows or lower "
                         "--eval-fraction")
    device = distributed.init(cfg.device, cfg.dist_timeout)  # torchrun: join the others (ppolm/distributed.py)
    model = models.load_causal_lm(cfg.model, dtype=torch.float32, device=device, tokenizer=tok,
                                  trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle)
    if cfg.lora_r > 0:
        model = trainloop.apply_lora(model, cfg, "CAUSAL_LM")
    trainloop.commit_output_dir(out_dir, cfg)
    pad, per_token = tok.pad_token_id, cfg.loss_type == "ipo"
    # The reference's log-probs, once, from the weights as loaded: a resumed run computes them here too,
    # before the checkpoint's weights are put in (TrainLoop.run), so they are the same numbers.
    ref_train = reference_logps(model, train, cfg.batch_size, pad, device, cfg.precision, per_token)
    ref_held = reference_logps(model, held, cfg.batch_size, pad, device, cfg.precision, per_token)
    forward = trainloop.parallel(model, cfg, device)  # DDP/FSDP with several processes
    steps_per_epoch = math.ceil(len(train) / cfg.batch_size)
    opt, sched = trainloop.make_optimizer([p for p in model.parameters() if p.requires_grad], cfg,
                                       steps_per_epoch * cfg.epochs)

    def held_out(row: dict[str, Any]) -> dict[str, Any]:
        if held:
            with torch.no_grad():  # every process, through the DDP/FSDP module (DDP: no grad, no backward)
                row.update(forward(evaluate, model, held, ref_held, cfg, pad, device))
        if on_epoch is not None:
            on_epoch(row["epoch"], model)
            model.train()
        return row

    def step_fn(idx: list[int], forward: Any) -> tuple[torch.Tensor, int, dict[str, Any]]:
        batch = [train[j] for j in idx]
        ref_b = ref_train[idx].to(device)  # (B, 2)
        with trainloop.autocast(device, cfg.precision):
            c, r = forward(pair_logps, model, batch, pad, device, per_token)
        loss, rc, rr = core.dpo_loss(c, r, ref_b[:, 0], ref_b[:, 1], cfg.beta, cfg.label_smoothing, cfg.loss_type)
        counters: dict[str, Any] = {"tokens": sum(len(x.ids) + len(y.ids) for x, y in batch)}
        if math.isfinite(loss.item()):  # a skipped update adds nothing to the epoch's means
            sums = metric_sums(loss, c, r, rc, rr)
            sums.pop("loss")  # TrainLoop sums the loss itself
            counters.update({f"sum/{k}": v for k, v in sums.items()}, pairs=len(batch))
        return loss, len(batch), counters

    def epoch_row(epoch: int, acc: dict[str, Any]) -> dict[str, Any]:
        row: dict[str, Any] = {"epoch": epoch, "loss": acc["loss_sum"] / acc["loss_n"] if acc["loss_n"] else None}
        n = acc.get("pairs", 0)
        row.update({k: acc[f"sum/{k}"] / n if n else None for k in METRICS})
        return held_out(row)

    loop = trainloop.TrainLoop(cfg, out, model, opt, sched, len(train), "dpo", step_fn, epoch_row,
                            lambda: held_out({"epoch": 0}) if held or on_epoch else None, forward)
    if not loop.run():
        return loop.rows, False

    final = trainloop.saveable(model, cfg, tok)
    if distributed.is_main():
        sft.save_model(final, tok, out, merge=cfg.merge_lora)
    distributed.barrier()
    return loop.rows, True


def run(cfg: DPOConfig) -> int:
    rows, finished = _train_dpo(cfg)
    if not finished:
        return 130
    last = rows[-1]
    acc = ""
    if "eval/rewards/accuracies" in last:
        acc = (f", held-out preference accuracy {last['eval/rewards/accuracies']:.3f}, "
               f"margin {last['eval/rewards/margins']:+.3f}")
    print(f"done: {cfg.epochs} epochs{acc}; policy saved to {cfg.output_dir} "
          f"(compare it with `ppolm eval`, or continue with `ppolm ppo --model {cfg.output_dir}`)", file=sys.stdout)
    return 0
