"""Iterative refresh of a reward model during PPO: fresh comparisons of the current policy's answers,
labelled by the judge, and more training of the reward model on them.

Why. A proxy reward model is fitted to comparisons of the *starting* policy's answers. PPO moves the
policy to where the proxy is high, which is soon where the proxy has seen no data and is wrong: the
proxy reward keeps rising while the true reward peaks and falls (Gao, Schulman & Hilton 2022,
https://arxiv.org/abs/2210.10760). Labelling what the policy writes now and training the proxy on it
closes that gap where the policy actually is. Llama 2 did this by hand, retraining its reward models
on each round's fresh comparisons of its latest models' answers (Touvron et al. 2023,
https://arxiv.org/abs/2307.09288, section 3.2).

What one :meth:`RewardModelRefresher.refresh` does:

1. sample two answers from the current policy to each of ``n_pairs`` training prompts and have the
   judge label them (:func:`ppolm.rm_check.sample_pairs`: identical or empty pairs are skipped, the
   judge's ties are dropped); optionally a share of the pairs sets the current answer against the
   starting policy's, the one contrast that shows the judge what PPO has drifted away from (pairs of
   two current answers cannot, once both carry the same exploit);
2. add the labelled pairs to the buffer: the reward model's original pairs (replay) and every fresh
   pair of earlier refreshes stay in it;
3. train the reward model from its current weights for ``steps`` optimiser steps of the
   Bradley-Terry loss (:func:`ppolm.core.pairwise_loss`, the loss of ``ppolm reward``); each batch is
   ``fresh_fraction`` this round's pairs and the rest replayed from the buffer, so the model learns
   the new region without forgetting the old (the replay keeps the ranking it had on the starting
   policy's answers, which is where the KL penalty keeps pulling the policy back);
4. re-fit the normalisation: gain and bias such that the scores of the reference samples (the
   texts the reward model was normalised on: by default the responses of its original pairs) have
   mean 0 and std 1 (OpenAI's detail 8, :func:`ppolm.reward_train.fit_norm`).

The accuracy on the fresh pairs *before* training is an on-policy check of the old model for free;
*after* training it says how much of the new data the model took in.

What happens to the critic. PPO goes on against the refreshed model with the same critic, which keeps
training (it is not reset, nor re-initialised from the new reward model). Step 4 is what makes that
sound: without it the refreshed head's raw scale would be arbitrary, and every value target would
jump by an unrelated offset and factor at the refresh. With it the score keeps mean 0 and std 1 on
the same reference answers, so a response scores what it did before except for what the new
comparisons changed about its standing; the value targets move only by that change in the policy's
standing under the new model (the part the critic has to learn anyway), and the critic's first
updates after a refresh see a shifted, not a rescaled, target. Critic-free estimators (GRPO, RLOO,
...) only compare the scores of one prompt's answers with each other and need nothing.

Memory. The refresher holds its own trainable float32 copy of the reward model (with an optimiser
state for the trained part) beside PPO's frozen one; :meth:`RewardModelRefresher.load_into` copies
the refreshed weights into the frozen model after each refresh.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

import torch

from ppolm import checkpoint, config, core, distributed, models, rewards, sft, trainloop
from ppolm.config_sections import LoRAOptions
from ppolm.data import encode_prompt
from ppolm.errors import PPOLMError
from ppolm.judge import Judge
from ppolm.pairs import Pair, load_pairs
from ppolm.reward_train import fit_norm, freeze_lower_layers, score_seqs
from ppolm.rm_check import FreshPairs, Sampler, agreement, sample_pairs
from ppolm.runtime import seeded_rng

CONFIG_FILE = "reward_config.yaml"
"""Written by ``ppolm reward`` beside the model: its options, and where its pairs came from."""


@dataclass
class RefreshConfig(LoRAOptions):
    """How a reward model is trained during a refresh (by default as ``ppolm reward`` trained it:
    :meth:`from_reward_model` reads its ``reward_config.yaml``)."""

    lr: float = 1e-4
    """AdamW learning rate of the refresh (``ppolm reward``'s default for its top 2 layers)."""
    batch_size: int = 8
    """Pairs per optimiser step."""
    fresh_fraction: float = 0.5
    """Share of each batch taken from this refresh's fresh pairs; the rest is replayed from the buffer."""
    train_layers: int = 2
    """Train the head, final norm and top N layers (-1 = all); ignored with LoRA (lora_r > 0)."""
    max_length: int = 512
    """Longest prompt+response in tokens, as ``ppolm reward --max-length``."""
    chat_template: bool = True
    """Apply the tokenizer's chat template to text prompts, as ``ppolm reward`` and ``ppolm ppo`` do."""
    precision: Literal["bf16", "fp32"] = "fp32"
    """bf16 autocast over float32 weights, or float32 throughout."""
    max_grad_norm: float = 1.0
    """Gradient clipping (global norm)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    lr_schedule: Literal["constant"] = "constant"
    """A refresh has no end of training to decay towards."""
    seed: int = 0
    """Seeds the refresher's own random stream (batches, labels when no rng is given, LoRA init)."""

    def validate(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)) or self.batch_size < 1:
            raise PPOLMError(f"the refresh needs a positive finite lr and batch size; got lr {self.lr}, "
                             f"batch size {self.batch_size}")
        if not 0.0 < self.fresh_fraction <= 1.0:
            raise PPOLMError(f"fresh_fraction must be in (0, 1]; got {self.fresh_fraction}")

    @classmethod
    def from_reward_model(cls, rm_dir: str | Path, **overrides: Any) -> RefreshConfig:
        """The options ``ppolm reward`` trained ``rm_dir`` with (its ``reward_config.yaml``, when there
        is one), then ``overrides``."""
        f = Path(rm_dir) / CONFIG_FILE
        saved = config.load_yaml(f) if f.is_file() else {}
        names = {x.name for x in fields(cls)} - {"lr_schedule", "precision"}
        known = {k: v for k, v in saved.items() if k in names and v is not None}
        if saved.get("precision") in ("bf16", "fp32"):
            known["precision"] = saved["precision"]
        if saved.get("group_by_prompt"):  # its batch size counted prompts, each with many pairs
            known.pop("batch_size", None)
        bad = sorted(set(overrides) - {x.name for x in fields(cls)})
        if bad:
            raise PPOLMError(f"unknown refresh option '{bad[0]}'; known: {', '.join(x.name for x in fields(cls))}")
        cfg = cls(**{**known, **overrides})
        cfg.validate()
        return cfg


