"""Reward services: a reward computed by another process or machine, reached over HTTP (``--reward-url``).

The protocol is OpenRLHF's remote reward model's (its ``serve_rm`` and ``remote_rm_fn``), so a
service written for OpenRLHF works unchanged, and ``ppolm serve-rm`` (ppolm/serve_rm.py) serves
any ppolm reward model in it::

    POST <url>   {"query": [prompt + response text, ...], "prompts": [prompt text, ...], "labels": [...]}
    answer       {"rewards": [number, ...]}          one per query, in order

``query`` is each prompt+response as the policy's tokenizer decodes it (chat template and special
tokens such as the end-of-sequence token kept, padding dropped): the text a reward model with
another tokenizer reads in-process. ``prompts`` holds the prompt part of each query (a prefix of
it) and ``labels`` the prompts file's ``--reward-url-label-column`` value of each row (null where
there is none). A URL without a path (``http://host:5000``) is sent to ``/get_reward``; one with a
path is used as given.

One ``--reward-url`` is one reward source, weighted on its own (``--reward-url-weights``). Its
value may list several comma-separated URLs, replicas of one service: a batch is cut into requests
of at most ``--reward-url-batch-size`` rows (and at least one request per replica), dealt to the
replicas in turn, and all are sent at once. A request that fails to connect, outlasts
``--reward-url-timeout`` or is answered with HTTP 408, 429 or 5xx is tried again after
0.5 s, 1 s, 2 s, ... (``--reward-url-retries`` more times). What happens when it still fails is in
docs/rewards.md ("When a service fails").
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import torch

from ppolm.errors import PPOLMError
from ppolm.rewards import ScoreBatch

DEFAULT_PATH = "/get_reward"
"""The path a URL without one is sent to (OpenRLHF's)."""
BACKOFF_S = 0.5
"""The first wait before a retry; each further one doubles, up to BACKOFF_MAX_S."""
BACKOFF_MAX_S = 8.0
RETRY_STATUS = {408, 429}
"""HTTP statuses below 500 that are worth another try (timeout, rate limit)."""


class ServiceDown(Exception):
    """A request that failed every try for a reason a later try might not meet (the service was
    unreachable, slow, or answered 408/429/5xx)."""


def endpoint(url: str, what: str) -> str:
    """Check an http(s) URL and return where requests go: ``/get_reward`` appended when it has no path."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PPOLMError(f"{what} '{url}' is not an http:// or https:// URL with a host (e.g. http://127.0.0.1:5000)")
    if parts.username or parts.password:
        raise PPOLMError(f"{what} '{url}' holds credentials; ppolm sends none in URLs (use an API key variable: "
                         "docs/rewards.md)")
    try:
        parts.port  # noqa: B018  (raises on a malformed port)
    except ValueError:
        raise PPOLMError(f"{what} '{url}' has a malformed port") from None
    return url.strip() if parts.path not in ("", "/") else url.strip().rstrip("/") + DEFAULT_PATH


def snippet(text: str, n: int = 160) -> str:
    """The start of a response body, on one line."""
    one = " ".join(text.split())
    return one if len(one) <= n else one[:n] + "..."


async def post_json(client: Any, url: str, body: dict[str, Any], *, retries: int, timeout: float, what: str,
                    headers: dict[str, str] | None = None) -> Any:
    """POST ``body`` as JSON and return the decoded JSON answer. Transport failures, timeouts and
    HTTP 408/429/5xx are retried ``retries`` times with exponential backoff, then raise
    :class:`ServiceDown`; any other HTTP error or a body that is not JSON raises PPOLMError at once.
    ``what`` names the service in messages (never the headers: they may hold an API key)."""
    import httpx

    problem = ""
    for attempt in range(retries + 1):
        if attempt:
            await asyncio.sleep(min(BACKOFF_S * 2 ** (attempt - 1), BACKOFF_MAX_S))
        try:
            async with asyncio.timeout(timeout):  # the whole request, however slowly its bytes trickle in
                r = await client.post(url, content=json.dumps(body, ensure_ascii=False).encode(),
                                      headers={"content-type": "application/json", **(headers or {})},
                                      timeout=timeout)
        except (httpx.TimeoutException, TimeoutError):
            problem = f"did not answer within {timeout:g} s"
            continue
        except httpx.HTTPError as e:
            problem = f"cannot be reached ({type(e).__name__}: {snippet(str(e), 100) or 'no detail'})"
            continue
        if r.status_code >= 500 or r.status_code in RETRY_STATUS:
            problem = f"answered HTTP {r.status_code}: {snippet(r.text) or '(empty body)'}"
            continue
        if r.status_code >= 400:
            raise PPOLMError(f"{what} answered HTTP {r.status_code}: {snippet(r.text) or '(empty body)'}")
        try:
            return r.json()
        except ValueError:
            raise PPOLMError(f"{what} answered with a body that is not JSON: {snippet(r.text) or '(empty)'}") from None
    tries = f"{retries + 1} tries" if retries else "1 try"
    raise ServiceDown(f"{what} {problem} ({tries})")


def jsonable(value: Any) -> Any:
    """A label as JSON can carry it: array scalars as Python numbers, NaN and infinities as null,
    anything else JSON cannot hold as its str()."""
    if hasattr(value, "tolist"):  # numpy / torch scalars and arrays (a parquet column's values)
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return str(value)
    return value


def shards(n: int, batch_size: int, replicas: int) -> list[range]:
    """Cut rows 0..n-1 into contiguous, near-equal requests of at most ``batch_size`` rows, at least
    one per replica while there are rows enough."""
    if n == 0:
        return []
    k = max(math.ceil(n / batch_size), min(replicas, n))
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


@dataclass
class RemoteReward:
    """One ``--reward-url`` source: a reward service (one URL, or several replicas of it)."""

    name: str
    urls: list[str]
    weight: float = 1.0
    batch_size: int = 64
    timeout: float = 60.0
    retries: int = 2
    label_column: str = "label"
    answered: bool = False
    """Whether the service has scored a whole batch already (before that, any failure stops the run)."""
    requests: int = field(default=0, repr=False)
    """Requests that returned scores (for tests and logs)."""

    is_async = True
    needs_queries = True

    def __post_init__(self) -> None:
        self.endpoints = [endpoint(u, "--reward-url") for u in self.urls]

    async def ascore(self, batch: ScoreBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(B,) scores; rows whose requests failed after the source first answered are NaN (the
        non-finite guard then skips the update and counts it)."""
        import httpx

        if batch.queries is None:
            raise PPOLMError(f"reward service {self.name} needs the prompt+response texts (ScoreBatch.queries)")
        n = len(batch.queries)
        prompts = batch.prompt_texts if batch.prompt_texts is not None else [str(p) for p in batch.prompts]
        labels = batch.columns.get(self.label_column) or [None] * n
        out = torch.full((n,), float("nan"))
        parts = shards(n, self.batch_size, len(self.endpoints))
        limits = httpx.Limits(max_connections=max(len(parts), 1))
        async with httpx.AsyncClient(limits=limits, timeout=self.timeout) as client:
            async def one(i: int, rows: range) -> list[float] | ServiceDown:
                url = self.endpoints[i % len(self.endpoints)]
                body = {"query": [batch.queries[j] for j in rows], "prompts": [prompts[j] for j in rows],
                        "labels": [jsonable(labels[j]) for j in rows]}
                try:
                    answer = await post_json(client, url, body, retries=self.retries, timeout=self.timeout,
                                             what=f"reward service {url}")
                except ServiceDown as e:
                    return e
                return self.rewards(answer, len(rows), url)

            results = await asyncio.gather(*(one(i, rows) for i, rows in enumerate(parts)))
        failed = [r for r in results if isinstance(r, ServiceDown)]
        if failed and not self.answered:
            raise PPOLMError(f"{failed[0]}; check that the service runs at that address, or raise "
                             "--reward-url-timeout / --reward-url-retries")
        for rows, r in zip(parts, results):
            if not isinstance(r, ServiceDown):
                out[rows.start:rows.stop] = torch.tensor(r, dtype=torch.float32)
                self.requests += 1
        if failed:
            print(f"warning: {failed[0]}; its {sum(len(p) for p, r in zip(parts, results) if isinstance(r, ServiceDown))}"
                  " rows score NaN this step, so the update is skipped (guard/skipped_updates)", file=sys.stderr)
        elif not self.answered:
            bad = next((j for j, v in enumerate(out.tolist()) if not math.isfinite(v)), None)
            if bad is not None:
                raise PPOLMError(f"reward service {self.name} returned {out[bad].item()} for row {bad} of its first "
                                 "batch; a reward must be a finite number")
            self.answered = True
        return out, {}

    def rewards(self, answer: Any, n: int, url: str) -> list[float]:
        """The ``rewards`` of a decoded answer, checked: n numbers (NaN and infinities pass, as
        values: the non-finite guard handles them)."""
        values = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(values, list):
            keys = ", ".join(map(str, answer)) if isinstance(answer, dict) else type(answer).__name__
            raise PPOLMError(f"reward service {url} answered without a 'rewards' list (got {snippet(keys, 80)}); "
                             "it must answer {\"rewards\": [number, ...]}")
        if len(values) != n:
            raise PPOLMError(f"reward service {url} returned {len(values)} rewards for {n} queries; it must return "
                             "one per query")
        bad = next((i for i, v in enumerate(values) if isinstance(v, bool) or not isinstance(v, (int, float))), None)
        if bad is not None:
            v = values[bad]
            raise PPOLMError(f"reward service {url} returned {snippet(json.dumps(v), 60)} ({type(v).__name__}) as "
                             f"reward {bad}; each must be a number")
        return [float(v) for v in values]


def source_name(url_spec: str, taken: set[str]) -> str:
    """``host:port`` of a source's first URL (``_2``, ``_3``, ... when taken): its ``reward/<name>`` metric."""
    parts = urlsplit(url_spec.split(",")[0].strip())
    base = f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)
    name, i = base, 2
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name
