"""What every command sets up around its training the same way: device and numeric precision,
seeds and random-number streams, and the process (Ctrl-C/SIGTERM; memory handed back). (The
output-directory guard is :mod:`ppolm.rundir`.)

``--precision auto`` is a speed choice only: bf16 where the hardware computes it natively (CUDA
with bf16 support; CPUs with AMX or AVX512-BF16), fp32 elsewhere (on a CPU without those
instructions bf16 is emulated and slower than fp32). The choice and its reason are printed once.

The bf16 recipe of ``ppolm ppo`` (mixed precision as in Micikevicius et al. 2018,
https://arxiv.org/abs/1710.03740, and as FSDP's ``MixedPrecisionPolicy(param_dtype=bf16)`` runs it):

* every model computes in bf16 with bf16 weights: the policy, the frozen reference, the reward
  models and the critic; so the policy and the reference run *the same operations on the same
  numbers* until the first update (KL exactly 0, importance ratio exactly 1), and a LoRA policy's
  reference (its adapter disabled) is the same bf16 base;
* trained weights keep an fp32 master copy (:class:`MasterWeights`): gradients are moved to it after
  each backward pass, the optimiser (and its states) works in fp32, and the bf16 weights are
  rounded from it after each step, so updates far below bf16's resolution still accumulate;
  LoRA adapters are kept in fp32 by peft and need no copy;
* the masters start *dithered*: each is the bf16 weight plus uniform noise within its rounding
  cell, so the bf16 weights are unchanged but sit at random places in their cells. A master that
  starts on its bf16 value (as a copy of bf16 weights does) must move half a bf16 step before its
  rounded weight moves at all, and a fine-tuning run moves most weights by less: on the embedded
  model, 40 PPO updates at lr 2e-5 left the bf16 model that sampled, scored and measured the KL
  with ~1/6 of its masters' displacement, so the saved fp32 policy had a held-out KL of 17-19
  nats while the run reported 7 against a target of 6. Dithered, a weight's rounding moves by its
  master's update in expectation (Schuchman 1964, "Dither signals and their effect on
  quantization noise"), and the model that trains is, up to rounding noise, the one that is saved;
* every quantity the PPO maths reads is fp32: logits come from the LM head in fp32
  (:func:`ppolm.models.output_logits`; the LM head's bf16 rounding alone makes sampled and
  recomputed log-probs differ by ~0.03 nats per token, MiniMax-M1, https://arxiv.org/abs/2506.13585),
  values from the value head in fp32, and log-probs, rewards, advantages and losses are fp32.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ppolm.errors import PPOLMError


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cuda' without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise PPOLMError("--device cuda was asked for but no CUDA device is available; use --device cpu or auto")
    return torch.device(name)


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` computes bf16 natively, and what that was read from."""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, f"{torch.cuda.get_device_name(device)} {'supports' if ok else 'does not support'} bf16"
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    found = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    if not found and not flags:  # no /proc/cpuinfo (macOS, Windows): ask torch's own CPU probe
        try:
            if torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported():
                found = ["bf16 (torch.cpu)"]
        except AttributeError:
            pass
    if found:
        return True, f"this CPU has {' and '.join(found)}"
    return False, "this CPU has neither AMX nor AVX512-BF16, so bf16 would be emulated and slower than fp32"


_SAID: set[tuple[str, str]] = set()
_PENDING: list[str] = []


def resolve_precision(name: str, device: torch.device, *, say: bool = True) -> str:
    """'auto' -> 'bf16' where ``device`` computes bf16 natively, else 'fp32'. The choice and why are
    said once per process (``say=False``: never), when the first model loads (:func:`announce`), so
    that bad input found before any work is reported by its one error line alone."""
    if name not in ("auto", "bf16", "fp32"):
        raise PPOLMError(f"--precision must be auto, bf16 or fp32; got {name!r}")
    if name == "auto":
        ok, why = native_bf16(device)
        chosen, reason = ("bf16" if ok else "fp32"), f"auto: {why}"
    else:
        chosen, reason = name, "as asked"
    key = (chosen, device.type)  # once: a later stage resolving the already chosen precision says nothing
    if say and key not in _SAID:
        _SAID.add(key)
        _PENDING.append(f"precision: {chosen} on {device.type} ({reason})")
    return chosen


def announce() -> None:
    """Print what :func:`resolve_precision` chose and has not said yet (called as models load)."""
    while _PENDING:
        print(_PENDING.pop(0), file=sys.stderr)


