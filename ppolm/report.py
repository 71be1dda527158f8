"""``ppolm report``: one self-contained HTML page (and PNGs) that explains a PPO run.

Reads what ``ppolm ppo`` writes (``metrics.jsonl``, ``samples.jsonl``, ``config.yaml``, and when
there was a held-out set ``eval.jsonl``, ``eval_samples.jsonl`` and ``best.json``) plus the
demo's ``demo.json``. Writes ``plots/*.png`` and ``report.html`` with the PNGs embedded as base64,
so the page can be mailed or opened offline. Plots follow the seeds' debugging checklist; the
reward-vs-KL plot is the one of Gao, Schulman & Hilton (2022) that shows over-optimisation.
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppolm import alarms, atomic, compare
from ppolm.config import load_yaml
from ppolm.errors import PPOLMError
from ppolm.tracking import read_jsonl


@dataclass
class ReportConfig:
    run_dir: str = "runs/ppo"
    """Directory of a `ppolm ppo` (or `ppolm demo`) run; report.html and plots/ are written into it."""


def run_report(cfg: ReportConfig) -> int:
    path = write_report(cfg.run_dir)
    print(f"report written to {path}")
    return 0


@dataclass
class Run:
    """Everything the report reads from a run directory."""

    dir: Path
    metrics: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    eval_samples: list[dict[str, Any]]
    config: dict[str, Any]
    best: dict[str, Any] | None
    demo: dict[str, Any] | None

    @property
    def gold(self) -> str | None:
        """The eval metric that plays the gold role: the best-checkpoint metric, the demo's, or a gold_judge."""
        for name in ((self.demo or {}).get("gold_metric"), (self.best or {}).get("metric"), "eval/gold_judge"):
            if name and any(name in r for r in self.evals):
                return name
        return None

    @property
    def kl_target(self) -> float | None:
        kl = self.config.get("kl", {})
        return kl.get("kl_target") if kl.get("adaptive_kl", True) else None


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def load_run(run_dir: str | Path) -> Run:
    d = Path(run_dir)
    if not (d / "metrics.jsonl").is_file():
        raise PPOLMError(f"{d} holds no metrics.jsonl, so it is not a ppolm PPO run (or no step finished yet); "
                         "pass the --output-dir of a `ppolm ppo` run")
    try:
        rows = read_jsonl(d / "metrics.jsonl")
    except UnicodeDecodeError:
        raise PPOLMError(f"{d / 'metrics.jsonl'} is not UTF-8 text, so not a ppolm metrics file; pass the "
                         "--output-dir of a `ppolm ppo` run") from None
    if not rows:
        raise PPOLMError(f"{d / 'metrics.jsonl'} holds no finished step yet; run the report once a step has finished")
    if not all(isinstance(r, dict) and "objective/scores" in r for r in rows):
        raise PPOLMError(f"{d / 'metrics.jsonl'} holds rows without objective/scores, so {d} is not a ppolm PPO run "
                         "(sft, reward and dpo runs have no report); pass the --output-dir of a `ppolm ppo` run")
    cfg: dict[str, Any] = {}
    if (d / "config.yaml").is_file():
        cfg = load_yaml(d / "config.yaml")
    return Run(d, rows, read_jsonl(d / "eval.jsonl"), read_jsonl(d / "samples.jsonl"),
               read_jsonl(d / "eval_samples.jsonl"), cfg, _json(d / "best.json"), _json(d / "demo.json"))


def run_alarms(run: Run) -> list[alarms.Alarm]:
    found = alarms.check_all(run.metrics, kl_target=run.kl_target)
    if run.gold and any("eval/score" in r for r in run.evals):
        a = alarms.over_optimisation(run.evals, proxy="eval/score", gold=run.gold)
        found = sorted(found + ([a] if a else []), key=lambda x: x.step)
    return found


# --------------------------------------------------------------------------------------- plots

