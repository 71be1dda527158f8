"""ppolm.memory: the peak memory of each phase of a step, checked against allocations of known size
and against the kernel's own counters; and the memory/* metrics of a real PPO run."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")

MB = 1e6


def in_fresh_process(code: str) -> dict:
    """Run ``code`` (which prints one JSON object) in a new Python: the allocations below must
    raise the resident set, which a long-lived process could serve from memory it freed earlier
    and kept (glibc keeps freed heap pages; how much depends on what ran before)."""
    import json
    import subprocess

    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@linux
def test_rss_is_the_kernels_resident_set():
    # statm's resident pages times the page size is VmRSS (KiB) of /proc/self/status
    got = in_fresh_process("""
        import gc, json, torch
        from ppolm import memory

        def status_kb(field):
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":"))

        before = memory.rss_bytes()
        vm = status_kb("VmRSS") * 1024
        x = torch.ones(50_000_000)  # 200 MB, written, hence resident
        grown = memory.rss_bytes() - before
        del x
        gc.collect()
        print(json.dumps(dict(before=before, vm=vm, grown=grown, after=memory.rss_bytes() - before,
                              max_rss=memory.max_rss_bytes(), hwm=status_kb("VmHWM") * 1024)))
    """)
    assert abs(got["before"] - got["vm"]) < 8 * MB
    assert 190 * MB < got["grown"] < 230 * MB
    assert got["after"] < 40 * MB  # a fresh process hands a freed 200 MB block back at once (mmap)
    assert got["max_rss"] >= got["hwm"] - 8 * MB


@linux
def test_each_phase_gets_its_own_peak():
    got = in_fresh_process("""
        import gc, json, time, torch
        from ppolm import memory

        peaks = memory.PhasePeaks("cpu", interval=0.002)
        peaks.start()
        # phase 0 holds 300 MB for 0.1 s, then frees it before its end: only sampling can see it
        x = torch.ones(75_000_000)
        time.sleep(0.1)
        del x
        gc.collect()
        peaks.mark()
        # phase 1 allocates nothing; phase 2 holds 100 MB at its end (read at the boundary)
        time.sleep(0.02)
        peaks.mark()
        y = torch.ones(25_000_000)
        peaks.mark()
        peaks.stop()
        m = peaks.metrics()
        del y
        print(json.dumps(dict(host=peaks.host, start=peaks.start_rss, m=m, cpu=peaks.sampler_cpu_s,
                              max_after=memory.max_rss_bytes())))
    """)
    held, m = got["start"], got["m"]
    p0, p1, p2 = (p - held for p in got["host"])
    assert 290 * MB < p0 < 340 * MB
    assert p1 < 40 * MB
    assert 95 * MB < p2 < 140 * MB
    assert m["memory/rss_rollout_gb"] == got["host"][0] / 1e9
    assert m["memory/rss_score_gb"] == got["host"][1] / 1e9
    assert m["memory/rss_train_gb"] == got["host"][2] / 1e9
    assert m["memory/rss_peak_gb"] == max(got["host"]) / 1e9 == m["memory/rss_rollout_gb"]
    assert m["memory/rss_start_gb"] == held / 1e9
    assert abs(m["memory/rss_floor_gb"] - held / 1e9) < 0.04 and m["memory/rss_floor_gb"] <= min(got["host"]) / 1e9
    # (the kernel updates its high-water mark lazily: a few hundred KB behind the sampled RSS at times)
    assert m["memory/rss_max_gb"] >= m["memory/rss_peak_gb"] - 0.008
    assert not any(k.startswith("memory/gpu") for k in m)  # no GPU here
    assert 0 <= got["cpu"] < 0.2
    # sampling does not lower what getrusage and /usr/bin/time report as the process's peak
    assert got["max_after"] >= held + 290 * MB


def test_a_ppo_run_logs_its_memory(tiny_policy_dir, tmp_path):
    from ppolm import config
    from ppolm.ppo import train_ppo
    from ppolm.ppo_config import PPOConfig

    rewards = tmp_path / "r.py"
    rewards.write_text("def n(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    cfg = config.build(PPOConfig, dict(model=str(tiny_policy_dir), reward_fn=[f"{rewards}:n"], steps=2,
                                       batch_size=4, response_length=6, output_dir=str(tmp_path / "run"),
                                       quiet=True, precision="fp32"))
    rows = train_ppo(cfg).metrics
    for row in rows:
        assert row["memory/rss_max_gb"] > 0
        if sys.platform.startswith("linux"):
            phases = [row[f"memory/rss_{p}_gb"] for p in ("rollout", "score", "train")]
            assert row["memory/rss_peak_gb"] == max(phases)
            assert 0 < row["memory/rss_start_gb"] <= row["memory/rss_peak_gb"] <= row["memory/rss_max_gb"] + 0.008
            assert 0 < row["memory/rss_floor_gb"] <= min(phases)
        if torch.cuda.is_available():  # (bench/gpu_check.sh runs this file on a GPU)
            phases = [row[f"memory/gpu_{p}_gb"] for p in ("rollout", "score", "train")]
            assert 0 < row["memory/gpu_peak_gb"] == max(phases) <= row["memory/gpu_reserved_gb"]
