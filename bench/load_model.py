"""Time cold and warm loads of the embedded model and its tokenizer.

Cold: ``PPOLM_CACHE`` points to a fresh temp dir, so the GGUF is dequantised and cached.
Warm: the same cache, now filled. Each load runs in a fresh process (as the CLI would); the first
load call there includes transformers' lazy imports (~3 s on a slow CPU), so a second call in the
same process is timed too. ``import ppolm.models`` (torch) is reported separately.

    .venv/bin/python bench/load_model.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _stage(what: str) -> None:
    t0 = time.perf_counter()
    from ppolm import models

    imported = time.perf_counter()
    load = models.load_tokenizer if what == "tokenizer" else models.load_causal_lm
    load(models.EMBEDDED_DEFAULT)
    loaded = time.perf_counter()
    load(models.EMBEDDED_DEFAULT)  # again in the same process: no lazy transformers imports left
    print(
        json.dumps(
            {"import_s": imported - t0, "load_s": loaded - imported, "again_s": time.perf_counter() - loaded}
        )
    )


def _run(what: str, cache: str) -> dict:
    env = {**os.environ, "PPOLM_CACHE": cache, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, __file__, "--stage", what], env=env, check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--stage":
        return _stage(sys.argv[2])
    cache = tempfile.mkdtemp(prefix="ppolm-bench-")
    try:
        print(f"cache: {cache} (fresh)")
        for what in ("tokenizer", "model"):
            for label in ("cold", "warm"):
                r = _run(what, cache)
                print(
                    f"{what:9s} {label}: load {r['load_s']:6.2f} s   (then again in-process {r['again_s']:.2f} s;"
                    f" import ppolm.models {r['import_s']:.2f} s)"
                )
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
