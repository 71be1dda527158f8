"""Worker for tests/test_distributed.py, launched by torchrun (or alone, as one process).

    python -m torch.distributed.run --nproc-per-node N tests/dist_worker.py SPEC.json

SPEC.json: {"rollout": FILE, "out": DIR, "cases": [{"name": ..., "cfg": {...}}, ...]}. For each case
every process builds a PPOTrainer from the flat config, takes its share of the rows of the fixed
rollout in FILE (process r of N: rows r*B/N .. (r+1)*B/N - 1, whole prompt groups) and runs one
PPO step on them (no sampling); process 0 writes DIR/<name>-w<N>.safetensors (the trained
parameters after the update) and DIR/<name>-w<N>.json (the step's metrics).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def main(spec_path: str) -> None:
    from ppolm import config, distributed
    from ppolm import rollout as ro
    from ppolm.data import Prompt
    from ppolm.ppo_config import PPOConfig
    from ppolm.ppo_trainer import PPOTrainer

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    saved = torch.load(spec["rollout"], weights_only=False)
    out = Path(spec["out"])
    for case in spec["cases"]:
        world = distributed.launched_world_size()
        cfg = config.build(PPOConfig, {**case["cfg"], "output_dir": str(out / f"{case['name']}-run-w{world}")})
        trainer = PPOTrainer(cfg)
        b = len(saved["prompts"])
        lo, hi = trainer.rank * b // trainer.world, (trainer.rank + 1) * b // trainer.world
        idx = torch.arange(lo, hi)
        prompts = [Prompt(*p) for p in saved["prompts"][lo:hi]]
        r = saved["roll"]
        roll = ro.Rollout(r["query"][idx], r["query_mask"][idx], r["response"][idx], r["response_mask"][idx],
                          r["ended"][idx], sample_logprobs=r["sample_logprobs"][idx])
        metrics, _ = trainer.step(0, given=(prompts, roll))
        # (--fsdp: every process takes part in gathering the shards)
        tensors = {n: distributed.full(p).detach().float().contiguous().clone() for n, p in trainer.trained_parameters()}
        if distributed.is_main():
            save_file(tensors, str(out / f"{case['name']}-w{world}.safetensors"))
            (out / f"{case['name']}-w{world}.json").write_text(json.dumps(
                {"beta": trainer.state.kl_ctl.value, "metrics": metrics}))
        distributed.barrier()
        del trainer  # (freed here, while the process group is alive)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
