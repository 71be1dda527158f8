"""``ppolm eval`` on tiny random models (determinism, metrics, tokenizers), and the whole pipeline on the
embedded model (slow)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from ppolm import config
from ppolm.cli import main
from ppolm.evaluate import EvalConfig, distinct_n, evaluate
from ppolm.tiny import build_tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
REWARD_FILE = "def short(prompts, completions, **kw):\n    return [float(len(c.split()) <= 5) for c in completions]\n"


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_policy_dir, tiny_rm_dir):
    root = tmp_path_factory.mktemp("eval")
    other = build_tiny_model_dir(root / "other_policy", kind="causal", seed=7)
    (root / "rf.py").write_text(REWARD_FILE)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                               ["Hi!", "Name a colour.", "Tell me a joke.", "What is 2+2?", "Say yes."]))
    return {"root": root, "other": other, "rf": f"{root / 'rf.py'}:short", "prompts": prompts,
            "policy": tiny_policy_dir, "rm": tiny_rm_dir}


def with_extra_token(src: Path, dst: Path) -> Path:
    """A copy of a model directory whose tokenizer has one more token (a different vocabulary)."""
    from transformers import AutoTokenizer

    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(dst)
    tok.add_tokens(["<|extra_token|>"])
    tok.save_pretrained(dst)
    return dst


def eval_cfg(s, out, **over):
    base = dict(policy=[str(s["policy"]), str(s["other"])], prompts=str(s["prompts"]), reward_model=[str(s["rm"])],
                reward_fn=[s["rf"]], output=str(out), response_length=6, batch_size=3, samples_per_prompt=2,
                precision="fp32", device="cpu")
    return config.build(EvalConfig, {**base, **over})


def test_eval_is_deterministic_and_reports_every_metric(setup, tmp_path):
    a = evaluate(eval_cfg(setup, tmp_path / "a.json"))
    evaluate(eval_cfg(setup, tmp_path / "b.json"))
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    c = evaluate(eval_cfg(setup, tmp_path / "c.json", seed=1, policy=[str(setup["policy"])], reward_model=[]))
    assert c["samples"] != {k: v for k, v in a["samples"].items() if k == str(setup["policy"])}

    assert a["n_samples"] == 10
    first, second = (a["policies"][str(p)] for p in (setup["policy"], setup["other"]))
    rm_name = Path(setup["rm"]).name
    for r in (first, second):
        assert {"reward/total", f"reward/{rm_name}", "reward/short", "kl", "length", "distinct_1", "distinct_2",
                "eos_fraction"} <= set(r)
        assert 0 <= r["eos_fraction"] <= 1 and 0 < r["distinct_1"] <= 1 and 1 <= r["length"]["mean"] <= 6
        total = r["reward/total"]["mean"]
        assert total == pytest.approx(r[f"reward/{rm_name}"]["mean"] + r["reward/short"]["mean"], abs=1e-5)
    assert first["kl"] == {"mean": 0.0, "std": 0.0}  # the reference is the first policy
    assert second["kl"]["mean"] > 0  # a different random model: KL > 0 on its own samples
    samples = a["samples"][str(setup["other"])]
    assert len(samples) == 10 and {"prompt", "response", "score", "kl", "length"} <= set(samples[0])


def test_distinct_n():
    assert distinct_n(["a b a b", "a b"], 1) == pytest.approx(2 / 6)
    assert distinct_n(["a b a b", "a b"], 2) == pytest.approx(2 / 4)
    assert distinct_n([""], 2) == 0.0


def test_reward_model_with_another_tokenizer_scores_from_text(setup, tmp_path):
    rm2 = with_extra_token(setup["rm"], tmp_path / "rm_other_vocab")
    r = evaluate(eval_cfg(setup, tmp_path / "e.json", policy=[str(setup["policy"])], reward_fn=[],
                          reward_model=[str(setup["rm"]), str(rm2)]))
    res = r["policies"][str(setup["policy"])]
    # scored from the decoded text (re-tokenised by that model), so finite and varying, not equal
    assert set(res) >= {"reward/rm/rm_other_vocab", "reward/ensemble_mean"}
    assert res["reward/rm/rm_other_vocab"]["std"] > 0


def test_cli_table_json_and_errors(setup, tmp_path, capsys):
    out = tmp_path / "cli.json"
    args = ["eval", "--policy", str(setup["policy"]), "--prompts", str(setup["prompts"]), "--reward-fn", setup["rf"],
            "--output", str(out), "--response-length", "4", "--precision", "fp32", "--max-prompts", "2"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "reward/short" in text and "distinct-2" in text and "ends with EOS" in text
    assert json.loads(out.read_text())["n_samples"] == 2

    other_vocab = with_extra_token(setup["other"], tmp_path / "pol_other_vocab")
    assert main(args + ["--reference", str(other_vocab)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "different tokenizers" in err[0] and "--reference" in err[0]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(args[:3] + ["--prompts", str(empty), "--output", str(out)]) == 2
    assert "holds no rows" in capsys.readouterr().err
    assert main(args[:5] + ["--reward-fn", "nope.py:f", "--output", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


def head_rows(src: Path, n: int, dst: Path) -> Path:
    dst.write_text("".join(src.read_text(encoding="utf-8").splitlines(keepends=True)[:n]), encoding="utf-8")
    return dst


@pytest.mark.slow
def test_whole_pipeline_on_the_embedded_model(tmp_path):
    """sft -> reward -> ppo -> eval on (the first rows of) the example files; each stage's output feeds the next.
    fp32 and few rows: minutes on 2 CPU cores without bf16 support."""
    sft, rm, ppo, ev = (tmp_path / n for n in ("sft", "rm", "ppo", "eval.json"))
    demos = head_rows(EXAMPLES / "sft.jsonl", 10, tmp_path / "sft.jsonl")
    pairs = head_rows(EXAMPLES / "pairs.jsonl", 10, tmp_path / "pairs.jsonl")
    prompts = str(EXAMPLES / "prompts.jsonl")
    common = ["--quiet", "--precision", "fp32"]
    assert main(["sft", "--model", "smollm2-135m-instruct", "--data", str(demos), "--output-dir", str(sft),
                 "--epochs", "1", *common]) == 0
    assert main(["reward", "--model", str(sft), "--data", str(pairs), "--output-dir", str(rm), "--epochs", "1",
                 "--lr", "1e-4", "--norm-samples", "8", "--norm-response-length", "16", *common]) == 0
    assert json.loads((rm / "ppolm_reward.json").read_text())["n_samples"] == 8
    assert main(["reward-eval", "--reward-model", str(rm), "--data", str(pairs), "--precision", "fp32"]) == 0
    assert main(["ppo", "--model", str(sft), "--reward-model", str(rm), "--prompts", prompts, "--steps", "1",
                 "--batch-size", "2", "--minibatches", "1", "--ppo-epochs", "1", "--response-length", "16",
                 "--output-dir", str(ppo), *common]) == 0
    assert main(["eval", "--policy", str(sft), "--policy", str(ppo / "policy"), "--prompts", prompts,
                 "--reward-model", str(rm), "--max-prompts", "2", "--response-length", "16", "--output", str(ev),
                 "--precision", "fp32"]) == 0
    res = json.loads(ev.read_text())
    assert set(res["policies"]) == {str(sft), str(ppo / "policy")}
    assert all(math.isfinite(r["reward/total"]["mean"]) for r in res["policies"].values())
