"""Bad inputs: each one exits with code 2 and one ``error:`` line naming the problem (and the fix),
no traceback, and no file in the output directory changed.

The ``ppo`` cases run against an output directory holding a previous run, with ``--overwrite``
(except where the case is about the directory itself): the previous run must survive every bad
input, including a reward function that only fails once the first step runs. Most cases run
``ppolm.cli.main`` in-process for speed; a few run ``python -m ppolm.cli`` as a real process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ppolm import config
from ppolm.cli import main
from ppolm.ppo_config import PPOConfig
from ppolm.tiny import build_tiny_model_dir

REWARDS = '''
def length(prompts, completions, **kwargs):
    return [len(c) / 10 for c in completions]

def boom(prompts, completions, **kwargs):
    raise ValueError("the judge is down")

def one(prompts, completions, **kwargs):
    return [1.0]

def words(prompts, completions, **kwargs):
    return ["good" for _ in completions]

def lonely(x):
    return [0.0]

def nan(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)

def numeric_strings(prompts, completions, **kwargs):
    return ["1.5" for _ in completions]

not_a_function = 3
'''

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


class Inputs:
    """Every malformed file and model directory the cases need, built once per module."""

    def __init__(self, root: Path):
        self.root = root
        self.model = build_tiny_model_dir(root / "micro", kind="causal", seed=0, num_layers=1, hidden_size=16,
                                          heads=2, kv_heads=1, intermediate_size=32)
        self.rewards = self.write("rewards.py", REWARDS)
        self.good_prompts = self.write("good.jsonl", "".join(json.dumps({"prompt": f"Say {w}."}) + "\n"
                                                             for w in ("hi", "yes", "no", "ok")))
        # model directories: short context, no chat template, no weights, pickle only, no config
        self.short_ctx = self.copy_model("short_ctx")
        cfg = json.loads((self.short_ctx / "config.json").read_text())
        cfg["max_position_embeddings"] = 64
        (self.short_ctx / "config.json").write_text(json.dumps(cfg))
        self.no_template = self.copy_model("no_template")
        (self.no_template / "chat_template.jinja").unlink(missing_ok=True)
        tc = json.loads((self.no_template / "tokenizer_config.json").read_text())
        tc.pop("chat_template", None)
        (self.no_template / "tokenizer_config.json").write_text(json.dumps(tc))
        self.no_weights = root / "no_weights"
        self.no_weights.mkdir()
        shutil.copy(self.model / "config.json", self.no_weights)
        self.pickle_only = root / "pickle_only"
        self.pickle_only.mkdir()
        shutil.copy(self.model / "config.json", self.pickle_only)
        (self.pickle_only / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really a pickle")
        self.no_config = root / "no_config"
        self.no_config.mkdir()
        (self.no_config / "README.md").write_text("weights were never copied here\n")
        # a model whose config asks for remote code that must not run without --trust-remote-code
        self.remote = self.copy_model("remote")
        cfg = json.loads((self.remote / "config.json").read_text())
        cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.Evil", "AutoConfig": "modeling_evil.EvilConfig"}
        (self.remote / "config.json").write_text(json.dumps(cfg))
        self.marker = root / "remote_code_ran"
        self.write("remote/modeling_evil.py", f"open({str(self.marker)!r}, 'w').write('ran')\n"
                   "from transformers import LlamaConfig as EvilConfig, LlamaForCausalLM as Evil\n")
        # reward model norm file that is not JSON
        self.bad_norm_rm = root / "bad_norm_rm"
        build_tiny_model_dir(self.bad_norm_rm, kind="scalar", seed=1, num_layers=1, hidden_size=16, heads=2,
                             kv_heads=1, intermediate_size=32)
        (self.bad_norm_rm / "ppolm_reward.json").write_text('{"gain": "big"')

    def write(self, name: str, text: str | bytes) -> Path:
        p = self.root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text) if isinstance(text, bytes) else p.write_text(text, encoding="utf-8")
        return p

    def copy_model(self, name: str) -> Path:
        return Path(shutil.copytree(self.model, self.root / name))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return Inputs(tmp_path_factory.mktemp("bad_inputs"))


def snapshot(root: Path) -> dict[str, tuple] | None:
    """Every file (and directory) under root: size, mtime and SHA-256; None when root is absent."""
    if not root.exists():
        return None
    snap: dict[str, tuple] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_dir():
            snap[rel] = ("dir",)
        else:
            st = p.stat()
            snap[rel] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return snap


def previous_run(out: Path, **cfg_over) -> None:
    """An output directory as a finished earlier run left it."""
    out.mkdir(parents=True)
    base = dict(model="earlier-model", reward_fn=["earlier_rewards.py:fn"], steps=3, ppo_epochs=2)
    base.update(cfg_over)
    config.save_yaml(config.build(PPOConfig, base), out / "config.yaml")
    (out / "metrics.jsonl").write_text('{"step": 0, "objective/scores": 0.5}\n')
    (out / "samples.jsonl").write_text('{"step": 0, "prompt": "hi", "response": "hello"}\n')
    for d, f in (("policy", "model.safetensors"), ("critic", "model.safetensors"),
                 ("checkpoints/step-000003", "tensors.safetensors"), ("tensorboard", "events.out.tfevents.1")):
        (out / d).mkdir(parents=True)
        (out / d / f).write_bytes(os.urandom(64))


def ppo_argv(inputs: Inputs, out: Path, over: dict) -> list[str]:
    opts = {"model": inputs.model, "reward_fn": f"{inputs.rewards}:length", "prompts": inputs.good_prompts,
            "steps": 1, "batch_size": 4, "minibatches": 2, "ppo_epochs": 1, "response_length": 4,
            "precision": "fp32", "device": "cpu", "quiet": True, "output_dir": out, "overwrite": True}
    opts.update(over)
    argv = ["ppo"]
    for k, v in opts.items():
        flag = "--" + k.replace("_", "-")
        if v is None or v is False:
            continue
        if v is True:
            argv.append(flag)
        else:
            for item in v if isinstance(v, list) else [v]:
                argv += [flag, str(item)]
    return argv


def damaged_copy(model: Path, t: Path, damage: str) -> Path:
    """A copy of a model directory with its weights cut in half or its config.json broken."""
    out = t / f"damaged-{damage}"
    shutil.copytree(model, out)
    if damage == "weights":
        w = out / "model.safetensors"
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    else:
        (out / "config.json").write_text("{bad")
    return out


def check_error(rc: int, err: str, expect: str) -> None:
    import re

    assert "Traceback" not in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2, (rc, err)
    assert len(errors) == 1, err
    assert re.search(expect, errors[0]), (expect, errors[0])


# Each case: (id, how to make the input -> command-line overrides, regex the error line must match).
# ``i`` is the Inputs, ``t`` a fresh tmp dir for files of this case.
CASES = [
    # --- the prompts file
    ("prompts-missing", lambda i, t: {"prompts": t / "nope.jsonl"}, r"data file .*nope\.jsonl does not exist"),
    ("prompts-empty", lambda i, t: {"prompts": i.write("empty.jsonl", "")}, r"empty\.jsonl holds no rows"),
    ("prompts-blank-lines", lambda i, t: {"prompts": i.write("blank.jsonl", "\n  \n")}, r"holds no rows"),
    ("prompts-not-utf8", lambda i, t: {"prompts": i.write("latin1.txt", "caf\xe9 au lait?\n".encode("latin-1"))},
     r"latin1\.txt is not UTF-8 text \(bad byte at offset 3\); re-save it as UTF-8"),
    ("prompts-bad-jsonl-line", lambda i, t: {"prompts": i.write("cut.jsonl", '{"prompt": "a"}\n{"prompt": "b\n')},
     r"cut\.jsonl line 2 is not valid JSON .*fix or remove that line"),
    ("prompts-truncated-json", lambda i, t: {"prompts": i.write("cut.json", '[{"prompt": "a"}, {"pro')},
     r"cut\.json is not valid JSON \(line 1"),
    ("prompts-line-not-object", lambda i, t: {"prompts": i.write("list.jsonl", '{"prompt": "a"}\n["b"]\n')},
     r"list\.jsonl line 2 is a list, not a JSON object"),
    ("prompts-wrong-column-type", lambda i, t: {"prompts": i.write("int.jsonl", '{"prompt": 42}\n')},
     r"int\.jsonl row 1: 'prompt' must be a non-empty string or a chat-message list; got int"),
    ("prompts-no-prompt-column", lambda i, t: {"prompts": i.write("cols.jsonl", '{"question": "why?"}\n')},
     r"row 1 has no 'prompt' or 'messages' column \(columns: question\); rename"),
    ("prompts-bad-messages", lambda i, t: {"prompts": i.write("msg.jsonl", '{"messages": [{"content": "hi"}]}\n')},
     r"msg\.jsonl row 1: 'messages' must be a non-empty list of \{'role': str, 'content': str\}"),
    ("prompts-not-parquet", lambda i, t: {"prompts": i.write("bad.parquet", "not parquet")},
     r"bad\.parquet could not be read as parquet \(ArrowInvalid: .*\); check the file"),
    ("prompts-unsupported-type", lambda i, t: {"prompts": i.write("p.xml", "<p>hi</p>")},
     r"unsupported type '\.xml'; use \.jsonl"),
    ("prompt-longer-than-max-prompt-length",
     lambda i, t: {"prompts": i.write("long.jsonl", json.dumps({"prompt": "word " * 60}) + "\n"),
                   "max_prompt_length": 16},
     r"long\.jsonl row 1 is \d+ tokens, longer than --max-prompt-length 16; shorten it or raise the limit"),
    ("prompt-longer-than-context",
     lambda i, t: {"model": i.short_ctx, "prompts": i.write("ctx.jsonl", json.dumps({"prompt": "word " * 60}) + "\n")},
     r"ctx\.jsonl row 1 is \d+ tokens; with --response-length 4 it exceeds the model's context of 64 tokens"),
    ("messages-without-chat-template",
     lambda i, t: {"model": i.no_template,
                   "prompts": i.write("chat.jsonl", json.dumps({"messages": [{"role": "user", "content": "hi"}]}))},
     r"tokenizer has no chat template, so 'messages' prompts cannot be formatted"),
    # --- models
    ("model-without-weights", lambda i, t: {"model": i.no_weights},
     r"no_weights has config\.json but no weights \(\*\.safetensors\)"),
    ("model-pickle-weights", lambda i, t: {"model": i.pickle_only},
     r"has only pickle weights \(pytorch_model\.bin\), which are refused .*--allow-pickle"),
    ("model-dir-without-config", lambda i, t: {"model": i.no_config}, r"no_config has no config\.json"),
    ("model-truncated-weights", lambda i, t: {"model": damaged_copy(i.model, t, "weights")},
     r"damaged-weights/model\.safetensors is not a readable safetensors file .*copy or save the model again"),
    ("model-bad-config-json", lambda i, t: {"model": damaged_copy(i.model, t, "config")},
     r"damaged-config/config\.json is not valid JSON .*restore the model's config\.json"),
    ("model-path-missing", lambda i, t: {"model": t / "gone" / "model"}, r"model path not found: .*gone/model"),
    ("model-unknown-name", lambda i, t: {"model": "smollm2-135m-instrukt"},
     r"unknown model 'smollm2-135m-instrukt'.*did you mean 'smollm2-135m-instruct'"),
    ("model-not-gguf-file", lambda i, t: {"model": i.write("weights.txt", "hello")}, r"is a file but not a \.gguf"),
    ("model-fake-gguf", lambda i, t: {"model": i.write("fake.gguf", b"NOPE" + bytes(64))},
     r"fake\.gguf is not a GGUF file \(bad magic bytes\)"),
    ("reward-model-without-head", lambda i, t: {"reward_model": i.model, "reward_fn": None},
     r"has no scalar head"),
    ("reward-model-bad-norm-file", lambda i, t: {"reward_model": i.bad_norm_rm, "reward_fn": None},
     r"ppolm_reward\.json is malformed; it must hold \{\"gain\": number, \"bias\": number\}"),
    # --- reward functions
    ("no-reward", lambda i, t: {"reward_fn": None},
     r"^error: no reward given: pass --reward-fn FILE\.py:fn \(TRL GRPO convention\) or --reward-model DIR; for "
     r"the built-in sentiment reward use --reward-fn ppolm\.builtin_rewards:positive_sentiment$"),
    ("reward-spec-without-colon", lambda i, t: {"reward_fn": "rewards.py"},
     r"reward function 'rewards\.py' must be 'path/to/file\.py:function' or 'package\.module:function'"),
    ("reward-file-missing", lambda i, t: {"reward_fn": f"{t}/nope.py:f"}, r"reward function file .*nope\.py does not exist"),
    ("reward-file-is-a-directory", lambda i, t: {"reward_fn": f"{t}:f"}, r"reward function file .* is a directory"),
    ("reward-function-typo", lambda i, t: {"reward_fn": f"{i.rewards}:lenght"},
     r"has no function 'lenght'; did you mean 'length'\?"),
    ("reward-not-callable", lambda i, t: {"reward_fn": f"{i.rewards}:not_a_function"},
     r"rewards\.py:not_a_function' is not callable"),
    ("reward-file-syntax-error", lambda i, t: {"reward_fn": str(i.write("broken.py", "def f(:\n")) + ":f"},
     r"importing .*broken\.py failed: SyntaxError"),
    ("reward-module-missing", lambda i, t: {"reward_fn": "no_such_module_xyz:score"},
     r"cannot import module 'no_such_module_xyz'"),
    ("reward-wrong-signature", lambda i, t: {"reward_fn": f"{i.rewards}:lonely"},
     r"must accept \(prompts, completions, \*\*kwargs\); its signature is \(x\)"),
    ("reward-raises", lambda i, t: {"reward_fn": f"{i.rewards}:boom"},
     r"reward function 'boom' raised ValueError: the judge is down; fix the function"),
    ("reward-wrong-count", lambda i, t: {"reward_fn": f"{i.rewards}:one"},
     r"reward function 'one' returned 1 values for 4 completions; return one per completion"),
    ("reward-not-numbers", lambda i, t: {"reward_fn": f"{i.rewards}:words"},
     r"reward function 'words' must return a list of numbers"),
    ("reward-nan-on-first-batch", lambda i, t: {"reward_fn": f"{i.rewards}:nan"},
     r"reward function 'nan' returned nan for completion 0 of its first batch; a reward must be a finite number"),
    ("reward-numeric-strings", lambda i, t: {"reward_fn": f"{i.rewards}:numeric_strings"},
     r"reward function 'numeric_strings' must return a list of numbers; got a list holding '1\.5' \(str\)"),
    ("reward-weight-nan", lambda i, t: {"reward_fn_weights": ["nan"]}, r"--reward-fn-weights must be finite numbers"),
    ("best-metric-unknown", lambda i, t: {"eval_prompts": i.good_prompts, "best_metric": "eval/nope"},
     r"--best-metric eval/nope is not an eval metric; choose one of eval/score"),
    ("reward-weights-count", lambda i, t: {"reward_fn_weights": [1.0, 2.0]},
     r"--reward-fn-weights has 2 values for 1 --reward-fn; give one per function"),
    # --- config values (command line and YAML)
    ("config-unknown-key", lambda i, t: {"config": i.write("k.yaml", "ppo_epoch: 2\n")},
     r"unknown config key 'ppo_epoch'; did you mean 'ppo_epochs'\?"),
    ("config-unknown-section-key", lambda i, t: {"config": i.write("s.yaml", "algo:\n  learning_rate: 1.0\n")},
     r"unknown config key 'algo\.learning_rate'"),
    ("config-wrong-type", lambda i, t: {"config": i.write("t.yaml", "batch_size: eight\n"), "batch_size": None},
     r"option 'batch-size' must be an integer; got 'eight'"),
    ("config-wrong-bool", lambda i, t: {"config": i.write("b.yaml", "adaptive_kl: maybe\n")},
     r"option 'adaptive-kl' must be true or false; got 'maybe'"),
    ("config-wrong-choice", lambda i, t: {"config": i.write("c.yaml", "precision: fp8\n"), "precision": None},
     r"option 'precision' must be one of auto, bf16, fp32; got 'fp8'"),
    ("config-list-for-number", lambda i, t: {"config": i.write("l.yaml", "clip_eps: [0.1, 0.2]\n")},
     r"option 'clip-eps' must be a number"),
    ("config-out-of-range", lambda i, t: {"clip_eps": 1.5}, r"--clip-eps must be in \(0, 1\); got 1\.5"),
    ("config-steps-zero", lambda i, t: {"steps": 0}, r"--steps must be at least 1; got 0"),
    ("config-negative-lr", lambda i, t: {"actor_lr": "-0.5"}, r"--actor-lr and --critic-lr must be > 0"),
    ("config-lr-overflows-float32", lambda i, t: {"critic_lr": "1e39"},
     r"--critic-lr 1e\+39 is too large for float32 \(the optimiser's type\); use a value <= 3\.4e\+38"),
    ("config-not-integer", lambda i, t: {"ppo_epochs": 1.5}, r"option 'ppo-epochs' must be an integer; got '1\.5'"),
    ("batch-not-divisible", lambda i, t: {"batch_size": 6, "minibatches": 4},
     r"--batch-size 6 is not divisible by --minibatches 4; choose a divisor such as 3"),
    ("ptx-without-data", lambda i, t: {"ptx_coef": 0.5}, r"--ptx-coef > 0 needs --ptx-data FILE"),
    # --- advantage estimators
    ("group-estimator-one-sample", lambda i, t: {"advantage": "grpo", "samples_per_prompt": 1},
     r"--advantage grpo compares the responses to one prompt: give --samples-per-prompt 2 or more"),
    ("group-default-not-dividing", lambda i, t: {"advantage": "grpo", "batch_size": 6, "minibatches": 1},
     r"--batch-size 6 is not divisible by --samples-per-prompt 4; use a multiple of 4 such as 4"),
    ("batch-not-divisible-by-samples", lambda i, t: {"advantage": "rloo", "samples_per_prompt": 3},
     r"--batch-size 4 is not divisible by --samples-per-prompt 3; use a multiple of 3 such as 3"),
    ("remax-top-k-1", lambda i, t: {"advantage": "remax", "top_k": 1},
     r"--advantage remax with --top-k 1 samples the greedy response itself"),
    ("dual-clip-not-above-1", lambda i, t: {"dual_clip": 1.0}, r"--dual-clip must be > 1; got 1\.0"),
    ("clip-eps-high-not-positive", lambda i, t: {"clip_eps_high": 0}, r"--clip-eps-high must be > 0; got 0"),
    ("kl-error-clip-out-of-range", lambda i, t: {"kl_error_clip": 1.0}, r"--kl-error-clip must be in \(0, 1\); got 1\.0"),
    ("kl-coef-max-below-kl-coef", lambda i, t: {"kl_coef": 0.05, "kl_coef_max": 0.01},
     r"--kl-coef-max must be >= --kl-coef and --kl-coef-min \(or inf: no ceiling\); got 0\.01"),
    ("critic-lam-out-of-range", lambda i, t: {"critic_lam": -0.5}, r"--critic-lam must be in \[0, 1\]"),
    ("config-yaml-syntax", lambda i, t: {"config": i.write("y.yaml", "steps: 3\nalgo: [\n")},
     r"y\.yaml is not valid YAML at line \d+; fix the syntax"),
    ("config-yaml-not-mapping", lambda i, t: {"config": i.write("m.yaml", "- steps\n- 3\n")},
     r"m\.yaml must hold a mapping of option: value; got list"),
    ("config-file-missing", lambda i, t: {"config": t / "none.yaml"}, r"config file .*none\.yaml does not exist"),
    ("config-file-is-a-directory", lambda i, t: {"config": t}, r"config file .* is a directory; pass the path of a YAML"),
    ("config-file-not-utf8", lambda i, t: {"config": i.write("u.yaml", b"steps: 3 # \xff\xfe\n")},
     r"u\.yaml is not UTF-8 text"),
    # --- the output directory
    ("resume-and-overwrite", lambda i, t: {"resume": True}, r"--resume and --overwrite exclude each other"),
    ("output-dir-holds-other-run", lambda i, t: {"overwrite": None},
     r"already holds files; pass --resume to continue that run, --overwrite to replace it"),
    ("resume-with-different-config", lambda i, t: {"overwrite": None, "resume": True},
     r"holds a run with a different config \(model: 'earlier-model' then, '.*micro' now\)"),
]


@pytest.mark.parametrize("make, expect", [pytest.param(m, e, id=n) for n, m, e in CASES])
def test_ppo_bad_input(inputs, tmp_path, capsys, make, expect):
    out = tmp_path / "run"
    previous_run(out)
    before = snapshot(out)
    over = make(inputs, tmp_path)
    rc = main(ppo_argv(inputs, out, over))
    check_error(rc, capsys.readouterr().err, expect)
    assert snapshot(out) == before


def test_output_dir_is_a_file_or_foreign(inputs, tmp_path, capsys):
    f = inputs.write("not_a_dir", "x")
    before = f.read_bytes()
    check_error(main(ppo_argv(inputs, f, {})), capsys.readouterr().err, r"--output-dir .*not_a_dir is a file")
    assert f.read_bytes() == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    snap = snapshot(foreign)
    check_error(main(ppo_argv(inputs, foreign, {"overwrite": None, "resume": True})), capsys.readouterr().err,
                r"does not hold a ppolm run \(no config\.yaml\)")
    assert snapshot(foreign) == snap


def test_fresh_output_dir_is_not_created_on_bad_input(inputs, tmp_path, capsys):
    out = tmp_path / "fresh"
    rc = main(ppo_argv(inputs, out, {"reward_fn": f"{inputs.rewards}:boom", "overwrite": None}))
    check_error(rc, capsys.readouterr().err, r"reward function 'boom' raised ValueError")
    assert not out.exists()


def test_remote_code_is_not_run_without_trust(inputs, tmp_path, capsys):
    """A model config naming custom code: transformers' own Llama class is used, the file never imported."""
    out = tmp_path / "run"
    rc = main(ppo_argv(inputs, out, {"model": inputs.remote, "prompts": inputs.write("r.jsonl", "[1]\n")}))
    check_error(rc, capsys.readouterr().err, r"r\.jsonl line 1 is a list")
    assert not inputs.marker.exists()