def original_pairs(rm_dir: str | Path) -> tuple[list[Pair], list[Pair]]:
    """(training pairs, held-out pairs) of the reward model in ``rm_dir``, read from the files its
    ``reward_config.yaml`` names: ``data`` (one file or several, read in order), and ``eval_data`` or
    the seeded ``eval_fraction`` of ``data`` that ``ppolm reward`` held out (the same split). ([], [])
    without a config file."""
    f = Path(rm_dir) / CONFIG_FILE
    if not f.is_file():
        return [], []
    saved = config.load_yaml(f)
    margin = saved.get("margin_column", "margin")
    data = saved.get("data") or []
    files = [data] if isinstance(data, str) else list(data)
    for key, path in [("data", x) for x in files] + [("eval_data", saved.get("eval_data"))]:
        if path and not Path(path).exists():
            raise PPOLMError(f"the reward model's {key} {path} (named in {f}) is not there; its pairs are replayed "
                             "when it is refreshed: run from the directory `ppolm reward` ran in, or restore the file")
    if not files:
        return [], []
    train = [p for path in files for p in load_pairs(path, margin)]  # concatenated as `ppolm reward` does
    if saved.get("eval_data"):
        return train, load_pairs(saved["eval_data"], margin)
    if float(saved.get("eval_fraction", 0.0)) > 0:
        return trainloop.split_rows(train, float(saved["eval_fraction"]), int(saved.get("seed", 0)))
    return train, []


