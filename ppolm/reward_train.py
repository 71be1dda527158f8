"""Reward-model training (``ppolm reward``): a backbone plus a scalar head, fitted to preference pairs.

The loss is Bradley-Terry (:func:`ppolm.core.pairwise_loss`): P(chosen > rejected) =
sigmoid(r_chosen - r_rejected [- margin]). Only differences are identified, so an optional
centring term ``coef * mean((r_c + r_r)^2)`` keeps the raw scores near zero. Each text is encoded
exactly as PPO scores it (chat-templated prompt, response, EOS) and read at the last real token.

After training, :func:`normalize_reward_model` fits a gain and bias so that scores have mean 0
and std 1 on responses sampled from a reference policy (OpenAI's detail 8). They are stored in
``ppolm_reward.json`` beside the weights and applied by :class:`ppolm.rewards.RewardModel`; plain
``AutoModelForSequenceClassification`` reads the raw head, which ranks pairs the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ppolm import atomic, checkpoint, core, critic, distributed, models, prefix, sft, trainloop, trunk
from ppolm import rollout as ro
from ppolm.config_sections import (
    HeldOutSplit,
    LoRAOptions,
    ModelLoading,
    OptimiserOptions,
    TextEncoding,
    TrainRunControl,
)
from ppolm.data import encode_prompt, load_prompts
from ppolm.errors import PPOLMError
from ppolm.models import position_ids_from_mask, scalar_forward
from ppolm.pairs import encode_pairs, group_keys, load_pairs
from ppolm.rewards import RewardModel, write_norm
from ppolm.rollout import left_pad
from ppolm.rundir import OutputDir
from ppolm.runtime import resolve_device, resolve_precision, seed_everything


@dataclass
class RewardTrainConfig(TrainRunControl, ModelLoading, LoRAOptions, TextEncoding, OptimiserOptions, HeldOutSplit):
    """Everything a reward-model run needs; ``train_reward(config.build(RewardTrainConfig, {...}))``."""

    model: str = "smollm2-135m-instruct"
    """Backbone: a causal LM (e.g. the `ppolm sft` output) or a sequence-classification model; a directory, .gguf or embedded name."""
    data: list[str] = field(default_factory=list)
    """Preference pairs (.jsonl/.json/.parquet/.csv or a datasets directory): 'prompt', 'chosen', 'rejected'. Repeatable. more: docs/pipeline.md"""
    init_from: str | None = None
    """Continue this reward model (e.g. last round's) instead of a new head on --model; its normalisation is fitted again."""
    eval_data: str | None = None
    """Held-out pairs for accuracy and loss; default: a seeded --eval-fraction of --data."""
    output_dir: str = "runs/reward"
    """Where the reward model (Hugging Face sequence-classification format, with tokenizer), ppolm_reward.json and metrics.jsonl go."""
    epochs: int = 1
    """Passes over the pairs (InstructGPT trained RMs for one epoch: more overfits)."""
    batch_size: int = 8
    """Pairs per optimiser step."""
    lr: float = 1e-4
    """AdamW learning rate (for the default --train-layers 2; full fine-tuning wants ~1e-5)."""
    margin_column: str | None = "margin"
    """Column whose value is subtracted inside the loss, sigmoid(r_c - r_r - margin) (Llama 2), when the data has it; none = ignore."""
    center_coef: float = 0.0
    """Weight of the centring term mean((r_c + r_r)^2), which keeps raw rewards near zero (e.g. 0.01)."""
    train_layers: int = 2
    """Train the scalar head, the final norm and the top N transformer layers; the rest stays frozen (fast on a CPU). -1 = all."""
    group_by_prompt: bool = False
    """Train each prompt's C(K, 2) comparisons as one item (InstructGPT): each response runs once; --batch-size counts prompts. more: docs/defaults.md#group-by-prompt"""
    trunk_cache: bool = True
    """With --train-layers N (no LoRA): run the frozen lower layers once per distinct text and train on their cached output. more: docs/defaults.md#trunk-cache"""
    lora_r: int = 0
    """LoRA rank (peft) on all layers instead of --train-layers; 0 = off. The head is always trained in full."""
    chat_template: bool = True
    """Apply the tokenizer's chat template to text prompts, as `ppolm ppo` does before scoring."""
    normalize: bool = True
    """After training, set a gain and bias so scores have mean 0, std 1 on responses of --norm-policy (OpenAI detail 8)."""
    norm_source: Literal["samples", "pairs"] = "samples"
    """What the normalisation is fitted on: fresh samples of --norm-policy, or the pairs' own responses (no sampling). more: docs/defaults.md#norm-source"""
    norm_policy: str | None = None
    """Reference policy whose samples define the normalisation; default: --model (the SFT model PPO starts from)."""
    norm_prompts: str | None = None
    """Prompts for the normalisation samples; default: the prompts of --data."""
    norm_samples: int = 64
    """Number of sampled responses the normalisation is fitted on."""
    norm_response_length: int = 48
    """Max new tokens per normalisation sample (match `ppolm ppo --response-length`)."""
    norm_temperature: float = 0.7
    """Sampling temperature of the normalisation samples (match `ppolm ppo --temperature`)."""
    seed: int = 0
    """Random seed (split, shuffling, head init, normalisation samples)."""

    def validate(self) -> None:
        for path in data_files(self) or [None]:  # each file checked as a single --data is
            trainloop.check_common(dataclasses.replace(self, data=path))
        if self.init_from is not None:
            out, rm = (Path(p).expanduser().resolve() for p in (self.output_dir, self.init_from))
            if out == rm or out in rm.parents:
                raise PPOLMError(f"--output-dir {self.output_dir} holds the --init-from reward model, which writing "
                                 "there would replace; choose another --output-dir")
        if self.center_coef < 0 or self.norm_samples < 2 or self.norm_response_length < 1:
            raise PPOLMError("--center-coef must be >= 0, --norm-samples >= 2 and --norm-response-length >= 1")
        if self.norm_temperature <= 0:
            raise PPOLMError(f"--norm-temperature must be > 0; got {self.norm_temperature}")
        if self.train_layers < -1:
            raise PPOLMError(f"--train-layers must be -1 (every layer) or >= 0; got {self.train_layers}")


def data_files(cfg: RewardTrainConfig) -> list[str]:
    """The --data files (one path given as a string counts as a list of one)."""
    return [cfg.data] if isinstance(cfg.data, str) else list(cfg.data or [])


# ------------------------------------------------------------------------------------ pairs

def score_seqs(model: Any, seqs: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """Raw head output at the last token of each (left-padded) sequence: (N,) float32."""

    ids, mask = left_pad(seqs, pad_id, device)
    return scalar_forward(model, ids, mask)[:, -1]


@torch.no_grad()
def evaluate_pairs(score_fn: Any, encoded: list[tuple], batch_size: int) -> dict[str, float]:
    """Pairwise accuracy (strictly higher chosen score), Bradley-Terry loss and mean score gap.

    Each distinct text is scored once (K ranked responses per prompt give C(K, 2) pairs but only K
    texts), in batches of ``2 * batch_size`` texts (at least 16)."""
    texts = list(dict.fromkeys(tuple(x) for c, r, _ in encoded for x in (c, r)))
    step = max(16, 2 * batch_size)
    found = torch.cat([score_fn([list(x) for x in texts[i:i + step]]).float().cpu()
                       for i in range(0, len(texts), step)]) if texts else torch.zeros(0)
    where = {x: i for i, x in enumerate(texts)}
    c = found[[where[tuple(x)] for x, _, _ in encoded]]
    r = found[[where[tuple(x)] for _, x, _ in encoded]]
    m = [x for _, _, x in encoded]
    return {"accuracy": float((c > r).float().mean()), "loss": float(core.pairwise_loss(c, r, torch.tensor(m))),
            "margin": float((c - r).mean()), "n": len(c), "scores": (c.tolist(), r.tolist())}


# ------------------------------------------------------------------------------------ training

def freeze_lower_layers(model: Any, n: int) -> None:
    """Train only the head, the final norm and the top ``n`` transformer blocks (n < 0: everything)."""
    if n < 0:
        return
    trunk = getattr(model, model.base_model_prefix)
    blocks = max((m for m in trunk.modules() if isinstance(m, torch.nn.ModuleList)), key=len, default=[])
    model.requires_grad_(False)
    model.score.requires_grad_(True)
    for block in list(blocks)[len(blocks) - n:] if n else []:
        block.requires_grad_(True)
    if n and getattr(trunk, "norm", None) is not None:
        trunk.norm.requires_grad_(True)


class TrunkCache:
    """The frozen trunk's output for every distinct sequence, computed once; scores from the top layers.

    With the lower ``L - n`` layers frozen, their output for a text never changes during training, so
    it is computed once (no grad, batched) and the trained top ``n`` layers, final norm and head run on
    it each step: the same function, computed in a fraction of the time (exact up to float rounding
    from different batch padding). Texts that begin alike (one chat template) run that beginning
    once per batch (:mod:`ppolm.prefix`). ``n = 0`` caches the final hidden state at the last token (head only).
    """

    BUDGET = 1 << 30  # bytes

    def __init__(self, model: Any, n: int, seqs: list[list[int]], pad_id: int, device: torch.device,
                 precision: str, batch_size: int = 16):

        backbone, layers = models.stack(model)  # type: ignore[misc]
        self.model, self.backbone, self.layers, self.n, self.pad_id = model, backbone, layers, n, pad_id
        self.split = len(layers) - n
        self.device, self.precision = device, precision
        self.hidden: dict[tuple[int, ...], torch.Tensor] = {}
        uniq = sorted(dict.fromkeys(tuple(x) for x in seqs), key=len)  # similar lengths batch together
        tap = critic.Tap(layers[self.split]) if n else None
        with torch.no_grad():
            for i in range(0, len(uniq), batch_size):
                chunk = uniq[i:i + batch_size]
                ids, mask = left_pad([list(x) for x in chunk], pad_id, device)
                # texts of one chat template begin alike: that beginning runs once (ppolm/prefix.py)
                split = prefix.find(ids, mask, ids.shape[1]) if prefix.usable(model) else None
                with trainloop.autocast(device, precision), (tap.capture() if tap else contextlib.nullcontext()):
                    if split is not None:
                        out = prefix.forward(backbone, ids, mask, split)
                    else:
                        out = backbone(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                                       use_cache=False).last_hidden_state
                h = tap.hidden if tap else out[:, -1:]  # (B, T, d), or (B, 1, d) after the final norm
                for j, x in enumerate(chunk):
                    self.hidden[x] = h[j, -min(len(x), h.shape[1]):].clone()

    @staticmethod
    def fits(model: Any, n: int, seqs: list[list[int]]) -> bool:
        found = models.stack(model)
        if found is None or n >= len(found[1]):
            return False
        width = model.config.hidden_size * 4
        distinct = {tuple(x) for x in seqs}
        return sum(len(x) if n else 1 for x in distinct) * width <= TrunkCache.BUDGET

    def scores(self, seqs: list[list[int]]) -> torch.Tensor:
        """Raw head output at the last token of each sequence: (N,) float32, with grad."""

        hs = [self.hidden[tuple(x)] for x in seqs]
        head = self.model.score
        if not self.n:
            with trainloop.autocast(self.device, self.precision):
                return models.scalar_head(head, torch.cat(hs))
        width = max(len(h) for h in hs)
        h = hs[0].new_zeros((len(hs), width, hs[0].shape[-1]))
        mask = torch.zeros((len(hs), width), dtype=torch.long, device=self.device)
        for i, x in enumerate(hs):
            h[i, width - len(x):], mask[i, width - len(x):] = x, 1
        with trainloop.autocast(self.device, self.precision):
            out = trunk.run_from(self.model, self.split, h.to(head.weight.dtype), mask)
            return models.scalar_head(head, out[:, -1])


def train_reward(cfg: RewardTrainConfig) -> list[dict[str, Any]]:
    """Train, save and (by default) normalise a reward model; returns the metrics rows (epoch 0 = before).

    Stopped by Ctrl-C/SIGTERM, it saves a checkpoint and returns the rows so far without saving the model
    (continue with ``resume=True``)."""
    return _train_reward(cfg)[0]


def _train_reward(cfg: RewardTrainConfig) -> tuple[list[dict[str, Any]], bool]:
    cfg.validate()
    out = Path(cfg.output_dir)
    device = resolve_device(cfg.device)
    cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, device))  # 'auto' -> bf16|fp32
    out_dir = OutputDir(out, "reward_config.yaml")
    out_dir.check(cfg)  # checks only: nothing changes before the inputs load
    seed_everything(cfg.seed)
    tok = models.load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle)
    # several files (labelling rounds): a prompt's pairs form one group per file, so that two rounds'
    # rankings of one prompt stay two items under --group-by-prompt
    pairs, train, keys = [], [], []
    for path in data_files(cfg):
        found = load_pairs(path, cfg.margin_column)
        first = max(keys) + 1 if keys else 0
        pairs += found
        train += encode_pairs(found, tok, cfg.chat_template, cfg.max_length, path)
        keys += [first + k for k in group_keys(found)]
    if cfg.eval_data:
        held = encode_pairs(load_pairs(cfg.eval_data, cfg.margin_column), tok, cfg.chat_template, cfg.max_length,
                            cfg.eval_data)
    else:
        both, held_both = trainloop.split_rows(list(zip(train, keys)), cfg.eval_fraction, cfg.seed)
        train, keys = [x for x, _ in both], [k for _, k in both]
        held = [x for x, _ in held_both]
    if not train:
        raise PPOLMError(f"{', '.join(data_files(cfg))} leave no training pairs after the held-out split; add rows or lower "
                         "--eval-fraction")
    if cfg.normalize and cfg.norm_source == "samples" and (cfg.norm_policy or cfg.norm_prompts):
        # the normalisation runs after training: its policy and prompts are checked now
        norm_tok = tok if cfg.norm_policy is None else models.load_tokenizer(
            cfg.norm_policy, trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle)
        if cfg.norm_prompts is not None:
            load_prompts(cfg.norm_prompts, norm_tok, chat_template=cfg.chat_template)
    device = distributed.init(cfg.device, cfg.dist_timeout)  # torchrun: join the others (ppolm/distributed.py)
    if cfg.init_from is not None:
        old = models.load_tokenizer(cfg.init_from, trust_remote_code=cfg.trust_remote_code,
                                    allow_pickle=cfg.allow_pickle)
        if old.get_vocab() != tok.get_vocab():
            raise PPOLMError(f"--init-from {cfg.init_from} has another tokenizer than --model {cfg.model}; continue a "
                             "reward model with the --model it was trained from")
    # --init-from: the reward model's raw head, without its normalisation (fitted again after training)
    model = models.load_scalar_model(cfg.init_from or cfg.model, head_init="keep" if cfg.init_from else "reward",
                                     dtype=torch.float32, device=device, tokenizer=tok,
                                     trust_remote_code=cfg.trust_remote_code, allow_pickle=cfg.allow_pickle)
    model = trainloop.apply_lora(model, cfg, "SEQ_CLS") if cfg.lora_r > 0 else model
    if cfg.lora_r == 0:
        freeze_lower_layers(model, cfg.train_layers)
    trainloop.commit_output_dir(out_dir, cfg)
    # training items: pairs, or with --group-by-prompt each prompt's pairs (in order of first appearance)
    groups: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    items = list(groups.values()) if cfg.group_by_prompt else [[i] for i in range(len(train))]
    steps_per_epoch = math.ceil(len(items) / cfg.batch_size)
    pad = tok.pad_token_id
    cache = None
    every = [x for c, r, _ in train + held for x in (c, r)]
    if cfg.trunk_cache and cfg.lora_r == 0 and cfg.train_layers >= 0 and TrunkCache.fits(model, cfg.train_layers,
                                                                                          every):
        t0 = time.perf_counter()
        cache = TrunkCache(model, cfg.train_layers, every, pad, device, cfg.precision)
        if not cfg.quiet:
            print(f"frozen lower layers run once for {len(cache.hidden)} distinct texts "
                  f"({time.perf_counter() - t0:.0f}s); training the top {cfg.train_layers} on their output",
                  file=sys.stderr)
    forward = trainloop.parallel(model, cfg, device)  # DDP/FSDP with several processes (after the cache)
    opt, sched = trainloop.make_optimizer([p for p in model.parameters() if p.requires_grad], cfg,
                                          steps_per_epoch * cfg.epochs)

    def scores(seqs: list[list[int]]) -> torch.Tensor:
        if cache is not None:
            return cache.scores(seqs)
        with trainloop.autocast(device, cfg.precision):
            return score_seqs(model, seqs, pad, device)

    last_eval: dict[str, Any] = {}

    def evaluate_held() -> dict[str, Any]:
        model.eval()
        with torch.no_grad():  # every process, through the DDP/FSDP module (DDP: no grad, no backward)
            return forward(evaluate_pairs, scores, held, cfg.batch_size)

    def held_out(row: dict[str, Any]) -> dict[str, Any]:
        if held:
            ev = evaluate_held()
            row.update(eval_accuracy=ev["accuracy"], eval_loss=ev["loss"], eval_margin=ev["margin"])
            last_eval.update(ev)
        return row

    def step_fn(idx: list[int], forward: Any) -> tuple[torch.Tensor, int, dict[str, int]]:
        """The loss is the mean over the batch's pairs (or, --group-by-prompt, its prompts)."""
        if not cfg.group_by_prompt:
            batch = [train[j] for j in idx]
            s = forward(scores, [c for c, _, _ in batch] + [r for _, r, _ in batch])
            rc, rr = s[:len(batch)], s[len(batch):]
            loss = core.pairwise_loss(rc, rr, torch.tensor([m for _, _, m in batch], device=device))
            if cfg.center_coef:
                loss = loss + cfg.center_coef * ((rc + rr) ** 2).mean()
            return loss, len(batch), {"tokens": sum(len(c) + len(r) for c, r, _ in batch),
                                      "correct": int((rc > rr).sum())}
        # each distinct response of the batch's prompts scored once; a prompt's pairs weigh as one item
        seq_index: dict[tuple[int, ...], int] = {}
        ci, ri, gi, margins = [], [], [], []
        for g, item in enumerate(idx):
            for j in items[item]:
                c, r, m = train[j]
                ci.append(seq_index.setdefault(tuple(c), len(seq_index)))
                ri.append(seq_index.setdefault(tuple(r), len(seq_index)))
                gi.append(g)
                margins.append(m)
        s = forward(scores, [list(x) for x in seq_index])
        as_long = dict(dtype=torch.long, device=s.device)
        c_t, r_t = torch.tensor(ci, **as_long), torch.tensor(ri, **as_long)
        loss = core.grouped_pairwise_loss(s, c_t, r_t, torch.tensor(gi, **as_long),
                                          torch.tensor(margins, device=s.device))
        if cfg.center_coef:
            loss = loss + cfg.center_coef * ((s[c_t] + s[r_t]) ** 2).mean()
        return loss, len(idx), {"tokens": sum(len(x) for x in seq_index), "correct": int((s[c_t] > s[r_t]).sum())}

    def epoch_row(epoch: int, acc: dict[str, Any]) -> dict[str, Any]:
        return held_out({"epoch": epoch, "train_loss": acc["loss_sum"] / acc["loss_n"] if acc["loss_n"] else None,
                         "train_accuracy": acc.get("correct", 0) / len(train)})

    loop = trainloop.TrainLoop(cfg, out, model, opt, sched, len(items), "reward", step_fn, epoch_row,
                            lambda: held_out({"epoch": 0}) if held else None, forward)
    if not loop.run():
        return loop.rows, False
    rows = loop.rows
    if held and not last_eval:
        last_eval.update(evaluate_held())
    raw = None
    texts = list(dict.fromkeys(tuple(x) for x in every))
    if cfg.normalize and cfg.norm_source == "pairs":
        model.eval()
        step = max(16, 2 * cfg.batch_size)
        with torch.no_grad():
            raw = torch.cat([forward(scores, [list(x) for x in texts[i:i + step]]).float().cpu()
                             for i in range(0, len(texts), step)])

    final = trainloop.saveable(model, cfg, tok, "scalar")
    if not distributed.is_main():  # process 0 saves and normalises the model
        distributed.barrier()
        return rows, True
    sft.save_model(final, tok, out, merge=True)
    if held:
        # the final model's raw scores of every held-out pair, in the order of --eval-data (or of the
        # held-out split): which pairs it gets wrong, and how sure it is
        chosen, rejected = last_eval["scores"]
        try:
            atomic.write_text(out / "eval_scores.jsonl", "".join(
                json.dumps({"score_chosen": c, "score_rejected": r, "correct": c > r}) + "\n"
                for c, r in zip(chosen, rejected)))
        except OSError as e:
            raise checkpoint.disk_error(e, out) from None
    if cfg.normalize and cfg.norm_source == "pairs":

        gain, bias, mean, std = fit_norm(raw, f"{len(texts)} responses of the pairs")
        write_norm(out, gain, bias, raw_mean=mean, raw_std=std, n_samples=len(texts), source="pairs")
        rows[-1].update(norm_gain=gain, norm_bias=bias)
    elif cfg.normalize:
        prompts = [p.prompt for p in pairs]
        prompts = list({repr(p): p for p in prompts}.values())  # unique, in order
        gain, bias = normalize_reward_model(out, cfg.norm_policy or cfg.model, cfg.norm_prompts or prompts,
                                            cfg.norm_samples, response_length=cfg.norm_response_length,
                                            temperature=cfg.norm_temperature, seed=cfg.seed, device=cfg.device,
                                            precision=cfg.precision, chat_template=cfg.chat_template,
                                            batch_size=cfg.batch_size)
        rows[-1].update(norm_gain=gain, norm_bias=bias)
    distributed.barrier()
    return rows, True


