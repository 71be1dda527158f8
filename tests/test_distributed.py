"""Data-parallel training under torchrun (gloo, CPU, tiny models): N processes compute what one
process computes on the same global batch, process 0 alone writes, a killed process ends the job
and --resume continues it exactly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ppolm import rollout as ro
from ppolm.data import load_prompts

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
REWARDS = '''
def words(prompts, completions, **kwargs):
    return [min(len(c.split()), 10) / 10 for c in completions]
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(n: int, args: list[str], *, timeout: float = 300, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node n ARGS`` (a script path, or -m ppolm ...)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *args]
    return subprocess.run(cmd, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture()
def reward_file(tmp_path):
    p = tmp_path / "rewards.py"
    p.write_text(REWARDS)
    return p


def fixed_rollout(policy_dir, tokenizer, path: Path, rows: int = 4) -> None:
    """Sample ``rows`` responses of 8 tokens from the tiny policy once, cut them to uneven lengths,
    and save them with their prompts."""
    prompts = load_prompts(None, tokenizer)[:rows]
    torch.manual_seed(0)
    from ppolm import models

    policy = models.load_causal_lm(str(policy_dir), dtype=torch.float32, device=torch.device("cpu"))
    roll = ro.generate(policy, [p.ids for p in prompts], pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                       max_new_tokens=8, temperature=1.0)
    # responses of uneven lengths (8, 2, 5, 7 tokens; EOS last): the processes' token counts differ
    for i, n in enumerate([8, 2, 5, 7][:rows]):
        roll.response[i, n - 1] = tokenizer.eos_token_id
        roll.response[i, n:] = tokenizer.pad_token_id
        roll.response_mask[i] = (torch.arange(roll.response.shape[1]) < n).long()
        roll.sample_logprobs[i, n:] = 0.0
    roll.ended[:] = True
    torch.save({"prompts": [(p.raw, p.ids, p.extra) for p in prompts],
                "roll": {k: getattr(roll, k) for k in ("query", "query_mask", "response", "response_mask", "ended",
                                                       "sample_logprobs")}}, path)


def assert_same_weights(one: dict, two: dict, label) -> None:
    """Two runs of the same update ended with the same weights: every element within 1e-6, except
    at most one in a million, and those within 1e-5 (a tenth of one critic step at lr 1e-4).

    Several processes sum each gradient in another order than one process does, and Adam divides
    every element by its own running magnitude: an element whose gradient is only rounding noise
    takes a step whose direction is that noise (one element of 3.2 million, 1.3e-6 apart, on an
    AMD EPYC). A wrong reduction moves whole tensors.
    """
    assert one.keys() == two.keys()
    diff = torch.cat([(one[k] - two[k].reshape(one[k].shape)).abs().flatten() for k in one])
    off = int((diff > 1e-6).sum())
    assert off <= diff.numel() // 1_000_000 and diff.max().item() <= 1e-5, (label, off, diff.max().item())


def test_statistics_helpers_on_one_process():
    """Without torchrun the helpers compute locally: moments of [1, 3] (9 masked) are mean 2, biased
    var 1, n 2; scale_to_global is 1; Sums gives total / count per name."""
    from ppolm import distributed

    mean, var, n = distributed.masked_moments(torch.tensor([[1.0, 3.0, 9.0]]), torch.tensor([[1, 1, 0]]))
    assert (float(mean), float(var), n) == (2.0, 1.0, 2.0)
    assert distributed.masked_var(torch.tensor([[1.0, 3.0, 9.0]]), torch.tensor([[1, 1, 0]])) == 2.0  # unbiased
    assert distributed.scale_to_global(3, 5) == 1.0 and distributed.world_size() == 1
    sums = distributed.Sums()
    sums.add("a", 6.0, 4)
    sums.add("b", 1.0, 0)
    got = sums.means()
    assert got["a"] == 1.5 and got["b"] != got["b"]  # nan where the count is 0


def test_one_update_on_two_processes_equals_one_process(tiny_policy_dir, tiny_rm_dir, tokenizer, tmp_path,
                                                        reward_file):
    """One PPO step on a fixed rollout of 4 rows: 2 processes with 2 rows each end with the weights
    (assert_same_weights) and metrics of 1 process with all 4, for full fine-tuning, LoRA, each
    critic kind and the critic-free estimators (global advantage and reward whitening, token-mean
    losses divided by the global token count, the KL controller fed the global KL)."""
    fixed_rollout(tiny_policy_dir, tokenizer, tmp_path / "roll.pt")
    base = dict(model=str(tiny_policy_dir), reward_fn=[f"{reward_file}:words"], steps=1, batch_size=4,
                ppo_epochs=2, response_length=8, quiet=True, precision="fp32", kl_horizon=1,
                kl_coef=0.05, kl_coef_min=0.0)  # unfloored, so beta must move
    cases = [
        ("top-layer-critic", dict(reward_model=[str(tiny_rm_dir)], critic_layers=1, whiten_rewards=True)),
        ("full-critic", dict(critic_layers=0, entropy_coef=0.01, update_kl_max=1e-6)),  # the bound binds
        ("shared-critic", dict(critic="shared")),
        ("lora", dict(lora_r=4, lora_alpha=8, actor_lr=1e-3, reward_model=[str(tiny_rm_dir)], critic_layers=1)),
        ("grpo", dict(advantage="grpo", samples_per_prompt=2)),
        ("reinforce++", dict(advantage="reinforce++", loss_agg="seq-mean-token-mean")),
    ]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"rollout": str(tmp_path / "roll.pt"), "out": str(tmp_path),
                                "cases": [{"name": n, "cfg": {**base, **c}} for n, c in cases]}))
    for n in (1, 2):
        p = torchrun(n, [str(HERE / "dist_worker.py"), str(spec)])
        assert p.returncode == 0, p.stderr[-3000:]
    # --fsdp (2 processes only): the trained models sharded, the same update
    sharded = [(n, c) for n, c in cases if n != "lora"]
    spec.write_text(json.dumps({"rollout": str(tmp_path / "roll.pt"), "out": str(tmp_path / "fsdp"),
                                "cases": [{"name": n, "cfg": {**base, **c, "fsdp": True}} for n, c in sharded]}))
    (tmp_path / "fsdp").mkdir()
    p = torchrun(2, [str(HERE / "dist_worker.py"), str(spec)])
    assert p.returncode == 0, p.stderr[-3000:]
    for name, _ in sharded:
        one, two = (load_file(str(d / f"{name}-w{n}.safetensors")) for d, n in ((tmp_path, 1), (tmp_path / "fsdp", 2)))
        assert_same_weights(one, two, (name, "fsdp"))
    before = load_file(str(tiny_policy_dir / "model.safetensors"))
    for name, _ in cases:
        one, two = (load_file(str(tmp_path / f"{name}-w{n}.safetensors")) for n in (1, 2))
        assert one
        assert_same_weights(one, two, name)
        moved = [k for k in one if k.startswith("policy.") and k.removeprefix("policy.") in before
                 and not torch.equal(one[k], before[k.removeprefix("policy.")])]
        assert moved or name == "lora", f"{name}: the update changed no policy weight"
        m1, m2 = (json.loads((tmp_path / f"{name}-w{n}.json").read_text()) for n in (1, 2))
        assert m1["beta"] == pytest.approx(m2["beta"], abs=1e-12) and m1["beta"] != 0.05  # adapted, identically
        for key in ("objective/kl", "objective/scores", "objective/entropy", "adv/var", "policy/entropy_avg",
                    "response/length_mean", "val/num_eos_tokens", "objective/non_score_reward", "policy/grad_norm"):
            assert m2["metrics"][key] == pytest.approx(m1["metrics"][key], rel=1e-5, abs=1e-6), (name, key)
        if name == "full-critic":  # --update-kl-max: the KL over every process's tokens, the same shrink
            assert m1["metrics"]["policy/update_scale"] < 1
            for key in ("policy/update_kl", "policy/update_scale"):
                assert m2["metrics"][key] == pytest.approx(m1["metrics"][key], rel=1e-4), (name, key)
        if "val/vf_explained_var" in m1["metrics"]:
            assert m2["metrics"]["val/vf_explained_var"] == pytest.approx(m1["metrics"]["val/vf_explained_var"],
                                                                          rel=1e-4, abs=1e-5)
        if "val/grad_norm" in m1["metrics"]:  # the separate critics' global gradient norm
            assert m2["metrics"]["val/grad_norm"] == pytest.approx(m1["metrics"]["val/grad_norm"], rel=1e-5)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


LEAVES_GROUP = """
import json, os, sys, torch
from ppolm import cli
rc = cli.main(sys.argv[2:])
with open(f"{sys.argv[1]}/rank{os.environ['RANK']}.json", "w") as f:
    json.dump({"rc": rc, "joined": torch.distributed.is_initialized()}, f)
