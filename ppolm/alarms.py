"""Alarms from the seeds' PPO debugging checklist, computed from the metrics rows of a run.

Each check is a pure function over the rows of ``metrics.jsonl`` (one dict per PPO step, TRL
metric names) and returns at most one :class:`Alarm`: the first step where its rule held. The
rules are deliberately simple and their thresholds are keyword arguments, so a report can quote
them and a test can hit both sides of each. Rolling means over a few steps keep one noisy batch
of 8 rollouts from firing an alarm on its own.

:class:`AlarmWatcher` re-runs the checks while a run is going (by tailing ``metrics.jsonl``) and
prints each new alarm once as a terminal warning, so a user sees trouble before the run ends.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ppolm.tracking import read_jsonl

Rows = list[dict[str, Any]]


@dataclass
class Alarm:
    name: str
    """Short id, e.g. ``entropy_collapse``."""
    step: int
    """The PPO step at which the rule first held."""
    message: str
    """One line for a human: what happened and what to try."""
    values: dict[str, float] = field(default_factory=dict)
    """The numbers the rule compared."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def series(rows: Rows, key: str) -> list[tuple[int, float]]:
    """(step, value) of every row holding a finite number under ``key``."""
    out = []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append((int(r.get("step", len(out))), float(v)))
    return out


def _rolling(vals: list[float], i: int, window: int) -> float:
    chunk = vals[max(0, i - window + 1):i + 1]
    return sum(chunk) / len(chunk)


def _untied(rows: Rows) -> Rows:
    """The rows of batches whose scores did not all tie (``adv/tied`` absent or 0)."""
    return [r for r in rows if r.get("adv/tied") != 1.0]


def _baseline(vals: list[float], n: int = 3) -> float:
    head = vals[:n]
    return sum(head) / len(head)


def length_drift(rows: Rows, *, rel: float = 0.5, min_tokens: float = 4.0, window: int = 3) -> Alarm | None:
    """Response length drifting: the rolling mean (``window`` steps) of ``response/length_mean``
    moves more than ``rel`` (50%) *and* more than ``min_tokens`` (4) tokens away from the mean of
    the first 3 steps. PPO exploits length when the reward correlates with it (Singhal et al. 2023)."""
    s = series(rows, "response/length_mean")
    if len(s) < window + 3:
        return None
    vals = [v for _, v in s]
    base = _baseline(vals)
    for i in range(3, len(s)):
        now = _rolling(vals, i, window)
        if abs(now - base) > max(rel * base, min_tokens):
            way = "longer" if now > base else "shorter"
            return Alarm("length_drift", s[i][0], f"responses got {way}: mean length {now:.1f} tokens vs "
                         f"{base:.1f} at the start; the reward may be paying for length (try --length-penalty)",
                         {"length": now, "baseline": base})
    return None


def entropy_collapse(rows: Rows, *, frac: float = 0.3, floor: float = 0.05, window: int = 3) -> Alarm | None:
    """Entropy collapsing: the rolling mean (``window`` steps) of the per-token policy entropy
    (``policy/entropy_avg``) or of the entropy of whole responses (``objective/entropy``, nats per
    response) falls below ``frac`` (30%) of its mean over the first 3 steps, or the per-token one
    below ``floor`` (0.05 nats). Both: a policy can keep its per-token entropy while its answers
    shrink to a few near-certain tokens. A collapsed policy repeats one answer; exploration and the
    KL estimate both suffer."""
    found = []
    for key, unit, low in (("policy/entropy_avg", "nats/token", floor), ("objective/entropy", "nats/response", 0.0)):
        s = series(rows, key)
        vals = [v for _, v in s]
        base = _baseline(vals) if vals else 0.0
        for i in range(1, len(s)):
            now = _rolling(vals, i, window)
            if now < low or (i >= 3 and now < frac * base):
                found.append(Alarm("entropy_collapse", s[i][0], f"policy entropy fell to {now:.3f} {unit} from "
                                   f"{base:.3f}; the policy is collapsing onto few answers (lower --actor-lr, raise "
                                   "--kl-coef or --kl-target lower, or add --entropy-coef)",
                                   {"entropy": now, "baseline": base}))
                break
    return min(found, key=lambda a: a.step) if found else None


def kl_runaway(rows: Rows, *, target: float | None = None, factor: float = 2.0, patience: int = 3) -> Alarm | None:
    """KL running away from the target: ``objective/kl`` above ``factor`` (2) x ``target`` for
    ``patience`` (3) consecutive steps (without a target: above 20 nats), or below -1 nat (the k1
    estimate going negative means sampling and scoring disagree, e.g. a temperature mismatch)."""
    s = series(rows, "objective/kl")
    limit = factor * target if target else 20.0
    run = 0
    for step, v in s:
        if v < -1.0:
            return Alarm("kl_runaway", step, f"KL estimate is negative ({v:.2f} nats): the sampled tokens do "
                         "not match the policy's log-probs; check temperature/top-p/top-k", {"kl": v})
        run = run + 1 if v > limit else 0
        if run >= patience:
            return Alarm("kl_runaway", step, f"KL {v:.2f} nats has been above {limit:.2f} for {patience} steps "
                         f"(target {target}); raise --kl-coef (or --kl-coef-max, if beta sits at it) or lower --actor-lr",
                         {"kl": v, "limit": limit, **({"target": target} if target else {})})
    return None