def test_unknown_cli_option_and_bad_choice_exit_2(inputs, tmp_path, capsys):
    for extra, expect in ((["--bogus-option", "1"], "unrecognized arguments: --bogus-option"),
                          (["--precision", "fp8"], "invalid choice: 'fp8'"),
                          (["--advantage", "ppo2"], "invalid choice: 'ppo2'")):
        with pytest.raises(SystemExit) as e:
            main(["ppo", "--output-dir", str(tmp_path / "x"), *extra])
        err = capsys.readouterr().err
        assert e.value.code == 2 and expect in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------ real processes: no traceback at all

SUBPROCESS_CASES = [
    ("bad-jsonl-line", lambda i, t: {"prompts": i.write("sp_cut.jsonl", '{"prompt": "a"}\n{"prompt": \n')},
     r"sp_cut\.jsonl line 2 is not valid JSON"),
    ("reward-raises", lambda i, t: {"reward_fn": f"{i.rewards}:boom"}, r"reward function 'boom' raised ValueError"),
    ("unknown-config-key", lambda i, t: {"config": i.write("sp.yaml", "kl_coeff: 0.1\n")},
     r"unknown config key 'kl_coeff'; did you mean 'kl_coef'\?"),
    ("group-estimator-one-sample", lambda i, t: {"advantage": "dr-grpo", "samples_per_prompt": 1},
     r"--advantage dr-grpo compares the responses to one prompt"),
    ("dual-clip-not-above-1", lambda i, t: {"dual_clip": 0.5}, r"--dual-clip must be > 1; got 0\.5"),
]


