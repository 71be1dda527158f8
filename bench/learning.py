"""How much do ppolm's PPO defaults learn on short rule-based rewards, against TRL's GRPO on the same budget?

For each task of bench/learning_tasks.py (by default the four the defaults were chosen on:
punctuation, word budget, vocabulary, format; `--tasks digit,caps,senses,comma,quote,length20` runs six added afterwards) and each
system, train the embedded SmolLM2-135M-Instruct for --steps steps of 8 samples with at most 32 new
tokens (`--response-length`), then score it *independently*: plain transformers sampling at temperature 1 (no top-k/top-p),
4 samples for each of 32 held-out prompts, and the KL to the starting model measured on those
samples (nats per response, sum over tokens of log p - log p_ref). "closed" is the share of the gap
from the starting model's held-out reward to the maximum (1; 0 for length20) that training closed.

A second table compares the systems at equal KL, from their own training logs: the best mean
training reward over 8 consecutive steps whose mean KL (nats per response) stays within the KL
target, and within twice the target. One run's end point says little when the systems spend
different KL (GRPO's beta in the loss holds no target); this reward-vs-KL frontier is what a KL
budget buys. Training prompts are the same for both (ppolm's built-in set); ppolm's KL is
`objective/kl` (k1 summed over the response), TRL's its logged per-token k3 `kl` times the mean
completion length (both estimate the same KL of the sampling policy to the reference).
`frontier.png` in --out draws the same paths, reward against KL, one panel per task, with each
run's held-out end point. The table's last column reads every run of a task at one common budget:
the largest KL all of them reached (at most twice the target), so that a run whose controller held
it near the target is compared with another at the KL both spent, not at KL only one of them had.

    python bench/learning.py --out /tmp/learning [--tasks exclaim,short,keyword,question]
        [--systems ppo,grpo] [--grpo-lrs 5e-5,1e-4] [--trl-python /path/to/venv-with-trl/bin/python]
        [--ppo-args "--actor-lr 1e-5"] [--tag NAME] [--kl-target 12] [--seed 0] [--jobs 2] [--keep-models]

(`--ppo-args "--score-scale std --kl-coef 0.05" --tag std` runs every score in units of its running std.)

TRL runs in its own virtual environment (`pip install torch==2.13.0 "trl==1.16.*"`), as a
subprocess; ppolm never imports it. Results are cached per run in --out, so a rerun only trains
what is missing; the table is printed at the end. Once a run is scored its weights are deleted (a
ppolm run's policy, critic and checkpoint hold about 2.7 GB, so a few dozen runs would fill a disk);
its logs stay, which is all the tables read. `--keep-models` keeps them.

`--jobs N` trains N runs side by side, each on one CPU thread (OMP_NUM_THREADS=1), and scores them
afterwards on every thread. On a 2-core machine two one-thread runs take about as long per step as
one run on both cores (decoding a batch of 8 is memory-bound), so the benchmark takes about half
the time; two runs with two threads each would spin-wait against each other and run many times
slower.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from learning_tasks import HELD_OUT, TASKS, maximum  # noqa: E402

RESPONSE_LENGTH = 32  # new tokens per answer unless --response-length says otherwise (and in results without one)


def score(model_dir: str | Path, ref_dir: str | Path, task: str, samples: int = 4, seed: int = 1234,
          max_new_tokens: int = RESPONSE_LENGTH) -> dict:
    """Held-out reward (mean, se over prompts) and KL to the reference, sampling at temperature 1."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ref_dir)
    tok.padding_side = "left"
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    fn = TASKS[task]
    prompts = [p for p in HELD_OUT for _ in range(samples)]
    texts_in = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                for p in prompts]
    torch.manual_seed(seed)
    rewards, kls = [], []
    for i in range(0, len(prompts), 64):  # decoding is memory-bound: 64 sequences cost little more than 4
        enc = tok(texts_in[i:i + 64], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, pad_token_id=tok.pad_token_id)
        p = enc["input_ids"].shape[1]
        resp = out[:, p:]
        ended = (resp == eos).int().cumsum(1)  # real response tokens: up to and including the first EOS
        mask = ((ended == 0) | ((ended == 1) & (resp == eos))).long()
        texts = tok.batch_decode(resp * mask + tok.pad_token_id * (1 - mask), skip_special_tokens=True)
        rewards += fn(prompts[i:i + 64], texts)
        full_mask = torch.cat([enc["attention_mask"], mask], 1)
        pos = (full_mask.cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            lp, lq = (torch.log_softmax(m(input_ids=out, attention_mask=full_mask, position_ids=pos).logits[:, p - 1:-1]
                                        .float(), -1).gather(-1, resp[..., None]).squeeze(-1) for m in (model, ref))
        kls += ((lp - lq) * mask).sum(1).tolist()
    per_prompt = [sum(rewards[j:j + samples]) / samples for j in range(0, len(rewards), samples)]
    n = len(per_prompt)
    mean = sum(per_prompt) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in per_prompt) / (n - 1) / n)
    return {"reward": mean, "se": se, "kl": sum(kls) / len(kls)}


