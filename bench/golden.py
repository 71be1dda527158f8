#!/usr/bin/env python
"""Golden outputs of a few fixed-seed tiny-model runs, to check that a refactoring changes no number.

Not a test (pytest does not collect it) and not a benchmark: it runs PPO (full fine-tuning with a
top-layers critic on the RM's trunk, the same without the shared trunk/prefix, LoRA, a shared value
head, a critic from the policy, held-out evaluation), one ``sft`` and one ``reward`` run, all in
fp32 on one thread, and records every metrics row (``time/*``, ``memory/*`` and other readings of the machine dropped) and
the sha256 of every safetensors file written.

    python bench/golden.py record /tmp/golden_before.json
    python bench/golden.py check /tmp/golden_before.json   # exit 1 at the first difference
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

REWARD_FILE = '''
def words(prompts, completions, **kwargs):
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [min(len(t.split()), 10) / 10 for t in texts]
'''

CLOCK_KEYS = {"time_s", "tokens_per_s", "elapsed_s"}


def clean(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "memory/")) and k not in CLOCK_KEYS}


def hashes(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*.safetensors"))}


def jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [clean(json.loads(x)) for x in path.read_text().splitlines() if x.strip()]


def record() -> dict[str, Any]:
    import torch

    from ppolm import config
    from ppolm.ppo import train_ppo
    from ppolm.ppo_config import PPOConfig
    from ppolm.tiny import build_tiny_model_dir

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="ppolm_golden_"))
    policy = build_tiny_model_dir(root / "policy", kind="causal", seed=0)
    rm = build_tiny_model_dir(root / "rm", kind="scalar", seed=1)
    rf = root / "my_rewards.py"
    rf.write_text(REWARD_FILE)
    base = dict(model=str(policy), reward_fn=[f"{rf}:words"], steps=2, batch_size=4, minibatches=2, ppo_epochs=2,
                response_length=8, quiet=True, precision="fp32", save_every=1)
    with_rm = dict(reward_model=[str(rm)])
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"The river {i} runs past the old house and the green hill.\n" for i in range(8)))
    held = root / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": f"Tell me about the number {i}."}) + "\n" for i in range(6)))
    runs = {
        "a_full_trunk_critic": dict(**with_rm, critic_layers=1, share_trunk=True, share_prefix=True),
        "b_full_no_sharing": dict(**with_rm, critic_layers=1, share_trunk=False, share_prefix=False),
        "c_lora_top_layer": dict(**with_rm, lora_r=4, critic_layers=0,
                                 lora_target="layers.1.self_attn.q_proj,layers.1.mlp.down_proj"),
        "d_shared_critic": dict(**with_rm, critic="shared"),
        "e_critic_from_policy": dict(**with_rm, critic_init="policy", critic_layers=1),
        "h_fused_kl_in_loss_ptx": dict(**with_rm, minibatches=1, kl_in="loss", entropy_coef=0.01, whiten_rewards=True,
                                       ptx_coef=0.1, ptx_data=str(corpus)),
        "g_eval_and_best": dict(**with_rm, critic_layers=1, eval_prompts=str(held), eval_every=1,
                                eval_batch_size=4, best_metric="eval/score"),
    }
    result: dict[str, Any] = {}
    for name, over in runs.items():
        out = root / name
        res = train_ppo(config.build(PPOConfig, {**base, **over, "output_dir": str(out)}))
        result[name] = {"metrics": [clean(r) for r in res.metrics], "eval": jsonl(out / "eval.jsonl"),
                        "samples": jsonl(out / "samples.jsonl"), "files": hashes(out)}
        print(f"recorded {name}", file=sys.stderr)

    from ppolm.reward_train import RewardTrainConfig, train_reward
    from ppolm.sft import SFTConfig, train_sft

    demos = root / "demos.jsonl"
    demos.write_text("".join(json.dumps({"prompt": f"Question {i}: what is the code word?", "response": "banana"})
                             + "\n" for i in range(6)))
    out = root / "sft"
    rows = train_sft(config.build(SFTConfig, dict(model=str(policy), data=str(demos), output_dir=str(out), epochs=2,
                                                  batch_size=4, lr=1e-3, quiet=True, precision="fp32")))
    result["f_sft"] = {"metrics": [clean(r) for r in rows], "files": hashes(out)}
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Say something about item {i}.",
                                         "chosen": f"the cat kindly sat {i}", "rejected": f"the cat sat {i} now"})
                             + "\n" for i in range(16)))
    out = root / "reward"
    rows = train_reward(config.build(RewardTrainConfig, dict(
        model=str(policy), data=str(pairs), output_dir=str(out), epochs=2, batch_size=8, lr=3e-3, train_layers=1,
        quiet=True, precision="fp32", norm_samples=8, norm_response_length=8)))
    result["f_reward"] = {"metrics": [clean(r) for r in rows], "files": hashes(out)}
    return result


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}/{k}: only in {'recorded' if k in a else 'now'}"
            d = first_difference(a[k], b[k], f"{path}/{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items recorded, {len(b)} now"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if a != b and not (a != a and b != b):  # NaN == NaN here
        return f"{path}: {a!r} recorded, {b!r} now"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["record", "check"])
    ap.add_argument("path", type=Path)
    args = ap.parse_args()
    now = json.loads(json.dumps(record()))  # the JSON round trip the recorded file went through
    if args.mode == "record":
        args.path.write_text(json.dumps(now, indent=1, sort_keys=True))
        print(f"wrote {args.path}")
        return 0
    diff = first_difference(json.loads(args.path.read_text()), now)
    if diff:
        print(f"DIFFERENT: {diff}")
        return 1
    print("identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
