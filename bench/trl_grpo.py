"""TRL's GRPOTrainer on one task of bench/learning_tasks.py; run with a Python that has trl installed.

    python bench/trl_grpo.py --model DIR --task exclaim --lr 5e-5 --steps 40 --out DIR

Budget as ppolm's default run: 8 completions per step (one prompt x 8 generations), at most 32
new tokens, beta 0.04, temperature 1 (TRL's defaults otherwise). Prompts: ppolm's built-in set,
as chat messages. Writes the trained model to --out, and TRL's per-step log (reward, per-token KL,
mean completion length, ...) to --out/log_history.json for bench/learning.py's reward-vs-KL table.
"""

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from learning_tasks import TASKS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--task", required=True, choices=sorted(TASKS))
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-completion-length", type=int, default=32)
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(args.seed)
    rows = [json.loads(x) for x in (HERE.parent / "ppolm" / "data" / "prompts.jsonl").read_text().splitlines()]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows])
    cfg = GRPOConfig(output_dir=args.out, learning_rate=args.lr, max_steps=args.steps, per_device_train_batch_size=8,
                     num_generations=8, max_completion_length=args.max_completion_length, beta=0.04, temperature=1.0,
                     logging_steps=1,
                     save_strategy="no", report_to=[], seed=args.seed, use_cpu=True, bf16=False,
                     gradient_accumulation_steps=1)
    t = time.perf_counter()
    trainer = GRPOTrainer(model=args.model, reward_funcs=TASKS[args.task], args=cfg, train_dataset=data)
    trainer.train()
    trainer.save_model(args.out)
    steps = [row for row in trainer.state.log_history if "reward" in row]
    (Path(args.out) / "log_history.json").write_text(json.dumps(steps, indent=1))
    print(json.dumps({"wall_s": round(time.perf_counter() - t, 1)}))


if __name__ == "__main__":
    main()
