"""The run around a command's training steps, shared by ppo, sft, reward and dpo.

A training command builds its models and data, then runs its own step function inside this
scaffold, which is the same for every command:

* the output-directory guard (:class:`ppolm.rundir.OutputDir`): check before anything loads,
  commit once the inputs have loaded;
* ``--resume``: :func:`resume` loads the newest valid checkpoint (every process the same one, written
  by as many processes) into the command's state; :func:`save_checkpoint` writes one
  (:func:`ppolm.checkpoint.save`: atomic, checksummed, every RNG and optimiser state);
* the non-finite guard (:class:`Guard`): a NaN/inf update is skipped and counted
  (``guard/skipped_updates``), each cause is warned about once, and the run stops after
  ``--max-skipped-updates`` consecutive skips or on non-finite weights, before it saves them;
* Ctrl-C/SIGTERM: :func:`ppolm.runtime.stop_on_signal`, then every process stops after the same
  step with a checkpoint (:func:`ppolm.distributed.any_flag`).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ppolm import checkpoint, distributed

LoadState = Callable[[dict[str, torch.Tensor], dict[str, Any]], None]


def allow_skipped_scheduler_steps() -> None:
    """A skipped (non-finite) update still advances the schedules, on purpose (resume-exact): silence
    torch's warning about a scheduler stepped before its optimiser."""
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")


@dataclass
class Guard:
    """The non-finite guard's record: skipped updates (all, and in a row), the last cause, and the
    warnings given (each key once per run)."""

    skipped_total: int = 0
    consecutive_skips: int = 0
    skip_cause: str = ""
    warned: set[str] = field(default_factory=set)

    def warn_once(self, key: str, msg: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            checkpoint.warn(msg)

    def skip(self, cause: str, key: str, where: str = "") -> None:
        """Record why an update was skipped, and warn once per ``key`` (``where``: "step 3: ", or "")."""
        self.skip_cause = cause
        self.warn_once(key, f"{where}{cause}; update skipped (counted in guard/skipped_updates)")

    def count(self, skipped: int) -> None:
        """Count an update's skipped optimiser steps (0: it applied, and the streak ends)."""
        self.skipped_total += skipped
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0

    def check(self, named: Iterable[tuple[str, torch.Tensor]], limit: int, *, last: str, when: str, advice: str,
              weights_advice: str, give_up: bool = False) -> None:
        """Stop a run that keeps skipping updates (``limit`` in a row, or ``give_up``), or whose weights
        went non-finite, before it saves them. ``last``: where the last skip happened (" at step 3", or
        ""); ``when``: the update just done ("step 3", "update 3")."""
        n = self.consecutive_skips
        if n >= limit or give_up:
            raise distributed.RankError(f"{n} consecutive updates skipped (last{last}: {self.skip_cause}); {advice}")
        bad = checkpoint.first_non_finite(named)
        if bad:
            raise distributed.RankError(f"non-finite weights in {bad} after {when}; nothing saved from it. "
                                        f"{weights_advice}")

    def state_dict(self) -> dict[str, int]:
        return {"skipped_total": self.skipped_total, "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        self.skipped_total, self.consecutive_skips = meta["skipped_total"], meta["consecutive_skips"]


def resume(out: Path, load_state: LoadState) -> int | None:
    """Continue from the newest valid checkpoint in ``out/checkpoints`` (``--resume``): its state goes
    through ``load_state``. Returns the step it continues from, or None without a checkpoint. With
    several processes each reads it (the directory must be on storage they all see) and takes its
    own random-number state from it."""
    found = checkpoint.load_latest(out / "checkpoints")
    seen = distributed.gather_objects(None if not found else str(found[0]))
    if len(set(seen)) > 1:
        raise distributed.RankError(f"the processes found different checkpoints to resume from ({', '.join(map(str, seen))}): "
                                    "--output-dir must be one directory that every node sees (a shared filesystem)")
    if not found:
        print(f"no checkpoint in {out}; starting from step 0", file=sys.stderr)
        return None
    path, tensors, meta = found
    saved_world, world = int(meta.get("world_size", 1)), distributed.world_size()
    if saved_world != world:
        raise distributed.RankError(
            f"checkpoint {path} was written by {saved_world} process(es) and this run has {world}: each "
            f"process resumes its own random-number streams; resume with torchrun --nproc-per-node {saved_world}"
            f"{' (or without torchrun)' if saved_world == 1 else ''}, or start again with --overwrite")
    try:
        load_state(tensors, meta)
    except (KeyError, RuntimeError, ValueError, TypeError) as e:
        raise distributed.RankError(f"checkpoint {path} does not match this model or version "
                                    f"({type(e).__name__}: {str(e)[:120]}); resume with the same options, "
                                    "or start again with --overwrite") from None
    print(f"resuming from {path} (step {meta['next_step']})", file=sys.stderr)
    return int(meta["next_step"])


def save_checkpoint(out: Path, next_step: int, state: Callable[[], tuple[dict[str, torch.Tensor], dict[str, Any]]],
                    keep_last: int) -> None:
    """Write the checkpoint after ``next_step`` updates; every process takes part (its random-number
    state), process 0 writes."""
    tensors, meta = state()
    if distributed.is_main():
        checkpoint.save(out / "checkpoints", next_step, tensors, meta, keep_last)


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every process's random-number state, for a checkpoint (process r's under ``rank<r>.``)."""
    return checkpoint.rng_state(distributed.gather_objects(checkpoint.rng_state()))
