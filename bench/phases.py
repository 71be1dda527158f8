#!/usr/bin/env python
"""Where the time of one PPO step goes, phase by phase, next to each phase's compute floor (not a test; prints figures).

    python bench/phases.py [--precision fp32|bf16] [--threads N] [--steps 4] [--critic-layers 0]

The work is TRL's PPOTrainer's in ../shared/peer-bench (bench/ppo_step.py's ``peer-full``):
SmolLM2-135M-Instruct as policy, reference, reward model and critic (reward head random, seeded;
the critic starts from the reward model), 8 rollouts x exactly 32 new tokens (--ignore-eos),
1 epoch, 1 minibatch, a separate critic trained whole (--critic-layers 0), full fine-tuning.
``--critic-layers 4`` measures ppolm's default critic instead.

The phases are timed from outside the engine, on the trainer's objects, without changing what
they compute: wrappers around the frozen models' passes (``trainer.frozen.reference_pass`` and
``.score``), the trained models' pass (``trainer.forward_train``) and the critic's part of it
(``trainer.actor_critic.values``); around ``torch.Tensor.backward``, split between the policy
and the critic by when each parameter's gradient is complete (``register_post_accumulate_grad_hook``:
the engine runs the critic's graph, built last, before the policy's); the optimisers' step hooks;
and the ``time/*`` metrics ppolm logs (``time/rollout_s``: step 1, the rollout). A wrapper whose
target the engine no longer has is left out, and its phase reads "n/a".

Each phase's floor is measured in the same process afterwards, with plain torch/transformers on
the last step's batch (B x (P + R) tokens, logits only for the R response positions, as both
trainers compute them), best of --floor-repeats:

* decode: the weight bytes read per decoded token / the memory bandwidth (the fastest of five
  streaming kernels over 512 MiB tensors, see read_bandwidth), x R tokens; next to it a plain HF
  ``generate`` of the batch (R new tokens, sampling), the cost of decoding without ppolm.
* reference forward: one causal-LM forward without grad; reward forward: one forward of the trunk
  (no LM head) without grad.
* policy / critic forward: the same with grad (what a training pass must do: keep activations).
* policy / critic backward: forward+backward minus forward (with grad).
* optimiser steps: one fused AdamW step over fp32 tensors of the trained parameters' shapes
  (ppolm's fp32 master weights in bf16 too).

The table: phase, seconds per step (median over the steps after the first), floor, ratio
(seconds / floor), and the FLOPs of the phase (2 x parameters x tokens per forward, + attention,
+ the head on R positions; backward = 2 x forward). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from grpo_vs_trl import bench_prompts  # noqa: E402

PHASES = [
    # (key, label, floor key)
    ("rollout", "rollout (decode, step 1)", "decode_bw"),
    ("reference", "reference forward", "lm_fwd_nograd"),
    ("reward", "reward-model forward", "trunk_fwd_nograd"),
    ("policy_fwd", "policy forward (rollout pass)", "lm_fwd"),
    ("critic_fwd", "critic forward (old values)", "trunk_fwd"),
    ("policy_bwd", "policy backward", "lm_bwd"),
    ("critic_bwd", "critic backward", "trunk_bwd"),
    ("actor_opt", "optimiser step: policy", "adam_policy"),
    ("critic_opt", "optimiser step: critic", "adam_critic"),
    ("opt_rest", "clip, copy, zero grads", None),
    ("other", "everything else", None),
    ("step", "whole step", "sum"),
]


# ---- pure helpers --------------------------------------------------------------------------------
class PhaseClock:
    """Seconds per named phase, summed over calls; a call nested in a call of the same phase counts once."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now
        self.total: dict[str, float] = defaultdict(float)
        self.depth: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        outer = self.depth[phase] == 0
        start = self.now() if outer else 0.0
        self.depth[phase] += 1
        try:
            yield
        finally:
            self.depth[phase] -= 1
            if outer:
                self.total[phase] += self.now() - start

    def wrap(self, obj: Any, attr: str, phase: str) -> bool:
        """Time every call of ``obj.attr`` as ``phase`` (an instance attribute shadowing the method);
        False when ``obj`` has no such attribute."""
        fn = getattr(obj, attr, None) if obj is not None else None
        if not callable(fn):
            return False

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            with self.timing(phase):
                return fn(*a, **k)

        setattr(obj, attr, timed)
        return True

    def add(self, phase: str, seconds: float) -> None:
        self.total[phase] += seconds

    def take(self) -> dict[str, float]:
        """The totals so far, and start again from zero."""
        out = dict(self.total)
        self.total.clear()
        return out


