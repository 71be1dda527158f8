"""``ppolm demo``: the whole RLHF pipeline on the embedded model, showing Goodhart's law.

Stages (each prints its progress; finished stages are kept, so ``--resume`` continues after Ctrl-C):

1. **task**: short product/film review prompts (train and held-out items disjoint) and the gold
   judge of :mod:`ppolm.gold`, a deterministic stand-in for a human rater;
2. **pairs**: K = 6 responses per training prompt (quick: 4) sampled from the starting policy at
   the temperature PPO samples at (0.7: the proxy learns to rank what PPO starts from), every two of
   them compared (C(K, 2) = 15 pairs per prompt, as InstructGPT's rankings), each label a
   Bradley-Terry draw from the gold difference (noisy, like human labels);
3. **proxy reward model**: ``ppolm reward`` on those pairs (each prompt's comparisons as one item,
   ``--group-by-prompt``), held-out accuracy reported, then normalised to mean 0 / std 1 on the same
   starting-policy samples;
4. **PPO** against the proxy (critic initialised from it with a zero value head, adaptive KL), scoring
   held-out prompts with the proxy *and* the gold judge every few steps and keeping the best-gold
   policy in ``best/``;
5. **confirm**: the best-gold checkpoint and the starting policy scored again on fresh samples (the
   best step was picked on noisy evaluations, so its in-run figure is optimistic);
6. **report**: ``report.html`` with the proxy-vs-gold curves against KL (Gao et al. 2022), alarms
   and samples; ``demo.json`` holds the numbers.

With ``--algorithms ppo,grpo,rloo,dpo`` each alternative trains after PPO on the same task and
budget, in ``<output-dir>/<name>/``, and the report compares them (ppolm/compare.py).
"""

from __future__ import annotations

import errno
import json
import math
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from ppolm import alarms, atomic, compare, config, models
from ppolm import rollout as ro
from ppolm.compare import ALGORITHMS
from ppolm.data import encode_prompt
from ppolm.demo_sizes import FULL, QUICK, Sizes
from ppolm.errors import PPOLMError
from ppolm.gold import JUDGE_DESCRIPTION, gold_score, review_prompts
from ppolm.ppo import train_ppo
from ppolm.ppo_config import PPOConfig
from ppolm.ppo_trainer import OUTPUTS
from ppolm.report import write_report
from ppolm.reward_train import RewardTrainConfig, _train_reward
from ppolm.runtime import dtype_of, resolve_device, resolve_precision
from ppolm.tracking import read_jsonl

RM_DIR = "proxy_rm"  # its name is the proxy's metric name: eval/proxy_rm
GOLD_METRIC = "eval/gold_judge"
OWN_FILES = ("demo.json", "prompts_train.jsonl", "prompts_eval.jsonl", "pairs_train.jsonl", "pairs_eval.jsonl",
             RM_DIR, "algorithm.json", "refresh")


