"""The files of ``ppolm label`` (ppolm/label.py) and the labelling state they hold: the
sampled answers, the judgements, and the preference pairs the rankings give.

Files in ``--output-dir``:

* ``label.json``: the settings (model, prompts, K, sampling); a rerun with other settings is refused;
* ``answers.jsonl``: one row per prompt, its K sampled answers, appended by the sampler as it goes,
  so a restart samples only what is missing;
* ``judgements.jsonl``: one row per judgement (ranking best first, ties as groups, or a skip, and an
  optional note), appended and fsynced before the page is told it is saved; an undo rewrites the
  file without its last row (temp file + rename);
* ``pairs.jsonl``: the pairs ``ppolm reward --data`` reads, rewritten from the judgements after
  each change: every two answers in different groups of a ranking, the better one chosen. Answers
  tied with each other give no pair; a skipped prompt gives none; neither do two answers of the same
  text or an empty answer (nothing to prefer).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ppolm.data import parse_jsonl
from ppolm.errors import PPOLMError

MAX_NOTE = 2000
"""Longest note kept with a judgement, in characters."""
FILES = ("label.json", "answers.jsonl", "judgements.jsonl", "pairs.jsonl")


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# ------------------------------------------------------------------------------------ pairs

def expand_pairs(judgement: dict[str, Any]) -> list[dict[str, Any]]:
    """The chosen/rejected pairs of one judgement: every two answers in different groups of its
    ranking (groups best first), the better one chosen; nothing for a skip, for answers tied in one
    group, for two answers of the same text or for an empty answer. Each row keeps the judgement's
    model, sampling settings, labeller and time."""
    if judgement.get("skipped"):
        return []
    answers, groups = judgement["answers"], judgement["ranking"]
    keep = {k: judgement[k] for k in ("model", "sampling", "labeller", "time") if k in judgement}
    keep["judgement"] = judgement.get("id")
    rows = []
    for gi, better in enumerate(groups):
        for worse in groups[gi + 1:]:
            for c in better:
                for r in worse:
                    a, b = answers[c], answers[r]
                    if not a.strip() or not b.strip() or a.strip() == b.strip():
                        continue
                    rows.append({"prompt": judgement["prompt"], "chosen": a, "rejected": b,
                                 "chosen_answer": c, "rejected_answer": r, **keep})
    return rows


def ranking_from_labels(k: int, pairs: list[tuple[int, int]], labels: list[float]) -> list[list[int]]:
    """Groups of answers, best first, ordered by their wins over the C(K, 2) labels (a tie counts
    half to each; Copeland's rule). Equal wins are a tie. Labels that follow one score order give
    that order."""
    wins = [0.0] * k
    for (i, j), y in zip(pairs, labels):
        wins[i] += y
        wins[j] += 1 - y
    order = sorted(set(wins), reverse=True)
    return [[i for i in range(k) if wins[i] == w] for w in order]


# ------------------------------------------------------------------------------------ files

def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def append_line(path: Path, row: dict[str, Any]) -> None:
    """Append one JSON line and flush it to disk before returning."""
    data = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace ``path`` with ``rows`` as JSON lines: a temp file, fsynced, renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)


def read_lines(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file this command wrote. A last line cut short (the process killed while
    writing it) is dropped and cut off the file; any other bad line is an error."""
    if not path.is_file():
        return []
    raw = path.read_bytes()
    body, _, tail = raw.rpartition(b"\n")
    if tail.strip():  # no newline at the end: an unfinished write
        print(f"{path}: dropping an unfinished last line ({len(tail)} bytes)", file=sys.stderr)
        with open(path, "r+b") as f:
            f.truncate(len(body) + 1 if body else 0)
    return parse_jsonl(body.decode("utf-8", errors="replace") if body else "", path)


class BadRequest(Exception):
    """A judgement or undo the store refuses: ``status`` is the HTTP code, the message says why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class LabelStore:
    """The labelling state on disk and in memory: prompts, sampled answers, judgements.

    Every change goes through :meth:`submit` or :meth:`undo` (the web page's handlers and
    ``--judge`` alike), under one lock: validated in full, then written and fsynced, then applied
    in memory, so a refused request changes nothing."""

    def __init__(self, out: Path, settings: dict[str, Any], prompts: list[Any],
                 columns: list[dict[str, Any]] | None = None):
        self.out, self.settings, self.prompts = out, settings, prompts
        self.columns = columns or [{} for _ in prompts]
        """Each prompt's other columns (a reference answer, ...), passed to a judge."""
        self.lock = threading.Lock()
        self.error: str | None = None
        self.sampling_done = threading.Event()
        out.mkdir(parents=True, exist_ok=True)
        found = out / "label.json"
        if found.is_file():
            try:
                old = json.loads(found.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                raise PPOLMError(f"{found} is not valid JSON; restore it or choose another --output-dir") from None
            diff = [k for k in settings if old.get(k) != settings[k]]
            if diff:
                k = diff[0]
                raise PPOLMError(f"{out} holds labels made with other settings ({k}: {old.get(k)!r}, now "
                                 f"{settings[k]!r}); rerun with those, or choose another --output-dir")
        else:
            tmp = found.with_name("label.json.tmp")
            tmp.write_text(json.dumps(settings, indent=2, ensure_ascii=False), encoding="utf-8")
            tmp.replace(found)
        self.answers: dict[int, dict[str, Any]] = {}
        for row in read_lines(out / "answers.jsonl"):
            i = row.get("index")
            if not isinstance(i, int) or not 0 <= i < len(prompts) or len(row.get("answers", [])) != settings["k"]:
                raise PPOLMError(f"{out / 'answers.jsonl'} has a row that does not fit these prompts (index {i!r}); "
                                 "choose another --output-dir")
            self.answers[i] = row
        self.judgements = read_lines(out / "judgements.jsonl")
        for n, j in enumerate(self.judgements, start=1):
            if not (j.get("index") in self.answers and isinstance(j.get("ranking"), list)
                    and isinstance(j.get("answers"), list) and isinstance(j.get("id"), str)):
                raise PPOLMError(f"{out / 'judgements.jsonl'} line {n} is not a judgement of these answers; "
                                 "restore the file or choose another --output-dir")
        self.judged = {j["index"] for j in self.judgements}
        self.write_pairs()

    # -- sampling side
    def missing(self) -> list[int]:
        with self.lock:
            return [i for i in range(len(self.prompts)) if i not in self.answers]

    def add_answers(self, index: int, answers: list[str]) -> None:
        row = {"index": index, "prompt": self.prompts[index], "answers": answers, "model": self.settings["model"],
               "sampling": self.settings["sampling"], "time": now()}
        with self.lock:
            append_line(self.out / "answers.jsonl", row)
            self.answers[index] = row

    # -- labelling side
    def next_index(self) -> int | None:
        return next((i for i in sorted(self.answers) if i not in self.judged), None)

    def state(self, index: int | None = None) -> dict[str, Any]:
        """What the page shows: counters, and the prompt to judge (``index`` or the next one)."""
        with self.lock:
            i = self.next_index() if index is None else index
            item = None
            if i is not None:
                row = self.answers[i]
                item = {"index": i, "prompt": display(row["prompt"]), "answers": row["answers"]}
            pairs = sum(len(expand_pairs(j)) for j in self.judgements)
            return {"done": len(self.judged), "total": len(self.prompts), "sampled": len(self.answers),
                    "skipped": sum(bool(j.get("skipped")) for j in self.judgements), "pairs": pairs,
                    "k": self.settings["k"], "item": item, "error": self.error,
                    "sampling": not self.sampling_done.is_set(),
                    "last": self.judgements[-1]["id"] if self.judgements else None}

    def check(self, body: Any) -> dict[str, Any]:
        """A judgement request, validated in full: {"index": int, "ranking": [[int, ...], ...] best
        first (a group holds tied answers), "skip": bool, "note": str}."""
        if not isinstance(body, dict):
            raise BadRequest(400, "the request body must be a JSON object")
        extra = set(body) - {"index", "ranking", "skip", "note"}
        if extra:
            raise BadRequest(400, f"unknown field {sorted(extra)[0]!r}; send index, ranking, skip, note")
        i, skip, note = body.get("index"), body.get("skip", False), body.get("note", "")
        if not isinstance(i, int) or isinstance(i, bool):
            raise BadRequest(400, "'index' must be an integer")
        if not isinstance(skip, bool):
            raise BadRequest(400, "'skip' must be true or false")
        if not isinstance(note, str) or len(note) > MAX_NOTE:
            raise BadRequest(400, f"'note' must be text of at most {MAX_NOTE} characters")
        if i not in self.answers:
            raise BadRequest(404, f"no sampled prompt has index {i}")
        if i in self.judged:
            raise BadRequest(409, f"prompt {i} is already judged; undo that judgement first")
        k = self.settings["k"]
        ranking = body.get("ranking")
        if skip:
            if ranking not in (None, []):
                raise BadRequest(400, "a skipped prompt has no ranking; send either skip or a ranking")
            ranking = []
        else:
            if not (isinstance(ranking, list) and ranking and all(
                    isinstance(g, list) and g and all(isinstance(a, int) and not isinstance(a, bool) for a in g)
                    for g in ranking)):
                raise BadRequest(400, "'ranking' must be a list of non-empty lists of answer numbers, best first")
            if sorted(a for g in ranking for a in g) != list(range(k)):
                raise BadRequest(400, f"'ranking' must place each of the {k} answers (0..{k - 1}) exactly once")
        row = self.answers[i]
        return {"id": uuid.uuid4().hex, "index": i, "prompt": row["prompt"], "answers": row["answers"],
                "ranking": ranking, "skipped": skip, "note": note.strip(), "model": row["model"],
                "sampling": row["sampling"], "sampled_at": row["time"]}

    def submit(self, body: Any, labeller: str = "person") -> dict[str, Any]:
        """Validate a judgement, append it to judgements.jsonl (fsynced) and refresh pairs.jsonl."""
        with self.lock:
            row = {**self.check(body), "labeller": labeller, "time": now()}
            append_line(self.out / "judgements.jsonl", row)
            self.judgements.append(row)
            self.judged.add(row["index"])
            self.write_pairs()
            return row

    def undo(self, body: Any = None) -> int:
        """Remove the last judgement (``{"id": ...}``: only if it is that one); returns its prompt's index."""
        if body is not None and not isinstance(body, dict):
            raise BadRequest(400, "the request body must be a JSON object")
        with self.lock:
            if not self.judgements:
                raise BadRequest(409, "there is no judgement to undo")
            want = (body or {}).get("id")
            last = self.judgements[-1]
            if want is not None and want != last["id"]:
                raise BadRequest(409, "only the last judgement can be undone, and that is another one")
            write_atomic(self.out / "judgements.jsonl", self.judgements[:-1])
            self.judgements.pop()
            self.judged.discard(last["index"])
            self.write_pairs()
            return last["index"]

    def write_pairs(self) -> None:
        write_atomic(self.out / "pairs.jsonl", [p for j in self.judgements for p in expand_pairs(j)])


def display(prompt: Any) -> str:
    """A prompt as plain text: a chat list becomes one 'role: content' paragraph per message."""
    if isinstance(prompt, list):
        return "\n\n".join(f"{m['role']}: {m['content']}" for m in prompt)
    return str(prompt)
