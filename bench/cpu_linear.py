#!/usr/bin/env python
"""Time a linear layer's three products with torch's default CPU kernel and with oneDNN (not a test; prints figures).

    python bench/cpu_linear.py [--threads 2] [--rows 8 32 304] [--precision fp32 bf16]

The weights are SmolLM2-135M's layer shapes (30 layers x q, k, v, o, gate, up, down, and the
49152 x 576 LM head), random, one copy per layer so that every product streams its weight from
memory as a real pass does. For each row count (8: decoding 8 sequences; 32: held-out decoding;
304: a training pass over 8 x 38 tokens) the table gives the milliseconds of one pass over all the
layers for

* forward ``x Wᵀ``: aten (``F.linear``), ``(W xᵀ)ᵀ`` (ppolm's decoding path when oneDNN is off)
  and oneDNN (``torch.ops.mkldnn._linear_pointwise``, what ``ppolm.cpu_linear`` routes fp32 to);
* input gradient ``g W`` and weight gradient ``gᵀ x`` (training rows only): aten's matmul and oneDNN.

Median of --repeats passes, kernels alternating. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def cpu_flags() -> str:
    try:
        flags = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")).split()
        model = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()
    return model.split(":", 1)[1].strip() + "; " + " ".join(
        f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


def onednn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32, 304])
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    print(f"# {cpu_flags()}; torch {torch.__version__}, {a.threads} threads")
    print("| precision | rows | product | aten ms | (W xᵀ)ᵀ ms | oneDNN ms | aten / oneDNN |")
    print("|---|---|---|---|---|---|---|")
    results = []
    for prec in a.precision:
        dt = torch.float32 if prec == "fp32" else torch.bfloat16
        weights = [torch.randn(o, i, dtype=dt) for _ in range(30) for o, i in SHAPES]
        weights.append(torch.randn(49152, 576, dtype=dt))
        for rows in a.rows:
            x = {d: torch.randn(rows, d, dtype=dt) for d in (576, 1536)}
            g = {d: torch.randn(rows, d, dtype=dt) for d in (192, 576, 1536, 49152)}
            kernels = {"forward": {"aten": lambda w, x=x: torch.nn.functional.linear(x[w.shape[1]], w),
                                   "wxt": lambda w, x=x: (w @ x[w.shape[1]].t()).t().contiguous(),
                                   "onednn": lambda w, x=x: onednn(x[w.shape[1]], w)}}
            if rows > 64:
                kernels["input grad"] = {"aten": lambda w, g=g: g[w.shape[0]] @ w,
                                         "onednn": lambda w, g=g: onednn(g[w.shape[0]], w.t())}
                kernels["weight grad"] = {"aten": lambda w, g=g, x=x: g[w.shape[0]].t() @ x[w.shape[1]],
                                          "onednn": lambda w, g=g, x=x: onednn(g[w.shape[0]].t(), x[w.shape[1]].t())}
            for product, ks in kernels.items():
                times: dict[str, list[float]] = {k: [] for k in ks}
                for _ in range(a.repeats + 1):
                    for name, fn in ks.items():
                        t = time.perf_counter()
                        for w in weights:
                            fn(w)
                        times[name].append((time.perf_counter() - t) * 1e3)
                med = {k: statistics.median(v[1:]) for k, v in times.items()}
                results.append({"precision": prec, "rows": rows, "product": product, **{k + "_ms": v for k, v in med.items()}})
                wxt = f"{med['wxt']:.1f}" if "wxt" in med else "–"
                print(f"| {prec} | {rows} | {product} | {med['aten']:.1f} | {wxt} | {med['onednn']:.1f} | "
                      f"{med['aten'] / med['onednn']:.2f} |", flush=True)
    print(json.dumps({"cpu": cpu_flags(), "threads": a.threads, "results": results}))


if __name__ == "__main__":
    main()