def trajectory(run_dir: Path) -> list[tuple[float, float]] | None:
    """(training reward, KL per response) at each step of a ppolm run (metrics.jsonl) or of a TRL
    GRPO run (log_history.json from bench/trl_grpo.py); None when the run left neither."""
    if (run_dir / "metrics.jsonl").exists():
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [(r["objective/scores"], r["objective/kl"]) for r in rows]
    if (run_dir / "log_history.json").exists():
        rows = json.loads((run_dir / "log_history.json").read_text())
        return [(float(r["reward"]), float(r["kl"]) * float(r["completions/mean_length"])) for r in rows]
    return None


def mean_of(steps: list[tuple[float, float]]) -> tuple[float, float]:
    """Mean reward and mean KL of some steps of a trajectory."""
    return sum(x[0] for x in steps) / len(steps), sum(x[1] for x in steps) / len(steps)


def frontier(traj: list[tuple[float, float]], budget: float, window: int = 8) -> tuple[float, float] | None:
    """The best mean reward over `window` consecutive steps whose mean KL is at most `budget`, with
    that KL; None when no window stays within it (or the run is shorter than a window)."""
    return max((m for m in curve(traj, window) if m[1] <= budget), key=lambda m: (m[0], -m[1]), default=None)  # ties: less KL


def curve(traj: list[tuple[float, float]], window: int = 8) -> list[tuple[float, float]]:
    """The run's path in the reward-vs-KL plane: (mean reward, mean KL) of every `window` consecutive
    steps, in order; the frontier at a budget is the highest of these points left of it."""
    return [mean_of(traj[i - window:i]) for i in range(window, len(traj) + 1)]


def common_budget(trajs: list[list[tuple[float, float]]], cap: float) -> float | None:
    """The largest KL every one of a task's runs reached on its path (the smallest of their paths'
    highest 8-step mean KL), at most `cap`: the budget at which all of them can be compared. None
    when a run has no path (fewer steps than a window)."""
    paths = [curve(t) for t in trajs]
    if not paths or not all(paths):
        return None
    return min(cap, min(max(p[1] for p in path) for path in paths))


