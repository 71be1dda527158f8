"""Judges: the preferences that a proxy reward model is trained to imitate.

A judge stands for the human (or the stronger model) whose comparisons a reward model learnt. ppolm
uses one wherever comparisons are made without a person: ``ppolm label --judge``, the on-policy
check of a reward model, and the refresh of a reward model during PPO. Two conventions are accepted:

* **pointwise**, the reward-function convention (TRL's GRPO)::

      def judge(prompts, completions, **kwargs) -> list[float]        # higher is better

  Two answers are compared through their scores, as a Bradley–Terry model does:
  ``P(a preferred) = sigmoid((s_a - s_b) / T)``.

* **pairwise**::

      def judge(prompts, completions_a, completions_b, **kwargs) -> list[float]

  returning, for each pair, the probability that answer ``a`` is preferred (0.5 = no preference).

``temperature`` sets the label noise. 0 (default): every label follows the judge (the higher score
wins; a pairwise probability above 0.5 picks ``a``); equal scores and a probability of exactly 0.5
are ties. T > 0: each label is a Bernoulli draw from the probability above (for a pairwise judge, from
its own probability), so that a judge can stand in for noisy human raters (InstructGPT's labellers
agreed with each other on about 73 % of comparisons; Ouyang et al. 2022, section 5.1).

A judge may also be a language model behind an OpenAI-compatible chat-completions endpoint (vLLM,
llama.cpp's server, Ollama, a hosted API), named by a spec instead of a function::

    openai:MODEL@BASE_URL[,option=value ...]      e.g. openai:qwen2.5-7b-instruct@http://127.0.0.1:8000/v1

As ``--judge`` it compares two answers (pairwise: "A", "B" or "tie" become 1, 0, 0.5); with
``mode=pointwise``, and always as a reward source (``ppolm ppo --reward-judge``,
:class:`JudgeReward`), it rates one answer on a 1-10 scale, mapped to [0, 1]. The options (API-key
variable, prompt template file, scale, timeout, retries, concurrency) and what happens to replies
that hold no rating are in docs/rewards.md, "LLM judge".
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import random
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ppolm import remote
from ppolm.errors import PPOLMError
from ppolm.rewards import ScoreBatch, accepted_columns, load_callable, run_async

PAIRWISE_PARAMS = ("completions_a", "completions_b")


def judge_kind(fn: Callable[..., Any], spec: str) -> Literal["pointwise", "pairwise"]:
    """Pairwise when the function names ``completions_a`` and ``completions_b``, pointwise when it
    accepts ``prompts`` and ``completions``; anything else is refused."""
    try:
        params = inspect.signature(fn).parameters
    except ValueError:  # a builtin without a signature: take it as pointwise
        return "pointwise"
    if all(p in params for p in PAIRWISE_PARAMS):
        return "pairwise"
    sig = inspect.signature(fn)
    if not (any(p.kind is p.VAR_KEYWORD for p in params.values())
            or ("prompts" in params and "completions" in params)):
        raise PPOLMError(f"judge '{spec}' must accept (prompts, completions, **kwargs) or (prompts, completions_a, "
                         f"completions_b, **kwargs); its signature is {sig}")
    return "pointwise"


def _numbers(out: Any, n: int, spec: str, what: str) -> list[float]:
    try:
        values = [float(v) for v in out]
    except (TypeError, ValueError):
        raise PPOLMError(f"judge '{spec}' must return a list of numbers; got {type(out).__name__}") from None
    if len(values) != n:
        raise PPOLMError(f"judge '{spec}' returned {len(values)} values for {n} {what}; return one each")
    bad = next((v for v in values if not math.isfinite(v)), None)
    if bad is not None:
        raise PPOLMError(f"judge '{spec}' returned {bad}; a judge's values must be finite")
    return values


@dataclass
class Judge:
    """A loaded judge; see the module docstring for the conventions and ``temperature``."""

    spec: str
    fn: Callable[..., Any]
    kind: Literal["pointwise", "pairwise"]
    temperature: float = 0.0
    calls: int = 0
    """Comparisons asked of the judge so far (its cost: human labels, or calls to a judging model)."""
    llm: Any = None
    """The :class:`LLMJudge` behind ``fn`` when the spec names a chat-completions endpoint."""

    @property
    def unparsed(self) -> int:
        """An LLM judge's replies so far that held no rating or choice (refusals included); 0 otherwise."""
        return self.llm.unparsed if self.llm is not None else 0

    def _kwargs(self, columns: dict[str, list[Any]] | None) -> dict[str, Any]:
        return accepted_columns(self.fn, columns)

    def _call(self, **kw: Any) -> Any:
        try:
            out = self.fn(**kw)
            return run_async(out) if inspect.isawaitable(out) else out
        except PPOLMError:
            raise
        except Exception as e:
            raise PPOLMError(f"judge '{self.spec}' raised {type(e).__name__}: {e}; fix the judge") from None

    def scores(self, prompts: Sequence[Any], completions: Sequence[Any],
               columns: dict[str, list[Any]] | None = None) -> list[float]:
        """A pointwise judge's score of each completion."""
        if self.kind != "pointwise":
            raise PPOLMError(f"judge '{self.spec}' is pairwise; it compares answers and gives no score of one")
        out = self._call(prompts=list(prompts), completions=list(completions), **self._kwargs(columns))
        return _numbers(out, len(completions), self.spec, "completions")

    def preference(self, prompts: Sequence[Any], completions_a: Sequence[Any], completions_b: Sequence[Any],
                   columns: dict[str, list[Any]] | None = None) -> list[float]:
        """P(a preferred over b) for each pair, before any label noise is drawn."""
        if not len(prompts) == len(completions_a) == len(completions_b):
            raise ValueError("prompts, completions_a and completions_b must have one entry per pair")
        self.calls += len(prompts)
        if self.kind == "pairwise":
            out = self._call(prompts=list(prompts), completions_a=list(completions_a),
                             completions_b=list(completions_b), **self._kwargs(columns))
            probs = _numbers(out, len(prompts), self.spec, "pairs")
            bad = next((p for p in probs if not 0.0 <= p <= 1.0), None)
            if bad is not None:
                raise PPOLMError(f"pairwise judge '{self.spec}' returned {bad}; it must return P(a preferred) "
                                 "in [0, 1]")
            return probs
        cols = {k: list(v) + list(v) for k, v in (columns or {}).items()}
        both = self.scores(list(prompts) * 2, list(completions_a) + list(completions_b), cols)
        n = len(prompts)
        return [bradley_terry(both[i], both[n + i], self.temperature) for i in range(n)]

    def label(self, prompts: Sequence[Any], completions_a: Sequence[Any], completions_b: Sequence[Any],
              rng: random.Random, columns: dict[str, list[Any]] | None = None) -> list[float]:
        """One label per pair: 1.0 (a preferred), 0.0 (b preferred) or 0.5 (a tie). With temperature 0
        the label follows the judge; above 0 it is a Bernoulli draw from ``preference``, one ``rng``
        draw per pair (so a seed fixes the labels)."""
        probs = self.preference(prompts, completions_a, completions_b, columns)
        if self.temperature > 0:
            return [1.0 if rng.random() < p else 0.0 for p in probs]
        return [1.0 if p > 0.5 else 0.0 if p < 0.5 else 0.5 for p in probs]


