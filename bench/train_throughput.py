"""Training throughput of ``ppolm sft`` and ``ppolm reward`` on the embedded SmolLM2-135M, in tokens/s.

Each variant trains for ``--epochs`` (default 2) passes over the example files (``examples/sft.jsonl``,
``examples/pairs.jsonl``, repeated to ``--rows`` rows) and reports the last epoch's rate, so the
first step's one-off costs are left out. Tokens are real (unpadded) prompt + response tokens; for
the reward model both sides of each pair count. No eval split, no normalisation: training only.

    .venv/bin/python bench/train_throughput.py                     # all variants, bf16
    .venv/bin/python bench/train_throughput.py --precision fp32 --only sft-full
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = {
    "sft-full": ("sft", {}),
    "sft-lora8": ("sft", {"lora_r": 8, "lr": 2e-4}),
    "reward-top2": ("reward", {"train_layers": 2}),
    "reward-full": ("reward", {"train_layers": -1}),
    "reward-lora8": ("reward", {"lora_r": 8, "lr": 2e-4}),
}


def repeat_rows(src: Path, n: int, dst: Path) -> Path:
    lines = [ln for ln in src.read_text(encoding="utf-8").splitlines() if ln.strip()]
    dst.write_text("\n".join(lines[i % len(lines)] for i in range(n)) + "\n", encoding="utf-8")
    return dst


def run_variant(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    from ppolm import config
    from ppolm.reward_train import RewardTrainConfig, train_reward
    from ppolm.sft import SFTConfig, train_sft

    kind, extra = VARIANTS[name]
    src = ROOT / "examples" / ("sft.jsonl" if kind == "sft" else "pairs.jsonl")
    data = repeat_rows(src, args.rows, tmp / f"{name}.jsonl")
    opts = {"model": args.model, "data": str(data), "output_dir": str(tmp / name), "epochs": args.epochs,
            "batch_size": args.batch_size, "eval_fraction": 0.0, "precision": args.precision, "quiet": True,
            "overwrite": True, **extra}
    if kind == "reward":
        opts["normalize"] = False
    t0 = time.perf_counter()
    rows = train_sft(config.build(SFTConfig, opts)) if kind == "sft" else \
        train_reward(config.build(RewardTrainConfig, opts))
    last = rows[-1]
    return {"variant": name, "tokens_per_s": round(last["tokens_per_s"], 1), "tokens_per_epoch": last["tokens"],
            "epoch_s": round(last["time_s"], 2), "total_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=32, help="rows per epoch (the example files, repeated)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--only", action="append", choices=list(VARIANTS), help="run only this variant (repeatable)")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"model {args.model}, {args.precision}, batch {args.batch_size}, {args.rows} rows/epoch, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'}")
    results = []
    with tempfile.TemporaryDirectory(prefix="ppolm-bench-") as tmp:
        for name in args.only or list(VARIANTS):
            r = run_variant(name, args, Path(tmp))
            results.append(r)
            print(f"{name:13s} {r['tokens_per_s']:9.1f} tokens/s   ({r['tokens_per_epoch']} tokens in "
                  f"{r['epoch_s']:.1f} s; whole run incl. load {r['total_s']:.1f} s)", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
