#!/usr/bin/env python
"""Data-parallel PPO under torchrun: s/step and rollout tokens/s at 1 and 2 processes (not a test).

Each configuration runs ``torchrun --standalone --nproc-per-node N -m ppolm ppo`` with one torch
thread per process (OMP_NUM_THREADS=1; on a 2-core machine 2 processes use both cores, 1 process
one), the same global batch (8 rollouts, --ignore-eos so every response is exactly 32 tokens and
the processes decode the same amount), and prints, from process 0's metrics.jsonl (steady steps:
the first excluded):

* s/step and its parts (rollout, score, train);
* rollout tokens/s of the whole job (8 x 32 tokens / the slowest process's rollout time);
* rollout imbalance: the slowest process's rollout time minus process 0's (``time/rollout_max_s``);
* scaling efficiency: (s/step at 1 process) / (N x s/step at N processes) for the same global
  batch with N times the cores;
* the time of one gloo all-reduce of the trained parameters' gradients (what DDP sends per update),
  measured alone.

    python bench/distributed.py [--models tiny,smollm2-135m-instruct] [--steps 5] [--precision fp32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REWARD = "def length(prompts, completions, **kw):\n    return [min(len(c.split()), 20) / 20 for c in completions]\n"


def run(n: int, model: str, steps: int, precision: str, tmp: Path) -> dict:
    out = tmp / f"run-{Path(model).name}-{n}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), "-m", "ppolm",
           "ppo", "--model", model, "--reward-fn", f"{tmp / 'reward.py'}:length", "--steps", str(steps),
           "--batch-size", "8", "--response-length", "32", "--ignore-eos", "--precision", precision, "--quiet",
           "--overwrite", "--save-every", "1000", "--sample-every", "1000", "--output-dir", str(out)]
    t = time.perf_counter()
    p = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]

    def med(k: str) -> float:
        return statistics.median(r[k] for r in rows)

    rollout_max = med("time/rollout_max_s") if "time/rollout_max_s" in rows[0] else med("time/rollout_s")
    return {"model": Path(model).name, "processes": n, "s_per_step": round(med("time/step_s"), 3),
            "rollout_s": round(med("time/rollout_s"), 3), "rollout_max_s": round(rollout_max, 3),
            "score_s": round(med("time/score_s"), 3), "train_s": round(med("time/train_s"), 3),
            "rollout_tokens_per_s": round(8 * 32 / rollout_max, 1),
            "rollout_imbalance_s": round(rollout_max - med("time/rollout_s"), 3),
            "job_wall_s": round(time.perf_counter() - t, 1)}


ALLREDUCE = r'''
import os, sys, time, torch, torch.distributed as dist
from ppolm import models
dist.init_process_group("gloo")
torch.set_num_threads(1)
m = models.load_causal_lm(sys.argv[1], dtype=torch.float32, device=torch.device("cpu"))
n = sum(p.numel() for p in m.parameters() if p.requires_grad)
g = torch.randn(n)
dist.all_reduce(g)
times = []
for _ in range(3):
    t = time.perf_counter(); dist.all_reduce(g); times.append(time.perf_counter() - t)
if dist.get_rank() == 0:
    print(n, sorted(times)[1])
dist.destroy_process_group()
'''


def allreduce_time(model: str, tmp: Path) -> tuple[int, float]:
    script = tmp / "allreduce.py"
    script.write_text(ALLREDUCE)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script), model], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                       text=True)
    n, t = p.stdout.split()[-2:]
    return int(n), float(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,smollm2-135m-instruct",
                    help="'tiny' (a 2-layer random model) and/or model specs")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--precision", default="fp32", choices=["auto", "bf16", "fp32"])
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ppolm_dist_bench_"))
    (tmp / "reward.py").write_text(REWARD)
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    print(json.dumps({"cpu_flags": [f for f in ("avx2", "avx512_bf16", "amx_bf16") if f in flags],
                      "cores": os.cpu_count()}))
    for spec in args.models.split(","):
        model = spec
        if spec == "tiny":
            from ppolm.tiny import build_tiny_model_dir

            model = str(build_tiny_model_dir(tmp / "tiny", kind="causal", seed=0))
        results = {n: run(n, model, args.steps, args.precision, tmp) for n in (1, 2)}
        for r in results.values():
            print(json.dumps(r), flush=True)
        params, t_ar = allreduce_time(model, tmp)
        eff = results[1]["s_per_step"] / (2 * results[2]["s_per_step"])
        print(json.dumps({"model": Path(model).name, "scaling_efficiency_2": round(eff, 3),
                          "speedup_2": round(results[1]["s_per_step"] / results[2]["s_per_step"], 3),
                          "trained_params": params, "allreduce_s": round(t_ar, 4),
                          "allreduce_MB": round(params * 4 / 2**20, 1)}), flush=True)


if __name__ == "__main__":
    main()
