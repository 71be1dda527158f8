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
import warnings
from pathlib import Path
from typing import Any

import torch

from ppolm.errors import PPOLMError

PREFIX = "step-"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    import numpy as np

    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    np_state = np.random.get_state()
    meta = {"python": _jsonable(random.getstate()),
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    import numpy as np

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
    """Split an optimiser state dict into tensors (for safetensors) and JSON."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{prefix}.{pid}.{k}"] = v.contiguous()
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
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save(root: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any], keep_last: int) -> Path:
    """Write checkpoint ``root/step-NNNNNN`` atomically; keep the newest ``keep_last``."""
    from safetensors.torch import save_file

    for k, v in tensors.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise PPOLMError(f"refusing to save a checkpoint with non-finite values in {k}")
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f".tmp-{PREFIX}{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / "tensors.safetensors"))
        (tmp / "state.json").write_text(json.dumps({"step": step, **meta}))
        files = {}
        for f in sorted(tmp.iterdir()):
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
            files[f.name] = {"size": f.stat().st_size, "sha256": _sha256(f)}
        with open(tmp / "manifest.json", "w") as fh:
            json.dump({"step": step, "files": files}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            raise PPOLMError(f"no space left on the device while saving a checkpoint in {root}; free disk space "
                             "and --resume (the previous checkpoint is intact)") from None
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise PPOLMError(f"permission denied writing a checkpoint in {root}; choose a writable --output-dir "
                             "(the previous checkpoint is intact)") from None
        raise
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def verify(path: Path) -> str | None:
    """None if the checkpoint matches its manifest, else what is wrong."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        for name, info in manifest["files"].items():
            f = path / name
            if not f.exists():
                return f"{name} is missing"
            if f.stat().st_size != info["size"]:
                return f"{name} has {f.stat().st_size} bytes, expected {info['size']}"
            if _sha256(f) != info["sha256"]:
                return f"{name} checksum differs"
    except (OSError, ValueError, KeyError) as e:
        return f"manifest unreadable ({type(e).__name__})"
    return None


def load_latest(root: Path) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]] | None:
    """The newest checkpoint that verifies, or None; corrupt ones are skipped with a warning."""
    from safetensors.torch import load_file

    for path in reversed(list_checkpoints(root)):
        problem = verify(path)
        if problem:
            warnings.warn(f"skipping corrupt checkpoint {path.name}: {problem}", stacklevel=2)
            continue
        return path, load_file(str(path / "tensors.safetensors")), json.loads((path / "state.json").read_text())
    return None