# ------------------------------------------------------------------------------------ normalisation

@torch.no_grad()
def reference_scores(rm: Any, policy: str, prompts: str | list[Any] | None, n_samples: int, *,
                     response_length: int = 48, temperature: float = 0.7, seed: int = 0, precision: str = "bf16",
                     chat_template: bool = True, batch_size: int = 8) -> torch.Tensor:
    """Scores by ``rm`` (a :class:`ppolm.rewards.RewardModel`) of ``n_samples`` responses that ``policy``
    samples for ``prompts`` (a file, a list of texts/chat lists, or None for the built-in set): (n,)."""
    dev = next(rm.model.parameters()).device
    tok = models.load_tokenizer(policy)
    lm = models.load_causal_lm(policy, dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
                               device=dev, tokenizer=tok)
    if prompts is None or isinstance(prompts, (str, Path)):
        ids = [p.ids for p in load_prompts(prompts, tok, chat_template=chat_template)]
    else:
        ids = [encode_prompt(p, tok, chat_template) for p in prompts]
    same_vocab = rm.tokenizer.get_vocab() == tok.get_vocab()
    torch.manual_seed(seed)
    picks = [ids[i % len(ids)] for i in torch.randperm(max(n_samples, len(ids))).tolist()][:n_samples]
    out = []
    for i in range(0, n_samples, batch_size):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            roll = ro.generate(lm, picks[i:i + batch_size], pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                               max_new_tokens=response_length, temperature=temperature)
            if same_vocab:
                out.append(rm.score_ids(roll.input_ids, roll.attention_mask).cpu())
            else:  # different tokenizers: score the text, re-tokenised by the reward model (as PPO does)
                texts = tok.batch_decode([r[m.bool()] for r, m in zip(roll.input_ids, roll.attention_mask)])
                out.append(rm.score_texts(texts))
    return torch.cat(out).float()


