"""The peak memory of each phase of a PPO step (rollout, score, train), for the ``memory/*`` metrics.

Out-of-memory is the most common complaint about PPO trainers: four models share one machine, and
which phase reaches the ceiling decides what to change (the KV cache and batch of the rollout, the
frozen models' pass, or the training pass's activations, gradients and optimiser states).

Host memory is the process's resident set (RSS), read from ``/proc/self/statm`` by a background
thread every ``interval`` seconds and at every phase boundary. The kernel's own high-water mark
(VmHWM) is exact but can only be lowered by resetting it (``/proc/self/clear_refs``), which also
resets what ``getrusage`` and ``/usr/bin/time`` report as the process's peak: ppolm would then hide
its true peak from the tools users measure it with. Sampling misses an allocation that lives
shorter than the interval; the default 5 ms is far below the life of a model's activations or of a
step's optimiser states. Off Linux there is no ``statm`` and only the process's peak so far
(``getrusage``) is reported.

On a GPU each phase also reports torch's allocator peak (``max_memory_allocated``, reset at the
phase's start) and the step its reserved peak, the memory the allocator holds from the driver.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref

import torch

GB = 1e9
PHASES = ("rollout", "score", "train")
HOST_METRICS = ("memory/rss_rollout_gb", "memory/rss_score_gb", "memory/rss_train_gb")
GPU_METRICS = ("memory/gpu_rollout_gb", "memory/gpu_score_gb", "memory/gpu_train_gb")

try:
    _PAGE = os.sysconf("SC_PAGE_SIZE")
except (AttributeError, ValueError, OSError):
    _PAGE = 4096


def rss_bytes() -> int | None:
    """The process's resident memory now, in bytes (Linux: ``/proc/self/statm``); None elsewhere."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def max_rss_bytes() -> int | None:
    """The process's peak resident memory since it started, in bytes (``getrusage``: what
    ``/usr/bin/time`` reports); None where there is no ``resource`` module (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux/BSD


class PhasePeaks:
    """The peak host RSS (and GPU allocator peak on CUDA) of consecutive phases.

    ``start()`` opens the first phase; each ``mark()`` closes the current one and opens the next;
    ``stop()`` ends sampling. ``host[i]`` and ``gpu[i]`` hold phase i's peaks in bytes; ``start_rss`` is
    the RSS when the first phase opened (the weights, optimiser states and runtime, plus what the
    allocator kept of the last step's freed memory); ``sampler_cpu_s`` the CPU time the sampling
    thread used."""

    def __init__(self, device: torch.device | str = "cpu", interval: float = 0.005) -> None:
        self.device = torch.device(device)
        self.interval = interval
        self.host: list[int] = []
        self.gpu: list[int] = []
        self.gpu_reserved = 0
        self.start_rss: int | None = None
        self.sampler_cpu_s = 0.0
        self._current = 0
        self.floor: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()

    def _sample(self) -> None:
        now = rss_bytes()
        if now is None:
            return
        with self._lock:
            if now > self._current:
                self._current = now
            if self.floor is None or now < self.floor:
                self.floor = now

    def _open(self) -> None:
        now = rss_bytes()
        with self._lock:
            self._current = now or 0
            if now is not None and (self.floor is None or now < self.floor):
                self.floor = now
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def start(self) -> None:
        self.start_rss = rss_bytes()
        if self._cuda:
            torch.cuda.synchronize(self.device)
        self._open()
        if self.start_rss is not None:
            self._thread = threading.Thread(target=_sampling, args=(weakref.ref(self), self._stop, self.interval),
                                            name="ppolm-memory", daemon=True)
            self._thread.start()

    def mark(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)
            self.gpu.append(torch.cuda.max_memory_allocated(self.device))
            self.gpu_reserved = max(self.gpu_reserved, torch.cuda.max_memory_reserved(self.device))
        self._sample()
        with self._lock:
            self.host.append(self._current)
        self._open()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def metrics(self) -> dict[str, float]:
        """``memory/rss_<phase>_gb`` for each closed phase of :data:`PHASES`, ``memory/rss_peak_gb``
        (their maximum), ``memory/rss_start_gb`` and ``memory/rss_floor_gb`` (the lowest RSS sampled),
        on Linux; ``memory/rss_max_gb``, the process's peak since it started; on CUDA
        ``memory/gpu_<phase>_gb``, ``memory/gpu_peak_gb`` and ``memory/gpu_reserved_gb``."""
        out: dict[str, float] = {}
        if self.start_rss is not None and self.host:
            for name, peak in zip(HOST_METRICS, self.host):
                out[name] = peak / GB
            out["memory/rss_peak_gb"] = max(self.host) / GB
            out["memory/rss_start_gb"] = self.start_rss / GB
            out["memory/rss_floor_gb"] = (self.floor or self.start_rss) / GB
        top = max_rss_bytes()
        if top is not None:
            out["memory/rss_max_gb"] = top / GB
        if self.gpu:
            for name, peak in zip(GPU_METRICS, self.gpu):
                out[name] = peak / GB
            out["memory/gpu_peak_gb"] = max(self.gpu) / GB
            out["memory/gpu_reserved_gb"] = self.gpu_reserved / GB
        return out


def _sampling(ref: weakref.ReferenceType[PhasePeaks], stop: threading.Event, interval: float) -> None:
    """The sampling thread. It holds its :class:`PhasePeaks` weakly, so a step that raised before
    ``stop()`` leaves no thread behind once its clock is gone."""
    t0 = time.thread_time()
    while not stop.wait(interval):
        peaks = ref()
        if peaks is None:
            return
        peaks._sample()
        peaks.sampler_cpu_s = time.thread_time() - t0
        del peaks
