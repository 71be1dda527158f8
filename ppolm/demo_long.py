"""``ppolm demo --overoptimisation``: Gao's whole curve, and the refresh that lifts it.

The demo's task, pairs and proxy reward model (:mod:`ppolm.demo`), rated by the demo's gold judge
with a floor on length (:func:`ppolm.gold.review_score`), then two PPO runs with the same budget of
sampled responses and the same loose KL budget (:data:`ppolm.demo_sizes.LONG`):

1. **static**: against the proxy as it was trained, long enough that held-out gold rises, peaks and
   falls while the proxy keeps rising (Gao, Schulman & Hilton 2022, arXiv:2210.10760);
2. **refresh**: the same, with the proxy refreshed every few steps on pairs of the current policy's
   answers labelled by the judge (``ppolm ppo --rm-refresh-every``, docs/overoptimisation.md).

Both runs check the proxy against the judge on their own answers at each evaluation
(``rm/onpolicy_accuracy``). The judge is that rater with the label noise of the proxy's own pairs:
it stands for the people who labelled them. Afterwards the starting policy and each run's
best-gold and final policies are scored again on fresh samples (common random numbers, so that the
per-prompt differences are paired), and ``report.html`` overlays the two runs against KL.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ppolm import models
from ppolm.demo import Demo, DemoConfig, mean_se, say
from ppolm.demo_sizes import LONG, LONG_QUICK
from ppolm.errors import PPOLMError
from ppolm.gold import REVIEW_JUDGE_DESCRIPTION, review_score
from ppolm.report import write_report
from ppolm.tracking import read_jsonl

REFRESH = "refresh"
"""The refreshed run's directory in --output-dir (the static run is the demo's own PPO run)."""
POLICIES = ("before", "static_best", "static_end", "refresh_best", "refresh_end")


class LongDemo(Demo):
    """The demo with a second PPO run whose proxy is refreshed (module docstring). Its rater is the
    demo's gold judge with a floor on length (:func:`ppolm.gold.review_score`): the demo's judge takes
    "Awesome." for a good review, and against it the proxy's favourite one-word answers plateau
    instead of falling."""

    gold_metric = "eval/review_judge"
    judge_spec = "ppolm.gold:review_judge"
    judge_description = REVIEW_JUDGE_DESCRIPTION

    def gold(self, text: str) -> float:
        return review_score(text)

    def __init__(self, cfg: DemoConfig):
        if cfg.algorithms.replace(" ", "") != "ppo":
            raise PPOLMError("--overoptimisation compares PPO against a static and a refreshed proxy; it does not "
                             "take --algorithms (run the head-to-head demo separately)")
        super().__init__(cfg)
        self.long = replace(LONG_QUICK if cfg.quick else LONG, **({"steps": cfg.steps} if cfg.steps else {}))
        # the shared PPO settings of both runs; the task, pairs and proxy stay the demo's
        self.sizes = replace(self.sizes, steps=self.long.steps, eval_every=self.long.eval_every,
                             kl_target=self.long.kl_target, kl_coef=self.long.kl_coef, actor_lr=self.long.actor_lr,
                             confirm_samples=self.long.confirm_samples)
        self.others = [REFRESH]
        self.algorithms = ["ppo", REFRESH]
        self.n_stages = 7

    def prepare(self) -> None:
        super().prepare()
        self.state.setdefault("overoptimisation", {"sizes": asdict(self.long)})
        self.save_state()

    def ppo_options(self, name: str = "ppo") -> dict[str, Any]:
        """The demo's PPO options with the judge checking the proxy at each evaluation; the refreshed
        run also refreshes it (same judge, same label noise as the proxy's pairs)."""
        s, lg = self.sizes, self.long
        options = {**super().ppo_options(name), "judge": self.judge_spec, "judge_temperature": s.label_temperature,
                   "rm_check_pairs": lg.check_pairs}
        if name == REFRESH:
            options.update(rm_refresh_every=lg.refresh_every, rm_refresh_pairs=lg.refresh_pairs,
                           rm_refresh_steps=lg.refresh_steps, rm_refresh_start_share=lg.refresh_start_share)
        return options

    def alternative(self, name: str) -> None:
        self.train_apart("ppo", self.ppo_options(name), self.out / name)

    # ------------------------------------------------------------------------------------ confirm
    def confirm(self) -> None:
        """The starting policy and each run's best-gold and final policies, scored by the rater on
        fresh responses to every held-out prompt (:meth:`Demo.fresh_gold`: one random stream for all,
        so that differences between policies are paired by prompt)."""
        from peft import PeftModel

        adapters = {"static_best": self.out / "best", "static_end": self.out,
                    "refresh_best": self.out / REFRESH / "best", "refresh_end": self.out / REFRESH}
        missing = [k for k, d in adapters.items() if not (d / "policy_adapter").is_dir()]
        if missing:
            raise PPOLMError(f"no policy adapter for {', '.join(missing)} in {self.out}; rerun with --overwrite")
        temperature = self.ppo_temperature()
        tok = models.load_tokenizer(self.cfg.model)
        per_prompt: dict[str, list[float]] = {}
        for which in POLICIES:
            # peft wraps the model it is given in place: a fresh base for each adapter
            policy = models.load_causal_lm(self.cfg.model, dtype=self.dtype, device=self.device, tokenizer=tok)
            if which != "before":
                policy = PeftModel.from_pretrained(policy, str(adapters[which] / "policy_adapter"))
            per_prompt[which] = self.fresh_gold(policy.eval(), tok, temperature)
            say(f"      {which}: gold {mean_se(per_prompt[which])['mean']:+.3f} on fresh responses")

        def diff(a: str, b: str) -> dict[str, float]:
            return mean_se([y - x for x, y in zip(per_prompt[a], per_prompt[b])])

        scored = {w: mean_se(v) for w, v in per_prompt.items()}
        n = len(per_prompt["before"])
        # the static run's best against the start, in the form the demo's verdict reads
        self.state["confirm"] = {"before": scored["before"], "best": scored["static_best"],
                                 "gain": diff("before", "static_best"), "samples_per_prompt": self.sizes.confirm_samples,
                                 "n_prompts": n, "temperature": temperature}
        self.state["overoptimisation"]["confirm"] = {
            "scores": scored, "samples_per_prompt": self.sizes.confirm_samples, "n_prompts": n,
            # paired over prompts: the gain of each run's best, its fall to the end, and refresh vs static
            "gain": {"static": diff("before", "static_best"), REFRESH: diff("before", "refresh_best")},
            "fall_after_best": {"static": diff("static_end", "static_best"),
                                REFRESH: diff("refresh_end", "refresh_best")},
            "refresh_minus_static": {"best": diff("static_best", "refresh_best"),
                                     "end": diff("static_end", "refresh_end")}}

    # ------------------------------------------------------------------------------------ report
    def report(self) -> None:
        """What the refresh cost, the verdict, and the refreshed run's own report; then the demo's
        report, whose comparison (``Demo.summarise``) holds both runs' curves."""
        long = self.state["overoptimisation"]
        long["runs"] = {"static": judge_costs(self.out), REFRESH: judge_costs(self.out / REFRESH)}
        long["verdict"] = verdict(long, self.state["comparison"])
        self.save_state()
        write_report(self.out / REFRESH)
        super().report()
        say(long["verdict"])


def judge_costs(run_dir: Path) -> dict[str, Any]:
    """What one run's judge and refreshes cost: from metrics.jsonl (the refreshes) and eval.jsonl
    (the on-policy checks at each evaluation)."""
    refreshes = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "rm_refresh/seconds" in r]
    return {"refreshes": len(refreshes),
            "refresh_judge_calls": int(sum(r.get("rm_refresh/judge_calls", 0) for r in refreshes)),
            "refresh_seconds": [r["rm_refresh/seconds"] for r in refreshes],
            "check_judge_calls": int(sum(r.get("rm/onpolicy_judge_calls", 0)
                                         for r in read_jsonl(run_dir / "eval.jsonl")))}