def split_intervals(start: float, end: float, events: list[tuple[float, str]]) -> dict[str, float]:
    """Split the window [start, end] by labelled completion times: the time up to each event is the
    work of that event's label; what follows the last event is "other". Events are sorted first."""
    out: dict[str, float] = defaultdict(float)
    t = start
    for when, label in sorted(events):
        when = min(max(when, t), end)
        out[label] += when - t
        t = when
    out["other"] += end - t
    return dict(out)


def forward_flops(params: int, tokens: int, layers: int, width: int, seq: int, rows: int,
                  vocab: int = 0, head_tokens: int = 0) -> float:
    """FLOPs of one transformer forward: 2 x (non-embedding) params x tokens, attention scores and
    mixing 4 x layers x width x seq^2 per row, and the LM head 2 x width x vocab per scored token."""
    return 2.0 * params * tokens + 4.0 * layers * width * seq * seq * rows + 2.0 * width * vocab * head_tokens


def decode_floor_s(weight_bytes: int, new_tokens: int, bytes_per_s: float) -> float:
    """Decoding reads every weight once per new token (the batch shares the reads): its floor."""
    return weight_bytes * new_tokens / bytes_per_s


def phase_rows(seconds: dict[str, float | None], floors: dict[str, float | None]
               ) -> list[tuple[str, float | None, float | None, float | None]]:
    """(label, seconds, floor, ratio) per phase of PHASES; "sum" as a floor key: the sum of the others'
    floors (None when there are none)."""
    rows = []
    known = [f for _, _, fk in PHASES if fk not in (None, "sum") and (f := floors.get(fk)) is not None]
    floor_sum = sum(known) if known else None
    for key, label, fk in PHASES:
        s = seconds.get(key)
        f = floor_sum if fk == "sum" else floors.get(fk) if fk else None
        rows.append((label, s, f, s / f if s is not None and f else None))
    return rows


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


# ---- the ppolm step, timed phase by phase ---------------------------------------------------------
class BackwardSplit:
    """Times every ``Tensor.backward`` and splits it by the labelled parameters whose gradients complete."""

    def __init__(self, groups: dict[str, list[Any]]):
        import torch

        self.events: list[tuple[float, str]] = []
        self.total: dict[str, float] = defaultdict(float)
        for label, params in groups.items():
            for p in params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(
                        lambda _p, label=label: self.events.append((time.perf_counter(), label)))
        self.original = torch.Tensor.backward
        split = self

        def timed_backward(tensor: Any, *a: Any, **k: Any) -> Any:
            split.events.clear()
            start = time.perf_counter()
            try:
                return split.original(tensor, *a, **k)
            finally:
                for label, s in split_intervals(start, time.perf_counter(), split.events).items():
                    split.total[label] += s

        torch.Tensor.backward = timed_backward

    def take(self) -> dict[str, float]:
        out = dict(self.total)
        self.total.clear()
        return out

    def restore(self) -> None:
        """Put torch's own ``Tensor.backward`` back."""
        import torch

        torch.Tensor.backward = self.original


def build_trainer(args: argparse.Namespace, tmp: Path) -> Any:
    import torch

    from ppolm import config, models
    from ppolm.ppo import PPOTrainer
    from ppolm.ppo_config import PPOConfig

    torch.manual_seed(0)
    rm = models.load_scalar_model(args.model, head_init="reward")
    models.save_pretrained(rm, models.load_tokenizer(args.model), tmp / "rm")
    del rm
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in bench_prompts()))
    opts = dict(model=args.model, reward_model=[str(tmp / "rm")], prompts=str(prompts), output_dir=str(tmp / "run"),
                steps=args.steps, batch_size=args.batch, response_length=args.response_length, ppo_epochs=1,
                minibatches=1, precision=args.precision, quiet=True, save_every=10**6, sample_every=10**6, seed=0,
                ignore_eos=True, temperature=1.0, critic="separate", critic_init="reward", lora_r=0,
                critic_layers=args.critic_layers)
    return PPOTrainer(config.build(PPOConfig, opts))


