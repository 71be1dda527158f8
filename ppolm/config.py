"""Typed configuration: nested dataclasses whose field docstrings are the ``--help`` text.

Every command's options come from one dataclass (e.g. :class:`ppolm.ppo.PPOConfig`), made of
sections (``ModelConfig``, ``KLConfig``, ...). Field names are unique across sections, so each
is one flat CLI option (``lora_r`` -> ``--lora-r``) and one YAML key, either flat or nested under
its section name. Options that several commands share are declared once, in
:mod:`ppolm.config_sections`, and inherited. Precedence: defaults < ``--config FILE.yaml`` <
command line.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import difflib
import inspect
import shutil
import textwrap
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from ppolm.errors import PPOLMError


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Map field name -> the docstring written on the line(s) under it in the class body."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (frozen app): help text is then empty
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def sections(cfg_cls: type) -> dict[str, type]:
    """The nested section dataclasses of a top-level config, by field name."""
    return {f.name: t for f in dataclasses.fields(cfg_cls)
            if dataclasses.is_dataclass(t := _hints(cfg_cls)[f.name])}


def ordered_fields(cls: type) -> list[dataclasses.Field]:
    """A config class's fields in ``--help`` and YAML order: those its own body declares (or
    redeclares) first, as written, then the inherited ones (:mod:`ppolm.config_sections`) in
    dataclass order. A dataclass alone would list inherited fields first."""
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    own = [by_name[n] for n in inspect.get_annotations(cls) if n in by_name]
    return own + [f for f in by_name.values() if f not in own]


def leaf_fields(cfg_cls: type) -> dict[str, tuple[str | None, dataclasses.Field, Any]]:
    """Flat option name -> (section or None, field, type) for every leaf field."""
    out: dict[str, tuple[str | None, dataclasses.Field, Any]] = {}
    hints = _hints(cfg_cls)
    for f in ordered_fields(cfg_cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            sub = _hints(t)
            for g in ordered_fields(t):
                assert g.name not in out, f"duplicate option name {g.name}"
                out[g.name] = (f.name, g, sub[g.name])
        else:
            assert f.name not in out, f"duplicate option name {f.name}"
            out[f.name] = (None, f, t)
    return out


def _optional_inner(t: Any) -> tuple[Any, bool]:
    if get_origin(t) in (typing.Union, types.UnionType):
        args = [a for a in get_args(t) if a is not type(None)]
        if len(args) == 1 and len(get_args(t)) == 2:
            return args[0], True
    return t, False


def convert(name: str, value: Any, t: Any) -> Any:
    """Check and convert one value (from YAML or the command line) to the field's type."""
    inner, optional = _optional_inner(t)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise PPOLMError(f"option '{name}' cannot be empty; give a value of type {_type_name(t)}")
    origin = get_origin(inner)
    if origin is Literal:
        choices = get_args(inner)
        if value not in choices:
            raise PPOLMError(f"option '{name}' must be one of {', '.join(map(str, choices))}; got {value!r}")
        return value
    if origin is list:
        (elem,) = get_args(inner)
        if isinstance(value, (str, int, float)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise PPOLMError(f"option '{name}' must be a list of {_type_name(elem)}; got {value!r}")
        return [convert(name, v, elem) for v in value]
    if inner is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise PPOLMError(f"option '{name}' must be true or false; got {value!r}")
    if inner is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise PPOLMError(f"option '{name}' must be an integer; got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise PPOLMError(f"option '{name}' must be an integer; got {value!r}") from None
    if inner is float:
        if isinstance(value, bool):
            raise PPOLMError(f"option '{name}' must be a number; got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise PPOLMError(f"option '{name}' must be a number; got {value!r}") from None
    if inner is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise PPOLMError(f"option '{name}' must be a string; got {value!r}")
        return str(value)
    raise TypeError(f"unsupported config type {t} for {name}")  # a bug in a config class


def _type_name(t: Any) -> str:
    inner, optional = _optional_inner(t)
    if get_origin(inner) is Literal:
        s = "{" + ",".join(map(str, get_args(inner))) + "}"
    elif get_origin(inner) is list:
        s = f"list[{_type_name(get_args(inner)[0])}]"
    else:
        s = getattr(inner, "__name__", str(inner))
    return s + ("|none" if optional else "")


def metavar(t: Any) -> str | None:
    """The placeholder after an option's flag in its help: the value's type (a repeatable option's
    element type, since each use takes one value); None for a choice, which argparse lists."""
    inner, _ = _optional_inner(t)
    if get_origin(inner) is Literal:
        return None
    if get_origin(inner) is list:
        return _type_name(get_args(inner)[0]).upper()
    return _type_name(t).upper()


def unknown_key(name: str, known: list[str], where: str) -> PPOLMError:
    prefix, _, leaf = name.rpartition(".")  # compare 'algo.lr' with the section's keys, not the prefix
    close = difflib.get_close_matches(leaf, [k.removeprefix(prefix + ".") if prefix else k for k in known],
                                      n=1, cutoff=0.6)
    close = [f"{prefix}.{close[0]}" if prefix else close[0]] if close else []
    hint = f"; did you mean '{close[0]}'?" if close else f"; see `ppolm {where} --help`"
    return PPOLMError(f"unknown config key '{name}'{hint}")


def load_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    p = Path(path)
    if p.is_dir():
        raise PPOLMError(f"config file {p} is a directory; pass the path of a YAML file to --config")
    if not p.is_file():
        raise PPOLMError(f"config file {p} does not exist; pass the path of a YAML file to --config")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise PPOLMError(f"config file {p} is not UTF-8 text; save it as UTF-8 YAML") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise PPOLMError(f"config file {p} is not valid YAML{at}; fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise PPOLMError(f"config file {p} must hold a mapping of option: value; got {type(data).__name__}")
    return data


def flatten_overrides(cfg_cls: type, data: dict[str, Any], where: str) -> dict[str, Any]:
    """Accept flat keys and keys nested under a section name; dashes or underscores."""
    leaves = leaf_fields(cfg_cls)
    secs = sections(cfg_cls)
    flat: dict[str, Any] = {}
    for key, value in data.items():
        k = str(key).replace("-", "_")
        if k in secs and isinstance(value, dict):
            for sk, sv in value.items():
                s = str(sk).replace("-", "_")
                if s not in leaves or leaves[s][0] != k:
                    raise unknown_key(f"{k}.{sk}", [f"{k}.{n}" for n, v in leaves.items() if v[0] == k], where)
                flat[s] = sv
        elif k in leaves:
            flat[k] = value
        else:
            raise unknown_key(str(key), list(leaves) + list(secs), where)
    return flat


def build(cfg_cls: type, overrides: dict[str, Any], where: str = "") -> Any:
    """Build a config from defaults plus flat overrides (checked, converted); then validate()."""
    leaves = leaf_fields(cfg_cls)
    per_section: dict[str | None, dict[str, Any]] = {}
    for name, value in overrides.items():
        if name not in leaves:
            raise unknown_key(name, list(leaves), where)
        sec, f, t = leaves[name]
        per_section.setdefault(sec, {})[name] = convert(name.replace("_", "-"), value, t)
    kwargs = dict(per_section.get(None, {}))
    for sec, t in sections(cfg_cls).items():
        kwargs[sec] = t(**per_section.get(sec, {}))
    cfg = cfg_cls(**kwargs)
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain data (sections as nested mappings), keys in :func:`ordered_fields` order."""
    return {f.name: to_dict(v) if dataclasses.is_dataclass(v := getattr(cfg, f.name)) else copy.deepcopy(v)
            for f in ordered_fields(type(cfg))}


SECTION_TITLES = {"model": "Model", "reward": "Reward", "generation": "Generation", "algo": "Algorithm",
                  "kl": "KL", "run": "Run"}
"""``--help`` group titles of a sectioned config's sections (``ppolm ppo``), by section field name."""

SHARED_TITLES = {"DeviceOptions": "Device and model loading", "ModelLoading": "Device and model loading",
                 "LoRAOptions": "LoRA", "PolicyLoRAOptions": "LoRA", "TextEncoding": "Text encoding",
                 "OptimiserOptions": "Optimiser", "HeldOutSplit": "Held-out split", "TrainRunControl": "Run"}
"""``--help`` group titles of the shared option groups (:mod:`ppolm.config_sections`) a flat config
inherits; the command's own fields stay in the parser's main group."""

HELP_WIDTH = 100
"""``--help`` never wraps wider than this, however wide the terminal."""


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter with each option's help on the lines under its flags, indented by 4,
    at most :data:`HELP_WIDTH` columns wide, and no line broken inside a hyphenated option name."""

    def __init__(self, prog: str) -> None:
        width = min(shutil.get_terminal_size().columns, HELP_WIDTH) - 2
        super().__init__(prog, max_help_position=6, width=width)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def default_text(f: dataclasses.Field) -> str:
    """A field's default as ``--help`` and docs/options.md show it."""
    default = f.default if f.default is not dataclasses.MISSING else (
        f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
    return str(default)


def option_groups(cfg_cls: type) -> list[tuple[str | None, list[str]]]:
    """``--help`` groups of a config in order: (title, option names); title None is the command's
    main group (its own fields). A sectioned config (``PPOConfig``) groups by section
    (:data:`SECTION_TITLES`); a flat one by the shared group that declares each inherited field
    (:data:`SHARED_TITLES`)."""
    groups: dict[str | None, list[str]] = {}
    own = set(inspect.get_annotations(cfg_cls))
    for name, (sec, _f, _t) in leaf_fields(cfg_cls).items():
        if sec is not None:
            title: str | None = SECTION_TITLES.get(sec, sec.capitalize())
        elif name in own:
            title = None
        else:
            declarer = next(k for k in cfg_cls.__mro__ if name in inspect.get_annotations(k))
            title = SHARED_TITLES.get(declarer.__name__, declarer.__name__)
        groups.setdefault(title, []).append(name)
    return list(groups.items())


def option_help(cfg_cls: type, name: str) -> str:
    """The ``--help`` text of one option: its field docstring and its default."""
    sec, f, t = leaf_fields(cfg_cls)[name]
    doc = field_docs(_hints(cfg_cls)[sec] if sec else cfg_cls).get(name, "")
    inner, _ = _optional_inner(t)
    return f"{doc} [default: {default_text(f)}]" + (" (repeatable)" if get_origin(inner) is list else "")


def add_arguments(parser: Any, cfg_cls: type) -> None:
    """Add one argparse option per leaf field, in argument groups (:func:`option_groups`); defaults
    are left unset (None) so that only options the user typed override the YAML file."""
    leaves = leaf_fields(cfg_cls)
    for title, names in option_groups(cfg_cls):
        group = parser if title is None else parser.add_argument_group(title)
        for name in names:
            _sec, _f, t = leaves[name]
            help_text = option_help(cfg_cls, name).replace("%", "%%")
            flag = "--" + name.replace("_", "-")
            inner, _ = _optional_inner(t)
            if inner is bool:
                group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                                   help=help_text)
            elif get_origin(inner) is list:
                group.add_argument(flag, dest=name, action="append", default=None, metavar=metavar(t),
                                   help=help_text)
            else:
                group.add_argument(flag, dest=name, default=None, metavar=metavar(t),
                                   choices=get_args(inner) if get_origin(inner) is Literal else None,
                                   help=help_text)


def from_cli(cfg_cls: type, args: Any, where: str) -> Any:
    """Defaults < YAML file (``args.config``) < command-line options."""
    overrides: dict[str, Any] = {}
    if getattr(args, "config", None):
        overrides.update(flatten_overrides(cfg_cls, load_yaml(args.config), where))
    for name in leaf_fields(cfg_cls):
        v = getattr(args, name, None)
        if v is not None:
            overrides[name] = v
    return build(cfg_cls, overrides, where)


def save_yaml(cfg: Any, path: str | Path) -> None:
    import yaml

    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")