def advantage_explosion(rows: Rows, *, factor: float = 100.0, window: int = 3) -> Alarm | None:
    """Advantage variance exploding: the rolling mean (``window`` steps) of ``adv/var`` (before
    whitening) above ``factor`` (100) x its mean over the first 3 steps, or a value not finite.
    Usually a reward scale problem or a critic that diverged; the whitened update hides it, so
    only this metric shows it. Batches whose scores all tied (``adv/tied`` 1: nobody earned a rare
    reward, or everybody earned a mastered one) are left out, as in :func:`value_not_learning`:
    their variance is the KL penalty's alone, ~1e-4 before a rare reward's first hit, against which
    that hit would read as a 20x "explosion". The factor is large because a working run's variance
    grows on its own: the KL penalty's part grows with the KL and with beta squared, and the
    adaptive controller raises beta 10-20x from its floor. A diverging critic or a reward whose
    scale runs away grows by orders of magnitude."""
    raw = [(int(r.get("step", i)), r.get("adv/var")) for i, r in enumerate(rows)]
    for step, v in raw:
        if v in ("inf", "-inf"):
            return Alarm("advantage_explosion", step, "advantage variance is infinite; check the reward scale",
                         {"adv_var": math.inf})
    s = series(_untied(rows), "adv/var")
    if len(s) < 3 + window:
        return None
    vals = [v for _, v in s]
    base = _baseline(vals)
    for i in range(3 + window - 1, len(s)):
        now = _rolling(vals, i, window)
        if base > 0 and now > factor * base:
            return Alarm("advantage_explosion", s[i][0], f"advantage variance {now:.3g} (mean of {window} steps) is "
                         f"{now / base:.0f}x its starting value {base:.3g}; normalise the reward or lower "
                         "--critic-lr", {"adv_var": now, "baseline": base})
    return None


VALUE_FAR_OFF = -1.0
"""Explained variance below which :func:`value_not_learning` points at the critic's start rather
than its learning rate: an error variance twice the returns' own."""


def value_not_learning(rows: Rows, *, min_steps: int = 6, window: int = 5) -> Alarm | None:
    """Value function not learning: from the ``min_steps``-th (6th) step on, the rolling mean of
    ``val/vf_explained_var`` over ``window`` (5) steps is <= 0, i.e. the critic predicts returns
    no better than a constant, so GAE's advantages are mostly noise. The first step where it held,
    as the live check reports it, so ``ppolm report`` and ``metrics.jsonl`` agree. Batches whose
    scores were all equal (``adv/tied`` 1: a rarely earned rule-based reward that nobody earned)
    are left out: their returns differ only by the KL penalty, so the explained variance of those
    tiny differences says nothing about the critic (it was -1 to -8 there while the batches with a
    hit gave +0.1 to +0.4, bench/learning.py keyword)."""
    s = series(_untied(rows), "val/vf_explained_var")
    vals = [v for _, v in s]
    for i in range(min_steps - 1, len(vals)):
        now = _rolling(vals, i, window)
        if now <= 0:
            # Far below 0 the values are further from the returns than their mean is: the mark of a
            # critic that kept a reward model's head, which scores partial responses as if finished.
            advice = ("its values are further from the returns than their mean: if it kept a reward model's head, "
                      "start that head at zero with --critic-zero-head, or raise --critic-lr"
                      if now < VALUE_FAR_OFF else
                      "raise --critic-lr, train more of its layers with --critic-layers, or start it from a reward "
                      "model with --critic-init reward")
            return Alarm("value_not_learning", s[i][0], f"value explained variance is {now:.2f} over "
                         f"{min(window, i + 1)} steps (<= 0): the critic is not learning ({advice})",
                         {"explained_var": now})
    return None


def over_optimisation(rows: Rows, *, proxy: str, gold: str, n_se: float = 2.0) -> Alarm | None:
    """Proxy reward rising while gold falls (Goodhart; Gao et al. 2022): on the evaluation rows,
    the last gold score is more than ``n_se`` (2) standard errors (``<gold>_se``, combined) below
    the best gold score so far, while the last proxy score is above the proxy score at the gold
    peak. ``proxy``/``gold`` are metric names such as ``eval/reward_model`` and ``eval/gold_judge``."""
    ev = [r for r in rows if _finite(r.get(gold)) and _finite(r.get(proxy))]
    if len(ev) < 3:
        return None
    for j in range(2, len(ev)):
        seen = ev[:j + 1]
        peak = max(seen[:-1], key=lambda r: r[gold])
        last = seen[-1]
        se = math.hypot(_num(peak.get(gold + "_se")), _num(last.get(gold + "_se")))
        if last[gold] < peak[gold] - n_se * se and last[gold] < peak[gold] and last[proxy] > peak[proxy]:
            return Alarm("over_optimisation", int(last["step"]),
                         f"over-optimisation: gold fell from {peak[gold]:.3f} (step {peak['step']}) to "
                         f"{last[gold]:.3f} while the proxy rose from {peak[proxy]:.3f} to {last[proxy]:.3f}; "
                         "use the best-gold checkpoint, a larger --kl-coef or a better reward model",
                         {"gold_peak": peak[gold], "gold_now": last[gold], "proxy_at_peak": peak[proxy],
                          "proxy_now": last[proxy], "peak_step": float(peak["step"])})
    return None