@pytest.mark.parametrize("make, expect", [pytest.param(m, e, id=n) for n, m, e in SUBPROCESS_CASES])
def test_ppo_bad_input_as_process(inputs, tmp_path, make, expect):
    out = tmp_path / "run"
    previous_run(out)
    before = snapshot(out)
    argv = ppo_argv(inputs, out, make(inputs, tmp_path))
    p = subprocess.run([sys.executable, "-m", "ppolm.cli", *argv], env=ENV, capture_output=True, text=True,
                       timeout=300)
    check_error(p.returncode, p.stderr, expect)
    assert snapshot(out) == before


# ------------------------------------------------------------------ sft and reward

SFT_CASES = [
    ("data-missing-option", lambda i, t: {"data": None}, r"--data FILE is required"),
    ("data-file-missing", lambda i, t: {"data": t / "none.jsonl"}, r"data file .*none\.jsonl does not exist"),
    ("data-no-response-column", lambda i, t: {"data": i.write("demo.jsonl", '{"prompt": "hi"}\n')},
     r"demo\.jsonl row 1 has no 'response' column"),
    ("data-empty-response", lambda i, t: {"data": i.write("demo2.jsonl", '{"prompt": "hi", "response": " "}\n')},
     r"'response' must be a non-empty string"),
    ("data-messages-not-ending-with-assistant",
     lambda i, t: {"data": i.write("demo3.jsonl", json.dumps({"messages": [{"role": "user", "content": "hi"}]}))},
     r"'messages' must end with an assistant turn"),
    ("eval-fraction-out-of-range", lambda i, t: {"eval_fraction": 1.5}, r"--eval-fraction must be in \[0, 1\); got 1\.5"),
    ("lr-overflows-float32", lambda i, t: {"lr": "1e39"}, r"--lr 1e\+39 is too large for float32"),
    ("max-length-too-small", lambda i, t: {"max_length": 4}, r"--max-length must be at least 8; got 4"),
    ("save-every-zero", lambda i, t: {"save_every": 0}, r"--save-every must be at least 1; got 0"),
    ("model-without-weights", lambda i, t: {"model": i.no_weights}, r"no_weights has config\.json but no weights"),
]

