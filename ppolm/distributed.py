"""Data-parallel training on ``torch.distributed``, as ``torchrun`` launches it.

One process per device (``torchrun --nproc-per-node N``, and ``--nnodes`` for several machines):
every process holds a full copy of each model, works on its own share of each batch, and the
trained models' gradients are averaged by :class:`torch.nn.parallel.DistributedDataParallel`
(gloo on CPUs, NCCL on CUDA, one GPU per process from ``LOCAL_RANK``). What must be the same on
every process is computed from all-reduced sums, so that N processes compute what one process
computes on the same global batch:

* batch statistics (advantage and reward whitening, variances, explained variance) from global
  sums and counts (:func:`masked_moments`);
* losses averaged over the tokens (or rows) of the *global* microbatch (:func:`scale_to_global`):
  each process divides its sum by the global count and multiplies by N, because DDP averages the
  gradients of the N processes;
* decisions (skip a non-finite update, stop early on --target-kl, stop on Ctrl-C) from all-reduced
  flags, so no process takes a branch the others do not (they would wait forever in a collective);
* the KL controller's input, the metrics and held-out results from all-reduced sums.

Process 0 (the "main" process) owns every output: metrics, samples, TensorBoard, checkpoints,
saved models, reports. The others print nothing (their errors excepted) and write nothing.

Without torchrun (no ``WORLD_SIZE``, or 1) every function here is the single-process identity:
nothing is initialised and nothing communicates.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from ppolm import core
from ppolm.errors import PPOLMError
from ppolm.models import stack
from ppolm.runtime import resolve_device

T = TypeVar("T")


def peer_failure(e: BaseException) -> bool:
    """Whether ``e`` is what a collective raises when another process died or stopped answering
    (gloo: "Connection closed by peer"/"Connection reset", a timeout; NCCL: its watchdog), rather
    than a bug of this process."""
    if not isinstance(e, RuntimeError):
        return False
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    text = str(e).lower()
    return any(w in text for w in ("connection closed", "connection reset", "timed out", "timeout", "gloo",
                                   "nccl", "broken pipe", "socket"))


class RankError(PPOLMError):
    """A bad-input error that every process found for the same reason (the config, or a check that
    process 0 made and broadcast): only process 0 prints it."""


def launched_world_size() -> int:
    """The number of processes torchrun (or the environment) asked for: ``WORLD_SIZE``, 1 if unset."""
    raw = os.environ.get("WORLD_SIZE", "1").strip() or "1"
    try:
        n = int(raw)
    except ValueError:
        raise PPOLMError(f"WORLD_SIZE={raw!r} is not a number; launch with torchrun --nproc-per-node N") from None
    if n < 1:
        raise PPOLMError(f"WORLD_SIZE={n} must be at least 1")
    return n


def active() -> bool:
    """Whether this process is one of several joined in a process group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def world_size() -> int:
    return torch.distributed.get_world_size() if active() else 1


def rank() -> int:
    if active():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def local_rank() -> int:
    """This process's index on its machine (``LOCAL_RANK``, set by torchrun; 0 for one process)."""
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def is_main() -> bool:
    """Process 0, the one that prints progress and writes the outputs (always True for one process)."""
    return rank() == 0


def init(device_name: str, timeout_s: float) -> torch.device:
    """Join the process group torchrun set up (a no-op for one process) and return this process's device.

    CUDA: one GPU per process, ``cuda:LOCAL_RANK``, NCCL; CPU: gloo. ``timeout_s`` bounds how long a
    collective waits for a process that stopped answering (a killed rank): the survivors then fail
    instead of hanging. Processes other than 0 stop printing (see :func:`silence_others`).
    """

    n = launched_world_size()
    device = resolve_device(device_name)
    if n == 1 or active():
        return _local_device(device) if active() else device
    for var in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise PPOLMError(f"WORLD_SIZE={n} is set but {var} is not; launch with torchrun --nproc-per-node {n} "
                             "-m ppolm ... (or unset WORLD_SIZE for one process)")
    device = _local_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    try:
        torch.distributed.init_process_group(backend, **kwargs)
    except (RuntimeError, ValueError) as e:
        raise PPOLMError(f"could not join the torchrun job ({type(e).__name__}: {str(e)[:160]}); check "
                         "--rdzv-endpoint/MASTER_ADDR:MASTER_PORT and that every node runs the same command") from None
    silence_others()
    return device


def _local_device(device: torch.device) -> torch.device:
    if device.type != "cuda":
        return device
    local = local_rank()
    if local >= torch.cuda.device_count():
        raise PPOLMError(f"LOCAL_RANK {local} but this machine has {torch.cuda.device_count()} CUDA device(s); "
                         "use --nproc-per-node at most the number of GPUs")
    return torch.device("cuda", local)