def reward_model_drift(rows: Rows, *, n_se: float = 2.0, min_drop: float = 0.05) -> Alarm | None:
    """The proxy reward model losing touch with the judge on the policy's own answers: the on-policy
    agreement ``rm/onpolicy_accuracy`` (:mod:`ppolm.rm_check`) falls below its first value by more
    than ``n_se`` (2) standard errors of the difference, ``hypot(se_start, se_now)`` from
    ``rm/onpolicy_accuracy_se``, *and* by more than ``min_drop`` (0.05, five points of accuracy).
    The first condition keeps a few dozen noisy pairs from firing it (64 pairs at 0.7 have an SE of
    0.057, so a drop must exceed 0.16); the second keeps a large check from firing on a drop too small
    to matter. The proxy is then rewarding what the judge does not prefer (Gao et al. 2022)."""
    checks = [(int(r.get("step", i)), float(r["rm/onpolicy_accuracy"]), _num(r.get("rm/onpolicy_accuracy_se")))
              for i, r in enumerate(rows) if _finite(r.get("rm/onpolicy_accuracy"))]
    if len(checks) < 2:
        return None
    step0, base, se0 = checks[0]
    for step, now, se_now in checks[1:]:
        limit = max(n_se * math.hypot(se0, se_now), min_drop)
        if base - now > limit:
            return Alarm("reward_model_drift", step, f"the reward model agrees with the judge on {now:.0%} of the "
                         f"policy's own answer pairs, down from {base:.0%} at step {step0}: it is being "
                         "over-optimised (refresh it with --rm-refresh-every, use the best-gold checkpoint, or "
                         "raise --kl-coef)", {"accuracy": now, "baseline": base, "drop_limit": limit})
    return None


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _num(v: Any) -> float:
    return float(v) if _finite(v) else 0.0


def check_all(rows: Rows, *, kl_target: float | None = None, proxy: str | None = None,
              gold: str | None = None) -> list[Alarm]:
    """Every alarm that fired, in step order. The over-optimisation check needs both metric names."""
    found: list[Alarm | None] = [length_drift(rows), entropy_collapse(rows), kl_runaway(rows, target=kl_target),
                                 advantage_explosion(rows), value_not_learning(rows), reward_model_drift(rows)]
    if proxy and gold:
        found.append(over_optimisation(rows, proxy=proxy, gold=gold))
    return sorted((a for a in found if a is not None), key=lambda a: a.step)


class LiveAlarms:
    """The checks of :func:`check_all` re-run after every step of a run, on the rows so far: an
    alarm that fires for the first time is reported once (``emit``, a warning line) and marked in
    that step's metrics row as ``alarm/<name>: 1``, so ``metrics.jsonl`` and TensorBoard show when.
    ``rows``: the rows of the steps before (a resumed run), whose alarms are not reported again."""

    def __init__(self, *, kl_target: float | None, emit: Callable[[str], None] | None = None,
                 rows: Rows | None = None):
        self.kl_target = kl_target
        self.emit = emit or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.rows: Rows = list(rows or [])
        self.seen = {k.removeprefix("alarm/") for r in self.rows for k in r if k.startswith("alarm/")}

    def __call__(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        self.rows.append({"step": step, **metrics})
        marks = {}
        for a in check_all(self.rows, kl_target=self.kl_target):
            if a.name not in self.seen:
                self.seen.add(a.name)
                self.emit(f"warning: alarm {a.name} at step {step}: {a.message}")
                marks[f"alarm/{a.name}"] = 1.0
        self.rows[-1].update(marks)
        return marks


class AlarmWatcher:
    """Tail ``metrics.jsonl`` in a background thread and print each newly fired alarm once.

    The trainer knows nothing about alarms; this keeps them out of the PPO loop and works for
    any run directory. Use as a context manager around the training call.
    """

    def __init__(self, metrics_path: Path, check: Callable[[Rows], list[Alarm]], every_s: float = 5.0,
                 emit: Callable[[str], None] | None = None):
        self.path = metrics_path
        self.check = check
        self.every_s = every_s
        self.emit = emit or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def poll(self) -> list[Alarm]:
        new = [a for a in self.check(read_jsonl(self.path)) if a.name not in self.seen]
        for a in new:
            self.seen.add(a.name)
            self.emit(f"warning: alarm {a.name} at step {a.step}: {a.message}")
        return new

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.poll()
            except Exception:  # a half-written file: try again next time
                pass

    def __enter__(self) -> AlarmWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.every_s)
        try:
            self.poll()
        except Exception:
            pass