def measure_steps(args: argparse.Namespace, trainer: Any) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """Run --steps PPO steps with the phase timers in place; per step, seconds per phase."""
    from ppolm import rollout as ro

    clock = PhaseClock()
    seen: dict[str, Any] = {}
    generate = getattr(ro, "generate", None)
    if generate is not None:
        def watched(policy: Any, prompts: list[list[int]], *a: Any, **k: Any) -> Any:
            seen["prompts"] = [list(p) for p in prompts]
            with clock.timing("generate"):
                return generate(policy, prompts, *a, **k)
        ro.generate = watched
    frozen = getattr(trainer, "frozen", None)
    learner = getattr(trainer, "learner", trainer)  # the PPO epochs and optimisers (ppolm/ppo_learner.py)
    wrapped = {"reference": clock.wrap(frozen, "reference_pass", "reference"),
               "reward": clock.wrap(frozen, "score", "reward"),
               "frozen": clock.wrap(frozen, "run", "frozen"),
               "forward_train": clock.wrap(learner, "forward_train", "forward_train"),
               "values": clock.wrap(getattr(trainer, "actor_critic", None), "values", "critic_fwd"),
               "optimizer_step": clock.wrap(learner, "optimizer_step", "optimizer_step")}
    for name in ("actor_opt", "critic_opt"):
        opt = getattr(learner, name, None)
        wrapped[name] = opt is not None
        if opt is not None:  # the optimiser's own step hooks: its step() alone
            opt.register_step_pre_hook(lambda *_a, name=name: seen.__setitem__(name, time.perf_counter()))
            opt.register_step_post_hook(lambda *_a, name=name: clock.add(name, time.perf_counter() - seen[name]))
    critic = getattr(trainer, "critic", None)
    groups = {"policy_bwd": [p for p in trainer.policy.parameters()]}
    if critic is not None:
        groups["critic_bwd"] = [p for p in critic.parameters()]
        if getattr(trainer, "value_bias", None) is not None:
            groups["critic_bwd"].append(trainer.value_bias)
    backward = BackwardSplit(groups)
    rows = []
    for step in range(args.steps):
        clock.take()
        backward.take()
        t = time.perf_counter()
        metrics, _ = trainer.step(step)
        wall = time.perf_counter() - t
        c, b = clock.take(), backward.take()
        row = {"step": wall, "rollout": metrics.get("time/rollout_s"), "generate": c.get("generate"),
               "time/score_s": metrics.get("time/score_s"), "time/train_s": metrics.get("time/train_s")}
        for key in ("reference", "reward", "critic_fwd", "actor_opt", "critic_opt"):
            row[key] = c.get(key) if wrapped.get(key if key != "critic_fwd" else "values") else None
        if wrapped["forward_train"]:
            row["policy_fwd"] = c.get("forward_train", 0.0) - (row["critic_fwd"] or 0.0)
        row["policy_bwd"], row["critic_bwd"] = b.get("policy_bwd"), b.get("critic_bwd")
        row["backward_other"] = b.get("other")
        if wrapped["optimizer_step"]:
            row["opt_rest"] = c.get("optimizer_step", 0.0) - (row["actor_opt"] or 0.0) - (row["critic_opt"] or 0.0)
        if wrapped["frozen"]:
            row["frozen_rest"] = c.get("frozen", 0.0) - (row["reference"] or 0.0) - (row["reward"] or 0.0)
        known = [row[k] for k, _, _ in PHASES if k not in ("other", "step") and row.get(k) is not None]
        row["other"] = wall - sum(known)
        rows.append(row)
    backward.restore()
    if generate is not None:
        ro.generate = generate
    info = {"wrapped": wrapped, "prompts": seen.get("prompts"), "precision": trainer.precision}
    return rows, info