"""


def test_a_finished_command_leaves_the_process_group(tiny_policy_dir, tmp_path):
    """Each process of a torchrun job that ran to completion leaves the process group before it
    exits (``distributed.shutdown``): a group left for the interpreter's exit to tear down can abort
    the process (gloo's threads, SIGABRT) after the work was saved."""
    script = tmp_path / "leaves.py"
    script.write_text(LEAVES_GROUP)
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"Q{i}?", "response": "A " * (i + 1)} for i in range(4)])
    out = tmp_path / "out"
    p = torchrun(2, [str(script), str(tmp_path), "sft", "--model", str(tiny_policy_dir), "--data", str(data),
                     "--epochs", "1", "--batch-size", "4", "--eval-fraction", "0", "--precision", "fp32", "--quiet",
                     "--output-dir", str(out)])
    assert p.returncode == 0, p.stderr[-3000:]
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [{"rc": 0, "joined": False}] * 2
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize("command", ["sft", "reward", "dpo"])
def test_one_training_step_on_two_processes_equals_one_process(command, tiny_policy_dir, tmp_path):
    """``torchrun --nproc-per-node 2 -m ppolm sft|reward|dpo`` on one batch of 5 rows (3 + 2 per
    process, so the token and pair counts differ between them) saves the weights one process saves.
    (Adam's first step moves each weight by lr * g / (|g| + eps): where a gradient cancels to almost
    0, float rounding of the two summation orders is amplified up to lr / eps-fold, so the learning
    rate is small enough for 1e-6 to test the gradients, not Adam's rounding.)"""
    if command == "sft":
        rows = [{"prompt": f"Question {i}?", "response": "An answer " + "word " * i} for i in range(5)]
    else:
        rows = [{"prompt": f"Say {i}.", "chosen": "Good " * (i + 1), "rejected": "Bad."} for i in range(5)]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    args = ["-m", "ppolm", command, "--model", str(tiny_policy_dir), "--data", str(data), "--epochs", "1",
            "--batch-size", "5", "--eval-fraction", "0", "--precision", "fp32", "--quiet", "--lr", "1e-5"]
    if command == "reward":
        args += ["--no-normalize", "--no-trunk-cache"]
    weights = {}
    for n, extra in ((1, []), (2, []), ("2-fsdp", ["--fsdp"])):
        out = tmp_path / f"w{n}"
        p = torchrun(int(str(n)[0]), [*args, *extra, "--output-dir", str(out)],
                     env={"PPOLM_RANK_SUMMARY": str(tmp_path / f"sum{n}")})
        assert p.returncode == 0, p.stderr[-3000:]
        weights[n] = load_file(str(out / "model.safetensors"))
        summaries = [json.loads((tmp_path / f"sum{n}" / f"rank{r}.json").read_text()) for r in range(int(str(n)[0]))]
        if not extra:
            assert len({s["weights"] for s in summaries}) == 1  # every process holds the same weights
        rows_logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["epoch"] for r in rows_logged] == [1]  # written once, by process 0
    before = load_file(str(tiny_policy_dir / "model.safetensors"))
    for n in (2, "2-fsdp"):  # DDP, and FSDP2 (each process held half of every weight)
        assert_same_weights(weights[1], weights[n], n)
    assert any(k in before and not torch.equal(weights[1][k], before[k]) for k in weights[1])


