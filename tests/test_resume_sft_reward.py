"""Crash safety of ``ppolm sft`` and ``ppolm reward``, as tests/test_resume.py checks ``ppolm ppo``.

SIGKILL (a real process) then SIGINT/SIGTERM (delivered to this process while it trains) then
--resume ends with the same model.safetensors bytes and the same metrics.jsonl rows as a run never
interrupted; corrupt checkpoints are skipped; a NaN loss is skipped and counted; a full disk or a
read-only checkpoint directory is one line with the previous checkpoint intact.

The runs use a micro Llama (1 layer, hidden 16, the real SmolLM2 tokenizer) and one torch thread.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ppolm import checkpoint, tracking
from ppolm.cli import main
from ppolm.tiny import build_tiny_model_dir

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONUNBUFFERED": "1"}
WORDS = "red green blue cyan pink gold grey lime teal navy plum rose sand jade ruby mint".split()

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_rm")
    micro = build_tiny_model_dir(root / "micro", kind="causal", seed=0, num_layers=1, hidden_size=16, heads=2,
                                 kv_heads=1, intermediate_size=32)
    return {
        "model": micro,
        "demos": write_jsonl(root / "demos.jsonl", [{"prompt": f"Name colour {i}.", "response": w}
                                                    for i, w in enumerate(WORDS)]),
        "held_demos": write_jsonl(root / "held_demos.jsonl", [{"prompt": f"Name colour {i}?", "response": w}
                                                              for i, w in enumerate(WORDS[:4])]),
        "pairs": write_jsonl(root / "pairs.jsonl", [{"prompt": f"Say something {i}.", "chosen": f"kindly {w}",
                                                     "rejected": f"the {w}"} for i, w in enumerate(WORDS)]),
        "held_pairs": write_jsonl(root / "held_pairs.jsonl", [{"prompt": f"Say it {i}.", "chosen": f"{w} kindly",
                                                               "rejected": f"{w} now"} for i, w in enumerate(WORDS[:4])]),
    }


def args_for(command: str, files: dict, out: Path, *, epochs: int = 3, data: Path | None = None,
             extra: tuple | list = ()) -> list[str]:
    """16 rows, batch 2: 8 optimiser steps per epoch, a checkpoint after each."""
    common = ["--model", str(files["model"]), "--epochs", str(epochs), "--batch-size", "2", "--precision", "fp32",
              "--device", "cpu", "--save-every", "1", "--keep-last", "2", "--quiet", "--output-dir", str(out)]
    if command == "sft":
        return ["sft", "--data", str(data or files["demos"]), "--eval-data", str(files["held_demos"]),
                "--lr", "1e-2", *common, *extra]
    return ["reward", "--data", str(data or files["pairs"]), "--eval-data", str(files["held_pairs"]), "--lr", "1e-2",
            "--train-layers", "1", "--no-normalize", *common, *extra]


def rows_without_time(path: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("time_s", "tokens_per_s")} for r in tracking.read_jsonl(path)]


def newest_step(root: Path) -> int:
    try:
        return max((int(p.name.removeprefix(checkpoint.PREFIX)) for p in checkpoint.list_checkpoints(root)), default=0)
    except (FileNotFoundError, ValueError):  # a directory renamed or removed while listing
        return -1


def assert_checkpoints_valid(root: Path) -> None:
    for path in checkpoint.list_checkpoints(root):
        assert checkpoint.verify(path) is None, path
        assert sorted(f.name for f in path.iterdir()) == ["manifest.json", "state.json", "tensors.safetensors"]


def kill_at(args: list[str], ckpts: Path, step: int, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``ppolm`` as a process and SIGKILL it once checkpoint ``step`` (or a later one) exists."""
    proc = subprocess.Popen([sys.executable, "-m", "ppolm.cli", *args], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while newest_step(ckpts) < step:
        assert proc.poll() is None, f"run ended before checkpoint {step}: {proc.communicate()}"
        assert time.monotonic() - t0 < timeout, "run too slow"
        time.sleep(0.002)
    proc.kill()
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def signal_at(ckpts: Path, step: int, sig: int) -> threading.Thread:
    """Send ``sig`` to this process once checkpoint ``step`` exists, while a run's handler is installed."""
    def watch() -> None:
        t0 = time.monotonic()
        while newest_step(ckpts) < step and time.monotonic() - t0 < 120:
            time.sleep(0.001)
        if getattr(signal.getsignal(sig), "__name__", "") == "on_signal":  # the run's handler, not pytest's
            os.kill(os.getpid(), sig)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("command, sig", [("sft", signal.SIGINT), ("reward", signal.SIGTERM)])
def test_kill_then_signal_then_resume_is_bit_identical(files, tmp_path, capsys, command, sig):
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(args_for(command, files, full)) == 0
    capsys.readouterr()

    # 1. SIGKILL a real process after 4 of its 24 updates (mid-step or mid-checkpoint)...
    killed = kill_at(args_for(command, files, cut), cut / "checkpoints", 4)
    assert killed.returncode == -signal.SIGKILL
    assert_checkpoints_valid(cut / "checkpoints")
    at_kill = newest_step(cut / "checkpoints")
    assert 4 <= at_kill < 24 and not (cut / "model.safetensors").exists()

    # 2. ...resume it, and Ctrl-C / SIGTERM it 5 updates later: it finishes the update, saves, exits 130...
    watcher = signal_at(cut / "checkpoints", at_kill + 5, sig)
    assert main(args_for(command, files, cut, extra=["--resume"])) == 130
    watcher.join()
    err = capsys.readouterr().err
    assert f"resuming from {cut / 'checkpoints' / f'step-{at_kill:06d}'} (step {at_kill})" in err
    assert "stopping after this step to save a checkpoint" in err
    assert "checkpoint saved. Continue with the same command plus --resume" in err and "Traceback" not in err
    stopped = newest_step(cut / "checkpoints")
    assert at_kill + 5 <= stopped < 24 and not (cut / "model.safetensors").exists()
    state = json.loads((cut / "checkpoints" / f"step-{stopped:06d}" / "state.json").read_text())
    assert state["next_step"] == stopped and state["epochs_done"] == stopped // 8
    assert rows_without_time(cut / "metrics.jsonl") == [{k: v for k, v in r.items() if k not in ("time_s", "tokens_per_s")}
                                                        for r in state["rows"]]
    assert [r["epoch"] for r in state["rows"]] == list(range(stopped // 8 + 1))

    # 3. ...and the last resume finishes with the same bytes and rows as the uninterrupted run.
    assert main(args_for(command, files, cut, extra=["--resume"])) == 0
    assert (full / "model.safetensors").read_bytes() == (cut / "model.safetensors").read_bytes()
    a, b = rows_without_time(full / "metrics.jsonl"), rows_without_time(cut / "metrics.jsonl")
    assert [r["epoch"] for r in b] == [0, 1, 2, 3]  # appended, never duplicated
    assert a == b
    assert a[-1]["eval_loss"] < a[0]["eval_loss"]  # it learned something (so equal bytes mean something)
    assert_checkpoints_valid(cut / "checkpoints")
    assert [p.name for p in checkpoint.list_checkpoints(cut / "checkpoints")] == ["step-000023", "step-000024"]
    assert not list(cut.rglob(".tmp-*"))


@pytest.mark.parametrize("command, over", [("sft", ["--lora-r", "4"]), ("reward", ["--lora-r", "4"]),
                                           ("reward", ["--train-layers", "-1", "--center-coef", "0.1"])],
                         ids=["sft-lora", "reward-lora", "reward-all-layers"])
def test_resume_variants_and_more_epochs_are_bit_identical(files, tmp_path, command, over):
    """LoRA adapters (and peft's copy of the reward head), every layer trained, and a run extended by
    one epoch with --resume: the same bytes as one run (constant learning rate, so the total may grow)."""
    a, b = tmp_path / "a", tmp_path / "b"
    extra = ["--lr-schedule", "constant", *over]
    assert main(args_for(command, files, a, epochs=2, extra=extra)) == 0
    assert main(args_for(command, files, b, epochs=1, extra=extra)) == 0
    assert main(args_for(command, files, b, epochs=2, extra=[*extra, "--resume"])) == 0
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert rows_without_time(a / "metrics.jsonl") == rows_without_time(b / "metrics.jsonl")
    ck = load_file(str(b / "checkpoints" / "step-000016" / "tensors.safetensors"))
    trained = {k for k in ck if k.startswith("model.")}
    if "--lora-r" in over:  # only what is trained is checkpointed: adapters (and the reward head)
        assert trained and all("lora_" in k or "score" in k for k in trained)
    assert any(k.startswith("opt.") for k in ck) and "rng.torch" in ck


def test_corrupt_checkpoint_is_skipped_and_the_step_redone(files, tmp_path, capsys):
    out = tmp_path / "run"
    args = args_for("sft", files, out, epochs=1, extra=["--keep-last", "3"])
    assert main(args) == 0
    model = (out / "model.safetensors").read_bytes()
    rows = rows_without_time(out / "metrics.jsonl")
    newest = out / "checkpoints" / "step-000008" / "tensors.safetensors"
    with open(newest, "r+b") as f:  # a disk that lost the end of the file
        f.truncate(newest.stat().st_size // 2)
    (out / "checkpoints" / ".tmp-step-000009-999").mkdir()  # debris of a process killed while saving
    capsys.readouterr()
    assert main(args + ["--resume"]) == 0
    err = capsys.readouterr().err
    assert "warning: skipping corrupt checkpoint step-000008: tensors.safetensors has" in err
    assert "step-000007 (step 7)" in err
    assert rows_without_time(out / "metrics.jsonl") == rows  # the epoch row redone, not duplicated
    assert (out / "model.safetensors").read_bytes() == model
    assert_checkpoints_valid(out / "checkpoints")
    assert not list((out / "checkpoints").glob(".tmp-*"))


def test_nan_margin_skips_one_update_and_the_run_finishes(files, tmp_path, capsys):
    """A real NaN from the data: one pair's margin is NaN, so its batch's Bradley-Terry loss is NaN."""
    rows = [json.loads(x) for x in files["pairs"].read_text().splitlines()]
    rows[5]["margin"] = float("nan")  # written as NaN, which JSON readers accept
    data = write_jsonl(tmp_path / "nan.jsonl", rows)
    out = tmp_path / "run"
    assert main(args_for("reward", files, out, epochs=1, data=data, extra=["--keep-last", "9"])) == 0
    err = capsys.readouterr().err
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "non-finite loss (nan); update skipped" in warnings[0], err
    k = int(warnings[0].split("update ")[1].split(" ")[0])  # which of the 8 updates held row 5
    assert 1 <= k <= 8
    (row0, row1) = tracking.read_jsonl(out / "metrics.jsonl")
    assert row1["guard/skipped_updates"] == 1 and row1["train_loss"] is not None
    assert row1["eval_accuracy"] is not None and row1["eval_loss"] == row1["eval_loss"]  # finite, not NaN

    def weights(step: int) -> dict[str, torch.Tensor]:
        if step == 0:
            return {}
        t = load_file(str(out / "checkpoints" / f"step-{step:06d}" / "tensors.safetensors"))
        return {n: v for n, v in t.items() if n.startswith("model.")}

    before, after = weights(k - 1), weights(k)
    if before:  # the skipped update left the weights exactly as they were
        assert all(torch.equal(before[n], after[n]) for n in after)
    nxt = weights(k + 1) if k < 8 else None
    if nxt:
        assert not all(torch.equal(after[n], nxt[n]) for n in after)  # the others moved them
    final = load_file(str(out / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in final.values())


def test_nan_every_update_aborts_after_max_skipped(files, tmp_path, capsys):
    rows = [{**json.loads(x), "margin": float("nan")} for x in files["pairs"].read_text().splitlines()]
    out = tmp_path / "run"
    rc = main(args_for("reward", files, out, data=write_jsonl(tmp_path / "nan.jsonl", rows),
                       extra=["--max-skipped-updates", "2"]))
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(
        "error: 2 consecutive updates skipped (last: update 2 (epoch 1): non-finite loss (nan)); lower --lr"), err
    assert "--resume" in lines[0] and err.count("warning:") == 1
    assert not (out / "model.safetensors").exists()
    for path in checkpoint.list_checkpoints(out / "checkpoints"):  # only finite weights, from before
        assert all(torch.isfinite(t).all() for t in load_file(str(path / "tensors.safetensors")).values())


def test_sft_overflowing_learning_rate_aborts_after_max_skipped(files, tmp_path, capsys):
    """--lr 3e37 moves every weight by ~3e37 in update 1; from then on the gradients overflow float32."""
    out = tmp_path / "run"
    rc = main(args_for("sft", files, out, extra=["--lr", "3e37", "--max-skipped-updates", "2"]))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("error: 2 consecutive updates skipped (last: update 3 (epoch 1): non-finite "), err
    assert "warning: update 2 (epoch 1): non-finite" in err and err.count("warning:") == 1
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["step-000001", "step-000002"]
    assert not (out / "model.safetensors").exists()


def test_sft_nan_loss_is_skipped_and_counted(files, tmp_path, capsys, monkeypatch):
    """SFT has no input that yields a NaN from finite weights, so the loss of the third batch is made NaN
    in-process; everything else (model, data, optimiser, checkpoints) is the real run."""
    import ppolm.sft

    real, calls = ppolm.sft.sft_loss, {"n": 0}

    def nan_third(model, ids, mask, loss_mask):
        s, n = real(model, ids, mask, loss_mask)
        if model.training:
            calls["n"] += 1
            if calls["n"] == 3:
                return s * float("nan"), n
        return s, n

    monkeypatch.setattr(ppolm.sft, "sft_loss", nan_third)
    out = tmp_path / "run"
    assert main(args_for("sft", files, out, epochs=1, extra=["--keep-last", "9"])) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "warning: update 3 (epoch 1): non-finite loss (nan); update skipped" in err
    w = [load_file(str(out / "checkpoints" / f"step-{i:06d}" / "tensors.safetensors")) for i in (2, 3, 4)]
    key = "model.model.embed_tokens.weight"
    assert torch.equal(w[0][key], w[1][key]) and not torch.equal(w[1][key], w[2][key])
    assert w[0]["opt.0.step"] == w[1]["opt.0.step"] == 2 and w[2]["opt.0.step"] == 3  # Adam never saw it
    rows = tracking.read_jsonl(out / "metrics.jsonl")
    assert rows[-1]["guard/skipped_updates"] == 1 and rows[-1]["train_loss"] == rows[-1]["train_loss"]
    assert all(torch.isfinite(t).all() for t in load_file(str(out / "model.safetensors")).values())


def test_disk_full_while_saving_keeps_previous_checkpoint(files, tmp_path, capsys, monkeypatch):
    """A full disk cannot be made for a test; the third checkpoint's write fails with the real errno."""
    import safetensors.torch

    real, calls = safetensors.torch.save_file, {"n": 0}

    def full_disk(tensors, filename, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real(tensors, filename, *a, **k)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    out = tmp_path / "run"
    args = args_for("reward", files, out, epochs=1, extra=["--keep-last", "5"])
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "no space left on the device while writing checkpoint step-000003" in lines[0], err
    assert "previous checkpoint is intact" in lines[0] and "Traceback" not in err
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["step-000001", "step-000002"]
    assert_checkpoints_valid(out / "checkpoints")
    assert not list((out / "checkpoints").glob(".tmp-*"))
    monkeypatch.setattr(safetensors.torch, "save_file", real)  # space freed: --resume finishes
    assert main(args + ["--resume"]) == 0
    assert [r["epoch"] for r in tracking.read_jsonl(out / "metrics.jsonl")] == [0, 1]


def test_disk_full_while_saving_the_final_model_is_one_line(files, tmp_path, capsys, monkeypatch):
    """The final model of sft (and reward, dpo: the same writer) fails the way safetensors reports a
    full disk, with its own SafetensorError naming the OS error: one line, no traceback."""
    import safetensors

    import ppolm.models

    def full_disk(model, tok, path):
        raise safetensors.SafetensorError(f"Error while serializing: I/O error: {os.strerror(errno.ENOSPC)} "
                                          f"(os error {errno.ENOSPC})")

    monkeypatch.setattr(ppolm.models, "save_pretrained", full_disk)
    assert main(args_for("sft", files, tmp_path / "run", epochs=1)) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "no space left on the device while writing the final model" in lines[0], err
    assert "Traceback" not in err
    assert not list((tmp_path / "run").glob(".tmp-model-*"))


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="running as root: a read-only directory does not stop root from writing")
def test_read_only_checkpoint_dir_is_one_line_and_keeps_the_checkpoint(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(args_for("sft", files, out, epochs=1)) == 0
    ckpts = out / "checkpoints"
    before = {p.name: checkpoint.verify(p) for p in checkpoint.list_checkpoints(ckpts)}
    os.chmod(ckpts, 0o555)
    try:
        capsys.readouterr()
        assert main(args_for("sft", files, out, epochs=2, extra=["--resume"])) == 2
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and "permission denied while writing checkpoint step-000009" in lines[0], err
        assert "Traceback" not in err
    finally:
        os.chmod(ckpts, 0o755)
    assert {p.name: checkpoint.verify(p) for p in checkpoint.list_checkpoints(ckpts)} == before


def test_resume_needs_the_same_options_and_excludes_overwrite(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(args_for("reward", files, out, epochs=1)) == 0
    capsys.readouterr()
    assert main(args_for("reward", files, out, epochs=1, extra=["--resume", "--lr", "0.5"])) == 2
    assert "holds a run with a different config (lr: 0.01 then, 0.5 now)" in capsys.readouterr().err
    assert main(args_for("reward", files, out, extra=["--resume", "--overwrite"])) == 2
    assert "--resume and --overwrite exclude each other" in capsys.readouterr().err
    assert main(args_for("sft", files, out, extra=["--resume"])) == 2  # a reward run is not an sft run
    assert "no sft_config.yaml" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["sft", "reward"])
def test_resume_refuses_other_epochs_under_a_linear_schedule(files, tmp_path, capsys, command):
    """The linear schedule decays to 0 over all epochs: more epochs on --resume would change the
    learning rate of the steps already taken. (A constant schedule may be extended: see
    test_resume_variants_and_more_epochs_are_bit_identical.)"""
    out = tmp_path / "run"
    assert main(args_for(command, files, out, epochs=1, extra=["--lr-schedule", "linear"])) == 0
    capsys.readouterr()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(args_for(command, files, out, epochs=2, extra=["--lr-schedule", "linear", "--resume"])) == 2
    err = capsys.readouterr().err
    assert ("error: --epochs changed from 1 to 2 but the linear learning-rate schedule decays over --epochs; "
            "resume with --epochs 1 (a run with --lr-schedule constant can be extended)") in err
    assert "Traceback" not in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_old_checkpoints_are_renamed_before_deletion(tmp_path):
    """keep_last removes old checkpoints via a .tmp-* name, so a kill mid-delete leaves no half step-* dir."""
    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        checkpoint.save(root, step, {"w": torch.full((2,), float(step))}, {"x": step}, keep_last=2)
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step-000002", "step-000003"]
    (root / ".tmp-step-000001-old-999").mkdir()  # what a kill during that rename-then-delete leaves
    checkpoint.discard(root / "step-000002")
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step-000003"]
    checkpoint.save(root, 4, {"w": torch.ones(2)}, {"x": 4}, keep_last=2)  # clears the stale .tmp-* dir
    assert sorted(p.name for p in root.iterdir()) == ["step-000003", "step-000004"]