def bradley_terry(score_a: float, score_b: float, temperature: float) -> float:
    """P(a preferred) = sigmoid((score_a - score_b) / T); at T = 0 the step function (0.5 at a tie)."""
    d = score_a - score_b
    if temperature <= 0:
        return 1.0 if d > 0 else 0.0 if d < 0 else 0.5
    z = d / temperature
    return 1 / (1 + math.exp(-z)) if z >= 0 else math.exp(z) / (1 + math.exp(z))


def load_judge(spec: str, temperature: float = 0.0) -> Judge:
    """The judge named by 'path/to/file.py:function', 'package.module:function' or an LLM judge's
    'openai:MODEL@BASE_URL[,option=value ...]' (pairwise unless ``mode=pointwise``)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise PPOLMError(f"judge temperature {temperature} must be a finite number >= 0 (0 = labels without noise)")
    if is_llm_spec(spec):
        llm = load_llm_judge(spec)
        fn = llm.pairwise_fn() if llm.mode == "pairwise" else llm.pointwise_fn()
        return Judge(spec=spec, fn=fn, kind=llm.mode, temperature=temperature, llm=llm)
    fn = load_callable(spec, "judge")
    return Judge(spec=spec, fn=fn, kind=judge_kind(fn, spec), temperature=temperature)


# ------------------------------------------------------------------------ LLM judges (chat completions)

LLM_PREFIX = "openai:"

POINTWISE_TEMPLATE = """You are rating an AI assistant's answer to a user's request.