def plot_frontiers(out: Path, results: dict[str, dict], budgets: tuple[float, float]) -> Path | None:
    """Write out/frontier.png: one panel per task, each system's training path (8-step means of
    reward against KL, a line ending in a dot) and its held-out end point (a cross at the held-out
    reward and KL), the starting model's held-out reward as a dotted line and the two KL budgets as
    dashed ones. The equal-KL table reads these paths at the dashed lines. None: no run to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks: dict[str, list[str]] = {}
    for key in sorted(results):
        task, system = key.split("/")
        if system != "start":
            tasks.setdefault(task, []).append(system)
    if not tasks:
        return None
    colors = {system: f"C{i % 10}" for i, system in enumerate(sorted({s for ss in tasks.values() for s in ss}))}
    cols = min(3, len(tasks))
    rows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)
    for ax, (task, systems) in zip(axes.flat, sorted(tasks.items())):
        for system in systems:
            color = colors[system]  # one colour per system in every panel
            path = curve(trajectory(out / f"{task}__{system}") or [])
            if path:
                ax.plot([p[1] for p in path], [p[0] for p in path], color=color, lw=1.2, label=system)
                ax.plot(path[-1][1], path[-1][0], "o", color=color, ms=4)
            end = results[f"{task}/{system}"]
            ax.plot(end["kl"], end["reward"], "x", color=color, ms=8, mew=2,
                    label=None if path else system)
        if f"{task}/start" in results:
            ax.axhline(results[f"{task}/start"]["reward"], color="grey", ls=":", lw=1)
        for b in budgets:
            ax.axvline(b, color="grey", ls="--", lw=0.8)
        ax.set_title(task)
        ax.set_xlabel("KL to the start (nats per response)")
        ax.set_ylabel("reward")
        ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    fig.suptitle("training reward (8-step means, line) and held-out reward (x) against KL", fontsize=10)
    fig.tight_layout()
    path = out / "frontier.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def machine() -> str:
    """The CPU a run trained on, with its bf16 instruction sets: the same seed on two CPUs gives two
    different runs (their kernels round differently), so results from different machines are
    not paired comparisons."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(info.split())
    return " ".join([name] + [f for f in ("avx512_bf16", "amx_bf16") if f in flags])


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def drop_weights(run_dir: Path) -> int:
    """Delete a scored run's weights and keep its logs (metrics.jsonl, samples.jsonl, config.yaml,
    TensorBoard events, TRL's log_history.json): each folder of the run that holds a weight or
    optimiser-state file goes whole (a ppolm run's policy/, critic/ and checkpoints/, so no model
    folder is left without its weights), and such files in the run folder itself (TRL's model) go
    alone. Returns the bytes freed."""
    doomed: set[Path] = set()
    for f in run_dir.rglob("*"):
        if f.is_file() and not f.is_symlink() and f.name.endswith(WEIGHT_SUFFIXES):
            rel = f.relative_to(run_dir)
            doomed.add(f if len(rel.parts) == 1 else run_dir / rel.parts[0])
    freed = 0
    for p in sorted(doomed):
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file() and not f.is_symlink()]
        freed += sum(f.stat().st_size for f in files)
        p.unlink() if p.is_file() else shutil.rmtree(p)
    return freed


def task_of(key: str) -> str:
    """The task of a result key ("exclaim/ppo-defaults" -> "exclaim")."""
    return key.split("/")[0]