def verdict(long: dict[str, Any], comparison: dict[str, Any]) -> str:
    """The long demo's finding in words: did gold fall after its peak against the static proxy, and did
    the refreshed run's best beat the static run's by more than 2 standard errors (paired)?"""
    c = long.get("confirm")
    if not c:
        return "The policies were not scored again on fresh samples; no verdict."
    s, f = c["scores"], c["fall_after_best"]
    d = c["refresh_minus_static"]["best"]

    def at(name: str) -> str:
        b = comparison.get(name, {}).get("best") or {}
        return f"step {b.get('step', '?')}, KL {b['kl']:.2f}" if b.get("kl") is not None else "?"

    static_fell = f["static"]["mean"] > 2 * f["static"]["se"]
    refresh_fell = f[REFRESH]["mean"] > 2 * f[REFRESH]["se"]
    won, lost = d["mean"] > 2 * d["se"], d["mean"] < -2 * d["se"]
    costs = long.get("runs", {}).get(REFRESH, {})
    return (
        f"Static proxy: best gold {s['static_best']['mean']:+.3f} ± {s['static_best']['se']:.3f} ({at('ppo')}), "
        f"end {s['static_end']['mean']:+.3f} ± {s['static_end']['se']:.3f}: gold "
        f"{'fell' if static_fell else 'did not fall significantly'} after its peak "
        f"({-f['static']['mean']:+.3f} ± {f['static']['se']:.3f}). Refreshed proxy: best gold "
        f"{s['refresh_best']['mean']:+.3f} ± {s['refresh_best']['se']:.3f} ({at(REFRESH)}), end "
        f"{s['refresh_end']['mean']:+.3f} ± {s['refresh_end']['se']:.3f} "
        f"({'a fall' if refresh_fell else 'no significant fall'} after its peak, "
        f"{-f[REFRESH]['mean']:+.3f} ± {f[REFRESH]['se']:.3f}), with {costs.get('refresh_judge_calls', 0)} judge "
        f"labels over {costs.get('refreshes', 0)} refreshes. Refreshed best minus static best: "
        f"{d['mean']:+.3f} ± {d['se']:.3f} (fresh samples, paired over {c['n_prompts']} held-out prompts; starting "
        f"policy {s['before']['mean']:+.3f}): "
        + ("the refreshed run did better, by more than twice its standard error." if won else
           "the refreshed run did worse, by more than twice its standard error." if lost else
           "no difference beyond twice its standard error."))


def run(cfg: DemoConfig) -> int:
    """``ppolm demo``: the demo, or with --overoptimisation its long mode."""
    return (LongDemo if cfg.overoptimisation else Demo)(cfg).run()
