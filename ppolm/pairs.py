"""Preference pairs: reading a pairs file (prompt, chosen, rejected, optional margin) with one clear
error per bad row, and laying each pair out as PPO scores a rollout (prompt, response, EOS). Read by
``ppolm reward``, ``ppolm dpo``, ``ppolm reward-eval`` and the reward-model checks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ppolm import sft
from ppolm.data import check_messages, encode_prompt, read_rows
from ppolm.errors import PPOLMError


@dataclass
class Pair:
    prompt: Any
    """Prompt text or chat list (what PPO feeds the policy)."""
    chosen: str
    rejected: str
    margin: float = 0.0


def _response(x: Any, where: str, col: str) -> tuple[str, list[dict[str, str]]]:
    """A chosen/rejected cell -> (response text, the conversation before it)."""

    if isinstance(x, list):
        msgs = check_messages(x, f"{where} '{col}'")
        if msgs[-1]["role"] != "assistant":
            raise PPOLMError(f"{where}: '{col}' must end with an assistant turn (the response)")
        text, prefix = msgs[-1]["content"], msgs[:-1]
    elif isinstance(x, str):
        text, prefix = x, []
    else:
        raise PPOLMError(f"{where}: '{col}' must be text or a chat-message list; got {type(x).__name__}")
    if not text.strip():
        raise PPOLMError(f"{where}: '{col}' is empty; remove the row or fill it in")
    return text, prefix


def load_pairs(path: str, margin_column: str | None = "margin") -> list[Pair]:
    """Read and check a pairs file; every problem is one line naming the row and the fix."""

    pairs = []
    for i, row in enumerate(read_rows(path, text_column="prompt"), start=1):
        where = f"{path} row {i}"
        missing = [c for c in ("chosen", "rejected") if c not in row]
        if missing:
            raise PPOLMError(f"{where} has no {' or '.join(repr(c) for c in missing)} column (columns: "
                             f"{', '.join(map(str, row))}); a pairs file needs 'prompt', 'chosen' and 'rejected'")
        chosen, pre_c = _response(row["chosen"], where, "chosen")
        rejected, pre_r = _response(row["rejected"], where, "rejected")
        prompt = row.get("prompt")
        if prompt is None:
            if not pre_c or pre_c != pre_r:
                raise PPOLMError(f"{where} has no 'prompt' column and 'chosen'/'rejected' are not conversations "
                                 "with the same user turns; add a 'prompt' column")
            prompt = pre_c
        elif isinstance(prompt, list):
            prompt = check_messages(prompt, where) + pre_c
        elif not isinstance(prompt, str) or not prompt.strip():
            raise PPOLMError(f"{where}: 'prompt' must be a non-empty string or a chat-message list")
        if chosen.strip() == rejected.strip():
            raise PPOLMError(f"{where}: 'chosen' equals 'rejected', so the pair prefers nothing; "
                             "remove the row or correct one side")
        margin = row.get(margin_column) if margin_column else None
        try:
            margin = 0.0 if margin is None else float(margin)
        except (TypeError, ValueError):
            raise PPOLMError(f"{where}: '{margin_column}' must be a number; got {margin!r}") from None
        pairs.append(Pair(prompt, chosen, rejected, margin))
    return pairs


def encode_pairs(pairs: list[Pair], tok: Any, chat_template: bool, max_length: int, path: str = "data"):
    """-> list of (chosen ids, rejected ids, margin), laid out as PPO scores a rollout."""
    return [(c, r, m) for _, c, r, m in encode_pairs_with_prompts(pairs, tok, chat_template, max_length, path)]


def encode_pairs_with_prompts(pairs: list[Pair], tok: Any, chat_template: bool, max_length: int,
                              path: str = "data") -> list[tuple[int, list[int], list[int], float]]:
    """-> list of (prompt length, chosen ids, rejected ids, margin): each ids list is the encoded prompt
    (its first ``prompt length`` ids) then the response and EOS, as :func:`encode_pairs` (``ppolm dpo``
    needs the prompt length to count the response tokens only)."""

    out = []
    for i, p in enumerate(pairs, start=1):
        p_ids = encode_prompt(p.prompt, tok, chat_template)
        where = f"{path} row {i}"
        out.append((len(p_ids), sft.encode_response(p_ids, p.chosen, tok, max_length, where),
                    sft.encode_response(p_ids, p.rejected, tok, max_length, where), p.margin))
    return out


def group_keys(pairs: list[Pair]) -> list[int]:
    """Group number of each pair: pairs with the same prompt (text or chat list) share one."""
    ids: dict[str, int] = {}
    return [ids.setdefault(json.dumps(p.prompt, sort_keys=True), len(ids)) for p in pairs]