[Request]
{prompt}

[Answer]
{response}

Rate how helpful, correct and well written the answer is, from 1 (useless) to 10 (excellent).
Reply with the rating alone, in the form "Rating: N"."""
"""The built-in pointwise template: fields {prompt} and {response}; scale 1-10."""

PAIRWISE_TEMPLATE = """You are comparing two AI assistant answers to the same user request.

[Request]
{prompt}

[Answer A]
{response_a}

[Answer B]
{response_b}

Which answer is more helpful, correct and well written? Do not let their order or length decide.
Reply with one word: A, B, or tie."""
"""The built-in pairwise template: fields {prompt}, {response_a} and {response_b}."""

FIELDS = {"pointwise": ("{prompt}", "{response}"), "pairwise": ("{prompt}", "{response_a}", "{response_b}")}
OPTIONS = ("mode", "key_env", "template", "scale", "timeout", "retries", "concurrency", "max_tokens")

_NUM = r"(-?\d+(?:\.\d+)?)"
_RATING_PATTERNS = [
    re.compile(r"(?i:rating|score|grade)\s*(?:is|of)?\s*[:=]?\s*[*\[(]*\s*" + _NUM),  # Rating: 7, score of **8**
    re.compile(r"\[\[\s*" + _NUM + r"\s*\]\]"),  # [[7]] (MT-Bench's judge format)
    re.compile(_NUM + r"\s*(?:/|(?i:out of))\s*\d+"),  # 7/10, 7 out of 10
]
_CHOICE_PATTERNS = [
    re.compile(r"\[\[\s*(A|B|C|(?i:tie))\s*\]\]"),  # [[A]]; MT-Bench writes a tie as [[C]]
    re.compile(r"(?i:verdict|answer|better|winner|choice|prefer)\w*\s*(?:is|:|=)?\s*[*\"']*\s*(?i:answer\s+)?"
               r"(A|B|(?i:tie))\b"),
]


def is_llm_spec(spec: str) -> bool:
    """'openai:MODEL@BASE_URL...' (a function spec's name cannot hold '@')."""
    return spec.startswith(LLM_PREFIX) and "@" in spec


def parse_rating(reply: str, low: float, high: float) -> float | None:
    """The rating in a judge's reply, or None: the last 'Rating: N' (or 'score', 'grade'), else the
    last [[N]], else the last 'N/10' or 'N out of 10', else a reply that is a number alone; a
    rating outside [low, high] counts as none."""
    found = None
    for pattern in _RATING_PATTERNS:
        hits = pattern.findall(reply)
        if hits:
            found = float(hits[-1])
            break
    if found is None:
        bare = reply.strip().strip("*.` ")
        if re.fullmatch(_NUM, bare):
            found = float(bare)
    return found if found is not None and low <= found <= high else None


def parse_choice(reply: str) -> float | None:
    """P(A preferred) from a pairwise judge's reply: 1.0 for A, 0.0 for B, 0.5 for a tie; None when
    the reply names none (or both) clearly: a bare 'A'/'B'/'tie' (markdown and punctuation
    ignored), else the last [[A]]/[[B]]/[[C]], else the last 'verdict: A' (or 'answer', 'better', ...)."""
    bare = re.sub(r"[*_`'\"\[\].:()!]", "", reply).strip().lower()
    bare = re.sub(r"^(?:answer|response)\s+", "", bare)
    table = {"a": 1.0, "b": 0.0, "tie": 0.5, "c": 0.5, "equal": 0.5, "both": 0.5}
    if bare in table:
        return table[bare]
    for pattern in _CHOICE_PATTERNS:
        hits = pattern.findall(reply)
        if hits:
            return table.get(hits[-1].lower())
    return None


def text_of(x: Any) -> str:
    """A prompt or completion as plain text: chat messages become 'role: content' lines."""
    if isinstance(x, str):
        return x
    if isinstance(x, list):
        if len(x) == 1 and isinstance(x[0], dict) and x[0].get("role") == "assistant":
            return str(x[0].get("content", ""))
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, dict) else str(m) for m in x)
    return str(x)


