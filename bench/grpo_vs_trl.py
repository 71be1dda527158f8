#!/usr/bin/env python
"""GRPO on identical work: ppolm ``ppo --advantage grpo`` against TRL's ``GRPOTrainer`` (not a test; prints figures).

    python bench/grpo_vs_trl.py --trl-python .venv-trl/bin/python --trl-model smol-hf [--rounds 2] [--steps 6]

Each system runs in its own child process, ppolm and TRL alternating for --rounds rounds; each
child trains for --steps GRPO steps and reports the wall time of every step. The table gives the
steady s/step (the mean over the steps after the first --warmup), and the peak RSS of the child
(ru_maxrss of that one child, from ``os.wait4``, so the whole process: Python, imports, models,
optimiser). The last line printed is one JSON object with every run and the median ratios.

The work is the same on both sides, option by option (TRL 0.29.1 names, see trl/trainer/grpo_config.py):

* model: SmolLM2-135M-Instruct, full fine-tuning, fp32 (TRL's configs default to ``bf16=True``,
  so ``bf16=False``; ``--precision bf16``: TRL's bf16 mixed precision against ppolm's bf16 compute
  with fp32 master weights). ppolm loads
  --ppolm-model (by default its embedded copy), TRL --trl-model (an HF directory of the same
  weights, from ../shared/peer-bench/make_smol_hf.py); TRL: ``model_init_kwargs={"dtype": ...}``.
* prompts: the peer bench's 64 chat prompts "Write one sentence about <topic>." (its TOPICS list,
  read from ../shared/peer-bench/trl_ppo_baseline.py; ppolm's built-in prompts when it is absent),
  as one user message each with the tokenizer's chat template and generation prompt on both sides
  (the JSON's ``prompt_ids_sha`` shows that both sides tokenise them alike).
* batch: --batch completions per step = --batch / --group-size prompts x --group-size samples.
  TRL: ``per_device_train_batch_size=batch, num_generations=group_size,
  gradient_accumulation_steps=1`` (so ``steps_per_generation=1``, ``generation_batch_size=batch``);
  ppolm: ``--batch-size batch --samples-per-prompt group_size``.
* length: exactly --response-length new tokens, EOS never drawn. TRL:
  ``max_completion_length=L, generation_kwargs={"min_new_tokens": L}`` (transformers then sets
  EOS's logit to -inf until L tokens); ppolm: ``--response-length L --ignore-eos`` (the same
  masking of EOS). Sampling: temperature 1, top_p 1, top_k 0 on both (TRL's defaults).
* one optimisation step per batch: TRL ``num_iterations=1`` with ``steps_per_generation=1`` (the
  old log-probs are then the training pass's own, detached: one policy forward with grad);
  ppolm ``--ppo-epochs 1 --minibatches 1 --grad-accum 1`` (its rollout pass is the training pass).
* KL: beta = --beta on both (default 0.04, the GRPO paper's; TRL's own default 0.0 would skip
  the reference model, which ppolm always runs), fixed (ppolm ``--kl-coef beta
  --no-adaptive-kl``), placed in the loss as beta * k3 per token (TRL's only form; ppolm's
  ``--kl-in loss``, the default for grpo), averaged over the batch's tokens like the policy loss.
* loss: clipped ratio with epsilon 0.2 on both sides (TRL ``epsilon=0.2, epsilon_high=None``;
  ppolm ``--clip-eps 0.2 --clip-eps-high none``), aggregated as the mean over every completion
  token of the batch (TRL ``loss_type="dapo"`` with one accumulation step; ppolm ``--loss-agg
  token-mean``); advantages (score - group mean) / group std (TRL ``scale_rewards="group"``; ppolm
  ``--advantage grpo``).
* optimiser: fused AdamW, lr 1e-6 decaying linearly to 0 over --steps, betas (0.9, 0.999), eps
  1e-8, no weight decay, gradients clipped at norm 1 (TRL's defaults ``learning_rate=1e-6,
  lr_scheduler_type="linear", adam_epsilon=1e-8, optim="adamw_torch_fused"``; ppolm
  ``--actor-lr 1e-6 --lr-schedule linear --adam-eps 1e-8``).
* no gradient checkpointing (TRL's configs turn it on by default; here ``gradient_checkpointing=False``), no
  checkpoints (TRL ``save_strategy="no"``; ppolm's steps run through its Python API, which writes
  none), logging every step on TRL (``logging_steps=1``), no vLLM, no Liger kernel, no compile.
* reward: :func:`length_reward`, the completion's length in characters / 100, a rule that costs
  nothing next to the models.

The prompts drawn for each step differ between the systems (each shuffles with its own seed); all
64 prompts are within a few tokens of each other's length.

The ppolm run is this command (plus --precision and --seed):

    ppolm ppo --advantage grpo --reward-fn bench/grpo_vs_trl.py:length_reward --prompts P.jsonl \\
      --batch-size 8 --samples-per-prompt 4 --response-length 32 --ignore-eos --kl-coef 0.04 \\
      --no-adaptive-kl --kl-in loss --ppo-epochs 1 --minibatches 1 --clip-eps 0.2 \\
      --clip-eps-high none --loss-agg token-mean --actor-lr 1e-6 --lr-schedule linear --adam-eps 1e-8
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
PEER = HERE.parents[1].parent / "shared" / "peer-bench" / "trl_ppo_baseline.py"
BUILTIN = HERE.parents[1] / "ppolm" / "data" / "prompts.jsonl"


# ---- shared by both sides (no ppolm or trl imports at module level) -----------------------------
def bench_prompts() -> list[str]:
    """The 64 prompt texts of the peer bench ("Write one sentence about <topic>."), else ppolm's built-in ones."""
    if PEER.exists():
        for node in ast.walk(ast.parse(PEER.read_text())):
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "TOPICS":
                return [f"Write one sentence about {t}." for t in ast.literal_eval(node.value)]
    return [json.loads(line)["prompt"] for line in BUILTIN.read_text().splitlines() if line.strip()]


