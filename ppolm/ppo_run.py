"""A PPO run around its steps: resume, the first step before anything is written, the loop with
metrics, held-out evaluation, checkpoints and Ctrl-C/SIGTERM, and the final outputs.

Each function takes the :class:`ppolm.ppo.PPOTrainer` it works for; :func:`run` is
``PPOTrainer.train``. What a run writes is listed in :data:`OUTPUTS`.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ppolm import alarms, checkpoint, config, distributed, runtime
from ppolm.errors import PPOLMError

OUTPUTS = ("policy", "policy_adapter", "critic", "checkpoints", "tensorboard", "metrics.jsonl", "samples.jsonl",
           "eval.jsonl", "eval_samples.jsonl", "best", "best.json", "config.yaml", "report.html", "plots")


@dataclass
class PPOResult:
    """What :func:`ppolm.ppo.train_ppo` returns: the output directory, the metrics rows, and whether
    Ctrl-C/SIGTERM ended the run early (a checkpoint was saved)."""

    output_dir: Path
    metrics: list[dict[str, Any]]
    interrupted: bool = False


def run(trainer: Any) -> PPOResult:
    """Train for --steps PPO steps (from the newest checkpoint with --resume) and write the outputs;
    Ctrl-C/SIGTERM ends the run after its current step, with a checkpoint. With several processes
    (torchrun) every one runs the steps and process 0 alone writes (``main`` below)."""
    from ppolm import tracking

    cfg = trainer.cfg
    main = distributed.is_main()
    # a skipped (non-finite) update still advances the schedules, on purpose: resume-exact
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
    if cfg.run.resume:
        resume(trainer)
    evaluating = trainer.eval_prompts is not None
    with runtime.stop_on_signal() as stop:
        try:
            # The first eval and step run before anything is written: a reward function that raises
            # or returns garbage fails with the output directory exactly as it was.
            t_begin = time.perf_counter()
            print(f"{'evaluating, then ' if evaluating and trainer.start_step == 0 else ''}running step "
                  f"{trainer.start_step + 1}/{cfg.algo.steps} (the progress bar starts after it)", file=sys.stderr)
            first_eval = trainer.evaluate(0) if evaluating and trainer.start_step == 0 else None
            first = trainer.step(trainer.start_step) if trainer.start_step < cfg.algo.steps else None
            if main:
                runtime.prepare_ppo_output_dir(trainer.out, cfg, OUTPUTS, commit=True)
                config.save_yaml(cfg, trainer.out / "config.yaml")
                for f in ("metrics.jsonl", "samples.jsonl"):
                    tracking.truncate_rows(trainer.out / f, trainer.start_step)
                for f in ("eval.jsonl", "eval_samples.jsonl"):  # keyed by updates done: the start's eval is kept
                    tracking.truncate_rows(trainer.out / f, trainer.start_step + 1)
        except OSError as e:
            raise checkpoint.disk_error(e, trainer.out) from None
        if main and cfg.run.best_metric and (trainer.out / "best.json").exists():
            trainer.best_value = json.loads((trainer.out / "best.json").read_text())["value"]

        tracker = None
        step = trainer.start_step
        try:
            live_alarms = None
            if main:
                tracker = tracking.Tracker(trainer.out, cfg.algo.steps, trainer.start_step, cfg.run.quiet,
                                           t0=t_begin)
                # the debugging checklist's alarms, live (ppolm/alarms.py): warned once, marked in metrics.jsonl
                live_alarms = alarms.LiveAlarms(kl_target=cfg.kl.kl_target if cfg.kl.adaptive_kl else None,
                                                emit=tracker.warn,
                                                rows=tracking.read_jsonl(trainer.out / "metrics.jsonl"))
            if first_eval is not None:
                log_eval(trainer, tracker, 0, first_eval)
            for step in range(trainer.start_step, cfg.algo.steps):
                metrics, samples = first if step == trainer.start_step else trainer.step(step)
                first = None
                if main:
                    metrics.update(live_alarms(step, metrics))
                    tracker.log(step, metrics)
                    if samples:
                        tracker.samples(samples)
                last = step + 1 == cfg.algo.steps
                check_health(trainer, step, last)
                if evaluating and ((step + 1) % cfg.run.eval_every == 0 or last):
                    log_eval(trainer, tracker, step + 1, trainer.evaluate(step + 1))
                # a signal reaches some processes only (Ctrl-C on one node): all stop after the same step
                stopping = distributed.any_flag(stop["requested"])
                if (step + 1) % cfg.run.save_every == 0 or last or stopping:
                    save_checkpoint(trainer, step + 1)
                if stopping and not last:
                    stop["requested"] = True
                    break
        except OSError as e:
            raise checkpoint.disk_error(e, trainer.out) from None
        finally:
            if tracker is not None:
                tracker.close()
    interrupted = stop["requested"] and step + 1 < cfg.algo.steps
    if interrupted:
        print(f"interrupted after step {step + 1}; checkpoint saved. Continue with the same command "
              "plus --resume", file=sys.stderr)
    elif trainer.cfg.model.fsdp:
        gather_for_saving(trainer)  # every process sends its shards; process 0 saves
    if not interrupted and main:
        try:
            save_outputs(trainer)
        except OSError as e:
            raise checkpoint.disk_error(e, trainer.out, "the final policy/critic") from None
    rows = distributed.broadcast_object(tracking.read_jsonl(trainer.out / "metrics.jsonl") if main else None)
    distributed.write_rank_summary(lambda: {
        "step": step + 1, "beta": trainer.kl_ctl.value, "last_row": rows[-1] if rows else None,
        "weights": distributed.checksum(p for _, p in trainer.trained_parameters()),
        "masters": distributed.checksum(trainer.actor.params)})
    distributed.barrier()  # the outputs are complete when any process returns
    return PPOResult(trainer.out, rows, interrupted)


def resume(trainer: Any) -> None:
    """Continue from the newest valid checkpoint in --output-dir (``--resume``), if there is one.
    With several processes each reads it (the directory must be on storage they all see) and takes
    its own random-number state from it."""
    found = checkpoint.load_latest(trainer.out / "checkpoints")
    seen = distributed.gather_objects(None if not found else str(found[0]))
    if len(set(seen)) > 1:
        raise distributed.RankError(f"the processes found different checkpoints to resume from ({', '.join(map(str, seen))}): "
                         "--output-dir must be one directory that every node sees (a shared filesystem)")
    if not found:
        print(f"no checkpoint in {trainer.out}; starting from step 0", file=sys.stderr)
        return
    path, tensors, meta = found
    saved_world = int(meta.get("world_size", 1))
    if saved_world != trainer.world:
        raise distributed.RankError(
            f"checkpoint {path} was written by {saved_world} process(es) and this run has {trainer.world}: each "
            f"process resumes its own random-number streams; resume with torchrun --nproc-per-node {saved_world}"
            f"{' (or without torchrun)' if saved_world == 1 else ''}, or start again with --overwrite")
    try:
        load_state(trainer, tensors, meta)
    except (KeyError, RuntimeError, ValueError, TypeError) as e:
        raise distributed.RankError(f"checkpoint {path} does not match this model or version "
                         f"({type(e).__name__}: {str(e)[:120]}); resume with the same --model, "
                         "or start again with --overwrite") from None
    print(f"resuming from {path} (step {trainer.start_step})", file=sys.stderr)


def check_health(trainer: Any, step: int, last: bool) -> None:
    """Stop a run that keeps skipping updates, or whose weights went non-finite, before it saves."""
    n = trainer.consecutive_skips
    # a run that ends having skipped every update trained nothing: the same error, sooner
    if n >= trainer.cfg.run.max_skipped_updates or (last and n > step):
        cause = getattr(trainer, "skip_cause", "non-finite values")
        raise distributed.RankError(f"{n} consecutive updates skipped (last at step {step}: {cause}); fix the reward or "
                         "lower --actor-lr, then continue from the last checkpoint with --resume")
    bad = checkpoint.first_non_finite(trainer.trained_parameters())
    if bad:
        raise distributed.RankError(f"non-finite weights in {bad} after step {step}; nothing saved from this step. "
                         "Lower --actor-lr/--critic-lr and continue from the last checkpoint with --resume")


def log_eval(trainer: Any, tracker: Any, updates: int, result: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    """Write a held-out evaluation (every process computed its share; process 0 writes) and keep
    the best policy."""
    if tracker is not None:
        tracker.log_eval(updates, *result)
    keep_best(trainer, updates, result[0])


def keep_best(trainer: Any, updates: int, metrics: dict[str, Any]) -> None:
    """Save the policy to best/ when the chosen eval metric improves (e.g. a gold judge)."""
    from ppolm.models import save_pretrained

    name = trainer.cfg.run.best_metric
    if name is None:
        return
    if name not in metrics:  # every process has the metrics: each stops here, process 0 says why
        raise distributed.RankError(f"--best-metric {name} is not an eval metric; choose one of "
                                    f"{', '.join(k for k in metrics if k.startswith('eval/') and not k.endswith('_se'))}")
    if not distributed.is_main():
        return
    if metrics[name] > trainer.best_value:
        trainer.best_value = metrics[name]
        best = trainer.out / "best"
        if hasattr(trainer.policy, "merge_and_unload"):
            trainer.policy.save_pretrained(str(best / "policy_adapter"))
        else:
            save_pretrained(trainer.policy, trainer.tokenizer, best / "policy")
        (trainer.out / "best.json").write_text(json.dumps(
            {"step": updates, "metric": name, "value": metrics[name], "se": metrics.get(name + "_se"),
             "kl": metrics["eval/kl"]}, indent=2))


def state(trainer: Any, next_step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The checkpoint: trained weights and optimiser states (the same on every process) and every
    process's random-number state (process r's under ``rank<r>.``, with several)."""
    tensors = {n: distributed.full(p) for n, p in trainer.trained_parameters()}  # --fsdp: gathered whole
    ta, ma = checkpoint.optimizer_state(trainer.actor_opt, "actor_opt")
    tr, mr = checkpoint.rng_state(distributed.gather_objects(checkpoint.rng_state()))
    tensors.update(ta | tr)
    meta = {"next_step": next_step, "kl_ctl": trainer.kl_ctl.state_dict(),
            "score_scale": trainer.score_scale.state_dict(), "actor_opt": ma,
            "actor_sched": trainer.actor_sched.state_dict(), "world_size": trainer.world,
            "rng": mr, "skipped_total": trainer.skipped_total, "consecutive_skips": trainer.consecutive_skips}
    if trainer.critic_opt is not None:  # the critic-free estimators have none
        tc, mc = checkpoint.optimizer_state(trainer.critic_opt, "critic_opt")
        tensors.update(tc)
        meta.update(critic_opt=mc, critic_sched=trainer.critic_sched.state_dict())
    return tensors, meta


