"""Does bf16 learn as much as fp32? The slow test's task on the embedded model, once per precision.

Task: answer "write one sentence about ..." prompts concisely; reward 1 - min(words, 40) / 40
(tests/test_slow.py). Same seed, same config; prints each precision's training-batch score per
step, the held-out reward before and after (with standard errors), the final KL and wall time.

    python bench/precision_parity.py [--steps 8] [--precisions fp32,bf16] [--seeds 0,1,2]

bf16 is emulated (slow) on CPUs without AVX512-BF16/AMX: read /proc/cpuinfo before comparing times.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_slow import HELD_OUT, REWARD  # noqa: E402  (the slow test's task, one definition)

from ppolm import config  # noqa: E402
from ppolm.ppo import train_ppo  # noqa: E402
from ppolm.ppo_config import PPOConfig  # noqa: E402


def run(precision: str, steps: int, tmp: Path, seed: int) -> dict:
    out = tmp / f"{precision}-{seed}"
    cfg = config.build(PPOConfig, dict(reward_fn=[f"{tmp / 'r.py'}:concise"], steps=steps, response_length=40,
                                       critic="shared", ppo_epochs=2, minibatches=1, actor_lr=1e-4,
                                       eval_prompts=str(tmp / "held.txt"), eval_every=steps, precision=precision, seed=seed,
                                       output_dir=str(out), quiet=True, save_every=1000, overwrite=True))
    t = time.perf_counter()
    result = train_ppo(cfg)
    wall = time.perf_counter() - t
    ev = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    return {"precision": precision, "seed": seed, "wall_s": round(wall, 1),
            "train_scores": [round(r["objective/scores"], 3) for r in result.metrics],
            "kl": [round(r["objective/kl"], 3) for r in result.metrics],
            "sampler_gap": [round(r["policy/sampler_logprob_gap"], 4) for r in result.metrics],
            "heldout_before": (round(ev[0]["eval/concise"], 3), round(ev[0]["eval/concise_se"], 3)),
            "heldout_after": (round(ev[-1]["eval/concise"], 3), round(ev[-1]["eval/concise_se"], 3)),
            "heldout_kl_after": round(ev[-1]["eval/kl"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--seeds", default="0", help="comma-separated; one run per precision and seed")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "r.py").write_text(REWARD)
        (tmp / "held.txt").write_text("\n".join(HELD_OUT) + "\n")
        for seed in (int(x) for x in args.seeds.split(",")):
            for p in args.precisions.split(","):
                r = run(p, args.steps, tmp, seed)
                gain = r["heldout_after"][0] - r["heldout_before"][0]
                print(json.dumps({**r, "heldout_gain": round(gain, 3)}), flush=True)


if __name__ == "__main__":
    main()
