"""Crash safety: SIGKILL/SIGTERM at any step then --resume gives the same bytes as a run never
interrupted; corrupt checkpoints are skipped; NaN rewards are skipped and counted; a full disk
or a permission problem while saving is one line with the previous checkpoint intact.

The runs use a micro Llama (1 layer, hidden 16, the real SmolLM2 tokenizer) and one torch thread
so that whole subprocess runs take seconds on 2 shared cores.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ppolm import checkpoint, tracking
from ppolm.cli import main
from ppolm.tiny import build_tiny_model_dir

REWARD_FILE = '''
import math

CALLS = {"n": 0}

def length(prompts, completions, **kwargs):
    """Deterministic: longer answers score more."""
    return [min(len(c.split()), 10) / 10 + 0.01 * len(c) for c in completions]

def nan_once(prompts, completions, **kwargs):
    """NaN for every sample of the second call (step 1) only."""
    CALLS["n"] += 1
    bad = CALLS["n"] == 2
    return [math.nan if bad else 0.1 * len(c.split()) for c in completions]
'''

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("micro"), kind="causal", seed=0, num_layers=1,
                                hidden_size=16, heads=2, kv_heads=1, intermediate_size=32)


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("rewards") / "rewards.py"
    p.write_text(REWARD_FILE)
    return p


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def ppo_args(model, reward, out, *, steps=6, fn="length", extra=()):
    return ["ppo", "--model", str(model), "--reward-fn", f"{reward}:{fn}", "--steps", str(steps),
            "--batch-size", "4", "--minibatches", "2", "--ppo-epochs", "2", "--response-length", "8",
            "--precision", "fp32", "--device", "cpu", "--save-every", "1", "--keep-last", "2",
            "--sample-every", "1", "--lr-schedule", "linear", "--quiet", "--output-dir", str(out), *extra]


def cli(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "ppolm.cli", *args]


def rows_without_time(path: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in tracking.read_jsonl(path)]


def n_rows(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except FileNotFoundError:
        return 0


def run_until(args: list[str], metrics: Path, rows: int, sig: int, timeout: float = 120) -> subprocess.Popen:
    """Start a run, send ``sig`` once metrics.jsonl has ``rows`` rows, and wait for it to end."""
    t_start = time.time_ns()
    proc = subprocess.Popen(cli(args), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    # rows written by this process (a resumed run first cuts the file back to its checkpoint)
    while n_rows(metrics) < rows or metrics.stat().st_mtime_ns < t_start:
        assert proc.poll() is None, f"run ended before {rows} rows: {proc.communicate()}"
        assert time.monotonic() - t0 < timeout, "run too slow"
        time.sleep(0.01)
    proc.send_signal(sig)
    proc.out, proc.err = proc.communicate(timeout=timeout)
    return proc


def assert_checkpoints_valid(root: Path) -> None:
    for path in checkpoint.list_checkpoints(root):
        assert checkpoint.verify(path) is None, path
        assert sorted(f.name for f in path.iterdir()) == ["manifest.json", "state.json", "tensors.safetensors"]


def test_sigkill_and_sigterm_then_resume_is_bit_identical(micro_dir, reward_file, tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    done = subprocess.run(cli(ppo_args(micro_dir, reward_file, full)), env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr

    # 1. SIGKILL once 2 rows are written (mid-step or mid-checkpoint), then resume...
    killed = run_until(ppo_args(micro_dir, reward_file, cut), cut / "metrics.jsonl", 2, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    assert_checkpoints_valid(cut / "checkpoints")
    # 2. ...SIGKILL the resumed run after 3 rows...
    killed = run_until(ppo_args(micro_dir, reward_file, cut, extra=["--resume"]), cut / "metrics.jsonl", 3,
                       signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL and "resuming from" in killed.err
    assert_checkpoints_valid(cut / "checkpoints")
    # 3. ...SIGTERM the next one after 4 rows: it finishes that step, saves, exits 130...
    termed = run_until(ppo_args(micro_dir, reward_file, cut, extra=["--resume"]), cut / "metrics.jsonl", 4,
                       signal.SIGTERM)
    assert termed.returncode == 130, termed.err
    assert "checkpoint saved" in termed.err and "Traceback" not in termed.err
    stopped_at = json.loads(next(reversed(checkpoint.list_checkpoints(cut / "checkpoints"))).joinpath(
        "state.json").read_text())["next_step"]
    assert stopped_at == n_rows(cut / "metrics.jsonl") and not (cut / "policy").exists()
    # 4. ...and the last resume finishes.
    last = subprocess.run(cli(ppo_args(micro_dir, reward_file, cut, extra=["--resume"])), env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert last.returncode == 0, last.stderr

    for f in ("policy/model.safetensors", "critic/model.safetensors"):
        assert (full / f).read_bytes() == (cut / f).read_bytes(), f
    a, b = rows_without_time(full / "metrics.jsonl"), rows_without_time(cut / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(6))  # appended, never duplicated
    assert a == b
    assert tracking.read_jsonl(full / "samples.jsonl") == tracking.read_jsonl(cut / "samples.jsonl")
    assert_checkpoints_valid(cut / "checkpoints")
    assert not list((cut / "checkpoints").glob(".tmp-*"))
    assert [p.name for p in checkpoint.list_checkpoints(cut / "checkpoints")] == ["step-000005", "step-000006"]


def test_truncated_checkpoint_is_skipped_on_resume(micro_dir, reward_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = ppo_args(micro_dir, reward_file, out, steps=3) + ["--keep-last", "3"]
    assert main(args) == 0
    policy = (out / "policy" / "model.safetensors").read_bytes()
    rows = rows_without_time(out / "metrics.jsonl")
    newest = out / "checkpoints" / "step-000003" / "tensors.safetensors"
    with open(newest, "r+b") as f:  # a crash mid-write, or a disk that lost the end of the file
        f.truncate(newest.stat().st_size // 2)
    (out / "checkpoints" / ".tmp-step-000004-999").mkdir()  # debris of a process killed while saving
    capsys.readouterr()

    assert main(args + ["--resume"]) == 0
    err = capsys.readouterr().err
    assert "skipping corrupt checkpoint step-000003: tensors.safetensors has" in err
    assert "resuming from" in err and "step-000002 (step 2)" in err
    assert rows_without_time(out / "metrics.jsonl") == rows  # step 2 redone, not duplicated
    assert (out / "policy" / "model.safetensors").read_bytes() == policy  # redone bit for bit
    assert_checkpoints_valid(out / "checkpoints")
    assert not list((out / "checkpoints").glob(".tmp-*"))

    # every checkpoint corrupt: a warning each, then a fresh start (still no traceback)
    for path in checkpoint.list_checkpoints(out / "checkpoints"):
        (path / "manifest.json").write_text("{")
    assert main(args + ["--resume"]) == 0
    err = capsys.readouterr().err
    assert err.count("skipping corrupt checkpoint") == 3 and "starting from step 0" in err
    assert (out / "policy" / "model.safetensors").read_bytes() == policy


def test_nan_reward_at_one_step_is_skipped_and_counted(micro_dir, reward_file, tmp_path, capsys):
    out = tmp_path / "run"
    # (no floor under beta, so that it moves after every update: the first step's KL of 0 lowers it)
    args = ppo_args(micro_dir, reward_file, out, steps=4, fn="nan_once") + ["--keep-last", "9", "--kl-coef-min", "0"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert err.count("warning: step 1: non-finite reward (NaN/inf) from nan_once; update skipped") == 1
    rows = tracking.read_jsonl(out / "metrics.jsonl")
    assert [r["guard/skipped_updates"] for r in rows] == [0, 1, 1, 1]
    assert rows[1]["objective/scores"] is None and rows[1]["ppo/epochs"] == 0
    # the adaptive KL coefficient moves after an update, and stays put after a skipped one
    beta = [r["objective/kl_coef"] for r in rows]
    assert beta[1] != beta[0] and beta[2] == beta[1] and beta[3] != beta[2]
    # the skipped step left the weights exactly as they were; the others moved them
    w = [load_file(str(out / "checkpoints" / f"step-{i:06d}" / "tensors.safetensors")) for i in (1, 2, 3)]
    key = next(k for k in w[0] if k.startswith("policy.") and "embed" in k)
    assert torch.equal(w[0][key], w[1][key]) and not torch.equal(w[1][key], w[2][key])
    final = load_file(str(out / "policy" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in final.values())


def test_inf_reward_every_step_aborts_without_saving_non_finite(micro_dir, tmp_path, capsys):
    """Finite on the first batch (which checks the wiring), infinite on every later one."""
    reward = tmp_path / "nan.py"
    reward.write_text("CALLS = [0]\n\ndef nan(prompts, completions, **kw):\n    CALLS[0] += 1\n"
                      "    return [float('inf') if CALLS[0] > 1 else 1.0] * len(completions)\n")
    out = tmp_path / "run"
    assert main(ppo_args(micro_dir, reward, out, steps=6, fn="nan") + ["--max-skipped-updates", "2"]) == 2
    err = capsys.readouterr().err
    assert "error: 2 consecutive updates skipped (last at step 2: non-finite reward (NaN/inf) from nan)" in err
    assert err.count("warning:") == 1 and "Traceback" not in err
    assert not (out / "policy").exists()
    assert [r["guard/skipped_updates"] for r in tracking.read_jsonl(out / "metrics.jsonl")] == [0, 1, 2]
    for path in checkpoint.list_checkpoints(out / "checkpoints"):  # only finite weights, from before
        assert all(torch.isfinite(t).all() for t in load_file(str(path / "tensors.safetensors")).values())


def test_nan_reward_on_every_step_of_a_short_run_is_one_error(micro_dir, tmp_path, capsys):
    """A reward that is NaN on every step fails on its first batch, as a reward service does: one
    error line, nothing written (not a summary of a run that never trained)."""
    reward = tmp_path / "nan.py"
    reward.write_text("def nan(prompts, completions, **kw):\n    return [float('nan')] * len(completions)\n")
    out = tmp_path / "run"
    assert main(ppo_args(micro_dir, reward, out, steps=2, fn="nan")) == 2
    err = capsys.readouterr().err
    assert "error: reward function 'nan' returned nan for completion 0 of its first batch" in err
    assert "Traceback" not in err and not out.exists()


def test_a_skipped_last_step_still_prints_the_summary(micro_dir, tmp_path, capsys):
    """The last step's score is null in metrics.jsonl when its update was skipped."""
    reward = tmp_path / "late_nan.py"
    reward.write_text("CALLS = [0]\n\ndef late_nan(prompts, completions, **kw):\n    CALLS[0] += 1\n"
                      "    return [float('nan') if CALLS[0] == 2 else 1.0] * len(completions)\n")
    assert main(ppo_args(micro_dir, reward, tmp_path / "run", steps=2, fn="late_nan")) == 0
    out, err = capsys.readouterr()
    assert "done: 2 steps, final score n/a (update skipped), KL " in out and "Traceback" not in err


