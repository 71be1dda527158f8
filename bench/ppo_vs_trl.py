#!/usr/bin/env python
"""ppolm against TRL's PPOTrainer on the peer bench's work, alternating in one session (not a test; prints figures).

    python bench/ppo_vs_trl.py --trl-python .venv-trl/bin/python --trl-model smol-hf [--rounds 2]

Each round runs, one after the other, each in its own process: TRL 0.29.1's ``PPOTrainer``
(../shared/peer-bench/trl_ppo_baseline.py, fp32; with --trl-bf16 also its bf16 mixed precision),
ppolm on TRL's exact work (``bench/ppo_step.py --workload peer-full --precision fp32``), the same
with ``PPOLM_CPU_LINEAR=aten`` (torch's default fp32 GEMM instead of oneDNN, see
ppolm/cpu_linear.py), and ppolm's defaults on that work (``--workload peer``, precision auto). The
table gives each run's steady s/step (TRL: its script's; ppolm: the median of the steps after the
first) and peak RSS, and each row's median against TRL's best median. The last line printed is one
JSON object with every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEER = HERE.parents[0].parent / "shared" / "peer-bench" / "trl_ppo_baseline.py"


def last_json(stdout: str) -> dict | None:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def run(name: str, cmd: list[str], env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    got = last_json(out.stdout)
    if got is None:
        print(f"# {name} failed (exit {out.returncode}): {out.stderr.strip()[-500:]}", flush=True)
        return {"name": name, "s_per_step": None, "peak_rss_mb": None}
    row = {"name": name, "s_per_step": got.get("s_per_step"), "peak_rss_mb": got.get("peak_rss_mb"), "raw": got}
    print(f"# {name}: {row['s_per_step']} s/step, {row['peak_rss_mb']} MB", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trl-python", required=True, help="the Python of an environment with TRL 0.29.1")
    ap.add_argument("--trl-model", required=True, help="HF directory of SmolLM2-135M-Instruct (make_smol_hf.py)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trl-steps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="ppolm steps per run (the first left out)")
    ap.add_argument("--trl-bf16", action="store_true", help="also TRL's bf16 mixed precision")
    ap.add_argument("--skip-aten", action="store_true", help="leave out the PPOLM_CPU_LINEAR=aten row")
    a = ap.parse_args()
    ppolm = [sys.executable, str(HERE / "ppo_step.py"), "--steps", str(a.steps)]
    trl = [a.trl_python, str(PEER), "--model", a.trl_model, "--steps", str(a.trl_steps)]
    runs: list[dict] = []
    for _ in range(a.rounds):
        runs.append(run("TRL fp32", trl))
        if a.trl_bf16:
            runs.append(run("TRL bf16", trl + ["--bf16"]))
        runs.append(run("ppolm exact work (peer-full, fp32)", ppolm + ["--workload", "peer-full", "--precision", "fp32"]))
        if not a.skip_aten:
            runs.append(run("ppolm exact work, PPOLM_CPU_LINEAR=aten", ppolm + ["--workload", "peer-full", "--precision", "fp32"],
                            {"PPOLM_CPU_LINEAR": "aten"}))
        runs.append(run("ppolm defaults (peer, auto)", ppolm + ["--workload", "peer", "--precision", "auto"]))
    names = list(dict.fromkeys(x["name"] for x in runs))
    med = {n: statistics.median([x["s_per_step"] for x in runs if x["name"] == n and x["s_per_step"]] or [float("nan")])
           for n in names}
    trl_best = min(v for n, v in med.items() if n.startswith("TRL"))
    trl_rss = min(x["peak_rss_mb"] for x in runs if x["name"].startswith("TRL") and x["peak_rss_mb"])
    print("| run | s/step (each round) | × TRL | peak RSS MB | × TRL |")
    print("|---|---|---|---|---|")
    for n in names:
        mine = [x for x in runs if x["name"] == n]
        steps = ", ".join(f"{x['s_per_step']:.2f}" if x["s_per_step"] else "–" for x in mine)
        rss = max((x["peak_rss_mb"] or 0) for x in mine)
        print(f"| {n} | {steps} | {med[n] / trl_best:.2f} | {rss:.0f} | {rss / trl_rss:.2f} |")
    print(json.dumps({"bench": "ppo_vs_trl", "medians": med, "trl_best": trl_best,
                      "runs": [{k: v for k, v in x.items() if k != "raw"} | {"raw": x.get("raw")} for x in runs]}))


if __name__ == "__main__":
    main()
