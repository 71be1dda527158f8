"""How far AdamW moves a weight whose gradient comes in only some batches, when the optimiser also
steps on the batches without one (``--tied-scores zero``: a batch nobody earned has advantages 0,
and the policy's optimiser still steps) or skips them (``--tied-scores skip``).

Adam's bias-corrected second moment, v / (1 - beta2^t), is for t << 1 / (1 - beta2) about the mean
of g^2 over every step taken, zero-gradient steps included. Stepping on the empty batches lowers
it, so the rare gradients get larger steps (up to sqrt(steps / steps with a gradient)) and their
momentum keeps moving the weight afterwards. docs/learning.md ("Holding the policy through batches
with no signal") uses these figures.

    python bench/adam_sparse.py [--batches 40] [--steps-per-batch 2] [--eps 1e-5]
"""
from __future__ import annotations

import argparse
import random

import torch


def distance(signal: list[bool], skip_empty: bool, steps_per_batch: int, eps: float) -> float:
    """|w| after AdamW (lr 1, no weight decay) on one weight, gradient 1 in the batches marked True
    and 0 in the others, which are stepped or, with ``skip_empty``, not."""
    w = torch.zeros(1)
    opt = torch.optim.AdamW([w], lr=1.0, eps=eps, weight_decay=0.0)
    for has_gradient in signal:
        if skip_empty and not has_gradient:
            continue
        for _ in range(steps_per_batch):
            w.grad = torch.ones(1) if has_gradient else torch.zeros(1)
            opt.step()
    return abs(float(w))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--steps-per-batch", type=int, default=2,
                    help="optimiser steps per batch: --ppo-epochs x --minibatches (the defaults: 2 x 1)")
    ap.add_argument("--eps", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    print(f"{'share with a gradient':>22} {'batches':>8} {'step empty (zero)':>18} {'skip empty':>11}")
    for share in (0.05, 0.25, 0.5, 1.0):
        signal = [rng.random() < share for _ in range(args.batches)]
        a = distance(signal, False, args.steps_per_batch, args.eps)
        b = distance(signal, True, args.steps_per_batch, args.eps)
        print(f"{share:>22.2f} {sum(signal):>8} {a:>18.1f} {b:>11.1f}")


if __name__ == "__main__":
    main()
