"""`ppolm demo` over seeds and thread counts: does its verdict hold whatever proxy the pairs give?

Runs the demo (or its long mode, --overoptimisation) once per seed x thread count x precision, in
subprocesses, `--jobs` at a time (two 1-thread runs share a 2-core machine without slowing each
other much; a 2-thread run should run alone), and prints one row per run: the proxy's held-out
accuracy, the best-gold step and its KL, the confirmed gain on fresh samples (paired SE) and whether
it is more than 2 SE, and the wall time. With --overoptimisation also the static and refreshed runs'
best and final gold and the refreshed-minus-static difference. Finished runs are read, not rerun.

    python bench/demo_seeds.py --out /tmp/seeds --seeds 0 1 2 --threads 1 2 [--precision auto fp32]
    python bench/demo_seeds.py --out /tmp/long --seeds 0 1 2 --threads 2 --overoptimisation
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def cpu_flags() -> str:
    try:
        flags = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")).split()
    except (OSError, StopIteration):
        return platform.processor()
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


def run_one(out: Path, seed: int, threads: int, precision: str, long: bool, extra: list[str]) -> Path:
    run_dir = out / (f"s{seed}-t{threads}-{precision}" + ("-long" if long else ""))
    state = run_dir / "demo.json"
    if state.is_file() and "report" in json.loads(state.read_text()).get("done", []):
        return run_dir
    cmd = [sys.executable, "-m", "ppolm", "demo", "--output-dir", str(run_dir), "--seed", str(seed), "--threads",
           str(threads), "--precision", precision, "--quiet",
           *(["--resume"] if state.is_file() else ["--overwrite"]), *(["--overoptimisation"] if long else []), *extra]
    t = time.perf_counter()
    with open(out / f"{run_dir.name}.log", "a") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    print(f"# {run_dir.name}: exit {rc} after {(time.perf_counter() - t) / 60:.1f} min", flush=True)
    return run_dir


def row(run_dir: Path) -> str:
    try:
        d = json.loads((run_dir / "demo.json").read_text())
    except (OSError, ValueError):
        return f"| {run_dir.name} | did not finish |"
    g, c = d.get("gold_gain") or {}, d.get("confirm") or {}
    best = (d.get("gold") or {}).get("best") or {}
    minutes = sum(v for k, v in d.get("timings_s", {}).items() if k != "total_this_call") / 60
    cells = [run_dir.name, f"{d.get('rm_accuracy', float('nan')):.3f}", str(best.get("step", "–")),
             f"{best.get('kl', float('nan')):.2f}",
             f"{c.get('gain', {}).get('mean', float('nan')):+.3f} ± {c.get('gain', {}).get('se', float('nan')):.3f}",
             "yes" if g.get("beats_2se") else "NO", f"{minutes:.1f}"]
    long = d.get("overoptimisation") or {}
    if long.get("confirm"):
        sc, runs, comp = long["confirm"]["scores"], long.get("runs", {}), d.get("comparison", {})
        diff = long["confirm"]["refresh_minus_static"]["best"]
        for name, run in (("static", "ppo"), ("refresh", "refresh")):
            b = comp.get(run, {}).get("best") or {}
            cells += [f"{sc[name + '_best']['mean']:+.3f} ± {sc[name + '_best']['se']:.3f}",
                      f"{b.get('kl', float('nan')):.2f}",
                      f"{sc[name + '_end']['mean']:+.3f} ± {sc[name + '_end']['se']:.3f}"]
        cells += [f"{diff['mean']:+.3f} ± {diff['se']:.3f}", str(runs.get("refresh", {}).get("refresh_judge_calls"))]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--precision", nargs="+", default=["auto"], choices=["auto", "bf16", "fp32"])
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (the thread counts should add up to the cores)")
    ap.add_argument("--overoptimisation", action="store_true", help="the long mode")
    ap.add_argument("extra", nargs="*", help="more `ppolm demo` options, after --")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"# machine: {platform.machine()}, {cpu_flags()}; `ppolm demo` {' '.join(a.extra)}", flush=True)
    grid = [(s, t, p) for p in a.precision for t in a.threads for s in a.seeds]
    with ThreadPoolExecutor(a.jobs) as pool:
        dirs = list(pool.map(lambda g: run_one(a.out, *g, a.overoptimisation, a.extra), grid))
    head = ["run", "RM acc", "best step", "its KL", "confirmed gain", "> 2 SE", "min"]
    if a.overoptimisation:
        head += ["static best", "its KL", "static end", "refresh best", "its KL", "refresh end",
                 "refresh − static (best)", "judge labels"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for d in dirs:
        print(row(d))


if __name__ == "__main__":
    main()
