"""The docs cannot go stale: the generated references match the code, every option's help fits two
lines, `ppolm ppo --help` groups its options by section, and every relative link and anchor in
README.md and docs/*.md resolves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ppolm import config, docs_gen
from ppolm.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_HELP_CHARS = 160


def test_generated_references_are_current():
    bad = [str(p.relative_to(ROOT)) for p in docs_gen.stale()]
    assert not bad, f"{', '.join(bad)} differ from what the code generates; run `python -m ppolm.docs_gen`"


def test_metric_names_in_the_docs_are_the_names_the_code_writes():
    in_code, documented = docs_gen.metric_names_in_code(), docs_gen.documented_metric_names()
    assert in_code - documented == set(), "metrics without a meaning in ppolm/docs_gen.py"
    assert documented - in_code == set(), "documented metrics that no code writes"
    assert {"objective/kl", "adv/unearned", "eval/score_se", "policy/update_scale"} <= documented


def test_a_real_run_writes_only_documented_metrics(tiny_policy_dir, tmp_path):
    from ppolm.ppo import train_ppo
    from ppolm.ppo_config import PPOConfig

    rewards = tmp_path / "my_rewards.py"
    rewards.write_text("def short(prompts, completions, **kw):\n    return [-len(c) / 10 for c in completions]\n")
    held = tmp_path / "held.txt"
    held.write_text("Say something.\nName a colour.\n")
    out = tmp_path / "run"
    cfg = config.build(PPOConfig, dict(model=str(tiny_policy_dir), reward_fn=[f"{rewards}:short"], steps=2,
                                       batch_size=4, minibatches=2, response_length=6, output_dir=str(out),
                                       quiet=True, precision="fp32", save_every=2, eval_prompts=str(held),
                                       eval_every=1, update_kl_max=0.1))
    train_ppo(cfg)

    def undocumented(path: Path, names: dict[str, str]) -> set[str]:
        keys = {k for line in path.read_text().splitlines() for k in json.loads(line)}
        patterns = [re.escape(n).replace("<source>", "[^/]+").replace("<name>", "[a-z_]+") for n in names]
        return {k for k in keys if not any(re.fullmatch(p, k) for p in patterns)}

    assert undocumented(out / "metrics.jsonl", docs_gen.PPO_METRICS) == set()
    assert undocumented(out / "eval.jsonl", docs_gen.EVAL_METRICS) == set()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"reward/short", "policy/update_kl", "objective/score_scale"} <= set(rows[0])


def help_blocks(command: str, capsys, monkeypatch) -> tuple[list[str], dict[str, list[str]]]:
    """``ppolm COMMAND --help`` at 100 columns: the group titles in order, and each option's help lines."""
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    titles, blocks, current = [], {}, None
    for line in capsys.readouterr().out.splitlines():
        if re.match(r"^[A-Za-z][\w -]*:$", line):
            titles.append(line[:-1])
        elif line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            blocks[current] = []
        elif line.startswith("      ") and current:
            blocks[current].append(line.strip())
    return titles, blocks


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_option_help_fits_two_lines_with_its_default(command, capsys, monkeypatch):
    cls = docs_gen._command_class(COMMANDS[command][0])
    _, blocks = help_blocks(command, capsys, monkeypatch)
    for name, (_sec, f, _t) in config.leaf_fields(cls).items():
        flag = "--" + name.replace("_", "-")
        doc = config.option_help(cls, name).rsplit(" [default: ", 1)[0]
        assert len(doc) <= MAX_HELP_CHARS, f"{command} {flag}: {len(doc)} characters; move the rest to docs/"
        lines = blocks[flag]
        assert 1 <= len(lines) <= 2, f"{command} {flag}: {len(lines)} lines of help"
        assert f"[default: {config.default_text(f)}]" in " ".join(lines), (command, flag)


def test_ppo_help_groups_options_by_section(capsys, monkeypatch):
    titles, blocks = help_blocks("ppo", capsys, monkeypatch)
    assert titles == ["options", "Model", "Reward", "Generation", "Algorithm", "KL", "Run"]
    groups = dict(config.option_groups(docs_gen._command_class(COMMANDS["ppo"][0])))
    assert "kl_target" in groups["KL"] and "score_center" in groups["Reward"] and "seed" in groups["Run"]
    assert "--kl-target" in blocks and "--no-whiten-advantages" not in blocks  # one entry per boolean


def test_sft_help_groups_the_shared_options(capsys, monkeypatch):
    titles, _ = help_blocks("sft", capsys, monkeypatch)
    assert titles[0] == "options" and {"LoRA", "Optimiser", "Run", "Device and model loading"} <= set(titles)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces as '-'."""
    text = heading.strip().lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not (m := re.match(r"^#{1,6} (.+)$", line)):
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def broken_links(path: Path) -> list[str]:
    """The relative links of a Markdown file whose file or #anchor does not exist (code spans and
    blocks aside)."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    bad = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no such heading)")
    return bad


def test_slugs_and_the_link_checker_by_hand(tmp_path):
    assert slug("A ceiling on β (`--kl-coef-max`)") == "a-ceiling-on-β---kl-coef-max"
    assert slug("2b. Or without a reward model: `ppolm dpo`") == "2b-or-without-a-reward-model-ppolm-dpo"
    page = tmp_path / "page.md"
    page.write_text("# Top\n## Run\n## Run\n[a](#run-1) [b](#run-2) [c](other.md) [d](page.md#top) "
                    "`[e](nowhere.md)` [f](https://example.com/x)\n")
    assert broken_links(page) == ["#run-2 (no such heading)", "other.md (no such file)"]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(path):
    assert broken_links(path) == []


def test_readme_is_short_and_starts_with_the_set_up():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 250
    text = "\n".join(lines)
    assert "../" not in text and text.index("## Set up") < text.index("## Commands")
    for command in COMMANDS:
        assert f"`ppolm {command}`" in text, command
