"""Evaluation: ``ppolm eval`` compares policies on held-out prompts; ``ppolm reward-eval`` scores a reward model;
:func:`during_ppo` is ``ppolm ppo --eval-prompts``'s held-out evaluation.

``ppolm eval`` samples each policy on the same prompts with the same seed, scores the responses
with the same reward models and/or functions as PPO (same code path: :class:`ppolm.rewards.Rewarder`),
and reports per policy: mean and std of every reward source, the summed per-token KL to a
reference (k1, as PPO's ``objective/kl``), response length, distinct-1/2 over whitespace words (so
policies with different tokenizers compare), and the fraction of responses that emitted EOS.
Everything is seeded; the JSON holds no timings, so two runs with one seed write identical files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ppolm import atomic, core, distributed, models, tracking
from ppolm import rollout as ro
from ppolm.config_sections import DeviceOptions, ModelLoading
from ppolm.data import load_prompts
from ppolm.errors import PPOLMError
from ppolm.pairs import encode_pairs, load_pairs
from ppolm.reward_train import evaluate_pairs
from ppolm.rewards import Rewarder, RewardFunction, RewardModel, function_name, load_reward_fn
from ppolm.rollout import left_pad
from ppolm.runtime import resolve_device, resolve_precision, seeded_rng


@dataclass
class EvalConfig(ModelLoading):
    """Options of ``ppolm eval``; ``evaluate(config.build(EvalConfig, {...}))`` from Python."""

    policy: list[str] = field(default_factory=list)
    """Policy to evaluate: a model directory (`ppolm sft` or `ppolm ppo`'s policy/), a .gguf file or an embedded name; none: the embedded model."""
    prompts: str | None = None
    """Held-out prompts (the formats of `ppolm ppo --prompts`); default: the built-in prompt set."""
    reward_model: list[str] = field(default_factory=list)
    """Reward model directory (from `ppolm reward`). Repeatable: an ensemble, each member also reported."""
    reward_fn: list[str] = field(default_factory=list)
    """Reward function 'file.py:function' or 'module:function' (TRL GRPO convention). Repeatable."""
    reward_fn_weights: list[float] = field(default_factory=list)
    """One weight per --reward-fn in the total (default 1 each)."""
    reward_ensemble: Literal["mean", "min", "mean-minus-std"] = "mean"
    """How several reward models combine into the total."""
    reference: str | None = None
    """Model the KL is measured against (same tokenizer as the policies); default: the first --policy."""
    max_prompts: int = 0
    """Use only the first N prompts (0 = all)."""
    samples_per_prompt: int = 1
    """Responses sampled per prompt."""
    response_length: int = 48
    """Maximum new tokens per response."""
    temperature: float = 0.7
    """Sampling temperature (also divides the logits of the KL, as in PPO)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 = off)."""
    batch_size: int = 8
    """Prompts per generation batch."""
    chat_template: bool = True
    """Apply the tokenizer's chat template to text prompts."""
    output: str = "eval.json"
    """JSON file the results (and every sample) are written to."""
    seed: int = 0
    """Random seed; every policy samples with the same seed."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """bf16 (models in bf16 under autocast, logits in fp32) or fp32; auto: bf16 where native."""
    dist_timeout: float = 600.0
    """Under torchrun: seconds a process waits in a collective for the others before failing."""

    def validate(self) -> None:
        if self.max_prompts < 0 or self.samples_per_prompt < 1 or self.response_length < 1 or self.batch_size < 1:
            raise PPOLMError("--max-prompts must be >= 0; --samples-per-prompt, --response-length, --batch-size >= 1")
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise PPOLMError("--temperature must be > 0 and --top-p in (0, 1]")
        if self.reward_fn_weights and len(self.reward_fn_weights) != len(self.reward_fn):
            raise PPOLMError(f"--reward-fn-weights has {len(self.reward_fn_weights)} values for "
                             f"{len(self.reward_fn)} --reward-fn; give one per function")
        atomic.check_file_target(self.output, "--output")


@dataclass
class RewardEvalConfig(DeviceOptions):
    """Options of ``ppolm reward-eval``."""

    reward_model: str | None = None
    """Reward model directory to evaluate (from `ppolm reward`, or any one-label sequence-classification model)."""
    data: str | None = None
    """Preference pairs (the formats of `ppolm reward --data`)."""
    batch_size: int = 8
    """Pairs per forward pass."""
    max_length: int = 512
    """Longest prompt+response in tokens; longer responses are cut."""
    margin_column: str | None = "margin"
    """Column subtracted inside the reported loss when present; none = ignore."""
    chat_template: bool = True
    """Apply the tokenizer's chat template to text prompts."""
    output: str | None = None
    """Also write the figures to this JSON file."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """bf16 (as PPO scores) or fp32."""

    def validate(self) -> None:
        if self.reward_model is None or self.data is None:
            raise PPOLMError("reward-eval needs --reward-model DIR and --data PAIRS_FILE")
        if self.batch_size < 1:
            raise PPOLMError("--batch-size must be at least 1")
        atomic.check_file_target(self.output, "--output")


def distinct_n(texts: list[str], n: int) -> float:
    """Unique word n-grams / all word n-grams over all texts (Li et al. 2016); 0 when there are none."""
    grams = [tuple(w[i:i + n]) for w in (t.split() for t in texts) for i in range(len(w) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def _stats(x: torch.Tensor) -> dict[str, float]:
    x = x.double()
    return {"mean": round(float(x.mean()), 6), "std": round(float(x.std(unbiased=False)), 6)}


def _rewarder(cfg: EvalConfig, dtype: torch.dtype, device: torch.device):
    taken: set[str] = set()
    weights = cfg.reward_fn_weights or [1.0] * len(cfg.reward_fn)
    fns = [RewardFunction(function_name(s, taken), load_reward_fn(s), w) for s, w in zip(cfg.reward_fn, weights)]
    rms = [RewardModel(p, dtype=dtype, device=device, trust_remote_code=cfg.trust_remote_code,
                       allow_pickle=cfg.allow_pickle) for p in cfg.reward_model]
    return Rewarder(rms, fns, ensemble_rule=cfg.reward_ensemble) if rms or fns else None


@torch.no_grad()
def evaluate(cfg: EvalConfig) -> dict[str, Any]:
    """Sample, score and measure every policy; write ``cfg.output`` and return the same dict.

    Batch b of prompts samples from seed + b, so the results do not depend on how many processes
    share the batches (torchrun: batch b on process b mod N; process 0 writes)."""

    cfg.validate()
    policies = cfg.policy or [models.EMBEDDED_DEFAULT]
    device = resolve_device(cfg.device)
    cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, device))  # 'auto' -> bf16|fp32
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    load = dict(trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle)

    def amp():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")

    rewarder = _rewarder(cfg, dtype, device)  # a bad spec fails before any model loads
    device = distributed.init(cfg.device, cfg.dist_timeout)
    ref_spec = cfg.reference or policies[0]
    ref_tok = models.load_tokenizer(ref_spec, **load)
    reference = models.load_causal_lm(ref_spec, dtype=dtype, device=device, tokenizer=ref_tok, **load)
    result: dict[str, Any] = {"prompts": cfg.prompts or "built-in", "reference": ref_spec, "seed": cfg.seed,
                              "temperature": cfg.temperature, "response_length": cfg.response_length,
                              "policies": {}, "samples": {}}
    for spec in policies:
        label = spec if spec not in result["policies"] else f"{spec}#{len(result['policies']) + 1}"
        tok = models.load_tokenizer(spec, **load)
        if tok.get_vocab() != ref_tok.get_vocab():
            raise PPOLMError(f"policy {spec} and reference {ref_spec} have different tokenizers, so the KL between "
                             "them is undefined; pass a --reference with the policy's tokenizer")
        policy = reference if spec == ref_spec else models.load_causal_lm(spec, dtype=dtype, device=device,
                                                                           tokenizer=tok, **load)
        prompts = load_prompts(cfg.prompts, tok, chat_template=cfg.chat_template)
        prompts = (prompts[:cfg.max_prompts] if cfg.max_prompts else prompts)
        prompts = [p for p in prompts for _ in range(cfg.samples_per_prompt)]
        result["n_samples"] = len(prompts)
        done_batches = []  # (batch index, kls, lengths, ended, texts, {source: scores}) of this process
        starts = range(0, len(prompts), cfg.batch_size)
        for b in range(len(starts))[distributed.rank()::distributed.world_size()]:
            batch = prompts[starts[b]:starts[b] + cfg.batch_size]
            with seeded_rng(cfg.seed + b, device), amp():
                roll = ro.generate(policy, [p.ids for p in batch], pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                                   max_new_tokens=cfg.response_length, temperature=cfg.temperature, top_p=cfg.top_p)
                lp = ro.logprobs(policy, roll, cfg.temperature)
                lr = lp if policy is reference else ro.logprobs(reference, roll, cfg.temperature)
            mask = roll.response_mask.float()
            batch_texts = tok.batch_decode(roll.response * roll.response_mask, skip_special_tokens=True)
            scored = {}
            if rewarder is not None:
                total, by_source = _score(rewarder, roll, batch, batch_texts, tok, amp)
                scored = {name: s.float().cpu() for name, s in {"reward/total": total, **by_source}.items()}
            done_batches.append((b, ((lp - lr) * mask).sum(1).cpu(), roll.lengths.cpu(), roll.ended.cpu(),
                                 batch_texts, scored))
        done_batches = sorted((x for part in distributed.gather_objects(done_batches) for x in part),
                              key=lambda x: x[0])
        kls, lengths, ended = [x[1] for x in done_batches], [x[2] for x in done_batches], [x[3] for x in done_batches]
        texts = [t for x in done_batches for t in x[4]]
        parts: dict[str, list[torch.Tensor]] = {}
        for x in done_batches:
            for name, v in x[5].items():
                parts.setdefault(name, []).append(v)
        kl, length, done = torch.cat(kls), torch.cat(lengths).float(), torch.cat(ended).float()
        rewards = {k: torch.cat(v) for k, v in parts.items()}
        result["policies"][label] = {
            **{k: _stats(v) for k, v in rewards.items()},
            "kl": _stats(kl), "length": _stats(length),
            "distinct_1": round(distinct_n(texts, 1), 6), "distinct_2": round(distinct_n(texts, 2), 6),
            "eos_fraction": round(float(done.mean()), 6),
        }
        total = rewards.get("reward/total")
        result["samples"][label] = [
            {"prompt": p.raw, "response": t, "kl": round(float(k), 6), "length": int(n),
             **({"score": round(float(total[j]), 6)} if total is not None else {})}
            for j, (p, t, k, n) in enumerate(zip(prompts, texts, kl, length))]
        if policy is not reference:
            del policy
    if distributed.is_main():
        path = Path(cfg.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(path, json.dumps(tracking.clean_json(result), indent=1, ensure_ascii=False) + "\n")
    distributed.barrier()
    return result


def _score(rewarder: Any, roll: Any, batch: list[Any], texts: list[str], tok: Any, amp: Any):
    """The PPO scoring path: token ids when vocabularies match, else the text re-tokenised by the RM."""
    vocab = tok.get_vocab()

    def rm_scores(rm: Any) -> torch.Tensor:
        with amp():
            if rm.tokenizer.get_vocab() == vocab:
                return rm.score_ids(roll.input_ids, roll.attention_mask)
            return rm.score_texts(tok.batch_decode([r[m.bool()] for r, m in zip(roll.input_ids, roll.attention_mask)]))

    keys = sorted({k for p in batch for k in p.extra})
    columns = {k: [p.extra.get(k) for p in batch] for k in keys}
    return rewarder.score(model_inputs=rm_scores, prompts=[p.raw for p in batch], completions=texts,
                          columns=columns, **rewarder.query_texts(roll, tok))


def _label(spec: str) -> str:
    """runs/x/policy -> x/policy; a directory's name alone otherwise."""
    parts = Path(spec).parts
    return "/".join(parts[-2:]) if parts and parts[-1] == "policy" else parts[-1] if parts else spec


def print_table(result: dict[str, Any]) -> None:
    """One row per metric, one column per policy (narrow terminals fit several policies)."""
    from rich.console import Console
    from rich.table import Table

    pols = result["policies"]
    sources = sorted({k for r in pols.values() for k in r if k.startswith("reward/")})
    table = Table(title=f"{result['n_samples']} samples per policy; KL to {_label(result['reference'])}")
    table.add_column("metric")
    for name in pols:
        table.add_column(_label(name), justify="right")

    def ms(s: dict[str, float]) -> str:
        return f"{s['mean']:+.3f} ± {s['std']:.3f}"

    for s in sources:
        table.add_row(s, *[ms(r[s]) if s in r else "-" for r in pols.values()])
    table.add_row("KL (nats)", *[ms(r["kl"]) for r in pols.values()])
    table.add_row("length (tokens)", *[f"{r['length']['mean']:.1f}" for r in pols.values()])
    table.add_row("distinct-1", *[f"{r['distinct_1']:.3f}" for r in pols.values()])
    table.add_row("distinct-2", *[f"{r['distinct_2']:.3f}" for r in pols.values()])
    table.add_row("ends with EOS", *[f"{r['eos_fraction']:.0%}" for r in pols.values()])
    Console().print(table)


def run_eval(cfg: EvalConfig) -> int:
    result = evaluate(cfg)
    print_table(result)
    print(f"results and samples written to {cfg.output}")
    return 0


# ------------------------------------------------------------------------------------ reward-eval

@torch.no_grad()
def reward_eval(cfg: RewardEvalConfig) -> dict[str, Any]:
    """Held-out pairwise accuracy, Bradley-Terry loss and mean score gap of a reward model on a pairs file."""

    cfg.validate()
    device = resolve_device(cfg.device)
    cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, device))  # 'auto' -> bf16|fp32
    bf16 = cfg.precision == "bf16"
    pairs = load_pairs(cfg.data, cfg.margin_column)  # type: ignore[arg-type]
    rm = RewardModel(cfg.reward_model, dtype=torch.bfloat16 if bf16 else torch.float32,  # type: ignore[arg-type]
                     device=device)
    encoded = encode_pairs(pairs, rm.tokenizer, cfg.chat_template, cfg.max_length, cfg.data)  # type: ignore[arg-type]

    def score(seqs: list[list[int]]) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            return rm.score_ids(*left_pad(seqs, rm.tokenizer.pad_token_id, device))

    out = {"reward_model": cfg.reward_model, "data": cfg.data, **evaluate_pairs(score, encoded, cfg.batch_size)}
    if cfg.output:
        Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(Path(cfg.output), json.dumps(tracking.clean_json(out), indent=1) + "\n")
    return out


