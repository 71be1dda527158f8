"""The reward: frozen reward models and/or reward functions, combined into one score per response.

Reward functions follow TRL's GRPO convention so existing ones run unchanged::

    def my_reward(prompts, completions, **kwargs) -> list[float]

``prompts``/``completions`` are strings for text prompts, and chat-message lists for ``messages``
prompts (a completion is then ``[{"role": "assistant", "content": ...}]``). Every other column of
the prompts file arrives as a keyword argument holding one value per sample. An ``async def``
function is awaited, and every asynchronous source of a run (such functions, reward services
``--reward-url``: ppolm/remote.py, LLM judges ``--reward-judge``: ppolm/judge.py) runs concurrently
with the others, on one event loop, while PPO waits for the scores (docs/rewards.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import difflib
import importlib
import importlib.util
import inspect
import json
import math
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ppolm import atomic, models, trunk
from ppolm.errors import PPOLMError

NORM_FILE = "ppolm_reward.json"
"""Beside a reward model's weights: {"gain": g, "bias": b}; the score is g * head_output + b."""


def load_reward_fn(spec: str) -> Callable[..., Any]:
    """Resolve 'path/to/file.py:function' or 'package.module:function' to a callable."""
    fn = load_callable(spec, "reward function")
    try:
        sig = inspect.signature(fn)
        if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            sig.bind(prompts=[], completions=[])
    except TypeError:
        raise PPOLMError(f"reward function '{spec}' must accept (prompts, completions, **kwargs); "
                         f"its signature is {sig}") from None
    except ValueError:  # builtins without a signature: trust them
        pass
    return fn


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """Import the callable named by 'path/to/file.py:function' or 'package.module:function'; ``what``
    names it in errors ("reward function", "judge")."""
    if ":" not in spec:
        raise PPOLMError(f"{what} '{spec}' must be 'path/to/file.py:function' or 'package.module:function'")
    target, _, name = spec.rpartition(":")
    if target.endswith(".py") or "/" in target or Path(target).is_file():
        path = Path(target)
        if path.is_dir():
            raise PPOLMError(f"reward function file {path} is a directory; give the .py file in '{spec}'")
        if not path.is_file():
            raise PPOLMError(f"reward function file {path} does not exist; check the path in '{spec}'")
        mod_name = f"ppolm_user_reward_{abs(hash(str(path.resolve())))}"
        modspec = importlib.util.spec_from_file_location(mod_name, path)
        if modspec is None or modspec.loader is None:
            raise PPOLMError(f"cannot import {path} as Python; check '{spec}'")
        module = importlib.util.module_from_spec(modspec)
        sys.modules[mod_name] = module
        try:
            modspec.loader.exec_module(module)
        except Exception as e:
            raise PPOLMError(f"importing {path} failed: {type(e).__name__}: {e}; fix the file") from None
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise PPOLMError(f"cannot import module '{target}' for {what} '{spec}' "
                             f"({type(e).__name__}: {e}); check the module name") from None
    fn = getattr(module, name, None)
    if fn is None:
        names = [n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")]
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f"; it defines: {', '.join(names) or 'no functions'}"
        raise PPOLMError(f"'{target}' has no function '{name}'{hint}")
    if not callable(fn):
        raise PPOLMError(f"'{spec}' is not callable")
    return fn


def run_async(coro: Awaitable[Any]) -> Any:
    """Run a coroutine to completion from synchronous code, also when the caller already runs an
    event loop (a notebook): then on a fresh loop in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def is_async_callable(fn: Any) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


@dataclass
class ScoreBatch:
    """What every reward source may read about the B responses of a batch."""

    prompts: list[Any]
    """The prompts as given (strings, or chat-message lists)."""
    completions: list[Any]
    """The responses in the reward-function convention (strings, or [{"role": "assistant", ...}])."""
    columns: dict[str, list[Any]]
    """The prompts file's other columns, one value per response."""
    queries: list[str] | None = None
    """Each prompt+response as one text, as the policy's tokenizer decodes it (special tokens kept)."""
    prompt_texts: list[str] | None = None
    """Each prompt as the policy saw it (chat template applied), decoded alike: a prefix of its query."""


def accepted_columns(fn: Callable[..., Any], columns: dict[str, list[Any]] | None) -> dict[str, Any]:
    """The prompts file's extra columns that ``fn`` accepts as keyword arguments: all of them when it
    takes ``**kwargs`` (or has no signature to read), else those it names."""
    kwargs = dict(columns or {})
    try:
        params = inspect.signature(fn).parameters
    except ValueError:
        return kwargs
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


@dataclass
class RewardFunction:
    name: str
    fn: Callable[..., Any]
    weight: float
    answered: bool = False
    """Whether it has returned a batch: its first batch checks the wiring, so a NaN or infinite
    number there is an error (as a reward service's, docs/rewards.md); later the non-finite guard
    skips the update. ``None`` stands for "no score" and becomes NaN on any batch."""

    @property
    def is_async(self) -> bool:
        return is_async_callable(self.fn)

    def _kwargs(self, columns: dict[str, list[Any]]) -> dict[str, Any]:
        return accepted_columns(self.fn, columns)

    def __call__(self, prompts: list[Any], completions: list[Any], columns: dict[str, list[Any]]) -> torch.Tensor:
        try:
            out = self.fn(prompts=prompts, completions=completions, **self._kwargs(columns))
            if inspect.isawaitable(out):
                out = run_async(out)
        except Exception as e:
            raise PPOLMError(f"reward function '{self.name}' raised {type(e).__name__}: {e}; fix the function") from None
        return self._values(out, len(completions))

    async def ascore(self, batch: ScoreBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The scores of an ``async def`` function, awaited on the running loop (no extra metrics)."""
        try:
            out = await self.fn(prompts=batch.prompts, completions=batch.completions, **self._kwargs(batch.columns))
        except Exception as e:
            raise PPOLMError(f"reward function '{self.name}' raised {type(e).__name__}: {e}; fix the function") from None
        return self._values(out, len(batch.completions)), {}

    def _values(self, out: Any, n: int) -> torch.Tensor:
        try:
            out = list(out)
            if any(isinstance(v, (str, bytes)) for v in out):  # float("1.5") would pass a string
                raise TypeError
            values = [float("nan") if v is None else float(v) for v in out]
        except (TypeError, ValueError):
            what = type(out).__name__
            if isinstance(out, (list, tuple)):
                bad = next(v for v in out if v is not None and not isinstance(v, (int, float)))
                what += f" holding {bad!r} ({type(bad).__name__})"
            raise PPOLMError(f"reward function '{self.name}' must return a list of numbers; "
                             f"got a {what}") from None
        if len(values) != n:
            raise PPOLMError(f"reward function '{self.name}' returned {len(values)} values for "
                             f"{n} completions; return one per completion")
        if not self.answered:
            bad = next((i for i, v in enumerate(out) if v is not None and not math.isfinite(values[i])), None)
            if bad is not None:
                raise PPOLMError(f"reward function '{self.name}' returned {values[bad]} for completion {bad} of its "
                                 "first batch; a reward must be a finite number (or None for no score)")
            self.answered = True
        return torch.tensor(values, dtype=torch.float32)


def reward_model_dir(path: str, *, allow_pickle: bool = False) -> Path:
    """The model directory of reward model ``path``, checked to have a scalar head (before any model loads)."""

    found = models.resolve_model_dir(path, allow_pickle=allow_pickle)
    if not models.has_scalar_head(found):
        raise PPOLMError(f"reward model {path} has no scalar head (score.weight); train one with "
                         "`ppolm reward` or pass a sequence-classification model with one label")
    return found


class RewardModel:
    """A frozen scalar-head model, with the gain/bias normalisation stored beside it."""

    def __init__(self, path: str, *, dtype: torch.dtype, device: str | torch.device,
                 trust_remote_code: bool = False, allow_pickle: bool = False):

        self.name = Path(path).name or str(path)
        self.dir = reward_model_dir(path, allow_pickle=allow_pickle)
        self.model = models.load_scalar_model(self.dir, head_init="keep", dtype=dtype, device=device,
                                              trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
        self.model.requires_grad_(False).eval()
        self.tokenizer = models.load_tokenizer(self.dir)
        self.gain, self.bias = read_norm(self.dir)

    @torch.no_grad()
    def score_ids(self, ids: torch.Tensor, mask: torch.Tensor, start: int = 0,
                  hidden: torch.Tensor | None = None, split: Any = None) -> torch.Tensor:
        """Normalised score at the last real token of each left-/right-padded row. ids, mask: (B, T).
        With ``hidden`` (B, T, d), the state entering layer ``start`` that this model shares with the
        reference (ppolm/trunk.py), only layers ``start ..`` run. ``split``: the rows' common beginning,
        run once (ppolm/prefix.py)."""

        if hidden is None:
            values = models.scalar_forward(self.model, ids, mask, split=split)  # (B, T)
        else:
            last_hidden = trunk.run_from(self.model, start, hidden, mask)
            values = models.scalar_head(models._unwrap(self.model).score, last_hidden)
        last = mask.shape[1] - 1 - mask.flip(1).long().argmax(1)  # last real position per row
        raw = values.gather(1, last[:, None]).squeeze(1).float()
        return raw * self.gain + self.bias

    def score_texts(self, texts: list[str], batch_size: int = 8) -> torch.Tensor:
        """Score full prompt+response texts tokenised with this model's own tokenizer."""
        dev = next(self.model.parameters()).device
        out = []
        for i in range(0, len(texts), batch_size):
            enc = self.tokenizer(texts[i:i + batch_size], return_tensors="pt", padding=True,
                                 add_special_tokens=False)
            out.append(self.score_ids(enc["input_ids"].to(dev), enc["attention_mask"].to(dev)).cpu())
        return torch.cat(out)


def read_norm(model_dir: str | Path) -> tuple[float, float]:
    f = Path(model_dir) / NORM_FILE
    if not f.exists():
        return 1.0, 0.0
    try:
        d = json.loads(f.read_text())
        gain, bias = float(d["gain"]), float(d["bias"])
    except (ValueError, KeyError, TypeError):
        raise PPOLMError(f"{f} is malformed; it must hold {{\"gain\": number, \"bias\": number}}") from None
    if not (math.isfinite(gain) and math.isfinite(bias)) or gain <= 0:
        raise PPOLMError(f"{f} has gain {gain}, bias {bias}; gain must be positive and both finite")
    return gain, bias


def write_norm(model_dir: str | Path, gain: float, bias: float, **info: Any) -> None:
    atomic.write_text(Path(model_dir) / NORM_FILE, json.dumps({"gain": gain, "bias": bias, **info}, indent=2))


def ensemble(scores: torch.Tensor, how: str) -> torch.Tensor:
    """Combine member scores (M, B) -> (B,): mean, min, or mean minus (unbiased) std."""
    if scores.shape[0] == 1 or how == "mean":
        return scores.mean(0)
    if how == "min":
        return scores.min(0).values
    if how == "mean-minus-std":
        return scores.mean(0) - scores.std(0)
    raise ValueError(f"unknown ensemble rule {how!r}")


class Rewarder:
    """All reward sources of a run; ``score`` returns the combined score and each source's.

    ``functions`` holds every source scored per response and weighted on its own: reward functions
    (:class:`RewardFunction`), reward services (:class:`ppolm.remote.RemoteReward`) and LLM judges
    (:class:`ppolm.judge.JudgeReward`). A source with ``is_async`` true has ``ascore(batch)``,
    awaited together with the others on one event loop; the rest are called one after another."""

    def __init__(self, reward_models: Sequence[RewardModel], functions: Sequence[Any],
                 *, model_weight: float = 1.0, ensemble_rule: str = "mean"):
        if not reward_models and not functions:
            raise PPOLMError("no reward given; pass --reward-model DIR, --reward-fn FILE.py:FUNCTION, --reward-url URL "
                             "and/or --reward-judge SPEC")
        self.models = list(reward_models)
        self.functions = list(functions)
        self.model_weight = model_weight
        self.ensemble_rule = ensemble_rule

    def query_texts(self, roll: Any, tokenizer: Any) -> dict[str, list[str]]:
        """``queries`` and ``prompt_texts`` of a rollout (:class:`ScoreBatch`) for :meth:`score`, decoded
        as a reward model with another tokenizer reads them in-process; {} when no source needs them."""
        if not any(getattr(f, "needs_queries", False) for f in self.functions):
            return {}
        full = [row[m.bool()] for row, m in zip(roll.input_ids, roll.attention_mask)]
        return {"queries": tokenizer.batch_decode(full),
                "prompt_texts": tokenizer.batch_decode([row[m.bool()] for row, m in zip(roll.query, roll.query_mask)])}

    def score(self, *, model_inputs: Callable[[RewardModel], torch.Tensor], prompts: list[Any],
              completions: list[str], columns: dict[str, list[Any]], queries: list[str] | None = None,
              prompt_texts: list[str] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """model_inputs(rm) -> that model's (B,) scores; functions get TRL-convention inputs; reward
        services get ``queries`` (prompt+response texts) and ``prompt_texts`` (see :class:`ScoreBatch`)."""
        parts: dict[str, torch.Tensor] = {}
        total = torch.zeros(len(completions))
        if self.models:
            member = torch.stack([model_inputs(rm).float().cpu() for rm in self.models])  # (M, B)
            for rm, s in zip(self.models, member):
                parts[f"reward/rm/{rm.name}" if len(self.models) > 1 else f"reward/{rm.name}"] = s
            combined = ensemble(member, self.ensemble_rule)
            if len(self.models) > 1:
                parts[f"reward/ensemble_{self.ensemble_rule}"] = combined
            total = total + self.model_weight * combined
        chat = bool(prompts) and isinstance(prompts[0], list)
        comps: list[Any] = [[{"role": "assistant", "content": c}] for c in completions] if chat else completions
        batch = ScoreBatch(prompts, comps, columns, queries, prompt_texts)
        waiting = [f for f in self.functions if getattr(f, "is_async", False)]

        async def concurrently() -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
            return await asyncio.gather(*(f.ascore(batch) for f in waiting))

        awaited = dict(zip(map(id, waiting), run_async(concurrently()))) if waiting else {}
        for f in self.functions:
            s, extra = awaited[id(f)] if id(f) in awaited else (f(prompts, comps, columns), {})
            parts[f"reward/{f.name}"] = s
            parts.update(extra)
            total = total + f.weight * s
        return total, parts


def function_name(spec: str, taken: set[str]) -> str:
    name = spec.rpartition(":")[2]
    base, i = name, 2
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name
