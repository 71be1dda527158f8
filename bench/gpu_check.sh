#!/usr/bin/env bash
# One GPU check, for a lent GPU machine (no network, torch with CUDA already installed), run from
# the repository root:  bash bench/gpu_check.sh
# 1. what the machine has; 2. ppolm installed without dependencies next to its torch; 3. the fast
# test suite on CUDA (device auto picks CUDA); 4. bench/gpu_ppo.py: s/step, rollout tokens/s and
# peak GPU memory at world size 1 on a random 135M-shaped model and on the tiny model; 5. a
# 2-process torchrun PPO run over NCCL when the machine has 2 GPUs or more.
# The SmolLM2 tokenizer comes from ppolm's cache: carry .cache/ppolm/tokenizers (a few MB) with the
# working tree (PPOLM_CACHE below points there). Results go to $OUT (default /tmp/ppolm-gpu).
set -u
OUT=${OUT:-/tmp/ppolm-gpu}
mkdir -p "$OUT"
export PPOLM_CACHE=${PPOLM_CACHE:-$PWD/.cache/ppolm} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python}
{
  echo "== machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -5
  $PY - <<'PYEOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count(), "bf16", torch.cuda.is_available() and torch.cuda.is_bf16_supported())
for m in ("transformers", "peft", "accelerate", "safetensors", "datasets", "gguf", "rich", "yaml", "tensorboard",
          "matplotlib", "vaderSentiment", "numpy", "pytest"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "?"))
    except Exception as e:
        print(m, "MISSING", type(e).__name__)
PYEOF
  echo "== install (no dependencies, no network)"
  $PY -m pip install --no-deps --no-build-isolation -e . 2>&1 | tail -2
  echo "== tests on CUDA (fast suite)"
  timeout 1500 $PY -m pytest -q -x -m "not slow" -p no:cacheprovider 2>&1 | tail -25
  echo "== PPO benchmark, world size 1"
  timeout 900 $PY bench/gpu_ppo.py --model 135m,tiny --device cuda --steps 6 --batch-size 8,64 2>&1 | tail -8
  if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    echo "== torchrun, 2 GPUs (NCCL)"
    timeout 600 $PY bench/distributed.py --models tiny --steps 4 --precision bf16 2>&1 | tail -4
  fi
} 2>&1 | tee "$OUT/gpu_check.log"