REWARD_CASES = [
    ("pairs-missing-rejected", lambda i, t: {"data": i.write("p1.jsonl", '{"prompt": "hi", "chosen": "a"}\n')},
     r"p1\.jsonl row 1 has no 'rejected' column"),
    ("pairs-chosen-equals-rejected",
     lambda i, t: {"data": i.write("p2.jsonl", '{"prompt": "hi", "chosen": "a", "rejected": "a"}\n')},
     r"'chosen' equals 'rejected', so the pair prefers nothing"),
    ("pairs-margin-not-number",
     lambda i, t: {"data": i.write("p3.jsonl", '{"prompt": "hi", "chosen": "a", "rejected": "b", "margin": "big"}\n')},
     r"'margin' must be a number; got 'big'"),
    ("norm-policy-missing", lambda i, t: {"norm_policy": str(t / "gone")}, r"model path not found: .*gone"),
    ("norm-prompts-bad-column", lambda i, t: {"norm_prompts": i.write("np.jsonl", '{"question": "why?"}\n')},
     r"np\.jsonl row 1 has no 'prompt' or 'messages' column"),
    ("train-layers-below-minus-one", lambda i, t: {"train_layers": -5},
     r"--train-layers must be -1 \(every layer\) or >= 0; got -5"),
    ("pairs-truncated-json", lambda i, t: {"data": i.write("p4.jsonl", '{"prompt": "hi", "cho')},
     r"p4\.jsonl line 1 is not valid JSON"),
    ("norm-temperature-zero", lambda i, t: {"norm_temperature": 0}, r"--norm-temperature must be > 0; got 0\.0"),
    ("resume-and-overwrite", lambda i, t: {"resume": True, "overwrite": True},
     r"--resume and --overwrite exclude each other; pick one"),
    ("max-skipped-updates-zero", lambda i, t: {"max_skipped_updates": 0}, r"--max-skipped-updates must be at least 1"),
]


