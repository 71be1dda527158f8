#!/usr/bin/env python
"""PPO step throughput on a GPU (or any device) with randomly initialised models (not a test).

For a machine without the embedded model (no network): the models are built from a config,
``tiny`` (2 layers, hidden 64) or ``135m`` (SmolLM2-135M's shape: 30 layers, hidden 576, 9 heads, 3
KV heads, MLP 1536), with the SmolLM2 tokenizer from ppolm's cache ($PPOLM_CACHE). Prints one JSON
line per configuration: s/step (steady steps, the first excluded) and its parts, rollout tokens/s,
peak GPU memory (torch.cuda.max_memory_allocated) and the precision used.

    python bench/gpu_ppo.py [--model tiny,135m] [--device cuda] [--steps 6] [--batch-size 8,64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

SHAPES = {"tiny": {}, "135m": dict(num_layers=30, hidden_size=576, heads=9, kv_heads=3, intermediate_size=1536)}


def run(shape: str, device: str, steps: int, batch: int, length: int, tmp: Path) -> dict:
    import torch

    from ppolm import config
    from ppolm.ppo_config import PPOConfig
    from ppolm.ppo_trainer import PPOTrainer
    from ppolm.tiny import build_tiny_model_dir

    policy = build_tiny_model_dir(tmp / f"{shape}-policy", kind="causal", seed=0, **SHAPES[shape])
    rm = build_tiny_model_dir(tmp / f"{shape}-rm", kind="scalar", seed=1, **SHAPES[shape])
    cfg = config.build(PPOConfig, dict(model=str(policy), reward_model=[str(rm)], steps=steps, batch_size=batch,
                                       response_length=length, ignore_eos=True, device=device, quiet=True,
                                       output_dir=str(tmp / f"run-{shape}-{batch}"), save_every=10_000,
                                       sample_every=10_000, critic_layers=min(4, 1 if shape == "tiny" else 4)))
    trainer = PPOTrainer(cfg)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rows = [trainer.step(s)[0] for s in range(steps)][1:]

    def med(k: str) -> float:
        return round(statistics.median(r[k] for r in rows), 4)

    return {"model": shape, "device": device, "precision": trainer.precision, "batch": batch, "tokens": length,
            "s_per_step": med("time/step_s"), "rollout_s": med("time/rollout_s"), "score_s": med("time/score_s"),
            "train_s": med("time/train_s"), "rollout_tokens_per_s": round(batch * length / med("time/rollout_s"), 1),
            "peak_gpu_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if device == "cuda" else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny,135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", default="8,64")
    ap.add_argument("--response-length", type=int, default=32)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ppolm_gpu_bench_"))
    for shape in args.model.split(","):
        for batch in map(int, args.batch_size.split(",")):
            print(json.dumps(run(shape, args.device, args.steps, batch, args.response_length, tmp)), flush=True)


if __name__ == "__main__":
    main()