def test_fsdp_checkpoint_resumes_exactly(tiny_policy_dir, tmp_path):
    """--fsdp: a checkpoint gathers the sharded weights and Adam states whole and --resume shards
    them again, so 1 epoch + --resume to 2 ends with the weights of 2 epochs straight, bit for bit;
    --fsdp without torchrun is one line."""
    rows = [{"prompt": f"Question {i}?", "response": "An answer " + "word " * i} for i in range(6)]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    args = ["-m", "ppolm", "sft", "--model", str(tiny_policy_dir), "--data", str(data), "--batch-size", "3",
            "--eval-fraction", "0", "--precision", "fp32", "--quiet", "--lr", "1e-3", "--lr-schedule", "constant",
            "--fsdp"]
    straight = torchrun(2, [*args, "--epochs", "2", "--output-dir", str(tmp_path / "a")])
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = torchrun(2, [*args, "--epochs", "1", "--output-dir", str(tmp_path / "b")])
    assert first.returncode == 0, first.stderr[-3000:]
    again = torchrun(2, [*args, "--epochs", "2", "--output-dir", str(tmp_path / "b"), "--resume"])
    assert again.returncode == 0, again.stderr[-3000:]
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("a", "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    p = subprocess.run([sys.executable, *args, "--epochs", "1", "--output-dir", str(tmp_path / "c")], env=ENV,
                       capture_output=True, text=True, timeout=300)
    errors = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "--fsdp shards the model over the processes" in errors[0]


