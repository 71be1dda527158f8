"""Write the generated references in docs/: every command's options (docs/options.md) from the
config dataclasses, the same text ``--help`` shows, and every metric name with its meaning
(docs/metrics.md).

    python -m ppolm.docs_gen            # rewrite docs/options.md and docs/metrics.md
    python -m ppolm.docs_gen --check    # exit 1, naming the stale files, if they differ

tests/test_docs.py runs the check, and checks that the metric names below are the names the code
writes (:func:`metric_names_in_code`).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import sys
from pathlib import Path

from ppolm import config
from ppolm.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = "python -m ppolm.docs_gen"

# name -> meaning, in the order docs/metrics.md lists them. Names follow TRL's PPOTrainer and
# OpenAI's lm-human-preferences, so runs of the three compare.
PPO_METRICS: dict[str, str] = {
    "step": "updates done before this row's batch (0 for the first).",
    "objective/kl": "mean over the batch of the response's summed per-token KL to the reference "
                    "(`--kl-estimator`), nats per response.",
    "objective/kl_coef": "β, the KL coefficient used on this batch (the adaptive controller's value before its "
                         "update).",
    "objective/entropy": "mean over the batch of the response's summed negative log-prob of its sampled tokens "
                         "(a per-response entropy estimate).",
    "objective/scores": "mean score of the batch: reward models and functions combined, missing-EOS and length "
                        "penalties included, before any centring or scaling.",
    "objective/non_score_reward": "mean over the batch of the summed per-token KL penalty in the score's units: "
                                  "−β · KL, times `objective/score_scale` when the KL is in the reward.",
    "objective/rlhf_reward": "`objective/scores` + `objective/non_score_reward`: what PPO maximises.",
    "objective/score_scale": "(`gae`) the divisor of the scores before the KL penalty (`--score-scale`).",
    "objective/score_center": "(`gae`) what is subtracted from the scores first (`--score-center`).",
    "policy/approxkl_avg": "mean approximate KL between the updated and the rollout policy over the update's "
                           "minibatches (0.5 · (log ratio)²).",
    "policy/clipfrac_avg": "share of tokens whose ratio was clipped in the policy loss.",
    "policy/dual_clipfrac_avg": "(`--dual-clip`) share of tokens whose loss the dual clip capped.",
    "policy/entropy_avg": "mean per-token entropy of the full next-token distribution over the response tokens.",
    "policy/sampler_logprob_gap": "mean per token of |recomputed − sampled| log-prob: ~0 in fp32, bf16 rounding "
                                  "otherwise; large values mean the rollouts were not drawn from the policy PPO "
                                  "optimises.",
    "policy/grad_norm": "global gradient norm of the policy before `--max-grad-norm` clips it, averaged over the "
                        "update's optimiser steps.",
    "policy/update_kl": "(`--update-kl-max`) the update's mean per-token KL to the rollout policy.",
    "policy/update_scale": "(`--update-kl-max`) the factor the update's step was shrunk by (1: not shrunk).",
    "loss/policy_avg": "mean clipped policy loss over the update.",
    "loss/value_avg": "(`gae`) mean clipped value loss over the update.",
    "loss/ptx_avg": "(`--ptx-coef`) mean language-modelling loss on `--ptx-data`.",
    "val/clipfrac_avg": "(`gae`) share of tokens whose value prediction was clipped (`--vf-clip`).",
    "val/ratio": "mean probability ratio of the updated to the rollout policy over the update's tokens.",
    "val/vf_explained_var": "(`gae`) 1 − Var(returns − values) / Var(returns) over the response tokens; "
                            "nan when the returns do not vary.",
    "val/num_eos_tokens": "number of EOS tokens in the batch's responses (responses that ended).",
    "val/grad_norm": "(separate critic) the critic's global gradient norm before clipping, averaged over the "
                     "update's optimiser steps.",
    "adv/var": "variance of the advantages before whitening.",
    "adv/tied": "(`gae`) 1 when every score of the batch was equal.",
    "adv/unearned": "(`gae`) 1 when they tied at or below the run's mean score: the batches `--tied-scores` acts "
                    "on.",
    "response/length_mean": "mean response length in tokens.",
    "lr": "the policy's learning rate used in this update (after schedule, warmup and `--kl-lr-boost`).",
    "lr/critic": "(`gae`) the critic's learning rate.",
    "ppo/epochs": "PPO epochs run on the batch (fewer than `--ppo-epochs` when `--target-kl` stopped them).",
    "guard/skipped_updates": "updates skipped so far for a non-finite reward, loss or gradient.",
    "time/rollout_s": "seconds spent sampling the responses.",
    "time/rollout_max_s": "(torchrun) the slowest process's sampling time.",
    "time/score_s": "seconds spent scoring and in the frozen models' pass (reference, reward models).",
    "time/train_s": "seconds spent in the PPO epochs.",
    "time/step_s": "seconds for the whole step.",
    "memory/rss_start_gb": "(Linux) the process's resident memory (RSS) when the step began, GB: weights, optimiser "
                           "states, the runtime and what the allocator kept from the last step; a steady climb is a leak.",
    "memory/rss_floor_gb": "(Linux) the lowest RSS sampled in the step: what the models, optimiser states and runtime "
                           "hold once ppolm has handed freed memory back before the training pass.",
    "memory/rss_rollout_gb": "(Linux) peak RSS while sampling (the KV cache), sampled every 5 ms (ppolm/memory.py).",
    "memory/rss_score_gb": "(Linux) peak RSS in the frozen models' pass and the trained models' first pass.",
    "memory/rss_train_gb": "(Linux) peak RSS in the PPO epochs (activations, gradients, optimiser states).",
    "memory/rss_peak_gb": "(Linux) the step's peak RSS, the largest of the three; with torchrun, of the largest process.",
    "memory/rss_max_gb": "the process's peak RSS since it started (`getrusage`, what `/usr/bin/time` reports).",
    "memory/gpu_rollout_gb": "(CUDA) torch's allocator peak while sampling.",
    "memory/gpu_score_gb": "(CUDA) torch's allocator peak in the frozen and first passes.",
    "memory/gpu_train_gb": "(CUDA) torch's allocator peak in the PPO epochs.",
    "memory/gpu_peak_gb": "(CUDA) the step's allocator peak, the largest of the three.",
    "memory/gpu_reserved_gb": "(CUDA) the allocator's reserved peak in the step: what torch held from the driver.",
    "time/rm_check": "seconds spent on the on-policy reward-model check (sampling, judging, scoring).",
    "rm/onpolicy_accuracy": "(`--judge`) share of pairs of answers of the policy that sampled this step's batch that "
                            "the proxy reward model orders as the judge does (a proxy tie counts half); "
                            "docs/overoptimisation.md.",
    "rm/onpolicy_accuracy_se": "its binomial standard error, sqrt(p(1 − p) / n).",
    "rm/onpolicy_pairs": "pairs the judge ordered (ties and skipped pairs left out).",
    "rm/onpolicy_ties": "pairs the judge tied.",
    "rm/onpolicy_skipped": "pairs skipped before judging: identical or empty answers.",
    "rm/onpolicy_judge_calls": "comparisons asked of the judge by this check.",
    "rm/heldout_accuracy": "the proxy's accuracy on the held-out pairs it was validated on, beside the on-policy one.",
    "rm/heldout_accuracy_se": "its standard error.",
    "rm/heldout_pairs": "held-out pairs scored.",
    "rm_refresh/round": "(`--rm-refresh-every`) refreshes of the reward model so far.",
    "rm_refresh/pairs_added": "fresh judge-labelled pairs of the policy's answers added by this refresh.",
    "rm_refresh/skipped": "fresh pairs skipped (identical or empty answers).",
    "rm_refresh/ties": "fresh pairs the judge tied (not trained on).",
    "rm_refresh/start_pairs": "fresh pairs that set the policy's answer against the starting policy's (`--rm-refresh-start-share`).",
    "rm_refresh/buffer_pairs": "pairs the reward model now trains on: the original ones and every refresh's.",
    "rm_refresh/fresh_accuracy_before": "the reward model's accuracy on this refresh's fresh pairs before training.",
    "rm_refresh/fresh_accuracy_after": "the same after training on them.",
    "rm_refresh/loss": "mean Bradley–Terry loss of the refresh's optimiser steps.",
    "rm_refresh/steps": "reward-model optimiser steps of this refresh.",
    "rm_refresh/norm_gain": "the refreshed model's normalisation gain (score = gain × head + bias).",
    "rm_refresh/norm_bias": "its bias.",
    "rm_refresh/judge_calls": "comparisons asked of the judge by this refresh.",
    "rm_refresh/judge_calls_total": "comparisons asked of the judge by every refresh so far.",
    "rm_refresh/seconds": "seconds this refresh took.",
    "reward/<source>": "mean raw score of each reward source (a function's name, a reward model's directory name).",
    "alarm/<name>": "present on the step where a debugging alarm first fired: `kl_runaway`, `entropy_collapse`, "
                    "`length_drift`, `advantage_explosion`, `value_not_learning`, `reward_model_drift`.",
    "reward/judge_<model>_unparsed": "(`--reward-judge`) replies of the LLM judge that held no rating this step.",
}

EVAL_METRICS: dict[str, str] = {
    "step": "updates done when the held-out prompts were scored (0: before training).",
    "updates": "the same count, as the evaluation itself records it.",
    "eval/score": "mean trained-on score of the held-out responses, penalties included (as `objective/scores`).",
    "eval/score_se": "its standard error over the prompts.",
    "eval/kl": "mean summed KL of a held-out response to the reference.",
    "eval/kl_se": "its standard error.",
    "eval/length_mean": "mean held-out response length in tokens.",
    "eval/<source>": "each reward source's raw mean score, and every `--eval-reward-fn` scorer's.",
    "eval/<source>_se": "its standard error.",
    "eval/gold_judge": "(`ppolm demo`) the gold judge's score, the demo's measure of true quality.",
    "eval/review_judge": "(`ppolm demo --overoptimisation`) its rater: the gold judge minus 0.2 per word short of 5 words.",
    "rm/<name>": "(`--judge`) the on-policy reward-model check of the evaluated policy (the `rm/` metrics of "
                 "metrics.jsonl).",
    "time/rm_check": "seconds that check took.",
    "alarm/<name>": "on the last evaluation: an alarm its check fired first (there is no step row after it).",
}

METRIC_PREFIXES = ("objective", "policy", "loss", "val", "adv", "response", "lr", "ppo", "guard", "time", "eval",
                   "rm", "rm_refresh", "memory")
"""Prefixes of the metric names :func:`metric_names_in_code` collects (``reward/`` and ``alarm/``
names are built from a source's or an alarm's name, so they are documented as patterns)."""


def metric_names_in_code(package: Path = ROOT / "ppolm") -> set[str]:
    """Every string constant in the package's modules (subpackages included, this one aside) that is
    a metric name with one of :data:`METRIC_PREFIXES`: the names the code writes and reads."""
    pattern = re.compile(rf"^({'|'.join(METRIC_PREFIXES)})/[a-z_]+$")
    names: set[str] = set()
    for path in sorted(package.rglob("*.py")):
        if path.resolve() == Path(__file__).resolve():
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.match(node.value):
                names.add(node.value)
    return names


def documented_metric_names() -> set[str]:
    """The fixed metric names docs/metrics.md lists (patterns such as ``reward/<source>`` aside)."""
    return {n for n in (*PPO_METRICS, *EVAL_METRICS) if "/" in n and "<" not in n}


def _cell(text: str) -> str:
    """Markdown table cell: pipes escaped; docs/X.md references as links relative to docs/."""
    text = text.replace("|", "\\|")
    return re.sub(r"docs/([\w-]+\.md)(#[\w-]+)?", lambda m: f"[{m.group(0)}]({m.group(1)}{m.group(2) or ''})",
                  text)


def _command_class(spec: str) -> type:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def options_markdown() -> str:
    lines = ["# Options of every command", "",
             f"<!-- Generated by `{REGENERATE}` from the config dataclasses; do not edit by hand. -->", "",
             "The text of `ppolm COMMAND --help`, grouped as it groups them. Every option is also a key of the",
             "YAML file `--config FILE.yaml` takes (flat, or under its section's name: `kl: {kl_target: 6}`), and",
             "the command line overrides the file. Why a default is what it is: [defaults.md](defaults.md).", ""]
    lines += [f"- [`ppolm {name}`](#ppolm-{name}): {help_text}" for name, (_, _, help_text) in COMMANDS.items()]
    for name, (spec, _, help_text) in COMMANDS.items():
        cls = _command_class(spec)
        lines += ["", f"## `ppolm {name}`", "", help_text[0].upper() + help_text[1:] + ".", ""]
        leaves = config.leaf_fields(cls)
        for title, names in config.option_groups(cls):
            lines += [f"**{title or 'Options'}**", "", "| option | default | what |", "|---|---|---|"]
            for opt in names:
                _sec, f, t = leaves[opt]
                inner, _ = config._optional_inner(t)
                flag = opt.replace("_", "-")
                meta = config.metavar(t) or config._type_name(t)  # a choice: {a,b,c}, as argparse shows it
                flag = f"--[no-]{flag}" if inner is bool else f"--{flag} {meta}"
                doc = config.option_help(cls, opt).rsplit(" [default: ", 1)[0]
                lines.append(f"| `{_cell(flag)}` | `{config.default_text(f)}` | {_cell(doc)} |")
            lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def metrics_markdown() -> str:
    lines = ["# Metrics", "",
             f"<!-- Generated by `{REGENERATE}` from ppolm/docs_gen.py, whose names tests/test_docs.py checks "
             "against the code; do not edit by hand. -->", "",
             "Names follow TRL's `PPOTrainer` and OpenAI's lm-human-preferences, so runs of the three compare. A",
             "name marked (`gae`) is absent for the critic-free estimators; one marked with an option, absent",
             "without it. `ppolm report --run-dir RUN` plots them.", "",
             "## `ppolm ppo`: metrics.jsonl", "",
             "One JSON object per PPO step, also written as TensorBoard scalars under `tensorboard/`.", "",
             "| name | meaning |", "|---|---|"]
    lines += [f"| `{n}` | {_cell(m)} |" for n, m in PPO_METRICS.items()]
    lines += ["", "## Held-out evaluation", "",
              "`ppolm ppo --eval-prompts FILE` scores the held-out prompts before training, every `--eval-every`",
              "steps and after the last: one row each in eval.jsonl, and every response with its scores in",
              "eval_samples.jsonl. `--best-metric eval/NAME` keeps the policy that maximises one of them in `best/`.",
              "", "| name | meaning |", "|---|---|"]
    lines += [f"| `{n}` | {_cell(m)} |" for n, m in EVAL_METRICS.items()]
    lines += ["", "## `ppolm sft`, `reward`, `dpo`", "",
              "One row per epoch in their metrics.jsonl: `epoch`, the training loss (`train_loss`, `loss` for",
              "dpo) and, with held-out data, `eval_loss` for sft and reward (reward: also `eval_accuracy` and",
              "`eval_margin`); dpo adds TRL's `rewards/chosen`, `rewards/rejected`, `rewards/margins`,",
              "`rewards/accuracies`, `logps/chosen` and `logps/rejected`, and on held-out data the same names",
              "under `eval/` (`eval/loss`, `eval/rewards/accuracies`, ...); `guard/skipped_updates` counts skipped",
              "updates."]
    return "\n".join(lines) + "\n"


def generated() -> dict[Path, str]:
    """Each generated file and the text it must hold."""
    return {ROOT / "docs" / "options.md": options_markdown(), ROOT / "docs" / "metrics.md": metrics_markdown()}


def stale() -> list[Path]:
    """The generated files whose checked-in text differs from what the code generates now."""
    return [p for p, text in generated().items() if not p.is_file() or p.read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ppolm.docs_gen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale files (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale()
        for p in bad:
            print(f"{p.relative_to(ROOT)} is out of date; run `{REGENERATE}` to regenerate it", file=sys.stderr)
        return 1 if bad else 0
    for p, text in generated().items():
        p.write_text(text, encoding="utf-8")
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