def _json_or_empty(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def pair_responses(pairs: Sequence[Pair]) -> list[tuple[Any, str]]:
    """Each distinct (prompt, response) of ``pairs`` once: the texts ``ppolm reward --norm-source pairs``
    normalises on (pass the training and held-out pairs together to match it exactly)."""
    seen: dict[str, tuple[Any, str]] = {}
    for p in pairs:
        for text in (p.chosen, p.rejected):
            seen.setdefault(json.dumps([p.prompt, text], sort_keys=True), (p.prompt, text))
    return list(seen.values())


class RewardModelRefresher:
    """A trainable copy of a reward model, its optimiser, its pairs buffer and its normalisation.

    ``rm_dir``: a reward model directory (``ppolm reward``'s output, or an earlier :meth:`save`).
    ``pairs``: its original training pairs, replayed during each refresh (:func:`original_pairs`).
    ``reference``: (prompt, response) texts the normalisation is fitted on; default: the distinct
    responses of ``pairs`` (what ``ppolm reward --norm-source pairs`` uses). ``device``: where it trains.
    """

    def __init__(self, rm_dir: str | Path, *, pairs: Sequence[Pair] = (),
                 reference: Sequence[tuple[Any, str]] | None = None, cfg: RefreshConfig | None = None,
                 device: str | torch.device = "cpu"):
        self.cfg = cfg or RefreshConfig()
        self.cfg.validate()
        self.dir = rewards.reward_model_dir(str(rm_dir))
        self.name = Path(rm_dir).name or str(rm_dir)
        self.device = torch.device(device)
        self.tokenizer = models.load_tokenizer(self.dir)
        model = models.load_scalar_model(self.dir, head_init="keep", dtype=torch.float32, device=self.device,
                                         tokenizer=self.tokenizer)
        self.start = distributed.checksum(p for _, p in sorted(model.named_parameters()))
        """Fingerprint of the weights as loaded: a resumed run must start from the same reward model."""
        if self.cfg.lora_r > 0:
            # LoRA's initial draws fixed by the seed, without touching the run's own random stream
            with seeded_rng(self.cfg.seed, self.device):
                model = trainloop.apply_lora(model, self.cfg, "SEQ_CLS")
        else:
            freeze_lower_layers(model, self.cfg.train_layers)
        self.model = model.eval()  # dropout is off (models.disable_dropout); eval mode throughout
        self.trained = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.opt, _ = trainloop.make_optimizer(list(self.trained.values()), self.cfg, 1)
        self.gain, self.bias = rewards.read_norm(self.dir)
        self.replay = list(pairs)
        self.fresh: list[Pair] = []
        """Every fresh pair so far, in the order labelled (chosen preferred)."""
        self.reference = list(reference) if reference is not None else pair_responses(self.replay)
        if len(self.reference) < 2:
            raise PPOLMError("a reward-model refresh needs reference samples to re-normalise on: give the "
                             "reference (prompt, response) texts or the reward model's original pairs")
        self.rng = random.Random(self.cfg.seed)
        self.rounds = 0
        self.judge_calls = 0
        self._ids: dict[str, list[int]] = {}

    # ------------------------------------------------------------------------------ scoring

    def _encode(self, prompt: Any, text: str) -> list[int]:
        """prompt + response + EOS, laid out as ``ppolm reward`` encodes its pairs (cached)."""
        key = json.dumps([prompt, text], sort_keys=True)
        if key not in self._ids:
            p_ids = encode_prompt(prompt, self.tokenizer, self.cfg.chat_template)
            self._ids[key] = sft.encode_response(p_ids, text, self.tokenizer, self.cfg.max_length, "refresh pair")
        return self._ids[key]

    def _raw(self, seqs: list[list[int]]) -> torch.Tensor:
        """Raw head output at the last token of each sequence: (N,) float32 (with grad when enabled)."""
        with trainloop.autocast(self.device, self.cfg.precision):
            return score_seqs(self.model, seqs, self.tokenizer.pad_token_id, self.device).float()

    @torch.no_grad()
    def raw_scores(self, prompts: Sequence[Any], completions: Sequence[str], batch_size: int = 16) -> torch.Tensor:
        seqs = [self._encode(p, c) for p, c in zip(prompts, completions)]
        out = [self._raw(seqs[i:i + batch_size]).cpu() for i in range(0, len(seqs), batch_size)]
        return torch.cat(out) if out else torch.zeros(0)

    def scores(self, prompts: Sequence[Any], completions: Sequence[str]) -> torch.Tensor:
        """Normalised scores (gain and bias applied): a proxy scorer for :func:`ppolm.rm_check.onpolicy_check`."""
        return self.raw_scores(prompts, completions) * self.gain + self.bias

    def accuracy(self, pairs: Sequence[Pair]) -> float:
        """Share of ``pairs`` whose chosen answer scores higher (a tie: half a point; nan without pairs)."""
        if not pairs:
            return math.nan
        s = self.raw_scores([p.prompt for p in pairs] * 2, [p.chosen for p in pairs] + [p.rejected for p in pairs])
        return agreement(s[:len(pairs)], s[len(pairs):])[0]

    # ------------------------------------------------------------------------------ refresh

    def refresh(self, prompts: Sequence[Any], sampler: Sampler, judge: Judge, n_pairs: int, steps: int,
                rng: random.Random | None = None, *, columns: dict[str, list[Any]] | None = None,
                reference: Sequence[tuple[Any, str]] | None = None, start: Sampler | None = None,
                start_share: float = 0.0) -> dict[str, float]:
        """Steps 1-4 of the module docstring; returns the log record (``rm_refresh/...``). ``rng``
        picks the prompts and draws noisy labels (default: the refresher's own, saved in its state);
        ``reference``: new reference texts to normalise on from now on (default: keep the previous);
        ``start``, ``start_share``: that share of the pairs sets the current policy's answer against
        one of ``start``, the starting policy (:func:`ppolm.rm_check.sample_pairs`' ``other``)."""
        t0 = time.perf_counter()
        fresh = sample_pairs(prompts, sampler, judge, n_pairs, rng or self.rng, columns, other=start,
                             other_share=start_share)
        record = self.learn(fresh, steps, reference=reference)
        record["rm_refresh/seconds"] = time.perf_counter() - t0
        return record

    def learn(self, fresh: FreshPairs, steps: int, *, reference: Sequence[tuple[Any, str]] | None = None
              ) -> dict[str, float]:
        """Steps 2-4 on pairs already labelled (an ensemble's members share one labelling)."""
        t0 = time.perf_counter()
        if steps < 0:
            raise PPOLMError(f"the refresh steps must be >= 0; got {steps}")
        if reference is not None:
            if len(reference) < 2:
                raise PPOLMError("the reference texts to normalise on must hold at least 2 samples")
            self.reference = list(reference)
        new = [Pair(p.prompt, *p.ordered()) for p in fresh.decided]
        pool = self.replay + self.fresh  # replay: the original pairs and earlier refreshes' pairs
        self.fresh += new
        self.rounds += 1
        self.judge_calls += fresh.judge_calls
        before = self.accuracy(new)
        losses = self._train(new, pool, steps) if new else []
        self._sync()
        after = self.accuracy(new)
        raw = self.raw_scores([p for p, _ in self.reference], [t for _, t in self.reference])
        self.gain, self.bias, _, _ = fit_norm(raw, f"{len(self.reference)} reference samples")
        if distributed.active():  # process 0's normalisation everywhere, to the last bit
            self.gain, self.bias = distributed.broadcast_object((self.gain, self.bias))
        record = {"rm_refresh/round": float(self.rounds), "rm_refresh/pairs_added": float(len(new)),
                  "rm_refresh/ties": float(len(fresh.pairs) - len(new)), "rm_refresh/skipped": float(fresh.skipped),
                  "rm_refresh/start_pairs": float(fresh.other),
                  "rm_refresh/buffer_pairs": float(len(self.replay) + len(self.fresh)),
                  "rm_refresh/fresh_accuracy_before": before, "rm_refresh/fresh_accuracy_after": after,
                  "rm_refresh/steps": float(len(losses)),
                  "rm_refresh/loss": sum(losses) / len(losses) if losses else math.nan,
                  "rm_refresh/norm_gain": self.gain, "rm_refresh/norm_bias": self.bias,
                  "rm_refresh/judge_calls": float(fresh.judge_calls),
                  "rm_refresh/judge_calls_total": float(self.judge_calls),
                  "rm_refresh/seconds": time.perf_counter() - t0}
        return {k: v for k, v in record.items() if math.isfinite(v)}  # no pairs: no accuracy, no loss

    @torch.no_grad()
    def _sync(self) -> None:
        """Under torchrun every process trains its own copy on the same pairs; process 0's weights are
        then given to all, so that the copies stay equal even where the hardware's sums are not."""
        if distributed.active():
            for p in self.trained.values():
                torch.distributed.broadcast(p.data, src=0)

    def _train(self, new: list[Pair], pool: list[Pair], steps: int) -> list[float]:
        """``steps`` optimiser steps on batches of fresh pairs (cycled through in seeded shuffles) and
        replayed ones (drawn without replacement within a batch); the mean loss of each step."""
        bs = self.cfg.batch_size
        n_new = bs if not pool else min(bs, max(1, round(bs * self.cfg.fresh_fraction)))
        order: list[int] = []
        losses = []
        for _ in range(steps):
            while len(order) < n_new:
                order += self.rng.sample(range(len(new)), len(new))
            batch = [new[i] for i in order[:n_new]] + self.rng.sample(pool, min(bs - n_new, len(pool)))
            del order[:n_new]
            seqs = [self._encode(p.prompt, p.chosen) for p in batch] + [self._encode(p.prompt, p.rejected)
                                                                         for p in batch]
            s = self._raw(seqs)
            loss = core.pairwise_loss(s[:len(batch)], s[len(batch):],
                                      torch.tensor([p.margin for p in batch], device=s.device))
            self.opt.zero_grad(set_to_none=True)
            if not torch.isfinite(loss):
                continue  # a non-finite loss is not stepped on (the update is skipped)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(list(self.trained.values()), self.cfg.max_grad_norm)
            if torch.isfinite(norm):
                self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        bad = checkpoint.first_non_finite(self.trained.items())
        if bad:
            raise PPOLMError(f"the reward-model refresh made {bad} non-finite; lower its learning rate")
        return losses

    # ------------------------------------------------------------------------------ outputs

    def merged_state(self) -> dict[str, torch.Tensor]:
        """The whole model's weights as a plain scalar-head model names them (LoRA merged into a copy;
        the trained model keeps its adapters)."""
        if hasattr(self.model, "merge_and_unload"):
            return copy.deepcopy(self.model).merge_and_unload().state_dict()
        return self.model.state_dict()

    @torch.no_grad()
    def load_into(self, rm: rewards.RewardModel) -> int:
        """Give a frozen :class:`ppolm.rewards.RewardModel` (PPO's) the refreshed weights and
        normalisation. Only the tensors that changed are replaced, by new parameters in ``rm``'s dtype:
        tensors ``rm`` shares with another model (``ppolm.trunk`` aliases the layers it has in common
        with the reference policy) are never written through. When the refresh trained layers that
        were shared (LoRA on all layers, or more layers than the reward model's own), the frozen models'
        trunk split must be worked out again. Returns the number of tensors replaced."""
        state = self.merged_state()
        replaced = 0
        for name, p in list(rm.model.named_parameters()):
            new = state.get(name)
            if new is None:
                raise PPOLMError(f"the reward model has a parameter {name} that the refreshed one lacks; "
                                 "refresh the same reward model that PPO loaded")
            new = new.to(device=p.device, dtype=p.dtype)
            if torch.equal(new, p):
                continue
            owner_name, _, leaf = name.rpartition(".")
            owner = rm.model.get_submodule(owner_name) if owner_name else rm.model
            owner._parameters[leaf] = torch.nn.Parameter(new.clone(), requires_grad=False)
            replaced += 1
        rm.gain, rm.bias = self.gain, self.bias
        return replaced

    def save(self, out_dir: str | Path) -> Path:
        """Write the refreshed reward model as a reward-model directory (weights with LoRA merged,
        tokenizer, ``ppolm_reward.json``) that ``ppolm reward-eval`` and ``ppolm ppo --reward-model``
        load. A directory holding anything but an earlier save of a refresh is refused."""
        out = Path(out_dir)
        if out.exists() and out.resolve() == self.dir.resolve():
            raise PPOLMError(f"{out} is the reward model being refreshed (a resumed run reloads it); save the "
                             "refreshed one to another directory")
        if out.exists() and any(out.iterdir()) and "refreshes" not in _json_or_empty(out / rewards.NORM_FILE):
            raise PPOLMError(f"{out} already holds other files; save the refreshed reward model to a new directory")
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise checkpoint.disk_error(e, out) from None
        model = copy.deepcopy(self.model) if hasattr(self.model, "merge_and_unload") else self.model
        sft.save_model(model, self.tokenizer, out, merge=True)
        rewards.write_norm(out, self.gain, self.bias, refreshes=self.rounds, fresh_pairs=len(self.fresh),
                           replay_pairs=len(self.replay), reference_samples=len(self.reference),
                           judge_calls=self.judge_calls, refreshed_from=str(self.dir))
        return out

    # ------------------------------------------------------------------------------ checkpoint

    def state_dict(self, prefix: str = "rm_refresh") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, JSON meta) in the form :func:`ppolm.checkpoint.save` stores: the trained weights, the
        optimiser, the fresh pairs, the reference texts, the normalisation and the random stream. The
        frozen weights and the original pairs are not stored: they are reloaded from their files."""
        tensors = {f"{prefix}.w.{n}": p.detach().cpu().contiguous() for n, p in self.trained.items()}
        opt_t, opt_meta = checkpoint.optimizer_state(self.opt, f"{prefix}.opt")
        tensors.update(opt_t)
        meta = {"start": self.start, "trained": list(self.trained), "optimizer": opt_meta, "fresh": [asdict(p) for p in self.fresh],
                "replay_pairs": len(self.replay), "reference": [list(x) for x in self.reference],
                "gain": self.gain, "bias": self.bias, "rng": checkpoint._jsonable(self.rng.getstate()),
                "rounds": self.rounds, "judge_calls": self.judge_calls}
        return tensors, meta

    @torch.no_grad()
    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                        prefix: str = "rm_refresh") -> None:
        """Restore what :meth:`state_dict` saved, into a refresher built with the same options, reward
        model and original pairs."""
        if meta.get("start") != self.start:
            raise PPOLMError(f"the reward model in {self.dir} is not the one the checkpoint's refresh started from "
                             "(its weights changed); resume with the reward model the run started with")
        if meta["trained"] != list(self.trained):
            raise PPOLMError("the checkpoint's reward-model refresh trained other parameters than this one; "
                             "resume with the same reward model and refresh options")
        if meta["replay_pairs"] != len(self.replay):
            raise PPOLMError(f"the checkpoint's refresh replayed {meta['replay_pairs']} original pairs, this run "
                             f"has {len(self.replay)}; resume with the same reward model pairs")
        for n, p in self.trained.items():
            p.copy_(tensors[f"{prefix}.w.{n}"].to(p.device, p.dtype))
        checkpoint.load_optimizer_state(self.opt, f"{prefix}.opt", tensors, meta["optimizer"])
        self.fresh = [Pair(**d) for d in meta["fresh"]]
        self.reference = [(x[0], x[1]) for x in meta["reference"]]
        self.gain, self.bias = float(meta["gain"]), float(meta["bias"])
        self.rng.setstate(checkpoint._tupled(meta["rng"]))
        self.rounds, self.judge_calls = int(meta["rounds"]), int(meta["judge_calls"])


def refresh_ensemble(refreshers: Sequence[RewardModelRefresher], prompts: Sequence[Any], sampler: Sampler,
                     judge: Judge, n_pairs: int, steps: int, rng: random.Random | None = None, *,
                     columns: dict[str, list[Any]] | None = None, start: Sampler | None = None,
                     start_share: float = 0.0) -> dict[str, float]:
    """Refresh every member of an ensemble on one set of fresh pairs (labelled once: the judge's cost
    does not grow with the ensemble; ``rng`` defaults to the first member's stream). Each member trains
    with its own batches. The record holds the shared counts, the members' mean of each accuracy and,
    per member, ``rm_refresh/<name>/...``. ``start``, ``start_share``: as for :meth:`RewardModelRefresher.refresh`."""
    if not refreshers:
        raise PPOLMError("no reward models to refresh")
    t0 = time.perf_counter()
    fresh = sample_pairs(prompts, sampler, judge, n_pairs, rng or refreshers[0].rng, columns, other=start,
                         other_share=start_share)
    records = [r.learn(fresh, steps) for r in refreshers]
    out = dict(records[0])
    names = [r.name for r in refreshers]
    if len(set(names)) < len(names):
        names = [f"{n}_{i}" for i, n in enumerate(names)]
    per_member = ("rm_refresh/fresh_accuracy_before", "rm_refresh/fresh_accuracy_after", "rm_refresh/loss",
                  "rm_refresh/norm_gain", "rm_refresh/norm_bias")
    for key in per_member:
        vals = [rec[key] for rec in records if key in rec]
        if len(vals) < len(records):
            continue
        out[key] = sum(vals) / len(vals)
        for name, v in zip(names, vals):
            out[key.replace("rm_refresh/", f"rm_refresh/{name}/")] = v
    out["rm_refresh/seconds"] = time.perf_counter() - t0
    return out