def _xy(rows: list[dict[str, Any]], y: str, x: str = "step") -> tuple[list[float], list[float]]:
    pts = [(r[x], r[y]) for r in rows if _num(r.get(x)) and _num(r.get(y))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _err(rows: list[dict[str, Any]], y: str) -> list[float]:
    return [r.get(y + "_se") if _num(r.get(y + "_se")) else 0.0 for r in rows if _num(r.get(y))]


def _eval_only_metrics(cfg: dict[str, Any]) -> list[str]:
    """eval/<name> of each --eval-reward-fn, named as ppolm.rewards.function_name names them (the
    function's name, suffixed _2, _3 ... after the training functions' names when taken)."""
    def section(name: str) -> dict[str, Any]:
        v = cfg.get(name)
        return v if isinstance(v, dict) else {}

    taken: set[str] = set()
    names = []
    for i, spec in enumerate(list(section("reward").get("reward_fn") or []) + list(section("run").get("eval_reward_fn") or [])):
        name = base = str(spec).rpartition(":")[2]
        k = 2
        while name in taken:
            name, k = f"{base}_{k}", k + 1
        taken.add(name)
        if i >= len(section("reward").get("reward_fn") or []):
            names.append(f"eval/{name}")
    return names


def reward_vs_kl_panels(run: Run) -> list[dict[str, Any]]:
    """The data of the reward-vs-KL plot (Gao, Schulman & Hilton 2022): one panel per reward, each
    with its own y-scale, its points ``{"kl", "y", "se", "step"}`` in KL order. With held-out
    evaluations: the trained-on score (eval/score), then the gold metric and the other eval-only
    scorers; without, the training batches' score against their KL."""
    def points(rows: list[dict[str, Any]], key: str, kl: str) -> list[dict[str, Any]]:
        pts = [{"kl": r[kl], "y": r[key], "se": r[key + "_se"] if _num(r.get(key + "_se")) else 0.0,
                "step": r.get("step")} for r in rows if _num(r.get(kl)) and _num(r.get(key))]
        return sorted(pts, key=lambda p: (p["kl"], p["step"] if _num(p["step"]) else 0))

    if not run.evals:
        return [{"key": "objective/scores", "title": "Proxy reward vs KL (training batches)",
                 "ylabel": "proxy reward (mean score)", "points": points(run.metrics, "objective/scores", "objective/kl")}]
    keys = ["eval/score"] + ([run.gold] if run.gold else [])
    keys += [k for k in _eval_only_metrics(run.config) if k not in keys and any(k in r for r in run.evals)]
    panels = []
    for k in keys:
        name = k.removeprefix("eval/")
        role = "proxy" if k == "eval/score" else "gold" if k == run.gold else "eval-only"
        panels.append({"key": k, "title": f"{'Proxy' if role == 'proxy' else name} vs KL" +
                       (" (gold)" if role == "gold" else ""),
                       "ylabel": "proxy reward, trained-on score (held-out mean)" if role == "proxy"
                       else f"{name} (held-out mean)", "points": points(run.evals, k, "eval/kl")})
    return panels


def onpolicy_vs_kl(run: Run) -> dict[str, list[dict[str, Any]]]:
    """The data of the on-policy check's plot (``ppolm ppo --judge``, docs/overoptimisation.md):
    ``rm/onpolicy_accuracy`` and ``rm/heldout_accuracy`` as points ``{"kl", "y", "se", "step"}`` in KL
    order, from the held-out evaluations (their KL) when they hold the check, else from the steps'
    rows (the KL of the batch the checked policy sampled). Empty lists without a check."""
    rows, kl = (run.evals, "eval/kl") if any("rm/onpolicy_accuracy" in r for r in run.evals) else \
        (run.metrics, "objective/kl")

    def points(key: str) -> list[dict[str, Any]]:
        pts = [{"kl": r[kl], "y": r[key], "se": r[key + "_se"] if _num(r.get(key + "_se")) else 0.0,
                "step": r.get("step")} for r in rows if _num(r.get(kl)) and _num(r.get(key))]
        return sorted(pts, key=lambda p: (p["kl"], p["step"] if _num(p["step"]) else 0))

    return {"onpolicy": points("rm/onpolicy_accuracy"), "heldout": points("rm/heldout_accuracy")}


def make_plots(run: Run, out: Path) -> dict[str, tuple[str, Path]]:
    """Write the PNGs; returns name -> (caption, path)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    m, ev, gold = run.metrics, run.evals, run.gold
    best_step = (run.best or {}).get("step")
    plots: dict[str, tuple[str, Path]] = {}

    def save(fig: Any, name: str, caption: str) -> None:
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=80)
        plt.close(fig)
        plots[name] = (caption, out / f"{name}.png")

    def line(ax: Any, rows: list[dict[str, Any]], key: str, label: str, x: str = "step", **kw: Any) -> None:
        xs, ys = _xy(rows, key, x)
        if xs:
            se = _err(rows, key) if x == "step" and rows is ev else None
            if se and any(se):
                ax.errorbar(xs, ys, yerr=se, marker="o", capsize=3, label=label, **kw)
            else:
                ax.plot(xs, ys, marker="o" if rows is ev or len(xs) < 30 else None, label=label, **kw)

    # 1. proxy and gold reward vs step
    fig, axes = plt.subplots(1, 2 if gold else 1, figsize=(11 if gold else 6.5, 4), squeeze=False)
    ax = axes[0][0]
    line(ax, m, "objective/scores", "proxy, training batch")
    line(ax, ev, "eval/score", "proxy, held-out prompts (±1 SE)")
    ax.set(xlabel="PPO step (updates done)", ylabel="proxy reward (mean score)", title="Proxy reward vs step")
    if gold:
        ax2 = axes[0][1]
        line(ax2, ev, gold, "gold, held-out prompts (±1 SE)", color="tab:green")
        if best_step is not None:
            ax2.axvline(best_step, color="grey", ls="--", label=f"best gold (step {best_step})")
        ax2.set(xlabel="PPO step (updates done)", ylabel="gold reward (mean)", title="Gold reward vs step")
        ax2.legend(fontsize=8)
    ax.legend(fontsize=8)
    save(fig, "rewards_vs_step", "Proxy (the trained-on reward) and gold reward against PPO steps." if gold
         else "The reward PPO maximises, on training batches and held-out prompts, against PPO steps.")

    # 2. rewards vs KL: the Gao et al. plot, one panel (and y-scale) per reward, points in KL order
    panels = reward_vs_kl_panels(run)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels) + 0.8, 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        pts = panel["points"]
        xs, ys, se = [p["kl"] for p in pts], [p["y"] for p in pts], [p["se"] for p in pts]
        color = "tab:green" if panel["key"] == gold else "tab:blue" if panel["key"] in ("eval/score",
                                                                                          "objective/scores") else "tab:purple"
        if ev:
            ax.errorbar(xs, ys, yerr=se if any(se) else None, marker="o", capsize=3, color=color, lw=1)
            for p in pts:  # each evaluation labelled with the PPO steps done
                ax.annotate(str(p["step"]), (p["kl"], p["y"]), textcoords="offset points", xytext=(4, 5),
                            fontsize=8, color="dimgrey")
            best = [p for p in pts if best_step is not None and p["step"] == best_step]
            if best:
                ax.scatter([best[0]["kl"]], [best[0]["y"]], s=160, facecolors="none", edgecolors="grey", zorder=3,
                           label=f"best gold (step {best_step})")
                ax.legend(fontsize=8, loc="best")
            ax.set_xlabel("KL(policy || reference), nats per response (held-out)")
        else:
            sc = ax.scatter(xs, ys, c=[p["step"] for p in pts], cmap="viridis", s=18)
            fig.colorbar(sc, ax=ax, label="PPO step")
            ax.set_xlabel("KL(policy || reference), nats per response (training batch)")
        ax.set(ylabel=panel["ylabel"], title=panel["title"])
    fig.suptitle("Reward vs KL (Gao et al. 2022); labels: PPO steps done" if ev else "Reward vs KL (Gao et al. 2022)",
                 fontsize=10)
    save(fig, "rewards_vs_kl", "Each reward against KL to the reference, one panel (and y-scale) each, points in "
                               "KL order labelled by step: a proxy that keeps rising while the gold reward peaks "
                               "and falls is over-optimisation." if gold else
                               "Reward against KL to the reference: how much reward each nat of KL bought.")

    # 3. KL and beta
    fig, ax = plt.subplots(figsize=(6.5, 4))
    line(ax, m, "objective/kl", "KL (training batch)")
    if run.kl_target:
        ax.axhline(run.kl_target, color="grey", ls="--", label=f"KL target {run.kl_target:g}")
    ax.set(xlabel="PPO step", ylabel="KL, nats per response", title="KL to the reference and β")
    ax.legend(loc="upper left", fontsize=8)
    ax2 = ax.twinx()
    xs, ys = _xy(m, "objective/kl_coef")
    ax2.plot(xs, ys, color="tab:red", label="β (KL coefficient)")
    ax2.set_ylabel("β (KL coefficient)", color="tab:red")
    save(fig, "kl_beta", "KL per response and the adaptive KL coefficient β.")

    # 4. entropy
    fig, ax = plt.subplots(figsize=(6.5, 4))
    line(ax, m, "policy/entropy_avg", "entropy per token")
    ax.set(xlabel="PPO step", ylabel="entropy, nats per token", title="Policy entropy")
    save(fig, "entropy", "Per-token entropy of the policy on its own samples; a collapse means few answers.")

    # 5. clip fraction and approx KL
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    line(a1, m, "policy/clipfrac_avg", "policy clip fraction")
    line(a1, m, "val/clipfrac_avg", "value clip fraction")
    a1.set(xlabel="PPO step", ylabel="fraction of tokens clipped", title="Clip fractions")
    a1.legend(fontsize=8)
    line(a2, m, "policy/approxkl_avg", "approx KL to rollout policy")
    a2.set(xlabel="PPO step", ylabel="approx KL, nats per token", title="Approx KL of the PPO update")
    save(fig, "clip_approxkl", "How far each update moved the policy from the one that sampled the batch.")

    # 6. value explained variance
    fig, ax = plt.subplots(figsize=(6.5, 4))
    line(ax, m, "val/vf_explained_var", "explained variance")
    ax.axhline(0, color="grey", ls="--")
    ax.set(xlabel="PPO step", ylabel="explained variance of returns", title="Value function explained variance")
    save(fig, "explained_variance", "1 = the critic predicts returns perfectly; ≤ 0 = no better than a constant.")

    # 7. response length
    fig, ax = plt.subplots(figsize=(6.5, 4))
    line(ax, m, "response/length_mean", "training batch")
    line(ax, ev, "eval/length_mean", "held-out prompts")
    ax.set(xlabel="PPO step", ylabel="response length, tokens", title="Response length")
    ax.legend(fontsize=8)
    save(fig, "length", "Mean response length; drift means the reward pays for length.")

    # 8. the reward model's agreement with the judge on the policy's own answers (--judge)
    check = onpolicy_vs_kl(run)
    if check["onpolicy"]:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for key, label, color in (("onpolicy", "on the policy's answers (±1 SE)", "tab:red"),
                                  ("heldout", "on its original held-out pairs", "grey")):
            pts = check[key]
            if pts:
                ax.errorbar([p["kl"] for p in pts], [p["y"] for p in pts], yerr=[p["se"] for p in pts],
                            marker="o", capsize=3, color=color, lw=1, label=label)
        ax.axhline(0.5, color="grey", ls=":", lw=1)
        ax.set(xlabel="KL(policy || reference), nats per response", ylabel="agreement with the judge",
               title="Reward model vs judge", ylim=(0, 1.02))
        ax.legend(fontsize=8)
        save(fig, "rm_agreement_vs_kl", "How often the reward model orders pairs of answers as the judge does "
                                        "(0.5: chance), against KL: a fall on the policy's own answers is the "
                                        "proxy being over-optimised (docs/overoptimisation.md).")
    return plots


# --------------------------------------------------------------------------------------- html

CSS = """body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;padding:0 1em;color:#222}
h1{margin-bottom:.2em} h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0;font-size:.9em} td,th{border:1px solid #ccc;padding:.3em .5em;
vertical-align:top;text-align:left;overflow-wrap:anywhere} th{background:#f3f3f3;white-space:nowrap} .num{text-align:right;font-variant-numeric:tabular-nums}
figure{display:inline-block;margin:.5em;vertical-align:top;max-width:100%} img{max-width:100%;border:1px solid #eee}
figcaption{font-size:.85em;color:#555;max-width:700px} .alarm{background:#fff1f0} .ok{color:#2a7a2a}
.resp{max-width:250px;white-space:pre-wrap} pre{background:#f7f7f7;padding:.6em;overflow:auto;font-size:.85em}
.small{color:#666;font-size:.85em}"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _f(v: Any, nd: int = 3) -> str:
    return f"{v:.{nd}f}" if _num(v) else "–"


def _pm(d: dict[str, Any] | None) -> str:
    return f"{_f(d.get('mean'))} ± {_f(d.get('se'))}" if d else "–"


def _text(raw: Any) -> str:
    return raw if isinstance(raw, str) else " / ".join(m.get("content", "") for m in raw)


def summary_html(run: Run) -> str:
    parts = []
    d = run.demo
    if d:
        parts.append(f"<p><b>Task.</b> {_e(d.get('task', ''))}</p><p><b>Gold judge.</b> {_e(d.get('judge', ''))}</p>")
        if d.get("rm_accuracy") is not None:
            parts.append(f"<p><b>Proxy reward model.</b> held-out pairwise accuracy {_f(d['rm_accuracy'])} "
                         f"on {_e(d.get('rm_accuracy_n', '?'))} pairs labelled by the gold judge "
                         f"(Bradley–Terry noise, so ~{_f(d.get('label_agreement'), 2)} is the ceiling).</p>"
                         if d.get("label_agreement") is not None else
                         f"<p><b>Proxy reward model.</b> held-out pairwise accuracy {_f(d['rm_accuracy'])} "
                         f"on {_e(d.get('rm_accuracy_n', '?'))} pairs.</p>")
        if d.get("ppo_reward"):
            parts.append(f"<p><b>PPO reward.</b> {_e(d['ppo_reward'])}, with the KL penalty against the "
                         "starting policy.</p>")
        if d.get("rm_accuracy_vs_gold") is not None:
            parts.append(f"<p class=small>Against the noise-free gold ordering of the same pairs the proxy is right "
                         f"{_f(d['rm_accuracy_vs_gold'])} of the time. PPO optimises this imperfect proxy; the gold "
                         "judge is never seen in training, only used to score held-out prompts. If the proxy keeps "
                         "rising while gold peaks and falls (plot <i>Reward vs KL</i>), that is over-optimisation "
                         "(Gao, Schulman &amp; Hilton 2022), and the best-gold checkpoint is the one to keep.</p>")
        g = d.get("gold") or {}
        if g:
            rows = "".join(f"<tr><td>{_e(label)}</td><td class=num>{_pm(g.get(k))}</td>"
                           f"<td class=num>{_e(g.get(k, {}).get('step', '–'))}</td>"
                           f"<td class=num>{_f(g.get(k, {}).get('kl'), 2)}</td></tr>"
                           for k, label in (("before", "starting policy"), ("best", "best-gold checkpoint"),
                                            ("end", "end of PPO")) if g.get(k))
            c = d.get("confirm")
            if c:
                rows += "".join(
                    f"<tr><td>{_e(label)}, scored again on {_e(c.get('samples_per_prompt'))} fresh sample(s) per "
                    f"prompt</td><td class=num>{_pm(c.get(k))}</td><td class=num>{_e(g.get(k, {}).get('step', '–'))}"
                    f"</td><td class=num>{_f(g.get(k, {}).get('kl'), 2)}</td></tr>"
                    for k, label in (("before", "starting policy"), ("best", "best-gold checkpoint")) if c.get(k))
                rows += (f"<tr><td><b>gain of the best-gold checkpoint (fresh samples, paired)</b></td>"
                         f"<td class=num><b>{_pm(c.get('gain'))}</b></td><td></td><td></td></tr>")
            parts.append("<table><tr><th>policy</th><th>gold reward (mean ± SE)</th><th>step</th>"
                         f"<th>KL (nats)</th></tr>{rows}</table>")
            if d.get("verdict"):
                parts.append(f"<p><b>{_e(d['verdict'])}</b></p>")
    if run.best:
        b = run.best
        parts.append(f"<p>Best checkpoint by <code>{_e(b.get('metric'))}</code>: {_f(b.get('value'))} "
                     f"(± {_f(b.get('se'))}) after {_e(b.get('step'))} PPO steps, at KL {_f(b.get('kl'), 2)} nats; "
                     f"saved in <code>best/</code>.</p>")
    last = run.metrics[-1] if run.metrics else {}
    parts.append(f"<p class=small>{len(run.metrics)} PPO steps; final training score "
                 f"{_f(last.get('objective/scores'))}, KL {_f(last.get('objective/kl'), 2)}, β "
                 f"{_f(last.get('objective/kl_coef'), 4)}.</p>")
    return "\n".join(parts)


def alarms_html(found: list[alarms.Alarm]) -> str:
    if not found:
        return ("<p class=ok>No alarm fired (over-optimisation, length drift, entropy collapse, KL runaway, "
                "advantage variance explosion, value function not learning).</p>")
    rows = "".join(f"<tr class=alarm><td>{_e(a.name)}</td><td class=num>{a.step}</td><td>{_e(a.message)}</td>"
                   f"<td>{_e(', '.join(f'{k}={v:.3g}' for k, v in a.values.items()))}</td></tr>" for a in found)
    return f"<table><tr><th>alarm</th><th>step</th><th>what</th><th>numbers</th></tr>{rows}</table>"


def samples_html(run: Run) -> str:
    """Held-out generations before PPO, at the best-gold checkpoint and at the end (same prompts)."""
    gold_key = run.gold.removeprefix("eval/") if run.gold else None
    if run.eval_samples:
        steps = sorted({r["step"] for r in run.eval_samples})
        picks = [("before PPO", steps[0])]
        if run.best and run.best.get("step") in steps and run.best["step"] not in (steps[0], steps[-1]):
            picks.append((f"best gold (step {run.best['step']})", run.best["step"]))
        if steps[-1] != steps[0]:
            picks.append((f"end (step {steps[-1]})", steps[-1]))
        by = {(r["step"], _text(r["prompt"])): r for r in run.eval_samples}
        prompts = list(dict.fromkeys(_text(r["prompt"]) for r in run.eval_samples if r["step"] == steps[0]))[:8]
        head = "".join(f"<th>{_e(label)}</th>" for label, _ in picks)
        body = []
        for p in prompts:
            cells = []
            for _, s in picks:
                r = by.get((s, p))
                if r is None:
                    cells.append("<td>–</td>")
                    continue
                sc = f"proxy {_f(r.get('score'), 2)}"
                if gold_key and gold_key in r.get("scores", {}):
                    sc += f" · gold {_f(r['scores'][gold_key], 2)}"
                cells.append(f"<td><div class=resp>{_e(r['response'])}</div><div class=small>{sc} · "
                             f"KL {_f(r.get('kl'), 1)}</div></td>")
            body.append(f"<tr><td>{_e(p)}</td>{''.join(cells)}</tr>")
        return f"<table><tr><th>held-out prompt</th>{head}</tr>{''.join(body)}</table>"
    if not run.samples:
        return "<p>No samples were written.</p>"
    steps = sorted({r["step"] for r in run.samples})
    rows = [r for r in run.samples if r["step"] in (steps[0], steps[-1])][:16]
    body = "".join(f"<tr><td class=num>{r['step']}</td><td>{_e(_text(r['prompt']))}</td><td><div class=resp>"
                   f"{_e(r['response'])}</div></td><td class=num>{_f(r.get('score'), 2)}</td>"
                   f"<td class=num>{_f(r.get('kl'), 1)}</td></tr>" for r in rows)
    return ("<p class=small>Training samples of the first and last sampled steps (no held-out set: run with "
            "--eval-prompts for before/after on the same prompts).</p><table><tr><th>step</th><th>prompt</th>"
            f"<th>response</th><th>score</th><th>KL</th></tr>{body}</table>")


def config_html(cfg: dict[str, Any]) -> str:
    rows = []
    for sec, vals in cfg.items():
        if isinstance(vals, dict):
            rows += [f"<tr><td>{_e(sec)}</td><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in vals.items()]
        else:
            rows.append(f"<tr><td></td><td>{_e(sec)}</td><td>{_e(vals)}</td></tr>")
    return f"<table><tr><th>section</th><th>option</th><th>value</th></tr>{''.join(rows)}</table>"


def write_report(run_dir: str | Path) -> Path:
    """Write plots/*.png and report.html into ``run_dir``; returns the HTML path."""
    run = load_run(run_dir)
    plots = make_plots(run, run.dir / "plots")
    found = run_alarms(run)
    figs = "".join(
        f"<figure><img src=\"data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}\" alt=\"{_e(n)}\">"
        f"<figcaption>{_e(c)}</figcaption></figure>" for n, (c, p) in plots.items())
    compared = ""
    if run.demo and run.demo.get("overoptimisation") and run.demo.get("comparison"):
        png = run.dir / "plots" / "static_vs_refreshed.png"
        compare.plot(run.demo["comparison"], png, compare.LONG_LABELS)
        compared = (
            "<h2>Static proxy against refreshed proxy</h2><p>The same PPO settings and KL budget twice: against "
            "the proxy as trained, and with the proxy refreshed every few steps on pairs of the policy's "
            "answers labelled by the judge. The refreshed run's proxy curve is in the units of the proxy of the "
            "moment (re-normalised at each refresh). Its own report: <code>refresh/report.html</code>.</p>"
            + compare.long_html(run.demo, _e, _f)
            + f"<figure><img src=\"data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}\" "
              "alt=\"static_vs_refreshed\"><figcaption>Gold reward, proxy reward and the proxy's agreement with "
              "the judge on each policy's own answers, against KL to the starting policy (±1 SE).</figcaption>"
              "</figure>")
    elif run.demo and run.demo.get("comparison"):

        png = run.dir / "plots" / "algorithms_vs_kl.png"
        compare.plot(run.demo["comparison"], png)
        compared = (
            "<h2>PPO and its alternatives</h2><p>Each algorithm trained on the same task from the same starting "
            "policy: the PPO family against the proxy reward model with the same number of sampled responses, "
            "DPO on the proxy's preference pairs; all scored on the same held-out prompts by the gold judge and "
            "the proxy, at each evaluation. The best gold score is the maximum over evaluations (optimistic "
            "for every algorithm alike); wall time and peak memory are each algorithm's own process.</p>"
            + compare.table_html(run.demo["comparison"], _e, _f)
            + f"<figure><img src=\"data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}\" "
              "alt=\"algorithms_vs_kl\"><figcaption>Gold and proxy reward against KL to the starting policy, "
              "one line per algorithm (error bars: ±1 SE over the held-out prompts).</figcaption></figure>")
    extra = ""
    if run.demo and run.demo.get("sizes"):
        extra = "<h2>Demo sizes and stage times</h2>" + config_html(
            {"sizes": run.demo["sizes"], "seconds": run.demo.get("timings_s", {}),
             "machine": {"threads": run.demo.get("threads"), "precision": run.demo.get("precision")}})
    title = "ppolm demo: over-optimisation on a real model" if run.demo else f"ppolm PPO run: {run.dir.name}"
    page = f"""<!doctype html><html lang=en><head><meta charset=utf-8><title>{_e(title)}</title>
<style>{CSS}</style></head><body><h1>{_e(title)}</h1><p class=small>{_e(run.dir.resolve())}</p>
<h2>Summary</h2>{summary_html(run)}
{compared}<h2>Alarms</h2>{alarms_html(found)}
<h2>Plots</h2>{figs}
<h2>Samples</h2>{samples_html(run)}
{extra}<h2>Config</h2>{config_html(run.config)}
</body></html>"""
    path = run.dir / "report.html"
    atomic.write_text(path, page)
    return path
