"""Atomic, verifiable checkpoints in safetensors + JSON (no pickle anywhere).

A checkpoint is a directory ``checkpoints/step-000012/`` holding ``tensors.safetensors`` (model
weights, optimiser moments, torch RNG states), ``state.json`` (everything else: step, KL
controller, schedulers, Python/NumPy RNG states, optimiser hyper-parameters) and
``manifest.json`` (size and SHA-256 of each file). It is written into a temporary directory,
flushed, then renamed, so a crash at any instant leaves the previous checkpoint intact; a
checkpoint whose manifest does not match its files is skipped with a warning on resume.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ppolm.atomic import atomic_dir
from ppolm.distributed import full, gather_objects, is_sharded, local, shard_like
from ppolm.errors import PPOLMError

PREFIX = "step-"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state(ranks: list[Any] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This process's random-number states (torch CPU and CUDA, Python, NumPy) as (tensors, meta).

    ``ranks``: the states of every process of a data-parallel run, in rank order (each an earlier
    call's result); with more than one, process r's tensors are stored under ``rank<r>.`` and meta
    is ``{"ranks": [meta of each]}``, so each process resumes its own streams.
    """
    import numpy as np

    if ranks is not None and len(ranks) > 1:
        tensors: dict[str, torch.Tensor] = {}
        for r, (t, _) in enumerate(ranks):
            tensors.update({f"rank{r}.{k}": v for k, v in t.items()})
        return tensors, {"ranks": [m for _, m in ranks]}
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    np_state = np.random.get_state()
    meta = {"python": _jsonable(random.getstate()),
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any], rank: int = 0) -> None:
    """Restore what :func:`rng_state` saved (process ``rank``'s streams when it saved several)."""
    import numpy as np

    if "ranks" in meta:
        meta = meta["ranks"][rank]
        prefix = f"rank{rank}."
        tensors = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    torch.set_rng_state(tensors["rng.torch"])
    if torch.cuda.is_available():
        n = sum(1 for k in tensors if k.startswith("rng.cuda."))
        if n:
            torch.cuda.set_rng_state_all([tensors[f"rng.cuda.{i}"] for i in range(n)])
    random.setstate(_tupled(meta["python"]))
    s = meta["numpy"]
    np.random.set_state((s[0], np.array(s[1], dtype=np.uint32), *s[2:]))


def _jsonable(x: Any) -> Any:
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tupled(x: Any) -> Any:
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x