def load_state(trainer: Any, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    with torch.no_grad():
        for n, p in trainer.trained_parameters():
            p.copy_(distributed.shard_like(tensors[n], p))  # --fsdp: each process takes its shard
    trainer.actor.copy_to_model()
    trainer.critic_weights.copy_to_model()
    checkpoint.load_optimizer_state(trainer.actor_opt, "actor_opt", tensors, meta["actor_opt"])
    trainer.actor_sched.load_state_dict(meta["actor_sched"])
    if trainer.critic_opt is not None:
        checkpoint.load_optimizer_state(trainer.critic_opt, "critic_opt", tensors, meta["critic_opt"])
        trainer.critic_sched.load_state_dict(meta["critic_sched"])
    trainer.kl_ctl.load_state_dict(meta["kl_ctl"])
    if "score_scale" in meta:  # (absent from checkpoints written before --score-scale)
        trainer.score_scale.load_state_dict(meta["score_scale"])
    trainer.skipped_total, trainer.consecutive_skips = meta["skipped_total"], meta["consecutive_skips"]
    checkpoint.set_rng_state(tensors, meta["rng"], trainer.rank)
    trainer.start_step = meta["next_step"]


def save_checkpoint(trainer: Any, next_step: int) -> None:
    tensors, meta = state(trainer, next_step)  # every process takes part (its random-number state)
    if distributed.is_main():
        checkpoint.save(trainer.out / "checkpoints", next_step, tensors, meta, trainer.cfg.run.keep_last)


def gather_for_saving(trainer: Any) -> None:
    """--fsdp: the sharded policy and critic gathered whole (every process takes part) into fp32 copies
    on process 0, which :func:`save_outputs` then saves as it saves unsharded models."""
    from ppolm import critic as critic_lib
    from ppolm import models

    def whole(module: Any) -> dict[str, torch.Tensor]:
        return {k: distributed.full(v).detach().cpu() for k, v in module.state_dict().items()}

    m = trainer.cfg.model
    policy_state = whole(trainer.policy)
    critic_state = None if trainer.critic is None else whole(trainer.critic.model if trainer.tap else trainer.critic)
    head_state = None if trainer.value_head is None else whole(trainer.value_head)
    bias = None if trainer.value_bias is None else distributed.full(trainer.value_bias).detach().cpu()
    if not distributed.is_main():
        return
    load = dict(dtype=torch.float32, device=torch.device("cpu"), trust_remote_code=m.trust_remote_code,
                allow_pickle=m.allow_pickle)
    trainer.policy = models.load_causal_lm(m.model, **load)
    trainer.policy.load_state_dict(policy_state)
    if critic_state is not None:
        src, head_init = trainer.critic_source
        fresh = models.load_scalar_model(src, head_init=head_init, **load)
        if trainer.tap is not None:  # top layers on the frozen trunk: the same cut of a fresh copy
            fresh = critic_lib.TrunkCritic(fresh, trainer.critic.n)
            fresh.model.load_state_dict(critic_state)
        else:
            fresh.load_state_dict(critic_state)
        trainer.critic = fresh
    if head_state is not None:
        trainer.value_head = torch.nn.Linear(head_state["weight"].shape[1], 1)
        trainer.value_head.load_state_dict(head_state)
    if bias is not None:
        trainer.value_bias = torch.nn.Parameter(bias)
    trainer.actor = trainer.critic_weights = runtime.MasterWeights([])  # the copies are fp32 already


def save_outputs(trainer: Any) -> None:
    """policy/ and critic/ in Hugging Face format (safetensors), loadable by plain transformers; no
    critic/ for the critic-free estimators."""
    from ppolm.models import save_pretrained

    bad = checkpoint.first_non_finite(trainer.trained_parameters())
    if bad:
        raise PPOLMError(f"non-finite weights in {bad}; not saving them (see metrics.jsonl guard/*)")
    # bf16 models are saved in fp32, with the trained weights from their fp32 masters
    trainer.actor.to_fp32_model()
    trainer.critic_weights.to_fp32_model()
    trainer.policy.float()
    if trainer.critic is not None:
        trainer.critic.float()
    policy = trainer.policy
    # each output directory is written beside its final name, then swapped in (a full disk leaves
    # the previous one, and the checkpoints, intact)
    if hasattr(policy, "merge_and_unload"):  # LoRA: save the adapter, and the merged model in policy/
        with checkpoint.atomic_dir(trainer.out / "policy_adapter") as tmp:
            policy.save_pretrained(str(tmp))
        policy = policy.merge_and_unload()
        trainer.policy = policy
    with checkpoint.atomic_dir(trainer.out / "policy") as tmp:
        save_pretrained(policy, trainer.tokenizer, tmp)
    if not trainer.has_critic:
        return
    with checkpoint.atomic_dir(trainer.out / "critic") as tmp:
        if trainer.tap is not None:  # top layers on a frozen trunk: saved as one whole model
            src, _ = trainer.critic_source
            m = trainer.cfg.model
            full = trainer.critic.full_model(src, dtype=torch.float32, device="cpu",
                                          trust_remote_code=m.trust_remote_code, allow_pickle=m.allow_pickle)
            save_pretrained(full, trainer.tokenizer, tmp)
            del full
        elif trainer.critic is not None:
            save_pretrained(trainer.critic, trainer.tokenizer, tmp)
        else:
            from safetensors.torch import save_file

            save_file({k: v.detach().cpu().contiguous() for k, v in trainer.value_head.state_dict().items()},
                      str(tmp / "value_head.safetensors"))
        if trainer.value_bias is not None:  # value = head output + bias (the RM's normalisation, trained on)
            (tmp / "ppolm_value.json").write_text(json.dumps({"bias": float(trainer.value_bias.detach())}, indent=2))