def fit_norm(raw: torch.Tensor, what: str) -> tuple[float, float, float, float]:
    """(gain, bias, mean, std) with gain * raw + bias of mean 0 and std 1 over ``raw``."""
    mean, std = float(raw.mean()), float(raw.std(unbiased=False))
    if not (math.isfinite(mean) and std > 1e-8):
        raise PPOLMError(f"the reward model gives (nearly) the same score to all {what} (std {std:.2g}); "
                         "train it longer or pass --no-normalize")
    return 1.0 / std, -mean / std, mean, std


def normalize_reward_model(rm_dir: str | Path, policy: str, prompts: str | list[Any] | None, n_samples: int, *,
                           response_length: int = 48, temperature: float = 0.7, seed: int = 0,
                           device: str = "auto", precision: str = "auto", chat_template: bool = True,
                           batch_size: int = 8) -> tuple[float, float]:
    """Fit score = gain * raw + bias to mean 0, std 1 over :func:`reference_scores` of ``policy``;
    write them to ``rm_dir/ppolm_reward.json`` (read by every later scorer) and return (gain, bias)."""

    dev = resolve_device(device)
    precision = resolve_precision(precision, dev)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    rm = RewardModel(str(rm_dir), dtype=dtype, device=dev)
    rm.gain, rm.bias = 1.0, 0.0  # raw scores while fitting
    raw = reference_scores(rm, policy, prompts, n_samples, response_length=response_length,
                           temperature=temperature, seed=seed, precision=precision, chat_template=chat_template,
                           batch_size=batch_size)
    gain, bias, mean, std = fit_norm(raw, f"{n_samples} samples of {policy}")
    write_norm(rm_dir, gain, bias, raw_mean=mean, raw_std=std, n_samples=n_samples, policy=str(policy),
               response_length=response_length, temperature=temperature, seed=seed)
    return gain, bias


def run(cfg: RewardTrainConfig) -> int:
    rows, finished = _train_reward(cfg)
    if not finished:
        return 130
    last = rows[-1]
    acc = f", held-out accuracy {last['eval_accuracy']:.3f}" if "eval_accuracy" in last else ""
    norm = " (normalised: mean 0, std 1 on reference samples)" if cfg.normalize else ""
    print(f"done: {cfg.epochs} epochs{acc}; reward model saved to {cfg.output_dir}{norm}; "
          f"use it with `ppolm ppo --reward-model {cfg.output_dir}`", file=sys.stdout)
    return 0
