#!/usr/bin/env python
"""Benchmark one PPO step on the embedded SmolLM2-135M-Instruct (not a test; prints figures).

Two workloads, each timed over --steps PPO steps (the first excluded as warm-up):
  small : ppolm defaults (precision auto: bf16 where the CPU/GPU has it natively, else fp32) at
          8 rollouts x 32 tokens x 1 epoch
  peer  : the work of ../shared/peer-bench (TRL's PPOTrainer): separate critic, full fine-tuning,
          --ignore-eos (exactly 32 tokens), 1 epoch, 1 minibatch, 8 rollouts, with ppolm's default
          critic (its top --critic-layers layers trained on the reward model's shared frozen trunk)
  peer-full : the same with --critic-layers 0: every critic layer trained, a full copy (TRL's work)
next to the time of a plain HF ``generate`` of the same batch (8 x 32 tokens, sampling).
Value and reward heads are randomly initialised (seeded), as in the peer bench.

    python bench/ppo_step.py [--steps 6] [--workload peer --precision bf16] [--threads N]

Peak memory is the process's max RSS, so run one workload per process (the default runs each
workload in a child process).
"""

from __future__ import annotations

import argparse
import ast
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEER = Path(__file__).resolve().parents[1].parent / "shared" / "peer-bench" / "trl_ppo_baseline.py"


def prompts_file(tmp: Path) -> Path:
    """The peer bench's 64 'Write one sentence about <topic>.' prompts (read from its script when
    present), else ppolm's built-in prompts."""
    f = tmp / "prompts.jsonl"
    topics = None
    if PEER.exists():
        for node in ast.walk(ast.parse(PEER.read_text())):
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "TOPICS":
                topics = ast.literal_eval(node.value)
    if topics is None:
        from ppolm.data import BUILTIN_PROMPTS

        shutil.copy(BUILTIN_PROMPTS, f)
        return f
    f.write_text("".join(json.dumps({"prompt": f"Write one sentence about {t}."}) + "\n" for t in topics))
    return f


def run_one(workload: str, precision: str, steps: int) -> dict:
    import torch

    from ppolm import config, models
    from ppolm.ppo import PPOTrainer
    from ppolm.ppo_config import PPOConfig

    tmp = Path(tempfile.mkdtemp(prefix="ppolm_bench_"))
    torch.manual_seed(0)
    rm = models.load_scalar_model("smollm2-135m-instruct", head_init="reward")
    models.save_pretrained(rm, models.load_tokenizer("smollm2-135m-instruct"), tmp / "rm")
    del rm
    opts = dict(reward_model=[str(tmp / "rm")], prompts=str(prompts_file(tmp)), output_dir=str(tmp / "run"),
                steps=steps, batch_size=8, response_length=32, ppo_epochs=1, minibatches=1, precision=precision,
                quiet=True, save_every=10_000, sample_every=10_000, seed=0)
    if workload in ("peer", "peer-full"):
        opts.update(ignore_eos=True, temperature=1.0, critic="separate", critic_init="reward", lora_r=0)
    if workload == "peer-full":
        opts.update(critic_layers=0)
    cfg = config.build(PPOConfig, opts)
    trainer = PPOTrainer(cfg)
    rows = []
    for step in range(steps):
        m, _ = trainer.step(step)
        rows.append(m)
    steady = rows[1:]

    def med(k: str) -> float:
        return round(statistics.median(r[k] for r in steady), 3)

    # plain generate of the same batch, same precision context as the rollout
    prompts = [p.ids for p in trainer.prompts[:8]]
    from ppolm.rollout import left_pad

    ids, mask = left_pad(prompts, trainer.pad_id, "cpu")
    gen_times = []
    for i in range(4):
        torch.manual_seed(i)
        t = time.perf_counter()
        with torch.no_grad():  # the models compute in the run's dtype (no autocast)
            trainer.policy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32,
                                    do_sample=True, temperature=1.0, top_k=0, pad_token_id=trainer.pad_id)
        gen_times.append(time.perf_counter() - t)
    shutil.rmtree(tmp, ignore_errors=True)
    return {"workload": workload, "precision": trainer.precision, "steps": steps,
            "s_per_step": med("time/step_s"), "rollout_s": med("time/rollout_s"), "score_s": med("time/score_s"),
            "train_s": med("time/train_s"), "step_s_all": [round(r["time/step_s"], 2) for r in rows],
            "plain_generate_s": round(statistics.median(gen_times[1:]), 3),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            # where the memory goes (ppolm's memory/* metrics, GB, medians over the steady steps)
            **{k.removeprefix("memory/"): med(k) for k in rows[-1] if k.startswith("memory/rss_")},
            "torch_threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--workload", choices=["small", "peer", "peer-full"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.workload:
        print(json.dumps(run_one(args.workload, args.precision, args.steps)), flush=True)
        return
    for workload in ("small", "peer", "peer-full"):
        extra = ["--threads", str(args.threads)] if args.threads else []
        out = subprocess.run([sys.executable, __file__, "--workload", workload, "--precision", args.precision,
                              "--steps", str(args.steps), *extra], capture_output=True, text=True)
        line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
        print(line, flush=True)


if __name__ == "__main__":
    main()