def other_argv(command: str, inputs: Inputs, out: Path, over: dict) -> list[str]:
    data = inputs.write(f"{command}_ok.jsonl", json.dumps({"prompt": "hi", "response": "hello", "chosen": "a",
                                                           "rejected": "b"}) + "\n")
    opts = {"model": inputs.model, "data": data, "output_dir": out, "precision": "fp32", "device": "cpu",
            "quiet": True}
    opts.update(over)
    argv = [command]
    for k, v in opts.items():
        if v is None:
            continue
        argv += ["--" + k.replace("_", "-")] + ([] if v is True else [str(v)])
    return argv


@pytest.mark.parametrize("command, make, expect",
                         [pytest.param("sft", m, e, id=f"sft-{n}") for n, m, e in SFT_CASES]
                         + [pytest.param("reward", m, e, id=f"reward-{n}") for n, m, e in REWARD_CASES])
def test_sft_and_reward_bad_input(inputs, tmp_path, capsys, command, make, expect):
    out = tmp_path / "out"
    rc = main(other_argv(command, inputs, out, make(inputs, tmp_path)))
    check_error(rc, capsys.readouterr().err, expect)
    assert not out.exists()  # checked before anything is written


@pytest.mark.parametrize("command", ["sft", "reward"])
def test_sft_and_reward_refuse_a_used_output_dir(inputs, tmp_path, capsys, command):
    out = tmp_path / "out"
    previous_run(out)
    before = snapshot(out)
    check_error(main(other_argv(command, inputs, out, {})), capsys.readouterr().err,
                r"already holds files; pass --resume to continue that run, --overwrite to replace it")
    assert snapshot(out) == before


