"""Where a run's numbers go: metrics.jsonl, TensorBoard event files, samples.jsonl, the terminal."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from ppolm import atomic


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a crash mid-write: drop it
            break
    return rows


def truncate_rows(path: Path, keep_below_step: int) -> None:
    """Keep rows with step < keep_below_step (a resumed run redoes the later ones)."""
    if not path.exists():
        return
    rows = [r for r in read_jsonl(path) if r.get("step", -1) < keep_below_step]
    atomic.write_text(path, "".join(json.dumps(r) + "\n" for r in rows))  # a kill mid-rewrite never loses rows


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def clean_json(x: Any) -> Any:
    """``x`` (dicts and lists nested) with each non-finite float as :func:`_clean` writes it (NaN as
    null, infinities as strings): strict JSON parsers reject NaN and Infinity."""
    if isinstance(x, dict):
        return {k: clean_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean_json(v) for v in x]
    return _clean(x)


class Tracker:
    """Append per-step metrics (JSONL + TensorBoard) and samples; drive a progress bar."""

    def __init__(self, out: Path, total_steps: int, start_step: int, quiet: bool, desc: str = "ppo",
                 t0: float | None = None):
        self.out = out
        self.metrics_path = out / "metrics.jsonl"
        self.samples_path = out / "samples.jsonl"
        self.quiet = quiet
        self.total = total_steps
        self.t0 = time.perf_counter() if t0 is None else t0  # when the run's first step began
        self.start = start_step
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=start_step)
        self.progress = None
        if not quiet:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                     TextColumn("{task.fields[live]}"), transient=False)
            self.progress.start()
            self.task = self.progress.add_task(desc, total=total_steps, completed=start_step, live="")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.tb.add_scalar(k, v, step)
        self.tb.flush()
        live = (f"score {metrics.get('objective/scores', float('nan')):+.3f}  "
                f"kl {metrics.get('objective/kl', float('nan')):.3f}  "
                f"beta {metrics.get('objective/kl_coef', float('nan')):.4f}")
        if self.progress is not None:
            self.progress.update(self.task, completed=step + 1, live=live)
        else:
            el = time.perf_counter() - self.t0
            done = step + 1 - self.start
            eta = el / done * (self.total - step - 1) if done else 0.0
            print(f"step {step + 1}/{self.total}  {live}  {el:.0f}s elapsed, eta {eta:.0f}s", file=sys.stderr,
                  flush=True)

    def warn(self, msg: str) -> None:
        """One warning line, above the progress bar when there is one."""
        if self.progress is not None:
            self.progress.console.print(msg, markup=False, highlight=False)
        else:
            print(msg, file=sys.stderr, flush=True)

    def log_eval(self, updates: int, metrics: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """Held-out evaluation after ``updates`` PPO steps: eval.jsonl, eval_samples.jsonl, TensorBoard."""
        with open(self.out / "eval.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": updates, **{k: _clean(v) for k, v in metrics.items()}}) + "\n")
        with open(self.out / "eval_samples.jsonl", "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        for k, v in metrics.items():
            if k.startswith("eval/") and isinstance(v, (int, float)) and math.isfinite(v):
                self.tb.add_scalar(k, v, updates)
        self.tb.flush()

    def samples(self, rows: list[dict[str, Any]]) -> None:
        with open(self.samples_path, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        self.tb.close()
