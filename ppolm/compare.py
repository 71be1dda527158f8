"""``ppolm demo --algorithms ppo,grpo,rloo,dpo``: PPO and its alternatives on the same task, head to head.

Every algorithm starts from the same policy and learns the demo's task from the same data: the
PPO family (``ppo`` and the critic-free estimators of ``ppolm ppo --advantage``) from the proxy
reward model with the same number of sampled responses (steps x batch), DPO from the preference
pairs the proxy was trained on (it samples nothing). Each is scored on the same held-out prompts
by the proxy and by the gold judge, with its KL to the starting policy, and each runs in a
process of its own (spawned, so its wall time and peak memory are its own). The report overlays
gold and proxy reward against KL and tabulates the best gold score.

The settings of each alternative (:data:`SETTINGS`) are the demo's PPO settings with what the
method itself changes; they are stated in README, "PPO and its alternatives".
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from ppolm import atomic, config, runtime
from ppolm import rollout as ro
from ppolm.data import load_prompts
from ppolm.dpo import DPOConfig, _train_dpo
from ppolm.errors import PPOLMError
from ppolm.gold import gold_score
from ppolm.ppo import train_ppo
from ppolm.ppo_config import PPOConfig
from ppolm.rewards import RewardModel
from ppolm.runtime import dtype_of, resolve_device, seeded_rng
from ppolm.tracking import read_jsonl

ALGORITHMS = ("ppo", "grpo", "dr-grpo", "rloo", "reinforce++", "reinforce++-baseline", "remax", "dpo")

SETTINGS: dict[str, dict[str, Any]] = {
    # The group estimators: the demo's batch of 32 as 8 prompts x 4 samples, the KL in the loss (k3)
    # starting at GRPO's beta of 0.04 (DeepSeekMath), adapted to the same target as PPO's.
    "grpo": {"advantage": "grpo", "samples_per_prompt": 4, "kl_coef": 0.04},
    "dr-grpo": {"advantage": "dr-grpo", "samples_per_prompt": 4, "kl_coef": 0.04},
    "rloo": {"advantage": "rloo", "samples_per_prompt": 4, "kl_coef": 0.04},
    "reinforce++-baseline": {"advantage": "reinforce++-baseline", "samples_per_prompt": 4},
    # REINFORCE++ keeps PPO's KL in the reward; ReMax decodes one greedy response per prompt besides.
    "reinforce++": {"advantage": "reinforce++"},
    "remax": {"advantage": "remax", "kl_coef": 0.04},
}
"""What each PPO alternative changes in the demo's PPO options."""

DPO_SETTINGS: dict[str, Any] = {"beta": 0.1, "epochs": 3, "batch_size": 8, "lr": 1e-4}
"""DPO on the proxy's training pairs, LoRA on the same layers as PPO's: beta 0.1 (Rafailov et al.),
3 epochs (an evaluation after each), lr 1e-4 (LoRA)."""


def parse(spec: str) -> list[str]:
    """``--algorithms`` as a list, checked: known names, no repeats, ``ppo`` included (the report's
    main run)."""
    names = [x.strip() for x in spec.split(",") if x.strip()]
    bad = [x for x in names if x not in ALGORITHMS]
    if bad:
        raise PPOLMError(f"--algorithms: unknown {', '.join(map(repr, bad))}; choose from {', '.join(ALGORITHMS)}")
    if len(set(names)) != len(names):
        raise PPOLMError(f"--algorithms lists a name twice: {spec}")
    if "ppo" not in names:
        raise PPOLMError("--algorithms must include ppo (the report's reference run), e.g. ppo,grpo,rloo,dpo")
    return names


# ------------------------------------------------------------------------------- one algorithm

