"""Variants of the long demo's refresh, each on the static runs the demo already made.

`ppolm demo --overoptimisation` spends most of its time on the two PPO runs. To compare settings of
the refresh (``ppolm.demo_sizes.LongSizes``' ``refresh_*`` fields) this script takes finished long
demos (`bench/demo_seeds.py --overoptimisation`), links each into a new directory without its
refreshed run (hard links: the pairs, the proxy, the static run and its checkpoints are shared, not
copied, and nothing in them is written again), and reruns only the refreshed run, the fresh-sample
confirmation and the report with the variant's settings. Both runs of a row then share one proxy and
one static run, so the row's refreshed-minus-static difference is the variant's alone. Finished
variants are read, not rerun.

    python bench/refresh_search.py --runs /tmp/long/s0-t1-auto-long /tmp/long/s1-t1-auto-long \\
        --out /tmp/search --set refresh_start_share=0.5 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_seeds import cpu_flags, row  # noqa: E402

from ppolm.demo_sizes import LongSizes  # noqa: E402

REDONE = ("refresh", "confirm", "report")
NOT_LINKED = {"refresh", "report.html", "plots", "demo.json"}  # written again by the stages redone


def parse_set(items: list[str]) -> dict[str, float | int]:
    known = {f.name: f.type for f in fields(LongSizes)}
    out: dict[str, float | int] = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in known or not key.startswith("refresh_"):
            raise SystemExit(f"error: --set {item}: give refresh_*=VALUE, one of "
                             f"{', '.join(k for k in known if k.startswith('refresh_'))}")
        out[key] = int(value) if known[key] in (int, "int") else float(value)
    return out


def link_run(src: Path, dst: Path, overrides: dict[str, float | int]) -> None:
    """``dst``: ``src`` hard-linked, without what the redone stages write, its state set to redo them."""
    state = json.loads((src / "demo.json").read_text())
    if "ppo" not in state.get("done", []) or not state.get("overoptimisation"):
        raise SystemExit(f"error: {src} is not a long demo whose static run finished")
    shutil.copytree(src, dst, copy_function=os.link, ignore=lambda d, names: (
        [n for n in names if n in NOT_LINKED] if Path(d) == src else []))
    state["done"] = [s for s in state["done"] if s not in REDONE]
    for key in ("confirm", "comparison", "verdict"):
        state.pop(key, None)
    state.get("costs", {}).pop("refresh", None)
    sizes = state["overoptimisation"].setdefault("sizes", {})
    sizes.update(overrides)
    state["overoptimisation"] = {"sizes": sizes}
    (dst / "demo.json").write_text(json.dumps(state, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, nargs="+", required=True, help="finished long demos")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--set", nargs="+", default=[], metavar="refresh_FIELD=VALUE", help="the variant")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    overrides = parse_set(a.set)
    name = "-".join(f"{k.removeprefix('refresh_')}{v}" for k, v in overrides.items()) or "baseline"
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"# machine: {cpu_flags()}; variant {name}; threads {a.threads}", flush=True)
    dirs = []
    for src in a.runs:
        dst = a.out / f"{src.name}-{name}"
        dirs.append(dst)
        done = (dst / "demo.json").is_file() and "report" in json.loads((dst / "demo.json").read_text())["done"]
        if done:
            continue
        if not dst.exists():
            link_run(src.resolve(), dst, overrides)
        state = json.loads((dst / "demo.json").read_text())
        code = ("import sys, dataclasses, json; from ppolm.demo import DemoConfig; from ppolm.demo_long import LongDemo; "
                f"d = LongDemo(DemoConfig(output_dir={str(dst)!r}, seed={state['seed']}, quick={state['quick']}, "
                f"precision={state['precision']!r}, threads={a.threads}, resume=True, overoptimisation=True, "
                f"quiet=True)); d.long = dataclasses.replace(d.long, **json.loads({json.dumps(overrides)!r})); "
                "sys.exit(d.run())")
        t = time.perf_counter()
        with open(a.out / f"{dst.name}.log", "a") as log:
            rc = subprocess.call([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)
        print(f"# {dst.name}: exit {rc} after {(time.perf_counter() - t) / 60:.1f} min", flush=True)
    head = ["run", "RM acc", "best step", "its KL", "confirmed gain", "> 2 SE", "min", "static best", "its KL",
            "static end", "refresh best", "its KL", "refresh end", "refresh − static (best)", "judge labels"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for d in dirs:
        print(row(d))


if __name__ == "__main__":
    main()