def silence_others() -> None:
    """Processes other than 0 print nothing: their progress would repeat process 0's. Their errors
    still reach the terminal (``ppolm.cli`` writes them to the stream it started with)."""
    if not is_main():
        devnull = open(os.devnull, "w")  # noqa: SIM115  (lives as long as the process)
        sys.stdout = sys.stderr = devnull


def shutdown() -> None:
    """Leave the process group at the end of a command that ran to completion. A group left for the
    interpreter's exit to tear down can abort the process: gloo's worker threads are then destroyed
    while still joinable ("terminate called without an active exception", SIGABRT), so a torchrun
    job whose work was done and saved could still exit non-zero (PyTorch asks for
    ``destroy_process_group()`` before exit: https://pytorch.org/docs/stable/distributed.html).
    Garbage is collected first: reference cycles (FSDP's modules and their hooks form them) can
    keep the collectives' work objects and their tensors alive until the interpreter's own
    teardown, where freeing them can abort the same way (pytorch/pytorch#179291)."""
    if active():
        gc.collect()
        torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------- collectives

def all_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over every process (a new tensor; ``x`` itself on one process)."""
    if not active():
        return x
    y = x.clone()
    torch.distributed.all_reduce(y)
    return y


def all_sum_floats(values: Sequence[float], device: torch.device | str = "cpu") -> list[float]:
    """Sums over every process of a few numbers, in one all-reduce (float64)."""
    if not active():
        return [float(v) for v in values]
    return all_sum(torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)).tolist()


def all_max_floats(values: Sequence[float], device: torch.device | str = "cpu") -> list[float]:
    """The largest value of each of a few numbers over every process, in one all-reduce."""
    if not active():
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.tolist()


def any_flag(flag: bool, device: torch.device | str = "cpu") -> bool:
    """True on every process if ``flag`` is True on any."""
    return all_sum_floats([1.0 if flag else 0.0], device)[0] > 0


def gather_objects(obj: T) -> list[T]:
    """Every process's ``obj`` (picklable), in rank order, on every process."""
    if not active():
        return [obj]
    out: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def on_main(fn: Callable[[], T]) -> T:
    """Run ``fn`` on process 0 only (a judge asked once, for every process) and give its result to
    every process. A :class:`PPOLMError` it raises is raised on every process (printed once, by process 0)."""
    if not active():
        return fn()
    result: Any = None
    error = None
    if is_main():
        try:
            result = fn()
        except PPOLMError as e:
            error = str(e)
    result, error = broadcast_object((result, error))
    if error is not None:
        raise RankError(error)
    return result


def broadcast_object(obj: T) -> T:
    """Process 0's ``obj`` on every process."""
    if not active():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if active():
        torch.distributed.barrier()


# ------------------------------------------------------------------------ global statistics

def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mean, biased variance and count of the entries of ``x`` where ``mask`` is 1, over every
    process's entries (sums in float64). x, mask: any matching shape."""
    m = mask.to(torch.float64)
    xd = x.to(torch.float64) * m
    s = all_sum(torch.stack([xd.sum(), (xd * x.to(torch.float64)).sum(), m.sum()]))
    n = float(s[2])
    if n == 0:
        raise ValueError("masked_moments: mask selects no entries on any process")
    mean = s[0] / n
    var = (s[1] / n - mean**2).clamp(min=0.0)
    return mean.to(torch.float32), var.to(torch.float32), n


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """:func:`ppolm.core.masked_whiten` with the mean and variance of every process's entries."""

    if not active():
        return core.masked_whiten(x, mask, shift_mean=shift_mean)
    mean, var, _ = masked_moments(x, mask)
    return core.masked_whiten(x, mask, shift_mean=shift_mean, moments=(mean, var))


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> float:
    """The unbiased variance of the masked entries of every process (0 with fewer than two)."""

    if not active():
        return core.masked_var(x, mask).item() if mask.sum() > 1 else 0.0
    _, var, n = masked_moments(x, mask)
    return float(var) * n / (n - 1) if n > 1 else 0.0


def scale_to_global(local_count: torch.Tensor | float, global_count: float) -> float:
    """The factor that turns a loss averaged over this process's ``local_count`` units (tokens, rows)
    into its share of the average over the global ``global_count``: local_count * N / global_count.
    DDP averages the N processes' gradients, so the N shares add up to the single-process gradient
    of the global average. 1 on one process."""
    n = world_size()
    if n == 1:
        return 1.0
    return float(local_count) * n / global_count if global_count else 0.0