def train_in_child(kind: str, options: dict[str, Any], out_dir: Path, threads: int,
                   evaluation: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train one algorithm in a spawned process; returns {"wall_s", "peak_rss_mb"} of that process
    (summed over resumed runs). ``kind``: "ppo" (``ppolm ppo`` with ``options``) or "dpo".
    Ctrl-C reaches the child too: it saves its checkpoint and this raises KeyboardInterrupt."""
    import multiprocessing

    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_child, args=(kind, options, str(out_dir), threads, evaluation))
    proc.start()
    try:
        proc.join()
    except KeyboardInterrupt:
        proc.join()
        raise
    result = json.loads((out_dir / "algorithm.json").read_text()) if (out_dir / "algorithm.json").is_file() else {}
    if result.get("status") == "error":
        raise PPOLMError(result["error"])
    if result.get("status") != "done" or proc.exitcode != 0:
        raise KeyboardInterrupt
    return result


def _child(kind: str, options: dict[str, Any], out_dir: str, threads: int, evaluation: dict[str, Any] | None) -> None:
    """The spawned process of :func:`train_in_child`: train, then write ``algorithm.json``."""
    import resource

    import torch


    runtime.quiet_libraries()  # a spawned process starts without the parent's warning filters
    torch.set_num_threads(threads)
    out = Path(out_dir)
    before = json.loads((out / "algorithm.json").read_text()) if (out / "algorithm.json").is_file() else {}
    t0 = time.perf_counter()
    status, error = "done", None
    try:
        if kind == "dpo":

            _, finished = _train_dpo(config.build(DPOConfig, options), on_epoch=HeldOutEval(out, **evaluation or {}))
        else:

            finished = not train_ppo(config.build(PPOConfig, options)).interrupted
        status = "done" if finished else "interrupted"
    except PPOLMError as e:
        status, error = "error", str(e)
    except KeyboardInterrupt:
        status = "interrupted"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    atomic.write_text(out / "algorithm.json", json.dumps({
        "status": status, "error": error, "wall_s": round(before.get("wall_s", 0.0) + time.perf_counter() - t0, 1),
        "peak_rss_mb": round(max(peak, before.get("peak_rss_mb", 0.0)), 1)}, indent=2))


class HeldOutEval:
    """DPO's held-out evaluation, as PPO's (``--eval-prompts``): one response to each held-out prompt
    sampled at ``temperature`` from a fixed seed, scored by the gold judge and the proxy reward
    model, and its KL to the starting policy (the adapter disabled); a row of ``eval.jsonl`` per call."""

    def __init__(self, out: Path, *, prompts: str, reward_model: str, response_length: int, temperature: float,
                 seed: int, device: str, precision: str):

        self.out, self.seed = out, seed
        self.response_length, self.temperature = response_length, temperature
        self.device = resolve_device(device)
        self.rm = RewardModel(reward_model, dtype=dtype_of(precision), device=self.device)
        self.prompts = load_prompts(prompts, self.rm.tokenizer)
        self.pad_id, self.eos_id = self.rm.tokenizer.pad_token_id, self.rm.tokenizer.eos_token_id
        self.rm_name = Path(reward_model).name

    def __call__(self, epoch: int, model: Any) -> None:
        import torch


        model.eval()
        tok = self.rm.tokenizer
        gold, proxy, kls = [], [], []
        with torch.no_grad(), seeded_rng(self.seed + 1_000_003, self.device):
            for i in range(0, len(self.prompts), 32):
                batch = self.prompts[i:i + 32]
                roll = ro.generate(model, [p.ids for p in batch], pad_id=self.pad_id, eos_id=self.eos_id,
                                   max_new_tokens=self.response_length, temperature=self.temperature)
                texts = tok.batch_decode(roll.response * roll.response_mask, skip_special_tokens=True)
                gold += [gold_score(t) for t in texts]
                proxy += self.rm.score_ids(roll.input_ids, roll.attention_mask).float().cpu().tolist()
                logp = ro.logprobs(model, roll, self.temperature)
                with model.disable_adapter():
                    ref = ro.logprobs(model, roll, self.temperature)
                kls += ((logp - ref) * roll.response_mask).sum(1).float().cpu().tolist()
        row: dict[str, Any] = {"step": epoch}
        for name, xs in (("eval/gold_judge", gold), (f"eval/{self.rm_name}", proxy), ("eval/kl", kls)):
            m = sum(xs) / len(xs)
            row[name] = m
            row[name + "_se"] = math.sqrt(sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1) / len(xs))
        with open(self.out / "eval.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


# ------------------------------------------------------------------------------- the comparison

def summarise(runs: dict[str, tuple[Path, dict[str, Any], dict[str, Any]]], gold: str, proxy: str
              ) -> dict[str, Any]:
    """name -> (run directory, settings, {"wall_s", "peak_rss_mb"}) as demo.json's "comparison":
    each algorithm's held-out evaluations (KL, gold, proxy, with standard errors), its best gold
    evaluation, and its cost."""

    table: dict[str, Any] = {}
    for name, (run_dir, settings, cost) in runs.items():
        rows = [r for r in read_jsonl(run_dir / "eval.jsonl") if gold in r]
        if not rows:
            continue
        points = [{"step": r["step"], "kl": r.get("eval/kl"), "gold": r[gold], "gold_se": r.get(gold + "_se"),
                   "proxy": r.get(proxy), "proxy_se": r.get(proxy + "_se"),
                   "agreement": r.get("rm/onpolicy_accuracy"), "agreement_se": r.get("rm/onpolicy_accuracy_se")}
                  for r in rows]
        best = max(points, key=lambda p: p["gold"])
        table[name] = {"points": points, "best": best, "start": points[0], "end": points[-1],
                       "gain": best["gold"] - points[0]["gold"], "settings": settings, **cost}
    return table


def plot(comparison: dict[str, Any], path: Path, labels: dict[str, str] | None = None) -> None:
    """Gold and proxy reward against KL, one line per algorithm (points in evaluation order, the best
    gold circled); a third panel with the proxy's on-policy agreement with the judge where the runs
    checked it (``ppolm ppo --judge``). ``labels`` renames the runs in the legends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["gold", "proxy"]
    if any(p.get("agreement") is not None for c in comparison.values() for p in c["points"]):
        keys.append("agreement")
    fig, axes = plt.subplots(1, len(keys), figsize=(5.8 * len(keys), 4.2))
    for name, c in comparison.items():
        pts = [p for p in c["points"] if p["kl"] is not None]
        for ax, key in zip(axes, keys):
            sub = [p for p in pts if p.get(key) is not None]
            if not sub or (key != "agreement" and len(sub) < len(pts)):
                continue
            line = ax.errorbar([p["kl"] for p in sub], [p[key] for p in sub],
                               yerr=[p.get(key + "_se") or 0.0 for p in sub], marker="o", capsize=2, lw=1.2,
                               label=(labels or {}).get(name, name))
            if key == "gold":
                ax.scatter([c["best"]["kl"]], [c["best"]["gold"]], s=150, facecolors="none",
                           edgecolors=line[0].get_color(), zorder=3)
    kl = "KL(policy || start), nats per response (held-out)"
    titles = {"gold": ("gold reward (mean ± SE)", "Gold reward vs KL (circled: best)"),
              "proxy": ("proxy reward (mean ± SE)", "Proxy reward vs KL"),
              "agreement": ("proxy's agreement with the judge (± SE)", "Proxy vs judge on the policy's answers")}
    for ax, key in zip(axes, keys):
        ax.set(xlabel=kl, ylabel=titles[key][0], title=titles[key][1])
        if key == "agreement":
            ax.axhline(0.5, color="grey", ls=":", lw=1)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def table_html(comparison: dict[str, Any], esc: Any, num: Any) -> str:
    """The head-to-head table: best gold (± SE) and its KL, the gain over the start, wall time, peak memory."""
    rows = []
    for name, c in comparison.items():
        b = c["best"]
        rows.append(f"<tr><td>{esc(name)}</td><td class=num>{num(b['gold'])} ± {num(b['gold_se'])}</td>"
                    f"<td class=num>{num(b['kl'], 2)}</td><td class=num>{esc(b['step'])}</td>"
                    f"<td class=num>{num(c['gain'])}</td><td class=num>{num(c['end']['gold'])}</td>"
                    f"<td class=num>{num(c.get('wall_s'), 0)}</td><td class=num>{num(c.get('peak_rss_mb'), 0)}</td>"
                    f"<td class=small>{esc(', '.join(f'{k} {v}' for k, v in c['settings'].items()))}</td></tr>")
    # headers break by hand (the report's headers do not wrap), so the table fits a laptop's width
    return ("<table><tr><th>algorithm</th><th>best gold<br>(± SE)</th><th>its KL</th><th>at step<br>/epoch</th>"
            "<th>gain over<br>the start</th><th>gold at<br>the end</th><th>wall s</th><th>peak RSS<br>MB</th>"
            f"<th>settings beyond<br>the demo's PPO ones</th></tr>{''.join(rows)}</table>")


LONG_LABELS = {"ppo": "static proxy", "refresh": "refreshed proxy"}
"""``ppolm demo --overoptimisation``'s two runs as the report names them."""


def long_html(demo: dict[str, Any], esc: Any, num: Any) -> str:
    """``ppolm demo --overoptimisation``'s table (ppolm/demo_long.py): for the static and the refreshed
    run, the best-gold evaluation, the best and final policies scored again on fresh samples, the fall
    after the peak (paired), the on-policy agreement of the proxy with the judge at the first and last
    evaluation, and what the refresh spent."""
    long, comp = demo.get("overoptimisation") or {}, demo.get("comparison") or {}
    conf = long.get("confirm") or {}
    scores, fall = conf.get("scores", {}), conf.get("fall_after_best", {})

    def pm(d: dict[str, Any] | None) -> str:
        return f"{num(d['mean'])} ± {num(d['se'])}" if d else "–"

    rows = []
    for name, key in (("ppo", "static"), ("refresh", "refresh")):
        c, r = comp.get(name), (long.get("runs") or {}).get(key, {})
        if not c:
            continue
        b, e = c["best"], c["end"]
        agree = [p for p in c["points"] if p.get("agreement") is not None]
        first_last = (f"{num(agree[0]['agreement'], 2)} → {num(agree[-1]['agreement'], 2)}" if agree else "–")
        secs = r.get("refresh_seconds") or []
        spent = (f"{r.get('refresh_judge_calls', 0)} labels, {len(secs)} refreshes, "
                 f"{num(sum(secs) / len(secs), 0)} s each" if secs else "–")
        rows.append(f"<tr><td>{esc(LONG_LABELS[name])}</td><td class=num>{num(b['gold'])} ± {num(b['gold_se'])}"
                    f"</td><td class=num>{esc(b['step'])}</td><td class=num>{num(b['kl'], 2)}</td>"
                    f"<td class=num>{pm(scores.get(key + '_best'))}</td><td class=num>{pm(scores.get(key + '_end'))}"
                    f"</td><td class=num>{num(e['kl'], 2)}</td><td class=num>{pm(fall.get(key))}</td>"
                    f"<td class=num>{first_last}</td><td>{esc(spent)}</td>"
                    f"<td class=num>{num(c.get('wall_s'), 0)}</td></tr>")
    start = scores.get("before")
    return ("<table><tr><th>run</th><th>best gold in run<br>(± SE)</th><th>at step</th><th>its KL</th>"
            "<th>best, fresh<br>samples</th><th>end, fresh<br>samples</th><th>KL at<br>the end</th>"
            "<th>best − end<br>(paired)</th><th>on-policy<br>agreement</th><th>judge labels<br>spent</th>"
            f"<th>wall s</th></tr>{''.join(rows)}</table>"
            + (f"<p class=small>Starting policy on the same fresh samples: {pm(start)}.</p>" if start else "")
            + (f"<p><b>{esc(long['verdict'])}</b></p>" if long.get("verdict") else ""))