# ---- the floors, with plain torch/transformers ---------------------------------------------------
def best_of(repeats: int, fn: Callable[[], Any]) -> float:
    """The fastest of ``repeats`` timed calls, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def read_bandwidth(repeats: int) -> float:
    """Memory bandwidth, bytes/s: the fastest of a sum, a max and a dot product over a 512 MiB float32
    tensor (bytes read), a copy (read + written) and y += x * z (3 read + 1 written): streaming
    several arrays at once is faster on many CPUs, and a floor wants the highest rate."""
    import torch

    x = torch.ones(128 * 2**20)
    y, z = torch.zeros_like(x), torch.ones_like(x)
    size = x.numel() * 4
    reads = [size / best_of(repeats, fn) for fn in (x.sum, x.amax, lambda: torch.dot(x, x))]
    return max(*reads, 2 * size / best_of(repeats, lambda: y.copy_(x)),
               4 * size / best_of(repeats, lambda: y.addcmul_(x, z)))


def measure_floors(args: argparse.Namespace, prompts: list[list[int]] | None, shapes: dict[str, list[tuple]],
                   dtype_name: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from ppolm import models
    from ppolm import rollout as ro

    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    n, r = args.floor_repeats, args.response_length
    lm = AutoModelForCausalLM.from_pretrained(models.resolve_model_dir(args.model), dtype=dtype)
    lm.eval()
    tok = models.load_tokenizer(args.model)
    if not prompts:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in bench_prompts()[:args.batch]]
        prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    query, qmask = ro.left_pad(prompts, tok.pad_token_id, "cpu")  # (B, P)
    g = torch.Generator().manual_seed(0)
    response = torch.randint(100, lm.config.vocab_size, (query.shape[0], r), generator=g)  # (B, R)
    ids = torch.cat([query, response], 1)  # (B, P + R)
    mask = torch.cat([qmask, torch.ones_like(response)], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    trunk = lm.model
    head = torch.nn.Linear(lm.config.hidden_size, 1, dtype=dtype)

    def lm_loss() -> Any:
        logits = lm(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                    logits_to_keep=r + 1).logits[:, :-1]  # (B, R, V): the positions predicting the response
        return torch.log_softmax(logits.float(), -1).gather(-1, response[..., None]).mean()

    def trunk_loss() -> Any:
        h = trunk(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
        return head(h).float().mean()

    def fwd_bwd(loss_fn: Callable[[], Any], module: Any) -> None:
        loss_fn().backward()
        module.zero_grad(set_to_none=True)

    out: dict[str, Any] = {"batch": list(ids.shape)}
    with torch.no_grad():
        out["lm_fwd_nograd"] = best_of(n, lm_loss)
        out["trunk_fwd_nograd"] = best_of(n, trunk_loss)
    out["lm_fwd"] = best_of(n, lm_loss)
    out["trunk_fwd"] = best_of(n, trunk_loss)
    out["lm_fwd_bwd"] = best_of(n, lambda: fwd_bwd(lm_loss, lm))
    out["trunk_fwd_bwd"] = best_of(n, lambda: fwd_bwd(trunk_loss, trunk))
    out["lm_bwd"] = max(out["lm_fwd_bwd"] - out["lm_fwd"], 0.0)
    out["trunk_bwd"] = max(out["trunk_fwd_bwd"] - out["trunk_fwd"], 0.0)

    # decode: weight bytes per token / read bandwidth; and a plain HF generate of the batch
    weight_bytes = sum(p.numel() * p.element_size() for p in lm.parameters())
    out["read_bandwidth_gb_s"] = read_bandwidth(n) / 1e9
    out["weight_bytes"] = weight_bytes
    out["decode_bw"] = decode_floor_s(weight_bytes, r, out["read_bandwidth_gb_s"] * 1e9)
    gkw = dict(max_new_tokens=r, min_new_tokens=r, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
               pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        out["hf_generate"] = best_of(max(1, n - 1), lambda: lm.generate(input_ids=query, attention_mask=qmask, **gkw))

    # FLOPs of the passes (per step)
    cfg = lm.config
    embed = cfg.vocab_size * cfg.hidden_size
    body = sum(p.numel() for p in lm.parameters()) - embed
    b, t = ids.shape
    fwd = forward_flops(body, b * t, cfg.num_hidden_layers, cfg.hidden_size, t, b, cfg.vocab_size, b * r)
    trunk_fwd = forward_flops(body, b * t, cfg.num_hidden_layers, cfg.hidden_size, t, b)
    out["gflop"] = {"lm_fwd": fwd / 1e9, "trunk_fwd": trunk_fwd / 1e9, "lm_bwd": 2 * fwd / 1e9,
                    "trunk_bwd": 2 * trunk_fwd / 1e9,
                    "decode": forward_flops(body, b * r, cfg.num_hidden_layers, cfg.hidden_size, t, b,
                                            cfg.vocab_size, b * r) / 1e9}
    lm = trunk = None  # (free the model before the optimiser floors)
    gc.collect()

    # one fused AdamW step over fp32 tensors of the trained parameters' shapes
    for key, shape_list in shapes.items():
        if not shape_list:
            out[key] = None
            continue
        params = [torch.zeros(s, requires_grad=True) for s in shape_list]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt = torch.optim.AdamW(params, lr=1e-6, eps=1e-5, fused=True)
        out[key] = best_of(n, opt.step)
        del params, opt
        gc.collect()
    return out


# ---- report -----------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--steps", type=int, default=4, help="PPO steps; the first is left out of the medians")
    ap.add_argument("--critic-layers", type=int, default=0, help="0: a full critic (TRL's work); 4: ppolm's default (the critic's floors stay a full critic's)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--response-length", type=int, default=32)
    ap.add_argument("--floor-repeats", type=int, default=3, help="timed repeats of each floor (best kept)")
    ap.add_argument("--no-floors", action="store_true", help="time the step's phases only")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is left out)")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="ppolm_phases_"))
    try:
        trainer = build_trainer(args, tmp)
        rows, info = measure_steps(args, trainer)
        shapes = {"adam_policy": [tuple(p.shape) for p in getattr(trainer, "actor_params", [])],
                  "adam_critic": [tuple(p.shape) for p in getattr(trainer, "critic_params", [])]}
        del trainer
        gc.collect()
        floors = {} if args.no_floors else measure_floors(args, info["prompts"], shapes, info["precision"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    steady = rows[1:]
    seconds = {}
    for key in {k for row in steady for k in row}:
        vals = [row[key] for row in steady if row.get(key) is not None]
        seconds[key] = statistics.median(vals) if vals else None
    gflop = floors.get("gflop", {})
    flop_of = {"rollout": gflop.get("decode"), "reference": gflop.get("lm_fwd"), "reward": gflop.get("trunk_fwd"),
               "policy_fwd": gflop.get("lm_fwd"), "critic_fwd": gflop.get("trunk_fwd"),
               "policy_bwd": gflop.get("lm_bwd"), "critic_bwd": gflop.get("trunk_bwd")}
    print(f"PPO step phases: precision {info['precision']}, {torch.get_num_threads()} threads, "
          f"--critic-layers {args.critic_layers}, batch {floors.get('batch', '?')} (B, P + R), "
          f"medians of steps 2..{args.steps}")
    print("| phase | seconds | floor | ratio | GFLOP |")
    print("|---|---|---|---|---|")
    for (key, _, _), (label, s, f, ratio) in zip(PHASES, phase_rows(seconds, floors)):
        print(f"| {label} | {fmt(s)} | {fmt(f)} | {fmt(ratio, '.2f')} | {fmt(flop_of.get(key), '.1f')} |")
    if floors:
        print(f"| plain HF generate (reference for decode) | {fmt(floors['hf_generate'])} | {fmt(floors['decode_bw'])} "
              f"| {fmt(floors['hf_generate'] / floors['decode_bw'], '.2f')} | |")
        print(f"read bandwidth {floors['read_bandwidth_gb_s']:.1f} GB/s; weights {floors['weight_bytes'] / 1e6:.0f} MB "
              f"read per decoded token")
    missing = [k for k, ok in info["wrapped"].items() if not ok]
    if missing:
        print(f"not timed (the engine has no such attribute): {', '.join(missing)}", file=sys.stderr)
    print(json.dumps({"bench": "ppo_phases", "precision": info["precision"], "threads": torch.get_num_threads(),
                      "critic_layers": args.critic_layers, "seconds": seconds, "floors": floors,
                      "steps": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
                      "wrapped": info["wrapped"]}))


if __name__ == "__main__":
    main()