class Sums:
    """Named (total, count) pairs summed over every process in one all-reduce; ``means()`` gives
    total / count for each name (nan where the count is 0)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.values: list[float] = []

    def add(self, name: str, total: float | torch.Tensor, count: float | torch.Tensor) -> None:
        self.names.append(name)
        self.values += [float(total), float(count)]

    def means(self) -> dict[str, float]:
        v = all_sum_floats(self.values)
        return {k: v[2 * i] / v[2 * i + 1] if v[2 * i + 1] else float("nan") for i, k in enumerate(self.names)}


def checksum(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes, in order (equal weights on every process give equal sums). An
    FSDP-sharded tensor (DTensor) is gathered whole first: a collective, so every process must call
    this with the same tensors."""
    import hashlib

    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.full_tensor()
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_rank_summary(summary: Callable[[], dict[str, Any]]) -> None:
    """With ``PPOLM_RANK_SUMMARY=DIR`` set, every process writes ``DIR/rank<r>.json`` at the end of a
    run, ``summary()`` (e.g. its KL coefficient and a checksum of its weights): a check that the
    processes agree. Nothing is computed without it."""
    import json

    where = os.environ.get("PPOLM_RANK_SUMMARY")
    if where:
        path = os.path.join(where, f"rank{rank()}.json")
        os.makedirs(where, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"rank": rank(), "world_size": world_size(), **summary()}, f)


# ------------------------------------------------------------------------------- wrapping

class Through(torch.nn.Module):
    """A model whose ``forward(fn, *args)`` returns ``fn(*args)``: whatever ``fn`` computes with the
    model then runs inside this module's forward, which is where DDP hooks in. For training code
    that calls a model's backbone and head itself rather than the model's own forward."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)


def fsdp(root: torch.nn.Module, models: Sequence[torch.nn.Module], param_dtype: torch.dtype | None = None,
         first_call: tuple[Any, ...] = (lambda: None,)) -> torch.nn.Module:
    """Shard ``root`` with FSDP2 (``torch.distributed.fsdp.fully_shard``): each decoder layer of each
    of ``models`` (the trained models inside ``root``) is one unit, then ``root`` itself (embeddings,
    final norms, heads). Every process then holds 1/N of each trained weight, of its gradient and of
    its Adam states; a unit's full weights exist only while it computes. ``param_dtype``: compute in
    this dtype (bf16) from fp32 shards (FSDP's mixed precision; gradients reduced in fp32). The
    optimiser must be built after this (the parameters become sharded DTensors). Everything that
    computes with the models must run inside ``root``'s forward (:class:`Through`), or inside
    :func:`gathered`. ``root(*first_call)``, a forward that computes nothing, runs once here so
    that FSDP takes ``root`` as its root before any layer runs alone (sampling)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mp_policy": mp} if mp is not None else {}
    for m in models:
        found = stack(m)
        if found is None:
            raise PPOLMError(f"--fsdp needs a model whose decoder layers it can shard one by one; "
                             f"{type(m).__name__} has no backbone.layers (drop --fsdp)")
        for layer in found[1]:
            fully_shard(layer, **kwargs)
    fully_shard(root, **kwargs)
    with torch.no_grad():
        root(*first_call)
    root.reshard()  # (the root keeps its weights gathered after a forward; the optimiser needs the shards)
    return root


@contextlib.contextmanager
def gathered(root: torch.nn.Module) -> Iterator[None]:
    """Inside, every FSDP unit of ``root`` holds its full weights and keeps them from one forward to
    the next: for sampling, which runs the policy's layers itself, token by token (one all-gather
    per unit, not one per unit and token). Nothing happens without FSDP."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    for u in units:
        u.set_reshard_after_forward(False, recurse=False)
        u.unshard()
    try:
        yield
    finally:
        for u in units:
            u.reshard()
            u.set_reshard_after_forward(True, recurse=False)


def is_sharded(t: Any) -> bool:
    return type(t).__name__ == "DTensor"


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP-sharded one (a collective: every process calls it in the same
    order); any other tensor as it is."""
    return t.full_tensor() if is_sharded(t) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of an FSDP-sharded tensor; any other tensor as it is."""
    return t.to_local() if is_sharded(t) else t


def shard_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``whole`` split as the FSDP-sharded ``like`` is (its mesh and placements); unchanged when
    ``like`` is not sharded."""
    if not is_sharded(like):
        return whole
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole.to(like.device, like.dtype), like.device_mesh, like.placements)


def ddp(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module`` under DistributedDataParallel (gradients averaged over the processes at each
    backward pass); the module itself on one process. Its parameters must already be equal on every
    process (DDP also broadcasts process 0's at construction)."""
    if not active():
        return module
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, broadcast_buffers=False)
