"""The output-directory guard every training command shares (ppo, sft, reward, dpo).

A non-empty ``--output-dir`` needs ``--resume`` (with the options of the run it continues) or
``--overwrite``; ``--overwrite`` never empties a repository, the working directory or home. The
guard runs twice: :meth:`OutputDir.check` before anything loads (it only reads, so a bad input
found later leaves the directory exactly as it was), and :meth:`OutputDir.commit` once the inputs
have loaded (it clears the previous run's files and creates the directory).

The guard reads the options it needs from the config's saved form (:func:`ppolm.config.to_dict`),
flat (sft, reward, dpo: ``resume``, ``epochs``) or in sections (ppo: ``run.resume``, ``algo.steps``)
alike: a key is found at the top or in any section.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppolm import atomic, config
from ppolm.errors import PPOLMError

RUN_CONTROL = {"resume", "overwrite", "quiet", "steps", "epochs", "save_every", "keep_last", "sample_every",
               "max_skipped_updates", "dist_timeout", "reward_url_timeout", "reward_url_retries",
               "reward_url_batch_size", "output_dir"}
"""Options a resumed run may change (of any section); every other option must match the run it continues.
(``output_dir`` is the run being resumed, however it is spelled or wherever it was moved.)"""


def same_path(old: Any, new: Any) -> bool:
    """Two spellings of one existing file or directory ("runs/sft" and "/home/me/runs/sft/"), also as
    the file of a "FILE.py:function" spec."""
    if not (isinstance(old, str) and isinstance(new, str)):
        return False
    if ":" in old and ":" in new:
        (old, f_old), (new, f_new) = old.rsplit(":", 1), new.rsplit(":", 1)
        if f_old != f_new:
            return False
    try:
        return os.path.samefile(os.path.expanduser(old), os.path.expanduser(new))
    except (OSError, ValueError):
        return False


def find(saved: Any, key: str) -> Any:
    """``key``'s value in a saved config: at the top, or in one of its sections; None if absent."""
    if not isinstance(saved, dict):
        return None
    if key in saved:
        return saved[key]
    return next((sec[key] for sec in saved.values() if isinstance(sec, dict) and key in sec), None)


def config_difference(saved: Any, now: dict[str, Any]) -> str:
    """The first option (not a run-control one) whose saved value differs from ``now``; "" if none.
    Sections (ppo's nested config) are compared option by option; an option the saved config lacks
    (added to ppolm since) counts as unchanged."""
    if not isinstance(saved, dict):
        return f"the saved config is a {type(saved).__name__}, not a mapping"

    def same(old: Any, new: Any) -> bool:  # an option that became repeatable: v then is [v] now
        if isinstance(new, list) and not isinstance(old, list):
            old = [old]
        if isinstance(old, list) and isinstance(new, list):
            return len(old) == len(new) and all(a == b or same_path(a, b) for a, b in zip(old, new))
        return old == new or same_path(old, new)

    for key, value in now.items():
        if isinstance(value, dict):
            section = saved.get(key, {})
            for k, v in value.items():
                old = section.get(k, v) if isinstance(section, dict) else None
                if (key, k) == ("kl", "kl_coef_max") and old is None and v is not None:
                    old = math.inf  # a run saved before the ceiling had a default: none meant no ceiling
                if k not in RUN_CONTROL and not same(old, v):
                    return f"{k}: {old!r} then, {v!r} now"
        elif key not in RUN_CONTROL and not same(saved.get(key, value), value):
            return f"{key}: {saved.get(key)!r} then, {value!r} now"
    return ""


def check_resumable(out: Path, diff: str, lr_schedule: str, length_option: str, old_length: Any,
                    new_length: Any) -> None:
    """Refuse --resume into a run whose config differs (``diff``, the first difference, or ""), or
    whose length (--steps, --epochs) changed under a linear schedule: that schedule decays over the
    run's length, so another total would rescale every step's rate."""
    if diff:
        raise PPOLMError(f"--output-dir {out} holds a run with a different config ({diff}); resume with "
                         "the same options, or use --overwrite or a new --output-dir")
    if lr_schedule == "linear" and old_length is not None and old_length != new_length:
        raise PPOLMError(f"--{length_option} changed from {old_length} to {new_length} but the linear learning-rate "
                         f"schedule decays over --{length_option}; resume with --{length_option} {old_length} (a run "
                         "with --lr-schedule constant can be extended)")


def check_creatable(out: Path) -> None:
    """One line, before anything is written, when ``--output-dir`` could not be created or written:
    its nearest existing ancestor is a file or not writable."""
    parent = out
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise PPOLMError(f"cannot create --output-dir {out} ({parent} is a file); choose a writable path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PPOLMError(f"cannot write to --output-dir {out} (permission denied on {parent}); "
                         "choose a writable path")


def write_config(cfg: Any, path: Path) -> None:
    """The config as YAML (:func:`ppolm.config.to_dict`), atomically: a kill mid-write never leaves a
    half file for --resume to read."""
    import yaml

    atomic.write_text(path, yaml.safe_dump(config.to_dict(cfg), sort_keys=False))


@dataclass(frozen=True)
class OutputDir:
    """One command's --output-dir and the file its config is saved in."""

    out: Path
    config_name: str
    """The saved config's file name: ``config.yaml`` (ppo), ``sft_config.yaml``, ..."""
    what: str = "a run of this command"
    """What a directory without that file does not hold (the error's wording)."""
    outputs: tuple[str, ...] | None = None
    """The names --overwrite removes (None: everything in the directory)."""

    def check(self, cfg: Any) -> None:
        """Refuse to mix runs; reads only (see the module's doc)."""
        out, now = self.out, config.to_dict(cfg)
        if out.exists() and not out.is_dir():
            raise PPOLMError(f"--output-dir {out} is a file; choose a directory")
        if out.is_dir() and any(out.iterdir()):
            if find(now, "overwrite"):
                if (out / ".git").exists() or out.resolve() == Path.cwd().resolve() or out.resolve() == Path.home():
                    raise PPOLMError(f"refusing to empty {out} (a repository, the working or home directory); "
                                     "choose a dedicated --output-dir")
            elif find(now, "resume"):
                saved = out / self.config_name
                if not saved.exists():
                    raise PPOLMError(f"--output-dir {out} does not hold {self.what} (no {self.config_name}); "
                                     "choose another directory")
                before = config.load_yaml(saved)
                length = "steps" if find(now, "steps") is not None else "epochs"
                check_resumable(out, config_difference(before, now), find(now, "lr_schedule"), length,
                                find(before, length), find(now, length))
            else:
                raise PPOLMError(f"--output-dir {out} already holds files; pass --resume to continue that run, "
                                 "--overwrite to replace it, or choose a new directory")
        check_creatable(out)

    def commit(self, cfg: Any) -> None:
        """Once the inputs have loaded: empty the directory (--overwrite), create it and save the config."""
        out = self.out
        if find(config.to_dict(cfg), "overwrite") and out.is_dir():
            names = [p.name for p in out.iterdir()] if self.outputs is None else self.outputs
            for name in names:
                p = out / name
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PPOLMError(f"cannot create --output-dir {out} ({e.strerror}); choose a writable path") from None
        write_config(cfg, out / self.config_name)