def completion_text(c: Any) -> str:
    """A completion as text: TRL passes conversational completions as [{"role": ..., "content": ...}]."""
    if isinstance(c, str):
        return c
    return "".join(m.get("content", "") for m in c) if isinstance(c, list) else str(c)


def length_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """The completion's length in characters / 100 (TRL's and ppolm's reward-function convention)."""
    return [len(completion_text(c)) / 100.0 for c in completions]


def ids_sha(ids: list[list[int]]) -> str:
    """A short digest of tokenised prompts, to compare the two sides' tokenisation."""
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:12]


def steady(step_s: list[float], warmup: int) -> float | None:
    """Mean seconds per step after the first ``warmup`` steps (None when no step is left)."""
    rest = step_s[warmup:]
    return statistics.fmean(rest) if rest else None


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median steady s/step and peak RSS per system over the rounds, and ppolm's ratios to TRL."""
    out: dict[str, Any] = {}
    for system in ("ppolm", "trl"):
        mine = [r for r in runs if r["system"] == system and r.get("s_per_step") is not None]
        out[system] = {"s_per_step": statistics.median(r["s_per_step"] for r in mine) if mine else None,
                       "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in mine) if mine else None}
    p, t = out["ppolm"], out["trl"]
    for key in ("s_per_step", "peak_rss_mb"):
        out[f"{key}_ratio"] = round(p[key] / t[key], 3) if p[key] and t[key] else None
    return out


# ---- one side, in a child process ---------------------------------------------------------------
def run_ppolm(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ppolm import config
    from ppolm.ppo import PPOTrainer
    from ppolm.ppo_config import PPOConfig

    tmp = Path(tempfile.mkdtemp(prefix="grpo_vs_trl_ppolm_"))
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in bench_prompts()))
    opts = dict(model=args.ppolm_model, reward_fn=[f"{HERE}:length_reward"], prompts=str(prompts),
                output_dir=str(tmp / "run"), steps=args.steps, batch_size=args.batch,
                samples_per_prompt=args.group_size, response_length=args.response_length, ignore_eos=True,
                temperature=1.0, top_p=1.0, top_k=0, advantage="grpo", kl_coef=args.beta, adaptive_kl=False,
                kl_in="loss", ppo_epochs=1, minibatches=1, grad_accum=1, clip_eps=0.2, clip_eps_high=None,
                loss_agg="token-mean", actor_lr=1e-6, lr_schedule="linear", adam_eps=1e-8, weight_decay=0.0,
                max_grad_norm=1.0, lora_r=0, precision=args.precision, quiet=True, save_every=10**6,
                sample_every=10**6, seed=args.seed)
    trainer = PPOTrainer(config.build(PPOConfig, opts))
    step_s, lengths = [], []
    for step in range(args.steps):
        t = time.perf_counter()
        metrics, _ = trainer.step(step)
        step_s.append(time.perf_counter() - t)
        lengths.append(metrics.get("response/length_mean"))
    return {"system": "ppolm", "precision": trainer.precision, "step_s": step_s, "completion_length": lengths,
            "prompt_ids_sha": ids_sha([p.ids for p in trainer.prompts]), "torch_threads": torch.get_num_threads()}


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tmp = tempfile.mkdtemp(prefix="grpo_vs_trl_trl_")
    texts = bench_prompts()
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in texts])
    length = args.response_length
    cfg = GRPOConfig(
        output_dir=tmp, max_steps=args.steps, per_device_train_batch_size=args.batch,
        num_generations=args.group_size, gradient_accumulation_steps=1, num_iterations=1,
        max_completion_length=length, generation_kwargs={"min_new_tokens": length},
        temperature=1.0, top_p=1.0, top_k=0, beta=args.beta, epsilon=0.2, epsilon_high=None, loss_type="dapo",
        scale_rewards="group", learning_rate=1e-6, lr_scheduler_type="linear", adam_epsilon=1e-8, weight_decay=0.0,
        max_grad_norm=1.0, optim="adamw_torch_fused", gradient_checkpointing=False,
        bf16=args.precision == "bf16", fp16=False,
        model_init_kwargs={"dtype": "float32"}, use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, seed=args.seed, dataloader_num_workers=0, log_completions=False)
    assert not cfg.gradient_checkpointing and cfg.steps_per_generation == 1, "TRL's config did not take the options"

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.begin, self.ends = 0.0, []

        def on_train_begin(self, *_a: Any, **_k: Any) -> None:
            self.begin = time.perf_counter()

        def on_step_end(self, *_a: Any, **_k: Any) -> None:
            self.ends.append(time.perf_counter())

    timer = StepTimer()
    trainer = GRPOTrainer(model=args.trl_model, reward_funcs=length_reward, args=cfg, train_dataset=data,
                          callbacks=[timer])
    trainer.train()
    starts = [timer.begin] + timer.ends[:-1]
    tok = AutoTokenizer.from_pretrained(args.trl_model)
    ids = []
    for p in texts:
        enc = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        ids.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    logs = [row for row in trainer.state.log_history if "completions/mean_length" in row]
    return {"system": "trl", "trl_version": trl.__version__, "precision": "bf16" if cfg.bf16 else "fp32",
            "step_s": [e - s for s, e in zip(starts, timer.ends)],
            "completion_length": [row["completions/mean_length"] for row in logs],
            "ref_model": trainer.ref_model is not None, "prompt_ids_sha": ids_sha(ids),
            "torch_threads": torch.get_num_threads()}


