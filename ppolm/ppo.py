"""``ppolm ppo``: a PPO run around its steps.

:func:`train_ppo` builds a :class:`ppolm.ppo_trainer.PPOTrainer` (the models, the data, one PPO
iteration as :meth:`~ppolm.ppo_trainer.PPOTrainer.step`) and :func:`run` runs its steps inside the
scaffold every training command shares (ppolm/scaffold.py): resume, the first step before anything
is written, the loop with metrics and the debugging checklist's alarms, held-out evaluation, the
reward model's on-policy check and refresh against a judge (--judge, ppolm/rm_guard.py),
checkpoints and Ctrl-C/SIGTERM, and the final outputs (ppolm/ppo_outputs.py). What a run writes is
listed in :data:`ppolm.ppo_trainer.OUTPUTS`.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppolm import alarms, checkpoint, distributed, evaluate, ppo_outputs, runtime, scaffold, tracking
from ppolm.ppo_config import PPOConfig
from ppolm.ppo_trainer import PPOTrainer
from ppolm.rm_guard import PPOWatch


@dataclass
class PPOResult:
    """What :func:`train_ppo` returns: the output directory, the metrics rows, and whether
    Ctrl-C/SIGTERM ended the run early (a checkpoint was saved)."""

    output_dir: Path
    metrics: list[dict[str, Any]]
    interrupted: bool = False


def train_ppo(cfg: PPOConfig) -> PPOResult:
    """Run PPO as configured (the Python twin of ``ppolm ppo``); returns the metrics rows."""
    return run(PPOTrainer(cfg))


def run(trainer: PPOTrainer) -> PPOResult:
    """Train for --steps PPO steps (from the newest checkpoint with --resume) and write the outputs;
    Ctrl-C/SIGTERM ends the run after its current step, with a checkpoint. With several processes
    (torchrun) every one runs the steps and process 0 alone writes (``main`` below)."""
    cfg, out, state = trainer.cfg, trainer.out, trainer.state
    main = distributed.is_main()
    scaffold.allow_skipped_scheduler_steps()
    watch = PPOWatch.of(trainer)  # --judge: the reward models' on-policy check and refresh (ppolm/rm_guard.py)
    if cfg.run.resume:
        scaffold.resume(out, functools.partial(load_checkpoint, trainer, watch))
    start, evaluating = state.start_step, trainer.eval_prompts is not None

    def eval_due(updates: int) -> bool:
        return evaluating and (updates % cfg.run.eval_every == 0 or updates == cfg.algo.steps)

    with runtime.stop_on_signal() as stop:
        try:
            # The first eval and step run before anything is written: a reward function that raises
            # or returns garbage fails with the output directory exactly as it was.
            t_begin = time.perf_counter()
            print(f"{'evaluating, then ' if evaluating and start == 0 else ''}running step "
                  f"{start + 1}/{cfg.algo.steps} (the progress bar starts after it)", file=sys.stderr)
            first_eval = held_out(trainer, 0) if evaluating and start == 0 else None
            # best/ of the first evaluation is written after the first step: keep the weights it saw
            first_weights = (ppo_outputs.policy_weights(trainer) if first_eval is not None and main
                             and cfg.run.best_metric and not cfg.model.fsdp else None)
            first_check = watch.check(0, evaluating) if watch and start == 0 else {}
            if first_eval is not None:  # a wrong name fails here, before the output directory changes
                check_best_metric(cfg.run.best_metric, first_eval[0] | first_check)
            first = trainer.step(start) if start < cfg.algo.steps else None
            if main:
                trainer.output_dir().commit(cfg)
                for f in ("metrics.jsonl", "samples.jsonl"):
                    tracking.truncate_rows(out / f, start)
                for f in ("eval.jsonl", "eval_samples.jsonl"):  # keyed by updates done: the start's eval is kept
                    tracking.truncate_rows(out / f, start + 1)
        except OSError as e:
            raise checkpoint.disk_error(e, out) from None
        if main and cfg.run.best_metric and (out / "best.json").exists():
            state.improves(json.loads((out / "best.json").read_text())["value"])

        tracker = None
        step = start
        try:
            live_alarms = None
            if main:
                tracker = tracking.Tracker(out, cfg.algo.steps, start, cfg.run.quiet, t0=t_begin)
                # the debugging checklist's alarms, live (ppolm/alarms.py): warned once, marked in metrics.jsonl
                live_alarms = alarms.LiveAlarms(kl_target=cfg.kl.kl_target if cfg.kl.adaptive_kl else None,
                                                emit=tracker.warn, rows=tracking.read_jsonl(out / "metrics.jsonl"))
            if first_eval is not None:
                log_eval(trainer, tracker, 0, (first_eval[0] | first_check, first_eval[1]), first_weights)
                first_weights = None
            for step in range(start, cfg.algo.steps):
                metrics, samples = first if step == start else trainer.step(step)
                first = None
                last = step + 1 == cfg.algo.steps
                check: dict[str, Any] = {}
                if watch:
                    # --judge: the check of the policy that sampled this step, the refresh due after its
                    # update, then the check of the updated policy (against the refreshed model), kept for
                    # the next step's row and this evaluation's
                    metrics.update(watch.pending())
                    metrics.update(watch.after_update(step + 1))
                    check = watch.check(step + 1, eval_due(step + 1))
                if main:
                    metrics.update(live_alarms(step, metrics))
                    tracker.log(step, metrics)
                    if samples:
                        tracker.samples(samples)
                # a run that ends having skipped every update trained nothing: the same error, sooner
                state.guard.check(trainer.trained_parameters(), cfg.run.max_skipped_updates, last=f" at step {step}",
                                  when=f"step {step}", give_up=last and state.guard.consecutive_skips > step,
                                  advice="fix the reward or lower --actor-lr, then continue from the last "
                                         "checkpoint with --resume",
                                  weights_advice="Lower --actor-lr/--critic-lr and continue from the last "
                                                 "checkpoint with --resume")
                if eval_due(step + 1):
                    result = held_out(trainer, step + 1)
                    if check and main and last:  # no step row after the last: its alarms go here
                        check |= live_alarms(step + 1, check)
                    log_eval(trainer, tracker, step + 1, (result[0] | check, result[1]))
                # a signal reaches some processes only (Ctrl-C on one node): all stop after the same step
                stopping = distributed.any_flag(stop["requested"])
                if (step + 1) % cfg.run.save_every == 0 or last or stopping:
                    scaffold.save_checkpoint(out, step + 1, functools.partial(checkpoint_state, trainer, watch, step + 1),
                                             cfg.run.keep_last)
                if stopping and not last:
                    stop["requested"] = True
                    break
        except OSError as e:
            raise checkpoint.disk_error(e, out) from None
        finally:
            if tracker is not None:
                tracker.close()
    interrupted = stop["requested"] and step + 1 < cfg.algo.steps
    if interrupted:
        print(f"interrupted after step {step + 1}; checkpoint saved. Continue with the same command "
              "plus --resume", file=sys.stderr)
    else:
        trained = ppo_outputs.gathered(trainer) if cfg.model.fsdp else ppo_outputs.trained(trainer)
        if main:
            try:
                ppo_outputs.save(trained, out)
                if watch:
                    watch.save(out)
            except OSError as e:
                raise checkpoint.disk_error(e, out, "the final policy/critic") from None
    rows = distributed.broadcast_object(tracking.read_jsonl(out / "metrics.jsonl") if main else None)
    distributed.write_rank_summary(lambda: {
        "step": step + 1, "beta": state.kl_ctl.value, "last_row": rows[-1] if rows else None,
        "weights": distributed.checksum(p for _, p in trainer.trained_parameters()),
        "masters": distributed.checksum(trainer.learner.actor.params)})
    distributed.barrier()  # the outputs are complete when any process returns
    return PPOResult(out, rows, interrupted)


def checkpoint_state(trainer: PPOTrainer, watch: PPOWatch | None, next_step: int
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The trainer's checkpoint after ``next_step`` updates, with --judge's guard state."""
    tensors, meta = trainer.checkpoint_state(next_step)
    return watch.checkpoint_state(tensors, meta) if watch else (tensors, meta)