def run(cmd: list[str], log: Path, threads: int | None = None) -> float:
    """Run one training command, its output to ``log``; its wall time in seconds. ``threads``: the
    CPU threads it may use (OMP_NUM_THREADS), default torch's own choice (every core)."""
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    t = time.perf_counter()
    with open(log, "w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, env=env)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tasks", default="exclaim,short,keyword,question")
    ap.add_argument("--systems", default="ppo,grpo")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--grpo-lrs", default="5e-5,1e-4")
    ap.add_argument("--trl-python", default=None, help="a Python with trl installed (needed for grpo)")
    ap.add_argument("--ppo-args", default="", help="extra ppolm ppo options (a variant of the defaults)")
    ap.add_argument("--tag", default="defaults", help="name of the ppolm variant in the table")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--response-length", type=int, default=RESPONSE_LENGTH,
                    help="most new tokens per answer, in training and in held-out scoring (default 32; "
                         "ppolm ppo's own default is 48); one --out holds runs of one length")
    ap.add_argument("--kl-target", type=float, default=None,
                    help="KL budget of the equal-KL table (default: ppolm ppo's --kl-target)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs trained side by side, one CPU thread each (default 1: one run on every core)")
    ap.add_argument("--keep-models", action="store_true",
                    help="keep each run's weights after it is scored (default: delete them, keep the logs)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    other = {r.get("response_length", RESPONSE_LENGTH) for r in results.values()} - {args.response_length}
    if other:  # runs of another length are another experiment: their rewards and KL are not comparable
        sys.exit(f"error: {out} holds runs of --response-length {sorted(other)[0]}; give --response-length "
                 f"{sorted(other)[0]} or another --out for runs of {args.response_length}")
    length = {"response_length": args.response_length}
    from ppolm.models import EMBEDDED_DEFAULT, resolve_model_dir

    ref = resolve_model_dir(EMBEDDED_DEFAULT)

    def save() -> None:
        (out / "results.json").write_text(json.dumps(results, indent=1))

    jobs = []  # (result key, command, subdirectory holding the policy)
    for task in args.tasks.split(","):
        if f"{task}/start" not in results:
            results[f"{task}/start"] = {**score(ref, ref, task, max_new_tokens=args.response_length), "wall_s": 0.0,
                                        **length}
            save()
        if "ppo" in args.systems:
            jobs.append((f"{task}/ppo-{args.tag}", [sys.executable, "-m", "ppolm.cli", "ppo", "--reward-fn",
                         f"{HERE / 'learning_tasks.py'}:{task}", "--steps", str(args.steps),
                         "--response-length", str(args.response_length),
                         "--seed", str(args.seed), "--quiet", "--overwrite", "--save-every", str(args.steps),
                         "--keep-last", "1", *shlex.split(args.ppo_args)], "policy"))  # one checkpoint (each holds Adam states)
        if "grpo" in args.systems and args.trl_python:
            for lr in args.grpo_lrs.split(","):
                jobs.append((f"{task}/grpo-lr{lr}", [args.trl_python, str(HERE / "trl_grpo.py"), "--model", str(ref),
                             "--task", task, "--lr", lr, "--steps", str(args.steps), "--seed", str(args.seed),
                             "--max-completion-length", str(args.response_length)], ""))
    jobs = [j for j in jobs if j[0] not in results]

    def train(job: tuple[str, list[str], str]) -> float:
        key, cmd, _ = job
        d = out / key.replace("/", "__")
        cmd = cmd + ["--output-dir" if cmd[1] == "-m" else "--out", str(d)]
        return run(cmd, out / (key.replace("/", "__") + ".log"), threads=1 if args.jobs > 1 else None)

    def record(job: tuple[str, list[str], str], wall: float) -> None:
        key, _, sub = job
        d = out / key.replace("/", "__")
        metrics = {}
        if sub == "policy":
            rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
            metrics = {"train_kl_last": rows[-1]["objective/kl"], "beta_last": rows[-1]["objective/kl_coef"]}
        results[key] = {**score(d / sub if sub else d, ref, task_of(key), max_new_tokens=args.response_length),
                        "wall_s": round(wall, 1), **metrics, "machine": machine(), "seed": args.seed, **length}
        save()
        print(key, json.dumps(results[key]), flush=True)
        if not args.keep_models:
            drop_weights(d)

    if args.jobs > 1:  # train side by side, then score each on every core
        with ThreadPoolExecutor(args.jobs) as pool:
            walls = list(pool.map(train, jobs))
        for job, wall in zip(jobs, walls):
            record(job, wall)
    else:
        for job in jobs:
            record(job, train(job))

    print(f"\n{'task':9} {'system':22} {'reward':>14} {'closed':>7} {'KL':>6} {'wall s':>7}")
    for key, r in sorted(results.items()):
        task, system = key.split("/")
        start = results[f"{task}/start"]["reward"]
        top = maximum(task)
        closed = (r["reward"] - start) / (top - start) if start < top else float("nan")
        print(f"{task:9} {system:22} {r['reward']:7.3f} ± {r['se']:.3f} {100 * closed:6.0f}% {r['kl']:6.2f} "
              f"{r['wall_s']:7.0f}")

    if args.kl_target is None:
        from ppolm.ppo_config import PPOConfig
        args.kl_target = PPOConfig().kl.kl_target
    budgets = (args.kl_target, 2 * args.kl_target)
    print("\nTraining reward at equal KL: best 8-step mean with mean KL <= budget (reward @ KL)")
    print(f"{'task':9} {'system':22} " + " ".join(f"{'KL <= ' + format(b, 'g'):>16}" for b in budgets)
          + f" {'last 8 steps':>16} {'KL <= common':>16}")
    trajs = {}
    for key in sorted(results):
        task, system = key.split("/")
        traj = None if system == "start" else trajectory(out / key.replace("/", "__"))
        if traj:
            trajs.setdefault(task, {})[system] = traj
    for task, runs in sorted(trajs.items()):
        common = common_budget(list(runs.values()), budgets[1]) if len(runs) > 1 else None
        for system, traj in runs.items():
            cells = [frontier(traj, b) for b in budgets] + [mean_of(traj[-8:])]
            cells.append(frontier(traj, common) if common is not None else None)
            print(f"{task:9} {system:22} " + " ".join(f"{'-':>16}" if c is None else f"{c[0]:8.3f} @ {c[1]:5.1f}"
                                                      for c in cells))
    print("(KL <= common: within the largest KL that every run of the task reached, at most twice the target)")
    png = plot_frontiers(out, results, budgets)
    if png:
        print(f"\nreward against KL, per task: {png}")


if __name__ == "__main__":
    main()