@pytest.mark.parametrize("command", ["sft", "reward"])
def test_sft_and_reward_overwrite_keeps_files_on_bad_data(inputs, tmp_path, capsys, command):
    out = tmp_path / "out"
    previous_run(out)
    before = snapshot(out)
    rc = main(other_argv(command, inputs, out, {"overwrite": True, "data": tmp_path / "missing.jsonl"}))
    check_error(rc, capsys.readouterr().err, r"does not exist")
    assert snapshot(out) == before
    # a model directory without weights is found only after the data loaded: still nothing changed
    rc = main(other_argv(command, inputs, out, {"overwrite": True, "model": inputs.no_weights}))
    check_error(rc, capsys.readouterr().err, r"no_weights has config\.json but no weights")
    assert snapshot(out) == before


@pytest.mark.parametrize("command", ["sft", "reward"])
def test_sft_and_reward_resume_refuses_another_commands_run(inputs, tmp_path, capsys, command):
    out = tmp_path / "out"
    previous_run(out)  # a ppo run: no sft_config.yaml / reward_config.yaml
    before = snapshot(out)
    check_error(main(other_argv(command, inputs, out, {"resume": True})), capsys.readouterr().err,
                rf"does not hold a run of this command \(no {command}_config\.yaml\); choose another directory")
    assert snapshot(out) == before


