"""Reading the user's data files: prompts, demonstrations, preference pairs, text corpora.

Every reader returns a list of plain dict rows and reports problems as one PPOLMError line that
names the file (and the line, for JSONL). Formats: ``.jsonl``, ``.json`` (a list of objects),
``.txt`` (one row per line, in the column given), ``.parquet``, ``.csv``, and a directory saved
by ``datasets.Dataset.save_to_disk``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ppolm.errors import PPOLMError

BUILTIN_PROMPTS = Path(__file__).parent / "data" / "prompts.jsonl"


def read_rows(path: str | Path, *, text_column: str = "prompt") -> list[dict[str, Any]]:
    """Rows of a data file as dicts (see the module docstring for the formats)."""
    p = Path(path)
    if not p.exists():
        raise PPOLMError(f"data file {p} does not exist; check the path")
    if p.is_dir():
        rows = _read_datasets_dir(p)
    else:
        suffix = p.suffix.lower()
        if suffix == ".jsonl":
            rows = _read_jsonl(p)
        elif suffix == ".json":
            rows = _read_json(p)
        elif suffix == ".txt":
            lines = [ln.strip() for ln in _read_text(p).splitlines()]
            rows = [{text_column: ln} for ln in lines if ln]
        elif suffix in (".parquet", ".csv"):
            rows = _read_with_datasets(p, suffix[1:])
        else:
            raise PPOLMError(f"data file {p} has an unsupported type '{suffix}'; use .jsonl, .json, .txt, "
                             ".parquet, .csv or a saved datasets directory")
    if not rows:
        raise PPOLMError(f"data file {p} holds no rows; add at least one")
    return rows


def _read_text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PPOLMError(f"data file {p} is not UTF-8 text (bad byte at offset {e.start}); re-save it as UTF-8") from None


def _read_jsonl(p: Path) -> list[dict[str, Any]]:
    return parse_jsonl(_read_text(p), p)


def parse_jsonl(text: str, p: Path | str) -> list[dict[str, Any]]:
    """The objects of JSONL ``text`` (read from ``p``), blank lines skipped; a bad line is one error
    naming the file and the line."""
    rows = []
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PPOLMError(f"{p} line {i} is not valid JSON ({e.msg}); fix or remove that line") from None
        if not isinstance(row, dict):
            raise PPOLMError(f"{p} line {i} is a {type(row).__name__}, not a JSON object; write one object per line")
        rows.append(row)
    return rows


def _read_json(p: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(_read_text(p))
    except json.JSONDecodeError as e:
        raise PPOLMError(f"{p} is not valid JSON (line {e.lineno}: {e.msg}); fix the file") from None
    if isinstance(data, dict):  # {"col": [..], ...} column layout
        if all(isinstance(v, list) for v in data.values()) and data:
            n = {len(v) for v in data.values()}
            if len(n) != 1:
                raise PPOLMError(f"{p}: columns have different lengths; make them equal")
            return [dict(zip(data, vals)) for vals in zip(*data.values())]
        raise PPOLMError(f"{p} must hold a list of objects (or an object of equal-length column lists)")
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise PPOLMError(f"{p} must hold a list of JSON objects")
    return data


def _read_with_datasets(p: Path, kind: str) -> list[dict[str, Any]]:
    import datasets

    datasets.disable_progress_bars()
    log = logging.getLogger("datasets")
    level, log.level = log.level, logging.CRITICAL  # it logs the reader's error too: one line, ours, is enough
    try:
        ds = datasets.Dataset.from_parquet(str(p)) if kind == "parquet" else datasets.Dataset.from_csv(str(p))
    except Exception as e:  # pyarrow raises many types for a corrupt file
        detail = str(e).split("\n")[0][:160]
        raise PPOLMError(f"{p} could not be read as {kind} ({type(e).__name__}: {detail}); check the file") from None
    finally:
        log.setLevel(level)
    return ds.to_list()


def _read_datasets_dir(p: Path) -> list[dict[str, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:
        raise PPOLMError(f"{p} is not a directory saved by datasets' save_to_disk ({type(e).__name__}); "
                         "pass a data file or a saved dataset") from None
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else next(iter(ds))
        ds = ds[split]
    return ds.to_list()


def check_messages(msgs: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in msgs):
        raise PPOLMError(f"{where}: 'messages' must be a non-empty list of {{'role': str, 'content': str}} objects")
    return msgs


@dataclass
class Prompt:
    """One prompt: what the reward functions see (text or chat list), its token ids, and extra columns."""

    raw: str | list[dict[str, str]]
    """The prompt as given: a string, or a chat-message list."""
    ids: list[int]
    """Token ids fed to the policy (chat template applied)."""
    extra: dict[str, Any]
    """Every other column of the row (e.g. a reference 'answer'), passed to reward functions."""


def encode_prompt(raw: str | list[dict[str, str]], tokenizer: Any, chat_template: bool) -> list[int]:
    if isinstance(raw, list) or chat_template:
        msgs = raw if isinstance(raw, list) else [{"role": "user", "content": raw}]
        if not getattr(tokenizer, "chat_template", None):
            raise PPOLMError("the tokenizer has no chat template, so 'messages' prompts cannot be formatted; "
                             "use text prompts with --no-chat-template or a chat model")
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(raw, add_special_tokens=True)["input_ids"]


def load_prompts(path: str | Path | None, tokenizer: Any, *, chat_template: bool = True,
                 max_length: int = 512, context_length: int | None = None,
                 response_length: int = 0) -> list[Prompt]:
    """Read and tokenise prompts; ``None`` gives the built-in set."""
    p = Path(path) if path is not None else BUILTIN_PROMPTS
    rows = read_rows(p, text_column="prompt")
    out = []
    for i, row in enumerate(rows, start=1):
        where = f"{p} row {i}"
        if "messages" in row and row["messages"] is not None:
            raw: Any = check_messages(row["messages"], where)
            if raw[-1]["role"] == "assistant":  # a conversation with its answer: prompt is what precedes it
                raw = raw[:-1]
                if not raw:
                    raise PPOLMError(f"{where}: 'messages' holds only an assistant turn; add the user turn")
        elif "prompt" in row:
            raw = row["prompt"]
            if isinstance(raw, list):
                raw = check_messages(raw, where)
            elif not isinstance(raw, str) or not raw.strip():
                raise PPOLMError(f"{where}: 'prompt' must be a non-empty string or a chat-message list; "
                                 f"got {type(raw).__name__}")
        else:
            raise PPOLMError(f"{where} has no 'prompt' or 'messages' column (columns: {', '.join(map(str, row))}); "
                             "rename the prompt column to 'prompt'")
        ids = encode_prompt(raw, tokenizer, chat_template)
        if len(ids) > max_length:
            raise PPOLMError(f"{where} is {len(ids)} tokens, longer than --max-prompt-length {max_length}; "
                             "shorten it or raise the limit")
        if context_length is not None and len(ids) + response_length > context_length:
            raise PPOLMError(f"{where} is {len(ids)} tokens; with --response-length {response_length} it exceeds "
                             f"the model's context of {context_length} tokens; shorten it")
        extra = {k: v for k, v in row.items() if k not in ("prompt", "messages")}
        out.append(Prompt(raw=raw, ids=ids, extra=extra))
    return out


def load_text_corpus(path: str | Path) -> list[str]:
    """Documents of a plain-text corpus (for PPO-ptx): .txt lines or a 'text' column."""
    rows = read_rows(path, text_column="text")
    texts = []
    for i, row in enumerate(rows, start=1):
        t = row.get("text")
        if not isinstance(t, str):
            raise PPOLMError(f"{path} row {i} has no 'text' string column; name the column 'text'")
        if t.strip():
            texts.append(t)
    if not texts:
        raise PPOLMError(f"{path} holds no non-empty text")
    return texts


class PromptOrder:
    """Which prompt each rollout row gets. Row i of the run (step s holds rows s*B .. s*B + B - 1)
    takes position i mod n of pass i // n's permutation, drawn from ``seed`` and the pass number
    alone: the prompts of a step depend only on the seed and the step, so a resumed run picks the
    same ones. Each pass's permutation is drawn once and kept until the next pass begins: O(B) per
    step, amortised, instead of an O(n) permutation per row."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self.epoch, self.perm = -1, []  # the cached pass and its permutation

    def permutation(self, epoch: int) -> list[int]:
        if epoch != self.epoch:
            g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
            self.perm, self.epoch = torch.randperm(self.n, generator=g).tolist(), epoch
        return self.perm

    def indices(self, step: int, batch_size: int) -> list[int]:
        """The prompt indices of ``step``'s batch."""
        first = step * batch_size
        return [self.permutation(i // self.n)[i % self.n] for i in range(first, first + batch_size)]