def child(args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    out = run_ppolm(args) if args.side == "ppolm" else run_trl(args)
    out["steps"] = args.steps
    print(json.dumps(out), flush=True)


# ---- the parent: alternate the two, one child process each --------------------------------------
def result_line(stdout: str) -> dict[str, Any] | None:
    """A child's result: its last stdout line that is a JSON object with a "system" (TRL's Trainer
    also prints its logs, as Python dicts, to stdout)."""
    for line in reversed(stdout.splitlines()):
        try:
            res = json.loads(line)
        except ValueError:
            continue
        if isinstance(res, dict) and "system" in res:
            return res
    return None


def spawn(python: str, args: argparse.Namespace, side: str) -> dict[str, Any]:
    """Run one side in a child process; its JSON result plus its own peak RSS (``os.wait4``)."""
    cmd = [python, str(HERE), "--side", side, "--steps", str(args.steps), "--batch", str(args.batch),
           "--group-size", str(args.group_size), "--response-length", str(args.response_length),
           "--beta", str(args.beta), "--precision", args.precision, "--seed", str(args.seed),
           "--ppolm-model", args.ppolm_model, "--trl-model", args.trl_model]
    env = dict(os.environ)
    if args.threads:
        cmd += ["--threads", str(args.threads)]
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    if side == "ppolm":  # the ppolm next to this script, whatever is installed
        env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        stdout = proc.stdout.read()  # type: ignore[union-attr]
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        tail = err.read()[-3000:]
    res = result_line(stdout)
    if proc.returncode != 0 or res is None:
        return {"system": side, "error": f"exit {proc.returncode}", "stderr_tail": tail, "s_per_step": None}
    res["peak_rss_mb"] = round(usage.ru_maxrss / 1024, 1)  # Linux: KiB
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    res["s_per_step"] = steady(res["step_s"], args.warmup)
    res["step_s"] = [round(x, 3) for x in res["step_s"]]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trl-python", help="Python of an environment with trl 0.29.1 (e.g. .venv-trl/bin/python)")
    ap.add_argument("--trl-model", default=str(HERE.parents[2] / "smol-hf"),
                    help="HF directory of SmolLM2-135M-Instruct for TRL (../shared/peer-bench/make_smol_hf.py)")
    ap.add_argument("--ppolm-model", default="smollm2-135m-instruct", help="ppolm's --model (same weights)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (ppolm, TRL), alternating")
    ap.add_argument("--steps", type=int, default=6, help="GRPO steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of s/step")
    ap.add_argument("--batch", type=int, default=8, help="completions per step")
    ap.add_argument("--group-size", type=int, default=4, help="completions per prompt")
    ap.add_argument("--response-length", type=int, default=32)
    ap.add_argument("--beta", type=float, default=0.04, help="KL coefficient of both (k3 in the loss)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--threads", type=int, default=None, help="torch threads in each child (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=["ppolm", "trl"], help="run one system only")
    ap.add_argument("--side", choices=["ppolm", "trl"], help=argparse.SUPPRESS)  # a child
    args = ap.parse_args()
    if args.side:
        child(args)
        return
    if args.steps <= args.warmup:
        ap.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
    if args.only != "ppolm" and not args.trl_python:
        ap.error("--trl-python is needed to run TRL (or --only ppolm)")
    if args.batch % args.group_size:
        ap.error(f"--batch {args.batch} is not a multiple of --group-size {args.group_size}")
    sides = [s for s in ("ppolm", "trl") if args.only in (None, s)]
    runs = []
    print("| round | system | steady s/step | step times (s) | peak RSS (GB) | completion length |", flush=True)
    print("|---|---|---|---|---|---|", flush=True)
    for r in range(args.rounds):
        for side in sides:
            res = spawn(sys.executable if side == "ppolm" else args.trl_python, args, side)
            res["round"] = r + 1
            runs.append(res)
            if "error" in res:
                print(f"| {r + 1} | {side} | failed: {res['error']} | | | |\n{res['stderr_tail']}", flush=True)
                continue
            lengths = sorted({round(x, 1) for x in res["completion_length"] if x is not None})
            print(f"| {r + 1} | {side} | {res['s_per_step']:.2f} | {', '.join(f'{x:.1f}' for x in res['step_s'])} "
                  f"| {res['peak_rss_mb'] / 1024:.2f} | {lengths} |", flush=True)
    shas = {r["prompt_ids_sha"] for r in runs if "prompt_ids_sha" in r}
    if len(shas) > 1:
        print(f"warning: the two sides tokenise the prompts differently ({sorted(shas)})", file=sys.stderr)
    summary = summarise(runs)
    for key, label in (("s_per_step", "s/step"), ("peak_rss_mb", "peak RSS")):
        if summary[f"{key}_ratio"] is not None:
            print(f"ppolm / TRL {label}: {summary[f'{key}_ratio']:.2f} (medians over {args.rounds} rounds)")
    print(json.dumps({"bench": "grpo_vs_trl", "config": {k: v for k, v in vars(args).items() if k != "side"},
                      "summary": summary, "runs": runs}))


if __name__ == "__main__":
    main()