def load_checkpoint(trainer: PPOTrainer, watch: PPOWatch | None, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
    trainer.load_checkpoint(tensors, meta)
    if watch:
        watch.load_checkpoint(tensors, meta)


def held_out(trainer: PPOTrainer, updates: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Held-out evaluation after ``updates`` steps: (metrics, sample rows); see
    :func:`ppolm.evaluate.during_ppo`."""
    with distributed.gathered(trainer.learner.train_model):  # --fsdp: the policy whole while it samples
        return evaluate.during_ppo(trainer, updates)


def check_best_metric(name: str | None, metrics: dict[str, Any]) -> None:
    """--best-metric must name a metric of the held-out evaluation (every process has the metrics:
    each stops here, process 0 says why)."""
    if name is not None and name not in metrics:
        raise distributed.RankError(f"--best-metric {name} is not an eval metric; choose one of "
                                    f"{', '.join(k for k in metrics if k.startswith('eval/') and not k.endswith('_se'))}")


def log_eval(trainer: PPOTrainer, tracker: Any, updates: int,
             result: tuple[dict[str, Any], list[dict[str, Any]]],
             weights: dict[str, Any] | None = None) -> None:
    """Write a held-out evaluation (every process computed its share; process 0 writes) and keep
    the best policy (``weights``: the policy's trained parameters when it was evaluated, if it has
    moved on since)."""
    if tracker is not None:
        tracker.log_eval(updates, *result)
    name = trainer.cfg.run.best_metric
    metrics = result[0]
    if name is None:
        return
    check_best_metric(name, metrics)
    if distributed.is_main() and trainer.state.improves(metrics[name]):
        ppo_outputs.save_best(trainer, updates, name, metrics, weights)
