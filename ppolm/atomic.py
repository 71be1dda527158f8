"""Atomic writes: a file or a directory appears complete under its final name, or not at all.

Everything is written beside its final name, flushed to the disk (``fsync`` of each file, then of
the directory that holds it), and renamed into place; a crash or a full disk at any instant leaves
the previous version (or nothing) behind, never half a file. Every command writes its checkpoints,
models, configs and metrics rows through these two helpers.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from ppolm.errors import PPOLMError

STALE_S = 3600.0
"""A shared directory's temporary left this long ago belongs to a process that died."""


def fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def safetensors_os_errors(path: Path | str) -> Iterator[None]:
    """Re-raise a safetensors write failure as the OSError behind it, so that the callers' OSError
    handling (:func:`ppolm.checkpoint.disk_error`) sees a full disk as one. safetensors raises its own
    ``SafetensorError`` ("I/O error: No space left on device (os error 28)"), not an OSError, when
    the disk fills while it writes a checkpoint or a model; other errors pass unchanged."""
    try:
        yield
    except Exception as e:
        found = re.search(r"os error (\d+)", str(e)) if type(e).__name__ == "SafetensorError" else None
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from e


def check_file_target(path: str | Path | None, option: str) -> None:
    """Refuse, before any work, an output file path that names a directory (one ``error:`` line)."""
    if path is not None and Path(path).is_dir():
        raise PPOLMError(f"{option} {path} is a directory; give a file path such as {Path(path) / 'results.json'}")


def write_text(path: Path, text: str) -> None:
    """Replace the file ``path`` by ``text`` (UTF-8) atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_dir(final: Path, *, shared: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``final``; on success, flush it and swap it in
    for ``final``. On failure the temporary directory is removed and ``final`` is as it was.

    ``shared=False`` (a run's own outputs): only this run writes here, so any temporary left beside
    ``final`` is stale and removed, and an existing ``final`` is replaced once the new one is complete.
    ``shared=True`` (the model cache, which processes may fill at once): temporaries younger than
    :data:`STALE_S` may be another process's and stay, and a ``final`` another process put in place
    first is kept.
    """
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    for stale in [*parent.glob(f".tmp-{final.name}-*"), *parent.glob(f".old-{final.name}-*")]:
        with contextlib.suppress(OSError):
            if not shared or time.time() - stale.stat().st_mtime > STALE_S:
                shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=parent))
    old = parent / f".old-{final.name}-{os.getpid()}"
    try:
        with safetensors_os_errors(tmp):
            yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        for f in tmp.rglob("*"):
            if f.is_file():
                fsync_file(f)
        fsync_dir(tmp)
        if shared:
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir() or not any(final.iterdir()):
                    raise  # otherwise another process finished first: keep theirs
        else:
            if final.exists():
                os.replace(final, old)
            os.replace(tmp, final)
        fsync_dir(parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