# ------------------------------------------------------------------ torchrun

@pytest.mark.parametrize("command", ["demo", "report", "reward-eval"])
def test_single_process_commands_refuse_torchrun(inputs, tmp_path, capsys, monkeypatch, command):
    """demo, report and reward-eval run as one process: under torchrun (WORLD_SIZE > 1) they say so
    before reading anything."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    out = tmp_path / "out"
    argv = {"demo": ["demo", "--output-dir", str(out), "--quick"],
            "report": ["report", "--run-dir", str(out)],
            "reward-eval": ["reward-eval", "--reward-model", str(inputs.model), "--data", str(out / "p.jsonl")]}[command]
    check_error(main(argv), capsys.readouterr().err,
                rf"^error: ppolm {command} runs as one process; launch it without torchrun \(WORLD_SIZE=2 is set\)$")
    assert not out.exists()


def test_world_size_without_torchrun_is_one_line(inputs, tmp_path):
    """WORLD_SIZE set by hand, without the rendezvous torchrun provides: one line saying how to launch."""
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "ppolm.cli", *ppo_argv(inputs, out, {"overwrite": None})],
                       env={**ENV, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, capture_output=True, text=True,
                       timeout=300)
    check_error(p.returncode, p.stderr, r"WORLD_SIZE=2 is set but MASTER_ADDR is not; launch with torchrun")
    assert not out.exists()


@pytest.mark.parametrize("command", ["eval", "reward-eval"])
def test_an_output_file_that_is_a_directory_is_refused_before_any_work(inputs, tmp_path, capsys, command):
    taken = tmp_path / "results"
    taken.mkdir()
    pairs = inputs.write("eval_pairs.jsonl", json.dumps({"prompt": "hi", "chosen": "a", "rejected": "b"}) + "\n")
    argv = ([command, "--policy", str(inputs.model), "--prompts", str(inputs.good_prompts)] if command == "eval"
            else [command, "--reward-model", str(inputs.model), "--data", str(pairs)])
    rc = main(argv + ["--output", str(taken), "--device", "cpu"])
    check_error(rc, capsys.readouterr().err, r"--output .*results is a directory; give a file path such as")
    assert list(taken.iterdir()) == []
