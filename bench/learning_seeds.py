"""Two systems of bench/learning.py over many seeds: is the difference larger than the seeds' noise?

One seed of a sparse reward says little (on keyword the system ahead changes from seed to seed), so
this reads every results.json under the given directories (one bench/learning.py --out per seed,
or one for many), pairs the runs of system A and system B that share a task, a seed and a machine
(the same seed on another CPU is another draw of the run) and an answer length (`exclaim@48` for
runs of `--response-length 48`; 32 is the plain task name), and prints for each task and KL budget
the mean training reward at equal KL (bench/learning.py's frontier: best 8-step mean whose mean KL
stays within the budget) of each system, their mean paired difference A - B with its standard
error, and on how many seeds each was ahead.

    python bench/learning_seeds.py /tmp/L/out --a ppo-defaults --b grpo [--kl-target 12]

--a and --b name a system as bench/learning.py keys it (`ppo-<tag>`, `grpo-lr<lr>`), or a prefix
that matches one system per task (`grpo`: the one learning rate run for that task). A run that
never stays within a budget counts as its starting reward there (it bought nothing within it).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from learning import RESPONSE_LENGTH, frontier, trajectory  # noqa: E402


def seed_of(entry: dict, out: Path) -> int | None:
    """The seed of a result: recorded by bench/learning.py, else a `-s<N>` in its directory's name."""
    if "seed" in entry:
        return int(entry["seed"])
    m = re.search(r"-s(\d+)(?:\D|$)", out.name)
    return int(m.group(1)) if m else None


def collect(dirs: list[Path], budgets: tuple[float, ...]) -> dict:
    """{(task, system): {(seed, machine): [reward at each budget]}} over every results.json found; a
    task's runs of another answer length than 32 tokens are the task `task@length`."""
    runs: dict = defaultdict(dict)
    for results_file in sorted(f for d in dirs for f in d.rglob("results.json")):
        out = results_file.parent
        results = json.loads(results_file.read_text())
        for key, entry in results.items():
            task, system = key.split("/")
            if system == "start":
                continue
            traj = trajectory(out / key.replace("/", "__"))
            seed = seed_of(entry, out)
            if not traj or seed is None:
                continue
            start = results[f"{task}/start"]["reward"]
            cells = [frontier(traj, b) for b in budgets]
            length = entry.get("response_length", RESPONSE_LENGTH)
            label = task if length == RESPONSE_LENGTH else f"{task}@{length}"
            runs[(label, system)][(seed, entry.get("machine", "?"))] = [start if c is None else c[0] for c in cells]
    return runs


def resolve(name: str, task: str, systems: set[str]) -> str | None:
    """The system of `task` that `name` names: an exact key, or the single one it prefixes."""
    if name in systems:
        return name
    hits = [s for s in systems if s.startswith(name)]
    return hits[0] if len(hits) == 1 else None


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of the differences a - b and its standard error (nan with fewer than two pairs)."""
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    if len(d) < 2:
        return mean, float("nan")
    var = sum((x - mean) ** 2 for x in d) / (len(d) - 1)
    return mean, math.sqrt(var / len(d))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path, help="directories holding bench/learning.py results")
    ap.add_argument("--a", default="ppo-defaults", help="system A (default ppo-defaults)")
    ap.add_argument("--b", default="grpo", help="system B (default: the task's one GRPO learning rate)")
    ap.add_argument("--kl-target", type=float, default=None,
                    help="budgets: this and twice it (default: ppolm ppo's --kl-target)")
    args = ap.parse_args()
    if args.kl_target is None:
        from ppolm.ppo_config import PPOConfig
        args.kl_target = PPOConfig().kl.kl_target
    budgets = (args.kl_target, 2 * args.kl_target)
    runs = collect(args.dirs, budgets)
    if not runs:
        sys.exit(f"no bench/learning.py results with a training log under {', '.join(map(str, args.dirs))}")
    by_task: dict = defaultdict(set)
    for task, system in runs:
        by_task[task].add(system)
    print(f"{'task':11} {'A':16} {'B':16} {'budget':>7} {'seeds':>5} {'A':>7} {'B':>7} {'A - B':>16} "
          f"{'A ahead':>7} {'B ahead':>7}")
    for task in sorted(by_task):
        sa, sb = resolve(args.a, task, by_task[task]), resolve(args.b, task, by_task[task])
        if sa is None or sb is None or sa == sb:
            continue
        keys = sorted(set(runs[(task, sa)]) & set(runs[(task, sb)]))
        if not keys:
            continue
        for i, budget in enumerate(budgets):
            a = [runs[(task, sa)][k][i] for k in keys]
            b = [runs[(task, sb)][k][i] for k in keys]
            mean, se = paired(a, b)
            ahead_a, ahead_b = sum(x > y for x, y in zip(a, b)), sum(y > x for x, y in zip(a, b))
            print(f"{task:11} {sa:16} {sb:16} {'<= ' + format(budget, 'g'):>7} {len(keys):5d} "
                  f"{sum(a) / len(a):7.3f} {sum(b) / len(b):7.3f} {mean:+8.3f} ± {se:5.3f} {ahead_a:7d} {ahead_b:7d}")


if __name__ == "__main__":
    main()