@pytest.mark.parametrize("over", [["--lora-r", "4"], ["--critic", "shared", "--kl-in", "loss", "--entropy-coef", "0.01"]],
                         ids=["lora", "shared-critic"])
def test_stop_and_resume_variants_are_bit_identical(micro_dir, reward_file, tmp_path, over):
    """LoRA (frozen base, adapter state) and a value head on the policy trunk resume exactly too."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(ppo_args(micro_dir, reward_file, a, steps=3) + ["--lr-schedule", "constant", *over]) == 0
    assert main(ppo_args(micro_dir, reward_file, b, steps=2) + ["--lr-schedule", "constant", *over]) == 0
    assert main(ppo_args(micro_dir, reward_file, b, steps=3) + ["--lr-schedule", "constant", "--resume", *over]) == 0
    files = [f.relative_to(a) for f in sorted(a.rglob("*.safetensors")) if "checkpoints" not in f.parts]
    assert len(files) >= 2
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert rows_without_time(a / "metrics.jsonl") == rows_without_time(b / "metrics.jsonl")


def test_resume_refuses_other_steps_under_a_linear_schedule(micro_dir, reward_file, tmp_path, capsys):
    """--lr-schedule linear decays to 0 over --steps, so more steps on --resume would change the
    learning rate of the steps already taken; with a constant schedule extending a run stays allowed
    (test_stop_and_resume_variants_are_bit_identical)."""
    out = tmp_path / "run"
    assert main(ppo_args(micro_dir, reward_file, out, steps=2)) == 0  # ppo_args: --lr-schedule linear
    capsys.readouterr()
    # each step's learning rate is the base one times 1 - step / steps (2e-5 and the critic's 1e-4 by
    # default): full at step 0, half at step 1
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["lr"], r["lr/critic"]) for r in rows] == [pytest.approx((2e-5, 1e-4)), pytest.approx((1e-5, 5e-5))]
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(ppo_args(micro_dir, reward_file, out, steps=3, extra=["--resume"])) == 2
    err = capsys.readouterr().err
    assert ("error: --steps changed from 2 to 3 but the linear learning-rate schedule decays over --steps; "
            "resume with --steps 2 (a run with --lr-schedule constant can be extended)") in err
    assert "Traceback" not in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert main(ppo_args(micro_dir, reward_file, out, steps=2, extra=["--resume"])) == 0  # same steps: fine


def test_a_run_saved_without_a_ceiling_on_beta_resumes_with_kl_coef_max_inf(micro_dir, reward_file, tmp_path,
                                                                             capsys):
    """A run whose config.yaml says kl_coef_max: null was saved when that meant no ceiling on beta.
    Resumed with today's default (a ceiling) it is refused with the difference named; with
    --kl-coef-max inf, the same controller as then, it continues."""
    out = tmp_path / "run"
    extra = ["--lr-schedule", "constant"]
    assert main(ppo_args(micro_dir, reward_file, out, steps=1, extra=extra)) == 0
    saved = out / "config.yaml"
    text = saved.read_text()
    assert "kl_coef_max: 0.04" in text
    saved.write_text(text.replace("kl_coef_max: 0.04", "kl_coef_max: null"))
    capsys.readouterr()
    assert main(ppo_args(micro_dir, reward_file, out, steps=2, extra=extra + ["--resume"])) == 2
    assert "(kl_coef_max: inf then, 0.04 now)" in capsys.readouterr().err
    assert main(ppo_args(micro_dir, reward_file, out, steps=2, extra=extra + ["--resume", "--kl-coef-max", "inf"])) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_checkpoint_refuses_non_finite_tensors(tmp_path):
    root = tmp_path / "ckpt"
    checkpoint.save(root, 1, {"w": torch.ones(3)}, {"x": 1}, keep_last=2)
    with pytest.raises(Exception, match=r"non-finite values in w \(step 2\)"):
        checkpoint.save(root, 2, {"w": torch.tensor([1.0, float("inf")])}, {"x": 2}, keep_last=2)
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step-000001"]
    assert checkpoint.load_latest(root)[2]["x"] == 1


@pytest.mark.parametrize("raised", ["oserror", "safetensors"])
def test_disk_full_or_denied_while_saving_keeps_previous_checkpoint(micro_dir, reward_file, tmp_path, capsys,
                                                                    monkeypatch, raised):
    """A full disk while a checkpoint is written is one line, whether it arrives as an OSError or,
    as the safetensors library raises it, as its own SafetensorError naming the OS error."""
    import safetensors
    import safetensors.torch

    import ppolm.models

    real, calls = safetensors.torch.save_file, {"n": 0}

    def full_disk(tensors, filename, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:  # the third checkpoint
            if raised == "safetensors":
                raise safetensors.SafetensorError(
                    f"Error while serializing: I/O error: {os.strerror(errno.ENOSPC)} (os error {errno.ENOSPC})")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real(tensors, filename, *a, **k)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    out = tmp_path / "run"
    # a constant learning rate, so that the run can be extended below
    args = ppo_args(micro_dir, reward_file, out, steps=4) + ["--keep-last", "5", "--lr-schedule", "constant"]
    assert main(args) == 2
    err_text = capsys.readouterr().err
    lines = [ln for ln in err_text.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "no space left on the device while writing checkpoint step-000003" in lines[0]
    assert "previous checkpoint is intact" in lines[0] and "Traceback" not in err_text
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["step-000001", "step-000002"]
    assert_checkpoints_valid(out / "checkpoints")
    assert not list((out / "checkpoints").glob(".tmp-*"))

    # space freed: --resume finishes from step-000002
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert main(args + ["--resume"]) == 0
    assert [r["step"] for r in tracking.read_jsonl(out / "metrics.jsonl")] == [0, 1, 2, 3]
    before = (out / "policy" / "model.safetensors").read_bytes()

    # the final save denied: one line; the checkpoints and the previous policy/ untouched
    def denied(model, tok, path):
        if raised == "safetensors":  # as transformers' save_pretrained passes it on from safetensors
            raise safetensors.SafetensorError(f"Error while serializing: I/O error: {os.strerror(errno.ENOSPC)} "
                                              f"(os error {errno.ENOSPC})")
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(ppolm.models, "save_pretrained", denied)
    capsys.readouterr()
    assert main(ppo_args(micro_dir, reward_file, out, steps=5) + ["--keep-last", "5", "--lr-schedule", "constant",
                                                                 "--resume"]) == 2
    err_text = capsys.readouterr().err
    why = "no space left on the device" if raised == "safetensors" else "permission denied"
    assert f"error: {why} while writing the final policy/critic" in err_text
    assert "Traceback" not in err_text
    assert (out / "policy" / "model.safetensors").read_bytes() == before
    assert "step-000005" in [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")]
    assert not list(out.glob(".tmp-*"))


def test_checkpoints_hold_no_pickle_and_full_state(micro_dir, reward_file, tmp_path):
    out = tmp_path / "run"
    assert main(ppo_args(micro_dir, reward_file, out, steps=1)) == 0
    ck = out / "checkpoints" / "step-000001"
    state = json.loads((ck / "state.json").read_text())
    assert {"next_step", "kl_ctl", "actor_opt", "critic_opt", "actor_sched", "critic_sched", "rng",
            "skipped_total", "consecutive_skips"} <= set(state)
    assert {"python", "numpy"} <= set(state["rng"])
    tensors = load_file(str(ck / "tensors.safetensors"))
    assert "rng.torch" in tensors and any(k.startswith("actor_opt.") for k in tensors)
    assert any(k.startswith("critic_opt.") for k in tensors)
    for f in out.rglob("*"):
        assert f.suffix not in (".bin", ".pt", ".pkl", ".pth"), f


def test_resume_takes_other_spellings_of_the_same_paths_and_a_moved_run(micro_dir, reward_file, tmp_path,
                                                                        monkeypatch):
    """The model and reward file given relative then absolute, the output directory with a trailing
    slash and then moved elsewhere: the same run, so --resume continues it; another model is refused."""
    monkeypatch.chdir(tmp_path)
    os.symlink(micro_dir, tmp_path / "model")
    (tmp_path / "rewards.py").write_text(REWARD_FILE)
    args = dict(steps=1, extra=("--lr-schedule", "constant"))
    assert main(ppo_args("model", "rewards.py", "run", **args)) == 0
    args = dict(steps=2, extra=("--lr-schedule", "constant", "--resume"))
    assert main(ppo_args(tmp_path / "model", tmp_path / "rewards.py", str(tmp_path / "run") + "/", **args)) == 0
    os.rename(tmp_path / "run", tmp_path / "moved")
    args = dict(steps=3, extra=("--lr-schedule", "constant", "--resume"))
    assert main(ppo_args(micro_dir, "rewards.py", "moved", **args)) == 0
    assert [r["step"] for r in tracking.read_jsonl(tmp_path / "moved" / "metrics.jsonl")] == [0, 1, 2]
    other = build_tiny_model_dir(tmp_path / "other", kind="causal", seed=1, num_layers=1, hidden_size=16, heads=2,
                                 kv_heads=1, intermediate_size=32)
    args = dict(steps=4, extra=("--lr-schedule", "constant", "--resume"))
    assert main(ppo_args(other, "rewards.py", "moved", **args)) == 2