def optimizer_state(opt: torch.optim.Optimizer, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimiser state dict into tensors (for safetensors) and JSON. States of FSDP-sharded
    parameters are gathered whole (every process must call this)."""

    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{prefix}.{pid}.{k}"] = full(v).contiguous()
            else:
                scalars[f"{pid}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def load_optimizer_state(opt: torch.optim.Optimizer, prefix: str, tensors: dict[str, torch.Tensor],
                         meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        if key.startswith(prefix + "."):
            pid, k = key[len(prefix) + 1:].split(".", 1)
            state.setdefault(int(pid), {})[k] = v
    for key, v in meta["scalars"].items():
        pid, k = key.split(".", 1)
        state.setdefault(int(pid), {})[k] = v
    # FSDP-sharded parameters: their states sharded alike (load_state_dict does not)

    params = [p for g in opt.param_groups for p in g["params"]]
    for pid, st in state.items():
        if pid < len(params) and is_sharded(params[pid]):
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    st[k] = shard_like(v, params[pid])
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


DISK_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
               errno.EACCES: "permission denied", errno.EPERM: "permission denied",
               errno.EROFS: "read-only file system"}


def disk_error(e: OSError, where: Path, what: str = "") -> BaseException:
    """A full disk or a permission problem as one PPOLMError line; any other OSError unchanged."""
    why = DISK_ERRNOS.get(e.errno or 0)
    if why is None:
        return e
    thing = what or "outputs"
    return PPOLMError(f"{why} while writing {thing} in {where} ({e.filename or where}); free space or choose a "
                      "writable --output-dir, then continue with --resume (the previous checkpoint is intact)")


def first_non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """Name of the first floating-point tensor holding NaN or inf, or None. FSDP-sharded tensors
    are checked shard by shard, each process its own, and the verdict is shared."""

    bad, sharded = None, False
    for name, t in named:
        sharded = sharded or is_sharded(t)
        if t.is_floating_point() and not bool(torch.isfinite(local(t)).all()):
            bad = name
            break
    if sharded:
        bad = next((b for b in gather_objects(bad) if b is not None), None)
    return bad


def _remove_stale(root: Path, pattern: str) -> None:
    """Delete temporary directories left by a process killed while writing (only this run writes here)."""
    for stale in root.glob(pattern):
        shutil.rmtree(stale, ignore_errors=True)


def save(root: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any], keep_last: int) -> Path:
    """Write checkpoint ``root/step-NNNNNN`` atomically; keep the newest ``keep_last``.

    Everything goes to a temporary directory that is flushed (files and directory) and then renamed
    into place, so a crash at any instant leaves the earlier checkpoints as they were. A full disk or
    a permission problem becomes one PPOLMError line; non-finite tensors are never written.
    """
    from safetensors.torch import save_file

    bad = first_non_finite(tensors.items())
    if bad:
        raise PPOLMError(f"refusing to save a checkpoint with non-finite values in {bad} (step {step}); the "
                         "previous checkpoint is intact")
    final = root / f"{PREFIX}{step:06d}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale(root, f".tmp-{PREFIX}*")
        with atomic_dir(final) as tmp:  # a checkpoint being redone (the newer one was corrupt) is replaced
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / "tensors.safetensors"))
            (tmp / "state.json").write_text(json.dumps({"step": step, **meta}), encoding="utf-8")
            files = {f.name: {"size": f.stat().st_size, "sha256": _sha256(f)} for f in sorted(tmp.iterdir())}
            (tmp / "manifest.json").write_text(json.dumps({"step": step, "files": files}), encoding="utf-8")
    except OSError as e:
        raise disk_error(e, root, f"checkpoint {final.name}") from None
    for path in list_checkpoints(root):  # newer ones are corrupt leftovers of the steps being redone
        if path.name > final.name:
            discard(path)
    for old in list_checkpoints(root)[:-keep_last]:
        discard(old)
    return final


def discard(path: Path) -> None:
    """Delete a checkpoint directory without ever leaving a half-deleted ``step-*`` behind: it is first
    renamed out of the ``step-*`` names (atomic), then removed; a kill midway leaves a ``.tmp-*``
    directory that the next save clears as stale."""
    trash = path.with_name(f".tmp-{path.name}-old-{os.getpid()}")
    try:
        os.replace(path, trash)
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def list_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


REQUIRED = ("tensors.safetensors", "state.json")


def verify(path: Path) -> str | None:
    """None if the checkpoint matches its manifest, else what is wrong."""
    try:
        manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
        files = manifest["files"]
        for name in REQUIRED:
            if name not in files:
                return f"the manifest does not list {name}"
        for name, info in files.items():
            f = path / name
            if not f.exists():
                return f"{name} is missing"
            if f.stat().st_size != info["size"]:
                return f"{name} has {f.stat().st_size} bytes, expected {info['size']}"
            if _sha256(f) != info["sha256"]:
                return f"{name} checksum differs"
    except FileNotFoundError:
        return "manifest.json is missing"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"manifest.json unreadable ({type(e).__name__})"
    return None


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def load_latest(root: Path) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]] | None:
    """The newest checkpoint that verifies, or None; corrupt ones are skipped with a warning."""
    from safetensors.torch import load_file

    for path in reversed(list_checkpoints(root)):
        problem = verify(path)
        if problem is None:
            try:
                return path, load_file(str(path / "tensors.safetensors")), json.loads(
                    (path / "state.json").read_text(encoding="utf-8"))
            except Exception as e:  # matched its manifest but does not parse: treat as corrupt
                problem = f"unreadable ({type(e).__name__})"
        warn(f"skipping corrupt checkpoint {path.name}: {problem}; trying the previous one")
    return None