@dataclass
class DemoConfig:
    output_dir: str = "runs/demo"
    """Where everything goes: pairs, the proxy reward model, the PPO run, report.html."""
    quick: bool = False
    """A smaller run (about 3 minutes on 2 CPU cores) that checks the pipeline, too short to show much."""
    overwrite: bool = False
    """Replace the demo files in an existing --output-dir."""
    resume: bool = False
    """Continue an interrupted demo in --output-dir: finished stages are kept, PPO resumes from its checkpoint."""
    seed: int = 0
    """Random seed of prompts, sampling, labels and training."""
    model: str = "smollm2-135m-instruct"
    """Starting policy (and the reward model's backbone)."""
    steps: int | None = None
    """PPO steps (default: 8, quick: 3)."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """auto: bf16 where the device the demo computes on has native bf16 (a GPU with bf16; a CPU with AMX/AVX512-BF16), else fp32 (emulated bf16 is slower)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of every stage: auto picks cuda when available."""
    quiet: bool = False
    """Log lines instead of progress bars."""
    threads: int = 0
    """CPU threads for torch; 0 = auto: every core, or 1 when the machine is already busy (load average >= cores). why: docs/defaults.md#threads"""
    overoptimisation: bool = False
    """A longer run (about 25 minutes on 2 AVX-512 cores): PPO against the static proxy and, at one KL budget, a refreshed one. more: docs/demo.md#the-long-mode"""
    algorithms: str = "ppo"
    """Algorithms to compare, comma-separated: ppo plus any of grpo, dr-grpo, rloo, reinforce++(-baseline), remax, dpo. more: docs/demo.md#head-to-head"""

    def validate(self) -> None:
        if self.steps is not None and self.steps < 1:
            raise PPOLMError(f"--steps must be at least 1; got {self.steps}")
        if self.threads < 0:
            raise PPOLMError(f"--threads must be >= 0; got {self.threads}")
        if self.resume and self.overwrite:
            raise PPOLMError("--resume and --overwrite exclude each other; pick one")

        compare.parse(self.algorithms)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write atomically (temp file + rename), so an interrupted stage never leaves half a file."""
    atomic.write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def mean_se(xs: list[float]) -> dict[str, float]:
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return {"mean": m, "se": sd / math.sqrt(len(xs)), "n": len(xs)}




class Demo:
    gold_metric = GOLD_METRIC
    """The held-out metric of the gold judge: ``eval/`` and the judge function's name."""
    judge_spec = "ppolm.gold:gold_judge"
    judge_description = JUDGE_DESCRIPTION

    def gold(self, text: str) -> float:
        """The gold judge on one response (ppolm/gold.py)."""
        return gold_score(text)

    def __init__(self, cfg: DemoConfig):
        cfg.validate()
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        base = QUICK if cfg.quick else FULL
        self.sizes = Sizes(**{**asdict(base), **({"steps": cfg.steps} if cfg.steps else {})})

        # one device for every stage, and the precision that is fastest *there* (not bf16 because a
        # GPU exists while the stages compute on the CPU)
        self.device = resolve_device(cfg.device)
        self.precision = resolve_precision(cfg.precision, self.device)
        self.dtype = dtype_of(self.precision)
        self.state: dict[str, Any] = {}
        self.t0 = time.perf_counter()

        self.algorithms = compare.parse(cfg.algorithms)
        self.others = [a for a in self.algorithms if a != "ppo"]  # the alternatives, each in out/<name>/
        self.n_stages = 6 + len(self.others)

    # ------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Refuse to mix runs: an existing non-empty dir needs --overwrite or --resume."""

        out = self.out
        if out.exists() and not out.is_dir():
            raise PPOLMError(f"--output-dir {out} is a file; choose a directory")
        busy = out.is_dir() and any(out.iterdir())
        if busy and self.cfg.resume:
            if not (out / "demo.json").is_file():
                raise PPOLMError(f"--output-dir {out} holds no demo to resume (no demo.json); choose another directory")
            self.state = json.loads((out / "demo.json").read_text())
            if self.state.get("quick") != self.cfg.quick or self.state.get("seed") != self.cfg.seed or \
                    self.state.get("algorithms", ["ppo"]) != self.algorithms or \
                    bool(self.state.get("overoptimisation")) != self.cfg.overoptimisation:
                raise PPOLMError(f"{out} holds a demo run with different options (quick={self.state.get('quick')}, "
                                 f"overoptimisation={bool(self.state.get('overoptimisation'))}, "
                                 f"seed={self.state.get('seed')}, algorithms="
                                 f"{','.join(self.state.get('algorithms', ['ppo']))}); resume with those, or use "
                                 "--overwrite")
            say(f"resuming the demo in {out}: done so far: {', '.join(self.state.get('done', [])) or 'nothing'}")
        elif busy and not self.cfg.overwrite:
            raise PPOLMError(f"--output-dir {out} already exists and holds files; pass --overwrite to replace it, "
                             "--resume to continue it, or choose a new directory")
        elif busy:

            for name in OWN_FILES + OUTPUTS + ALGORITHMS:
                p = out / name
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        if not self.state:
            self.state = {"quick": self.cfg.quick, "seed": self.cfg.seed, "model": self.cfg.model,
                          "precision": self.precision, "sizes": asdict(self.sizes), "done": [], "timings_s": {},
                          "algorithms": self.algorithms}
            self.save_state()

    def save_state(self) -> None:
        atomic.write_text(self.out / "demo.json", json.dumps(self.state, indent=2))

    def stage(self, n: int, name: str, fn: Any) -> None:
        if name in self.state["done"]:
            say(f"[{n}/{self.n_stages}] {name}: already done")
            return
        self.current = name
        say(f"[{n}/{self.n_stages}] {name} ...")
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        self.state["timings_s"][name] = round(dt, 1)
        self.state["done"].append(name)
        self.save_state()
        say(f"[{n}/{self.n_stages}] {name}: done in {dt:.0f}s (total {time.perf_counter() - self.t0:.0f}s)")

    # ------------------------------------------------------------------------------------ stages
    def task(self) -> None:
        s = self.sizes
        train, held = review_prompts(s.train_prompts, s.eval_prompts, self.cfg.seed)
        write_jsonl(self.out / "prompts_train.jsonl", [{"prompt": p} for p in train])
        write_jsonl(self.out / "prompts_eval.jsonl", [{"prompt": p} for p in held])
        self.state.update(task="Write a short review of a product or film named in the prompt (e.g. "
                               f"'{train[0]}'). {len(train)} training prompts; {len(held)} held-out prompts "
                               "about items never seen in training.", judge=self.judge_description,
                          gold_metric=self.gold_metric)
        say(f"      {len(train)} training prompts, {len(held)} held-out; gold judge: {self.judge_description}")

    def pairs(self) -> None:
        import torch


        s, cfg = self.sizes, self.cfg
        torch.manual_seed(cfg.seed)
        tok = models.load_tokenizer(cfg.model)
        policy = models.load_causal_lm(cfg.model, dtype=self.dtype, device=self.device, tokenizer=tok)
        prompts = [json.loads(x)["prompt"] for x in (self.out / "prompts_train.jsonl").read_text().splitlines()]
        k = s.responses_per_prompt
        jobs = [p for p in prompts for _ in range(k)]  # K responses per prompt
        texts = self.sample(policy, tok, jobs, s.pair_temperature, progress=True)
        # The labeller compares every two of a prompt's K responses (InstructGPT's rankings give C(K, 2)
        # comparisons); each label is a Bradley-Terry draw: P(a preferred) = sigmoid((gold_a - gold_b) / T).
        rng = random.Random(cfg.seed)
        by_prompt, agree, n_pairs = [], 0, 0
        for j, p in enumerate(prompts):
            rows = []
            for a_i in range(k):
                for b_i in range(a_i + 1, k):
                    a, b = texts[j * k + a_i], texts[j * k + b_i]
                    if a.strip() == b.strip() or not a.strip() or not b.strip():
                        continue  # identical responses prefer nothing; an empty one is no review
                    ga, gb = self.gold(a), self.gold(b)
                    a_wins = rng.random() < 1 / (1 + math.exp(-(ga - gb) / s.label_temperature))
                    chosen, rejected = (a, b) if a_wins else (b, a)
                    gc, gr = (ga, gb) if a_wins else (gb, ga)
                    agree += gc >= gr
                    rows.append({"prompt": p, "chosen": chosen, "rejected": rejected, "gold_chosen": gc,
                                 "gold_rejected": gr})
            by_prompt.append(rows)
            n_pairs += len(rows)
        # held out by prompt: the RM's accuracy is measured on prompts it never saw
        n_eval_prompts = max(1, round(len(prompts) * s.rm_eval_fraction))
        held = [r for rows in by_prompt[:n_eval_prompts] for r in rows]
        train = [r for rows in by_prompt[n_eval_prompts:] for r in rows]
        write_jsonl(self.out / "pairs_train.jsonl", train)
        write_jsonl(self.out / "pairs_eval.jsonl", held)
        self.state.update(label_agreement=agree / max(1, n_pairs), n_pairs=n_pairs, rm_accuracy_n=len(held),
                          responses_per_prompt=k, sample_gold=mean_se([self.gold(x) for x in texts]))
        say(f"      {n_pairs} pairs from {k} responses per prompt ({len(train)} train, {len(held)} held-out on "
            f"{n_eval_prompts} prompts); labels agree with the gold ordering on {agree / max(1, n_pairs):.0%} "
            f"(Bradley-Terry noise, T={s.label_temperature})")

    def reward_model(self) -> None:
        s, out = self.sizes, self.out
        cfg = config.build(RewardTrainConfig, dict(
            model=self.cfg.model, data=str(out / "pairs_train.jsonl"), eval_data=str(out / "pairs_eval.jsonl"),
            output_dir=str(out / RM_DIR), epochs=s.rm_epochs, train_layers=s.rm_layers, lr=s.rm_lr,
            batch_size=s.rm_batch_prompts, group_by_prompt=True,
            normalize=True, norm_source="pairs", precision=self.precision, device=self.device.type,
            seed=self.cfg.seed, overwrite=True,
            quiet=self.cfg.quiet))
        # Normalised on the starting policy's own samples, the pairs' responses: mean 0, std 1 (OpenAI
        # detail 8), from the trained top layers on the cached trunk (no second pass over the texts).
        rows, finished = _train_reward(cfg)
        if not finished:  # Ctrl-C/SIGTERM: its checkpoint is saved; the demo says how to resume
            raise KeyboardInterrupt
        acc = rows[-1].get("eval_accuracy")
        held_pairs = [json.loads(x) for x in (out / "pairs_eval.jsonl").read_text().splitlines()]
        scored = [json.loads(x) for x in (out / RM_DIR / "eval_scores.jsonl").read_text().splitlines()]
        vs_gold = [(sc["score_chosen"] > sc["score_rejected"]) == (r["gold_chosen"] > r["gold_rejected"])
                   for r, sc in zip(held_pairs, scored) if r["gold_chosen"] != r["gold_rejected"]]
        self.state.update(rm_accuracy=acc, rm_accuracy_vs_gold=sum(vs_gold) / max(1, len(vs_gold)))
        say(f"      proxy RM held-out accuracy {acc:.3f} on {len(held_pairs)} labelled pairs "
            f"({self.state['rm_accuracy_vs_gold']:.3f} against the noise-free gold ordering)")

    def lora_targets(self) -> str:
        """LoRA on every linear layer of the top ``policy_layers`` blocks: backward stops there (fast on a CPU)."""

        n = json.loads((models.resolve_model_dir(self.cfg.model) / "config.json").read_text())["num_hidden_layers"]
        mods = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")
        return ",".join(f"layers.{i}.{m}" for i in range(max(0, n - self.sizes.policy_layers), n) for m in mods)

    def ppo_options(self, name: str = "ppo") -> dict[str, Any]:
        """``ppolm ppo`` options of the demo's PPO run, or of an alternative estimator's (its settings
        in :data:`ppolm.compare.SETTINGS`, its outputs in out/<name>/): the same task, budget of
        sampled responses, held-out evaluation, LoRA layers and learning rate."""

        s = self.sizes
        out = self.out if name == "ppo" else self.out / name
        resume = (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir())
        options = dict(
            model=self.cfg.model, reward_model=[str(self.out / RM_DIR)], critic_init="reward", temperature=0.7,
            prompts=str(self.out / "prompts_train.jsonl"), eval_prompts=str(self.out / "prompts_eval.jsonl"),
            eval_every=s.eval_every, eval_reward_fn=[self.judge_spec], best_metric=self.gold_metric,
            steps=s.steps, batch_size=s.batch_size, ppo_epochs=s.ppo_epochs,
            response_length=s.response_length, actor_lr=s.actor_lr, lora_r=s.lora_r, minibatches=s.minibatches,
            critic_zero_head=s.critic_zero_head,
            lora_target=self.lora_targets(), kl_coef=s.kl_coef, kl_target=s.kl_target, kl_horizon=s.kl_horizon,
            kl_coef_min=s.kl_coef_min,
            # the proxy is normalised to unit std on the pairs' responses, the unit the demo's beta was
            # measured in; it keeps its raw scores rather than ppolm ppo's running scale
            score_scale="none",
            # and no centring: `ppolm reward` already shifts the proxy towards mean 0, and the
            # demo's report was measured on its scores as they are
            score_center="none",
            length_penalty=s.length_penalty, length_budget=s.length_budget,
            adaptive_kl=True, precision=self.precision, device=self.device.type, seed=self.cfg.seed, sample_every=1,
            save_every=1, keep_last=1, output_dir=str(out), overwrite=not resume, resume=resume, quiet=self.cfg.quiet)
        return {**options, **compare.SETTINGS.get(name, {})}

    def ppo(self) -> None:
        s, out = self.sizes, self.out
        options = self.ppo_options()
        proxy = f"eval/{RM_DIR}"
        if s.length_penalty:
            self.state["ppo_reward"] = (f"proxy reward model score - {s.length_penalty} per response token beyond "
                                        f"{s.length_budget} (a length penalty against length drift)")
            say(f"      PPO reward: {self.state['ppo_reward']}; KL penalty on top")

        def check(rows: list[dict[str, Any]]) -> list[alarms.Alarm]:
            # the per-step alarms are ppolm ppo's own (live); the demo adds the one that needs its gold judge
            a = alarms.over_optimisation(read_jsonl(out / "eval.jsonl"), proxy=proxy, gold=self.gold_metric)
            return [a] if a else []

        with alarms.AlarmWatcher(out / "metrics.jsonl", check):
            if self.others:  # compared with alternatives: a process of its own, as theirs
                self.train_apart("ppo", options, out)
            elif train_ppo(config.build(PPOConfig, options)).interrupted:
                raise KeyboardInterrupt

    def alternative(self, name: str) -> None:
        """Train the PPO alternative ``name`` (ppolm/compare.py) in out/<name>/, in a process of its own."""

        run_dir = self.out / name
        if name != "dpo":
            self.train_apart("ppo", self.ppo_options(name), run_dir)
            return
        s = self.sizes
        resume = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
        options = dict(model=self.cfg.model, data=str(self.out / "pairs_train.jsonl"),
                       eval_data=str(self.out / "pairs_eval.jsonl"), output_dir=str(run_dir), lora_r=s.lora_r,
                       lora_target=self.lora_targets(), precision=self.precision, device=self.device.type,
                       seed=self.cfg.seed, quiet=self.cfg.quiet, save_every=50, keep_last=1, resume=resume,
                       overwrite=not resume, merge_lora=False, **compare.DPO_SETTINGS)
        if resume:  # its held-out evaluations restart with the epoch it resumes (rows after it are redone)
            (run_dir / "eval.jsonl").unlink(missing_ok=True)
        evaluation = dict(prompts=str(self.out / "prompts_eval.jsonl"), reward_model=str(self.out / RM_DIR),
                          response_length=s.response_length, temperature=self.ppo_temperature(), seed=self.cfg.seed,
                          device=self.device.type, precision=self.precision)
        self.train_apart("dpo", options, run_dir, evaluation)

    def train_apart(self, kind: str, options: dict[str, Any], run_dir: Path,
                    evaluation: dict[str, Any] | None = None) -> dict[str, Any]:

        cost = compare.train_in_child(kind, options, run_dir, self.state.get("threads", 1), evaluation)
        self.state.setdefault("costs", {})[run_dir.name if run_dir != self.out else "ppo"] = cost
        self.save_state()
        return cost

    def confirm(self) -> None:
        """Score the best-gold checkpoint and the starting policy once more on the held-out prompts, with
        fresh samples (a seed the run never used) and ``confirm_samples`` responses per prompt. The best
        step was picked as the maximum of several noisy evaluations, which biases its in-run figure
        upwards; these new samples are independent of that choice. Both policies draw from the same
        random stream (common random numbers), so their per-prompt difference is less noisy."""
        import contextlib

        from peft import PeftModel

        adapter = self.out / "best" / "policy_adapter"
        if not adapter.is_dir():
            say("      no best-gold checkpoint was saved; nothing to confirm")
            return
        cfg = self.cfg
        temperature = self.ppo_temperature()
        tok = models.load_tokenizer(cfg.model)
        base = models.load_causal_lm(cfg.model, dtype=self.dtype, device=self.device, tokenizer=tok)
        policy = PeftModel.from_pretrained(base, str(adapter)).eval()
        per_prompt: dict[str, list[float]] = {}
        t = time.perf_counter()
        for which in ("before", "best"):
            with policy.disable_adapter() if which == "before" else contextlib.nullcontext():
                per_prompt[which] = self.fresh_gold(policy, tok, temperature)
            say(f"      {which}: fresh responses scored ({time.perf_counter() - t:.0f}s)")
        diffs = [b - a for a, b in zip(per_prompt["before"], per_prompt["best"])]
        self.state["confirm"] = {"before": mean_se(per_prompt["before"]), "best": mean_se(per_prompt["best"]),
                                 "gain": mean_se(diffs), "samples_per_prompt": self.sizes.confirm_samples,
                                 "n_prompts": len(diffs), "temperature": temperature}

    def fresh_gold(self, policy: Any, tok: Any, temperature: float) -> list[float]:
        """The gold score of ``policy`` per held-out prompt, the mean over ``confirm_samples`` fresh
        responses, drawn from one fixed random stream (a seed no run used): every policy scored this
        way sees the same random numbers, so differences between policies pair by prompt."""
        import torch

        k = self.sizes.confirm_samples
        prompts = [json.loads(x)["prompt"] for x in (self.out / "prompts_eval.jsonl").read_text().splitlines()]
        torch.manual_seed(self.cfg.seed + 2_000_029)
        scores = [self.gold(x) for x in self.sample(policy, tok, [p for p in prompts for _ in range(k)], temperature)]
        return [sum(scores[j * k:(j + 1) * k]) / k for j in range(len(prompts))]

    def sample(self, policy: Any, tok: Any, prompts: list[str], temperature: float, progress: bool = False
               ) -> list[str]:
        """One sampled response per prompt (chat template applied), in batches of 32: decoding is
        memory-bound on a CPU, so 32 sequences cost little more than 8."""
        import torch


        texts: list[str] = []
        bs, t = 32, time.perf_counter()
        for i in range(0, len(prompts), bs):
            ids = [encode_prompt(p, tok, True) for p in prompts[i:i + bs]]
            with torch.no_grad():  # the models are in the run's dtype (ppolm/runtime.py)
                roll = ro.generate(policy, ids, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                                   max_new_tokens=self.sizes.response_length, temperature=temperature)
            texts += tok.batch_decode(roll.response * roll.response_mask, skip_special_tokens=True)
            if progress:
                done, el = min(i + bs, len(prompts)), time.perf_counter() - t
                say(f"      sampled {done}/{len(prompts)} responses ({el:.0f}s, "
                    f"eta {el / done * (len(prompts) - done):.0f}s)")
        return texts

    def ppo_temperature(self) -> float:
        import yaml

        if not (self.out / "config.yaml").is_file():
            return 0.7  # the temperature ppo_options gives
        cfg = yaml.safe_load((self.out / "config.yaml").read_text())
        return float((cfg.get("generation") or {}).get("temperature", cfg.get("temperature", 0.7)))

    def summarise(self) -> None:
        evals = read_jsonl(self.out / "eval.jsonl")
        best = json.loads((self.out / "best.json").read_text()) if (self.out / "best.json").is_file() else None

        def at(row: dict[str, Any]) -> dict[str, Any]:
            return {"mean": row[self.gold_metric], "se": row.get(self.gold_metric + "_se"), "step": row["step"],
                    "kl": row.get("eval/kl"), "proxy": row.get(f"eval/{RM_DIR}")}

        gold: dict[str, Any] = {"before": at(evals[0]), "end": at(evals[-1])}
        if best:
            gold["best"] = next((at(r) for r in evals if r["step"] == best["step"]), None)
        self.state["gold"] = gold
        if self.others:

            settings = {"ppo": {}, **{n: compare.SETTINGS.get(n, compare.DPO_SETTINGS if n == "dpo" else {})
                                      for n in self.others}}
            runs = {n: (self.out if n == "ppo" else self.out / n, settings[n], self.state.get("costs", {}).get(n, {}))
                    for n in self.algorithms}
            self.state["comparison"] = compare.summarise(runs, self.gold_metric, f"eval/{RM_DIR}")
        if gold.get("best"):
            b, a = gold["best"], gold["before"]
            gain, se_unpaired = b["mean"] - a["mean"], math.hypot(b["se"] or 0.0, a["se"] or 0.0)
            # Both evaluations score the same held-out prompts, so the gain's standard error is that of
            # the per-prompt differences (a paired comparison); the unpaired one ignores that and is larger.
            diffs = self.paired_gold_differences(b["step"])
            se = mean_se(diffs)["se"] if len(diffs) > 1 else se_unpaired
            in_run = (f"gold {b['mean']:.3f} ± {b['se']:.3f} vs {a['mean']:.3f} ± {a['se']:.3f} before PPO on the same "
                      f"{len(diffs)} held-out prompts, a gain of {gain:+.3f} ± {se:.3f} (paired standard error; "
                      f"{se_unpaired:.3f} unpaired)")
            gold_gain = {"gain": gain, "se": se, "se_unpaired": se_unpaired, "n_prompts": len(diffs),
                         "in_run": {"gain": gain, "se": se, "beats_2se": gain > 2 * se}}
            c = self.state.get("confirm")
            if c:  # fresh samples, independent of the choice of the best step: the figure that counts
                gain, se = c["gain"]["mean"], c["gain"]["se"]
                ok = gain > 2 * se
                self.state["verdict"] = (
                    f"Best-gold checkpoint (step {b['step']}, KL {b['kl']:.2f} nats), scored again after PPO on "
                    f"{c['samples_per_prompt']} fresh response(s) to each of the {c['n_prompts']} held-out prompts: "
                    f"gold {c['best']['mean']:.3f} ± {c['best']['se']:.3f} vs {c['before']['mean']:.3f} ± "
                    f"{c['before']['se']:.3f} for the starting policy, a gain of {gain:+.3f} ± {se:.3f} (paired "
                    f"over prompts), {'more' if ok else 'less'} than twice its standard error. In the run's own "
                    f"evaluations, from which the best step was picked (so optimistic): {in_run}.")
                gold_gain.update(gain=gain, se=se, n_prompts=c["n_prompts"], source="fresh samples after PPO")
            else:
                ok = gain > 2 * se
                self.state["verdict"] = (
                    f"Best-gold checkpoint (step {b['step']}, KL {b['kl']:.2f} nats): {in_run}, "
                    f"{'more' if ok else 'less'} than twice its standard error. "
                    "(The best step is chosen on these same prompts, so the gain is optimistic.)")
                gold_gain["source"] = "in-run evaluations"
            gold_gain.update(beats_2se=ok, beats_2se_unpaired=gold_gain["in_run"]["gain"] > 2 * se_unpaired)
            self.state["gold_gain"] = gold_gain
        self.save_state()
        self.report()

    def report(self) -> None:
        path = write_report(self.out)
        say(self.state.get("verdict", ""))
        say(f"report: {path}")

    def paired_gold_differences(self, step: int) -> list[float]:
        """Gold score at ``step`` minus before PPO, per held-out prompt (eval_samples.jsonl)."""

        by_step: dict[int, dict[str, float]] = {}
        for r in read_jsonl(self.out / "eval_samples.jsonl"):
            key = r["prompt"] if isinstance(r["prompt"], str) else json.dumps(r["prompt"])
            by_step.setdefault(r["step"], {})[key] = r["scores"][self.gold_metric.removeprefix("eval/")]
        before, after = by_step.get(0, {}), by_step.get(step, {})
        return [after[p] - before[p] for p in before if p in after]

    # ------------------------------------------------------------------------------------
    def set_threads(self) -> None:
        import os

        import torch

        n = self.cfg.threads
        if n == 0:
            cores = os.cpu_count() or 1
            n = 1 if cores > 1 and os.getloadavg()[0] >= cores else cores
            if n == 1:
                say(f"the machine is busy (load {os.getloadavg()[0]:.1f} on {cores} cores): using 1 thread")
        torch.set_num_threads(n)
        self.state["threads"] = n

    def run(self) -> int:
        self.prepare()
        self.set_threads()
        self.current = "setup"
        try:
            self.stage(1, "task", self.task)
            self.stage(2, "pairs", self.pairs)
            self.stage(3, "reward_model", self.reward_model)
            self.stage(4, "ppo", self.ppo)
            for i, name in enumerate(self.others):
                self.stage(5 + i, name, lambda n=name: self.alternative(n))
            self.stage(5 + len(self.others), "confirm", self.confirm)
            self.stage(6 + len(self.others), "report", self.summarise)
        except KeyboardInterrupt:
            self.save_state()
            done = ", ".join(self.state["done"]) or "nothing"
            say(f"\ninterrupted during stage '{self.current}'; kept in {self.out}: {done}. Continue with: "
                f"ppolm demo --output-dir {self.out} --resume" + (" --quick" if self.cfg.quick else "")
                + (" --overoptimisation" if self.cfg.overoptimisation else ""))
            return 130
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise PPOLMError(f"no space left on device while writing to {self.out} (stage "
                                 f"'{self.current}'); free some space or choose another --output-dir, then "
                                 "add --resume") from None
            raise
        total = time.perf_counter() - self.t0
        self.state["timings_s"]["total_this_call"] = round(total, 1)
        self.save_state()
        say(f"demo finished in {total / 60:.1f} min; open {self.out / 'report.html'} in a browser")
        return 0