def ppo_args(model, reward_file, out, *extra: str) -> list[str]:
    return ["-m", "ppolm", "ppo", "--model", str(model), "--reward-fn", f"{reward_file}:words", "--batch-size", "4",
            "--response-length", "6", "--precision", "fp32", "--quiet", "--output-dir", str(out), *extra]


def test_ppo_under_torchrun_writes_each_output_once(tiny_policy_dir, tiny_rm_dir, reward_file, tmp_path):
    """3 steps on 2 processes: one metrics row per step, every process's samples in samples.jsonl,
    one policy and critic; each process ends with rank 0's beta, last metrics row and weights."""
    out = tmp_path / "run"
    eval_prompts = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"Describe {x}."} for x in "abcde"])
    p = torchrun(2, ppo_args(tiny_policy_dir, reward_file, out, "--steps", "3", "--reward-model", str(tiny_rm_dir),
                             "--critic-layers", "1", "--sample-every", "1", "--eval-prompts", str(eval_prompts),
                             "--eval-every", "2", "--eval-batch-size", "2", "--kl-horizon", "1",
                             "--kl-coef-min", "0"),
                 env={"PPOLM_RANK_SUMMARY": str(tmp_path / "sum")})
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0] * 4 + [1] * 4 + [2] * 4  # both processes' rows, once
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 3]
    assert len((out / "eval_samples.jsonl").read_text().splitlines()) == 15  # 5 prompts x 3 evaluations
    assert (out / "policy" / "model.safetensors").exists() and (out / "critic" / "model.safetensors").exists()
    assert len(list((out / "tensorboard").iterdir())) == 1
    summaries = [json.loads((tmp_path / "sum" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert summaries[0]["beta"] == summaries[1]["beta"] == rows[-1]["objective/kl_coef"] * (
        1 + max(-0.2, min(0.2, rows[-1]["objective/kl"] / 6.0 - 1)))
    assert summaries[0]["weights"] == summaries[1]["weights"]
    assert summaries[0]["last_row"] == summaries[1]["last_row"]
    saved = load_file(str(out / "policy" / "model.safetensors"))
    assert any(not torch.equal(v, load_file(str(tiny_policy_dir / "model.safetensors"))[k]) for k, v in saved.items())
    assert "error" not in p.stderr.lower()


def test_bf16_ppo_under_torchrun_keeps_the_processes_equal(tiny_policy_dir, reward_file, tmp_path):
    """In bf16 each process steps dithered fp32 masters (ppolm/runtime.py): the dither is drawn from
    --seed, not the rank, so after 2 steps on 2 processes both hold the same masters and the same
    bf16 weights. A rank-dependent draw would leave equal gradients stepping unequal masters. With
    --update-kl-max binding, both shrink their masters' step by the same factor."""
    args = ppo_args(tiny_policy_dir, reward_file, tmp_path / "run", "--steps", "2", "--actor-lr", "1e-4",
                    "--update-kl-max", "1e-6")
    args[args.index("fp32")] = "bf16"
    p = torchrun(2, args, env={"PPOLM_RANK_SUMMARY": str(tmp_path / "sum")})
    assert p.returncode == 0, p.stderr[-3000:]
    summaries = [json.loads((tmp_path / "sum" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert summaries[0]["weights"] == summaries[1]["weights"]
    assert summaries[0]["masters"] == summaries[1]["masters"]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["policy/update_scale"] < 1 for r in rows)
    saved = load_file(str(tmp_path / "run" / "policy" / "model.safetensors"))
    before = load_file(str(tiny_policy_dir / "model.safetensors"))
    assert any(not torch.equal(v, before[k]) for k, v in saved.items())


def worker_pids(tag: str) -> dict[int, int]:
    """{rank: pid} of the worker processes of the job whose environment holds PPOLM_TEST_JOB=tag
    (torchrun passes its environment on and adds RANK; the launcher itself has no RANK)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PPOLM_TEST_JOB={tag}".encode() in env:
            ranks = [e for e in env if e.startswith(b"RANK=")]
            if ranks:
                found[int(ranks[0].split(b"=")[1])] = int(pid)
    return found


def saved_steps(out: Path) -> list[int]:
    """The steps of the complete checkpoints in ``out`` (step-000003 -> 3), in order."""
    found = out / "checkpoints"
    if not found.is_dir():
        return []
    return sorted(int(p.name.split("-")[1]) for p in found.iterdir()
                  if p.name.startswith("step-") and (p / "manifest.json").exists())


def test_killed_process_ends_the_job_and_resume_is_exact(tiny_policy_dir, reward_file, tmp_path):
    """SIGKILL process 1 mid-run: the job exits (non-zero) within the collective timeout, the last
    checkpoint is intact, and --resume on 2 processes ends with the weights and metrics of an
    uninterrupted 2-process run, bit for bit."""
    args = ["--steps", "24", "--save-every", "1", "--dist-timeout", "30", "--seed", "3"]
    full = torchrun(2, ppo_args(tiny_policy_dir, reward_file, tmp_path / "full", *args))
    assert full.returncode == 0, full.stderr[-3000:]

    out = tmp_path / "killed"
    tag = f"kill-{os.getpid()}-{time.time()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           *ppo_args(tiny_policy_dir, reward_file, out, *args)]
    launcher = subprocess.Popen(cmd, env={**ENV, "PPOLM_TEST_JOB": tag}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not saved_steps(out) or saved_steps(out)[-1] < 3:
            assert time.time() < deadline and launcher.poll() is None, "the run never reached step 3"
            time.sleep(0.05)
        os.kill(worker_pids(tag)[1], signal.SIGKILL)
        t_kill = time.time()
        _, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode != 0
    assert time.time() - t_kill < 60, "the job outlived its killed process by more than a minute"
    done = saved_steps(out)
    assert done and 3 <= done[-1] < 24, done

    resumed = torchrun(2, ppo_args(tiny_policy_dir, reward_file, out, *args, "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = (load_file(str(d / "policy" / "model.safetensors")) for d in (tmp_path / "full", out))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows_a, rows_b = ([{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "memory/"))}
                       for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (tmp_path / "full", out))
    assert rows_a == rows_b


def test_resume_with_another_number_of_processes_is_refused(tiny_policy_dir, reward_file, tmp_path):
    out = tmp_path / "run"
    p = torchrun(2, ppo_args(tiny_policy_dir, reward_file, out, "--steps", "1"))
    assert p.returncode == 0, p.stderr[-3000:]
    p = subprocess.run([sys.executable, *ppo_args(tiny_policy_dir, reward_file, out, "--steps", "2", "--resume")],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    errors = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "written by 2 process(es)" in errors[0] and "--nproc-per-node 2" in errors[0]


def test_two_nodes_on_localhost(tiny_policy_dir, reward_file, tmp_path):
    """Two torchrun launchers, one process each, meeting at a c10d rendezvous (two 'nodes')."""
    port = free_port()
    out = tmp_path / "run"
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "ppolm-test", *ppo_args(tiny_policy_dir, reward_file, out, "--steps", "2")]
        procs.append(subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]


def test_bad_process_counts_are_one_line_before_any_work(tiny_policy_dir, reward_file, tmp_path):
    """3 processes cannot share 4 prompts, nor 2 processes 3 minibatches of their rows."""
    out = tmp_path / "run"
    p = torchrun(3, ppo_args(tiny_policy_dir, reward_file, out, "--steps", "1"), timeout=120)
    errors = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert p.returncode != 0 and len(errors) == 1, p.stderr[-2000:]
    assert "3 processes (WORLD_SIZE) cannot share the 4 prompts" in errors[0]
    p = torchrun(2, ppo_args(tiny_policy_dir, reward_file, out, "--steps", "1", "--minibatches", "4"), timeout=120)
    errors = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert p.returncode != 0 and len(errors) == 1, p.stderr[-2000:]
    assert "--minibatches 4" in errors[0] and "multiple of 8" in errors[0]
    assert not out.exists()


def test_ctrl_c_stops_every_process_after_the_same_step(tiny_policy_dir, reward_file, tmp_path):
    """Ctrl-C in the terminal (SIGINT to the launcher's whole process group, which torchrun also
    passes on to each worker): every process finishes the same step, process 0 saves that step's
    checkpoint, and --resume finishes the run."""
    out = tmp_path / "run"
    args = ppo_args(tiny_policy_dir, reward_file, out, "--steps", "200", "--save-every", "1000")
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2", *args], env=ENV, start_new_session=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
            assert time.time() < deadline and launcher.poll() is None
            time.sleep(0.05)
        os.killpg(launcher.pid, signal.SIGINT)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    stopped = [x for x in err.splitlines() if x.startswith("interrupted after step")]
    assert len(stopped) == 1, err[-3000:]  # process 0 says it; process 1 stopped silently
    step = int(stopped[0].split()[3].rstrip(";"))
    assert saved_steps(out) == [step]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == step
    p = torchrun(2, args[:args.index("--steps") + 1] + [str(step + 2)] + args[args.index("--steps") + 2:] +
                 ["--resume"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == list(range(step + 2))


def test_ppo_fsdp_saves_whole_models_and_resumes_exactly(tiny_policy_dir, tiny_rm_dir, reward_file, tmp_path):
    """ppolm ppo --fsdp on 2 processes: held-out evaluation and sampling with the gathered policy,
    checkpoints of the gathered weights, a policy/ and critic/ as whole Hugging Face models; 2
    steps + --resume to 4 end as 4 steps straight, bit for bit."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    eval_prompts = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"Describe {x}."} for x in "abcd"])
    extra = ["--fsdp", "--reward-model", str(tiny_rm_dir), "--critic-layers", "1", "--eval-prompts", str(eval_prompts),
             "--eval-every", "2", "--save-every", "1"]
    straight = torchrun(2, ppo_args(tiny_policy_dir, reward_file, tmp_path / "a", "--steps", "4", *extra))
    assert straight.returncode == 0, straight.stderr[-3000:]
    part = torchrun(2, ppo_args(tiny_policy_dir, reward_file, tmp_path / "b", "--steps", "2", *extra))
    assert part.returncode == 0, part.stderr[-3000:]
    rest = torchrun(2, ppo_args(tiny_policy_dir, reward_file, tmp_path / "b", "--steps", "4", "--resume", *extra))
    assert rest.returncode == 0, rest.stderr[-3000:]
    a, b = (load_file(str(tmp_path / d / "policy" / "model.safetensors")) for d in ("a", "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "policy")
    before = AutoModelForCausalLM.from_pretrained(tiny_policy_dir)
    assert policy.model.embed_tokens.weight.shape == before.model.embed_tokens.weight.shape
    assert not torch.equal(policy.model.layers[1].mlp.up_proj.weight, before.model.layers[1].mlp.up_proj.weight)
    critic = AutoModelForSequenceClassification.from_pretrained(tmp_path / "a" / "critic")
    assert critic.config.num_hidden_layers == before.config.num_hidden_layers  # the whole critic, trunk included
    evals = [json.loads(x) for x in (tmp_path / "a" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 4]