def dithered(w: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """An fp32 copy of the bf16 tensor ``w`` with each non-zero value moved uniformly within the set
    of fp32 values that round (to nearest) back to it: its 16 low bits, zero in a bf16 value, become
    a uniform draw in [-32767, 32767] (in bits, so a cell that straddles a power of two, finer below
    it, is covered the same way). ``dithered(w, gen).bfloat16()`` equals ``w``; zeros stay zero."""
    if w.dtype != torch.bfloat16:
        return w.float().clone()
    bits = w.float().cpu().view(torch.int32)
    noise = torch.randint(-32767, 32768, bits.shape, dtype=torch.int32, generator=gen)
    # The int32 pattern of a float is sign and magnitude: adding to its low bits moves the magnitude
    # either way by less than half a bf16 step, whatever the sign. Zero (either sign) is left alone.
    out = torch.where((bits & 0x7FFFFFFF) == 0, bits, bits + noise).view(torch.float32)
    return out.to(w.device)


def dtype_of(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


class MasterWeights:
    """fp32 master copies of trained parameters that the model holds in bf16.

    The optimiser steps :attr:`params` (fp32); the model's own parameters (``model_params``) are
    what the forward pass uses. An fp32 model parameter is its own master (no copy). Use:
    ``loss.backward(); mw.grads_to_master()`` after every backward pass (gradients accumulate in
    fp32, not bf16), then clip and step the optimiser on ``mw.params``, then ``mw.copy_to_model()``.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], seed: int = 0):
        self.model_params = list(params)
        gen = torch.Generator().manual_seed(seed)  # the same on every process: DDP replicas stay equal
        self.params = [p if p.dtype == torch.float32 else torch.nn.Parameter(dithered(p.detach(), gen))
                       for p in self.model_params]

    def pairs(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        return [(p, m) for p, m in zip(self.model_params, self.params) if p is not m]

    def grads_to_master(self) -> None:
        for p, m in self.pairs():
            if p.grad is None:
                continue
            g = p.grad.float()
            m.grad = g if m.grad is None else m.grad.add_(g)
            p.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for p, m in self.pairs():
            p.copy_(m)

    @torch.no_grad()
    def to_fp32_model(self) -> None:
        """Make the model's parameters fp32 copies of the masters (before saving the final model)."""
        for p, m in self.pairs():
            p.data = m.detach().clone()


# ----------------------------------------------------------------------------------- seeds

def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_devices(device: torch.device) -> list[int]:
    """The CUDA devices whose generators a computation on ``device`` draws from: that device's
    index (the current device when the index is unset), or none on a CPU."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


@contextlib.contextmanager
def seeded_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Run a block with its own seed on the CPU generator and, on CUDA, ``device``'s generator, and
    restore both afterwards. (``torch.manual_seed`` would reseed every CUDA device, including ones
    ``torch.random.fork_rng(devices=...)`` did not save, so it is not used here.)"""
    devices = rng_devices(device)
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        for d in devices:
            with torch.cuda.device(d):
                torch.cuda.manual_seed(seed)
        yield


# ------------------------------------------------------------------------------- the process

@contextlib.contextmanager
def stop_on_signal() -> Iterator[dict[str, bool]]:
    """While active, the first Ctrl-C or SIGTERM only sets ``stop["requested"]`` (the training loop
    then saves a checkpoint and ends after its current step); a second one aborts at once
    (KeyboardInterrupt). Handlers are installed on the main thread only, and restored on exit.

    Under torchrun a Ctrl-C reaches each worker twice, from the terminal (the whole foreground
    process group) and from torchrun passing it on; so there a second signal aborts only when it
    comes more than ``REPEAT_S`` seconds after the first."""
    import time

    stop: dict[str, Any] = {"requested": False}
    several = os.environ.get("WORLD_SIZE", "1") not in ("", "1")

    def on_signal(signum: int, frame: Any) -> None:
        if stop["requested"]:
            if several and time.monotonic() - stop["at"] < REPEAT_S:
                return
            raise KeyboardInterrupt
        stop["requested"], stop["at"] = True, time.monotonic()
        print("\nstopping after this step to save a checkpoint (Ctrl-C again to abort without saving)",
              file=sys.stderr, flush=True)

    main = threading.current_thread() is threading.main_thread()
    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        yield stop
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


REPEAT_S = 3.0
"""Under torchrun, a signal this soon after the first is the same Ctrl-C delivered twice."""


def quiet_libraries() -> None:
    """Offline, and without the warnings and progress bars of the libraries ppolm drives (also in
    the processes ppolm spawns: ppolm/compare.py)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a hub at run time
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.utils.tensorboard")
    warnings.filterwarnings("ignore", message=".*generation flags are not valid.*")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


_LIBC: Any = None


def malloc_trim() -> None:
    """Hand memory freed by the last stage (KV cache, frozen models' activations) back to the OS
    before the training pass, so the peak is not the sum of both (glibc only; ~80 MB on the peer work)."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018  (raises AttributeError off glibc)
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)