@dataclass
class LLMJudge:
    """A judging model behind an OpenAI-compatible ``/chat/completions`` endpoint (see
    :func:`load_llm_judge` for the spec). One request per answer (or pair), ``concurrency`` at a
    time, each with ``timeout`` seconds and ``retries`` more tries (ppolm/remote.py's backoff)."""

    model: str
    url: str
    mode: Literal["pointwise", "pairwise"] = "pointwise"
    template: str = POINTWISE_TEMPLATE
    scale: tuple[float, float] = (1.0, 10.0)
    timeout: float = 60.0
    retries: int = 2
    concurrency: int = 8
    max_tokens: int = 64
    key_env: str | None = None
    api_key: str | None = field(default=None, repr=False)
    """Read from the environment variable ``key_env``; sent as a bearer token, never shown or logged."""
    replies: int = 0
    """Replies received so far."""
    unparsed: int = 0
    """Replies so far without a rating (or choice), refusals included."""
    answered: bool = False
    """Whether the endpoint has answered a whole batch already (before that, any failure stops the run)."""

    def render(self, **fields: str) -> str:
        text = self.template
        for k, v in fields.items():  # plain replacement: braces elsewhere in a template stay as written
            text = text.replace("{" + k + "}", v)
        return text

    async def ask_all(self, contents: list[str]) -> list[str | None | Exception]:
        """Each message's reply text; None for a refusal or an empty reply; the ServiceDown of a
        request that failed every try."""
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        gate = asyncio.Semaphore(self.concurrency)
        what = f"judge endpoint {self.url}"

        async def one(client: Any, content: str) -> str | None | Exception:
            body = {"model": self.model, "messages": [{"role": "user", "content": content}],
                    "temperature": 0, "max_tokens": self.max_tokens}
            async with gate:
                try:
                    answer = await remote.post_json(client, self.url, body, retries=self.retries, timeout=self.timeout,
                                             what=what, headers=headers)
                except remote.ServiceDown as e:
                    return e
            try:
                choice = answer["choices"][0]
                message = choice["message"]
            except (KeyError, IndexError, TypeError):
                raise PPOLMError(f"{what} answered without choices[0].message (is it an OpenAI-compatible "
                                 "/chat/completions endpoint?)") from None
            self.replies += 1
            if not isinstance(message, dict) or message.get("refusal") or choice.get("finish_reason") == "content_filter":
                return None
            content_out = message.get("content")
            return content_out if isinstance(content_out, str) and content_out.strip() else None

        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=self.concurrency)) as client:
            return list(await asyncio.gather(*(one(client, c) for c in contents)))

    def check_reachable(self, results: list[Any]) -> list[Any]:
        """Raise the first failed request's error while the endpoint has not answered a batch yet."""
        failed = [r for r in results if isinstance(r, Exception)]
        if failed and not self.answered:
            raise PPOLMError(f"{failed[0]}; check that it runs at that address and serves model '{self.model}', "
                             "or raise its timeout= / retries= options")
        if not failed:
            self.answered = True
        return failed

    async def ratings(self, prompts: list[Any], completions: list[Any]) -> tuple[list[float], list[bool], int]:
        """(score in [0, 1] or NaN, unparsed?, failed requests) per answer; a failed request's score is NaN."""
        low, high = self.scale
        results = await self.ask_all([self.render(prompt=text_of(p), response=text_of(c))
                                      for p, c in zip(prompts, completions)])
        failed = self.check_reachable(results)
        scores, unparsed = [], []
        for r in results:
            rating = None if isinstance(r, Exception) or r is None else parse_rating(r, low, high)
            scores.append(float("nan") if rating is None else (rating - low) / (high - low))
            unparsed.append(rating is None and not isinstance(r, Exception))
        self.unparsed += sum(unparsed)
        return scores, unparsed, len(failed)

    async def choices(self, prompts: list[Any], completions_a: list[Any], completions_b: list[Any]) -> list[float]:
        """P(a preferred) per pair: 1, 0 or 0.5, and 0.5 (no preference) for a reply naming no choice."""
        results = await self.ask_all([self.render(prompt=text_of(p), response_a=text_of(a), response_b=text_of(b))
                                      for p, a, b in zip(prompts, completions_a, completions_b)])
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            raise PPOLMError(f"{failed[0]}; check that it runs at that address and serves model '{self.model}'")
        self.answered = True
        probs = []
        for r in results:
            p = None if r is None else parse_choice(str(r))
            self.unparsed += p is None
            probs.append(0.5 if p is None else p)
        return probs

    def pairwise_fn(self) -> Any:
        def judge(prompts: list[Any], completions_a: list[Any], completions_b: list[Any], **kwargs: Any) -> list[float]:
            return run_async(self.choices(prompts, completions_a, completions_b))

        return judge

    def pointwise_fn(self) -> Any:
        def judge(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
            scores, unparsed, failed = run_async(self.ratings(prompts, completions))
            if failed:
                raise PPOLMError(f"judge endpoint {self.url}: {failed} of {len(scores)} requests failed every try")
            return fill_unparsed(scores, unparsed, self.url)

        return judge


def fill_unparsed(scores: list[float], unparsed: list[bool], url: str) -> list[float]:
    """Scores with each unparsed one replaced by the mean of the batch's parsed ones (a neutral
    score: it moves that answer neither up nor down against its batch)."""
    parsed = [s for s, u in zip(scores, unparsed) if not u and math.isfinite(s)]
    if not parsed:
        raise PPOLMError(f"judge endpoint {url} gave no reply with a rating in a batch of {len(scores)}; check its "
                         "model and template (docs/rewards.md, \"LLM judge\")")
    mean = sum(parsed) / len(parsed)
    return [mean if u else s for s, u in zip(scores, unparsed)]


def load_llm_judge(spec: str, mode: Literal["pointwise", "pairwise"] | None = None) -> LLMJudge:
    """Parse 'openai:MODEL@BASE_URL[,option=value ...]'. ``mode`` forces one (``--reward-judge``:
    pointwise); else the spec's ``mode=`` option, pairwise by default. The endpoint is BASE_URL +
    '/chat/completions' unless BASE_URL already ends with it."""
    head, *opts = spec[len(LLM_PREFIX):].split(",")
    model, _, base = head.rpartition("@")
    if not model or not base:
        raise PPOLMError(f"LLM judge '{spec}' must be openai:MODEL@BASE_URL (e.g. openai:llama3.1@http://127.0.0.1:11434/v1)")
    options: dict[str, str] = {}
    for o in opts:
        k, eq, v = o.strip().partition("=")
        if not eq or k not in OPTIONS:
            raise PPOLMError(f"LLM judge '{spec}': unknown option '{o.strip()}'; the options are "
                             f"{', '.join(o + '=...' for o in OPTIONS)}")
        options[k] = v.strip()
    chosen = options.get("mode", mode or "pairwise")
    if chosen not in ("pointwise", "pairwise") or (mode is not None and chosen != mode):
        raise PPOLMError(f"LLM judge '{spec}': mode must be {mode or 'pointwise or pairwise'}; got '{chosen}'")
    url = base.strip().rstrip("/")
    url = remote.endpoint(url if url.endswith("/chat/completions") else url + "/chat/completions", "LLM judge URL")

    def number(key: str, default: float, low: float, kind: type = float) -> Any:
        raw = options.get(key)
        if raw is None:
            return kind(default)
        try:
            value = kind(raw)
        except ValueError:
            raise PPOLMError(f"LLM judge '{spec}': {key}={raw} is not a{'n integer' if kind is int else ' number'}") from None
        if not (math.isfinite(value) and value >= low):
            raise PPOLMError(f"LLM judge '{spec}': {key} must be >= {low}; got {raw}")
        return value

    scale = (1.0, 10.0)
    if "scale" in options:
        m = re.fullmatch(r"\s*" + _NUM + r"\s*-\s*" + _NUM + r"\s*", options["scale"])
        if not m or float(m.group(1)) >= float(m.group(2)):
            raise PPOLMError(f"LLM judge '{spec}': scale must be LOW-HIGH with LOW < HIGH (e.g. scale=1-10)")
        scale = (float(m.group(1)), float(m.group(2)))
    template = POINTWISE_TEMPLATE if chosen == "pointwise" else PAIRWISE_TEMPLATE
    if "template" in options:
        path = Path(options["template"])
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise PPOLMError(f"LLM judge template {path} cannot be read ({type(e).__name__}); check template= in "
                             f"'{spec}'") from None
        missing = [f for f in FIELDS[chosen] if f not in template]
        if missing:
            raise PPOLMError(f"LLM judge template {path} lacks {', '.join(missing)}; a {chosen} template needs "
                             f"{', '.join(FIELDS[chosen])}")
    key_env = options.get("key_env") or None
    api_key = None
    if key_env is not None:
        api_key = os.environ.get(key_env)
        if not api_key:
            raise PPOLMError(f"LLM judge '{spec}': environment variable {key_env} (key_env=) is not set; export the "
                             "API key in it")
    return LLMJudge(model=model, url=url, mode=chosen, template=template, scale=scale,  # type: ignore[arg-type]
                    timeout=number("timeout", 60.0, 1e-3), retries=number("retries", 2, 0, int),
                    concurrency=number("concurrency", 8, 1, int), max_tokens=number("max_tokens", 64, 1, int),
                    key_env=key_env, api_key=api_key)


@dataclass
class JudgeReward:
    """An LLM judge as a reward source (``ppolm ppo --reward-judge``): each answer's 1-10 rating,
    mapped to [0, 1]. A reply without a rating scores the mean of its batch's rated answers and is
    counted in ``reward/<name>_unparsed`` (the share of the batch); a batch with no rating at all,
    or a request that fails every try once the endpoint has answered, scores NaN, which the
    non-finite guard skips and counts (docs/rewards.md)."""

    name: str
    llm: LLMJudge
    weight: float = 1.0

    is_async = True

    async def ascore(self, batch: ScoreBatch) -> tuple[Any, dict[str, Any]]:
        import torch

        scores, unparsed, failed = await self.llm.ratings(batch.prompts, batch.completions)
        if failed:
            print(f"warning: judge endpoint {self.llm.url}: {failed} of {len(scores)} requests failed every try; those "
                  "answers score NaN this step, so the update is skipped (guard/skipped_updates)", file=sys.stderr)
        parsed = [s for s, u in zip(scores, unparsed) if not u and math.isfinite(s)]
        if parsed:
            mean = sum(parsed) / len(parsed)
            scores = [mean if u else s for s, u in zip(scores, unparsed)]
        return (torch.tensor(scores, dtype=torch.float32),
                {f"reward/{self.name}_unparsed": torch.tensor(unparsed, dtype=torch.float32)})


def build_sources(reward: Any, taken: set[str]) -> list[Any]:
    """The remote reward sources, ``--reward-url`` (ppolm/remote.py) and ``--reward-judge``, of a :class:`ppolm.ppo_config.RewardConfig`,
    each checked (URLs, judge specs, API-key variables) before any model loads."""
    out: list[Any] = []
    url_weights = reward.reward_url_weights or [1.0] * len(reward.reward_url)
    for spec, w in zip(reward.reward_url, url_weights):
        urls = [u.strip() for u in spec.split(",") if u.strip()]
        if not urls:
            raise PPOLMError(f"--reward-url '{spec}' holds no URL")
        out.append(remote.RemoteReward(remote.source_name(spec, taken), urls, w,
                                       batch_size=reward.reward_url_batch_size, timeout=reward.reward_url_timeout,
                                       retries=reward.reward_url_retries, label_column=reward.reward_url_label_column))
    judge_weights = reward.reward_judge_weights or [1.0] * len(reward.reward_judge)
    for spec, w in zip(reward.reward_judge, judge_weights):
        llm = load_llm_judge(spec, mode="pointwise")
        base, i = f"judge_{llm.model}", 2
        name = base
        while name in taken:
            name, i = f"{base}_{i}", i + 1
        taken.add(name)
        out.append(JudgeReward(name, llm, w))
    return out