def run_reward_eval(cfg: RewardEvalConfig) -> int:
    r = reward_eval(cfg)
    print(f"{r['reward_model']} on {r['data']}: accuracy {r['accuracy']:.3f} over {r['n']} pairs, "
          f"loss {r['loss']:.4f}, mean score gap {r['margin']:+.3f}")
    if not math.isfinite(r["loss"]):
        print("warning: non-finite loss; check the reward model", file=sys.stderr)
    return 0


# ----------------------------------------------------------------- during a PPO run (--eval-prompts)

@torch.no_grad()
def during_ppo(trainer: Any, updates: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """PPO's held-out evaluation (``--eval-prompts``) after ``updates`` steps of ``trainer`` (a
    :class:`ppolm.ppo_trainer.PPOTrainer`): (metrics, sample rows).

    Score the held-out prompts with every training source, the eval-only scorers and the KL
    to the reference. Sampling uses its own seed (:func:`seeded_rng`) so the training RNG stream,
    and hence resume, is unaffected. eval/score is objective/scores' definition (the training
    sources' weighted sum, with the missing-EOS and length penalties); eval/<source> is each raw."""

    g, cfg = trainer.cfg.generation, trainer.cfg
    scorer = Rewarder(trainer.rewarder.models, trainer.rewarder.functions + trainer.eval_functions,
                      model_weight=trainer.rewarder.model_weight, ensemble_rule=trainer.rewarder.ensemble_rule)
    n_train = len(trainer.rewarder.functions)
    done = []  # (batch index, totals, parts, kls, lengths, rows) of this process's batches
    trainer.policy.eval()
    size = cfg.run.eval_batch_size
    starts = range(0, len(trainer.eval_prompts), size)
    # Batch b runs on process b mod N under its own seed (the training streams untouched): the same
    # results on any number of processes.
    for b in range(len(starts))[distributed.rank()::distributed.world_size()]:
        i = starts[b]
        with seeded_rng(cfg.run.seed + 1_000_003 + b, trainer.device):
            prompts = trainer.eval_prompts[i:i + size]
            roll = ro.generate(trainer.policy, [p.ids for p in prompts], pad_id=trainer.pad_id,
                               eos_id=trainer.eos_id,
                               max_new_tokens=g.response_length, temperature=g.temperature, top_p=g.top_p,
                               top_k=g.top_k, ignore_eos=g.ignore_eos, share_prefix=cfg.model.share_prefix)
            if cfg.model.share_prefix:
                roll.share_prefix()
            fo = trainer.frozen.run(roll, prompts, scorer, tap=False)
            parts, texts = fo.parts, fo.texts
            logp = ro.logprobs(trainer.policy, roll, g.temperature, trainer.policy_start, fo.policy_entering)
            kl = (core.kl_penalty(logp, fo.ref_logprobs, cfg.kl.kl_estimator) * roll.response_mask).sum(1)
            # the training score excludes the eval-only scorers' weights
            total = sum((parts[f"reward/{f.name}"] * f.weight for f in scorer.functions[:n_train]),
                        torch.zeros(len(prompts)))
            if trainer.rewarder.models:
                total = total + trainer.rewarder.model_weight * parts[ensemble_key(trainer.rewarder)]
            total = trainer.penalise(total, roll).cpu()  # as objective/scores; eval/<source> stay raw
            rows = [{"step": updates, "prompt": p.raw, "response": t,
                     "scores": {k.removeprefix("reward/"): float(v[j]) for k, v in parts.items()},
                     "score": float(total[j]), "kl": float(kl[j])} for j, (p, t) in enumerate(zip(prompts, texts))]
            done.append((b, total, {k: v.float().cpu() for k, v in parts.items()}, kl.float().cpu(),
                         roll.lengths.float().cpu(), rows))
    trainer.policy.train()
    done = sorted((x for part in distributed.gather_objects(done) for x in part), key=lambda x: x[0])
    totals = [x[1] for x in done]
    all_parts: dict[str, list[torch.Tensor]] = {}
    for x in done:
        for k, v in x[2].items():
            all_parts.setdefault(k, []).append(v)
    kls, lengths = [x[3] for x in done], [x[4] for x in done]
    rows = [r for x in done for r in x[5]]

    def mean_se(xs: list[torch.Tensor]) -> tuple[float, float]:
        x = torch.cat(xs).float()
        return x.mean().item(), (x.std().item() / math.sqrt(len(x)) if len(x) > 1 else 0.0)

    metrics: dict[str, Any] = {"updates": updates}
    metrics["eval/score"], metrics["eval/score_se"] = mean_se(totals)
    for k, v in all_parts.items():
        name = "eval/" + k.removeprefix("reward/")
        metrics[name], metrics[name + "_se"] = mean_se(v)
    metrics["eval/kl"], metrics["eval/kl_se"] = mean_se(kls)
    metrics["eval/length_mean"] = torch.cat(lengths).mean().item()
    return metrics, rows


def ensemble_key(rewarder: Any) -> str:
    """The parts key holding the (ensembled) reward-model score."""
    if len(rewarder.models) == 1:
        return f"reward/{rewarder.models[0].name}"
    return f"reward/ensemble_{rewarder.ensemble_rule}"
