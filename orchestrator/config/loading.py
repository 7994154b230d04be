"""Building a config at the entry point: defaults < YAML < environment < flags < `--set PATH=VALUE`.

A command's flags are a table of `Flag`s, each naming the config field it sets by its dotted path; its help text
is that field's description and default, so the flags and the models cannot drift apart (a test checks every
flag's path, and that `docs/configuration.md` is what `reference_markdown()` writes).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

__all__ = ["Flag", "load_yaml", "set_path", "add_flags", "apply_flags", "apply_sets", "field_at", "reference_markdown",
           "ConfigFileError"]


class ConfigFileError(ValueError):
    """A config file or a --set item that cannot be read (the CLI prints it and exits)."""


@dataclass(frozen=True)
class Flag:
    option: str  # "--max-inflight"; "" for a setting read from the environment only
    path: str  # dotted config path, "frontend.admission.max_inflight_per_model"
    type: Any = None  # argparse type; None for store_true flags
    env: str | None = None  # environment variable read when the flag is not given
    store_true: bool = False
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")


def load_yaml(path: str | Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigFileError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: the top level must be a mapping")
    return data


def set_path(data: dict, path: str, value: Any) -> None:
    """data[a][b][c] = value for path "a.b.c", creating mappings on the way."""
    *parents, leaf = path.split(".")
    node = data
    for key in parents:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            raise ConfigFileError(f"{path}: {key} is not a section")
        node = child
    node[leaf] = value


def field_at(model: type[BaseModel], path: str) -> FieldInfo:
    """The pydantic field a dotted path names, below `model`; KeyError if there is none."""
    *parents, leaf = path.split(".")
    for key in parents:
        model = _submodel(model.model_fields[key])
    return model.model_fields[leaf]


def _submodel(info: FieldInfo) -> type[BaseModel]:
    ann = info.annotation
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    raise KeyError(f"not a section: {ann!r}")


def _help(model: type[BaseModel], flag: Flag) -> str:
    info = field_at(model, flag.path)
    default = info.get_default(call_default_factory=True)
    shown = "" if flag.store_true or default in (None, [], "") else f" (default {_fmt(default)})"
    env = f" [env {flag.env}]" if flag.env else ""
    return f"{info.description}{shown}{env}; config {flag.path}"


def _fmt(value: Any) -> str:
    if isinstance(value, frozenset):
        return ",".join(map(str, sorted(value)))
    return getattr(value, "value", value).__str__()


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel], flags: Iterable[Flag]) -> None:
    """One argparse option per Flag, default None (the config's default then applies), help from the field."""
    for f in flags:
        if not f.option:
            continue
        kw: dict[str, Any] = {"dest": f.dest, "default": None, "help": _help(model, f), **f.extra}
        if f.store_true:
            kw["action"] = "store_true"
        else:
            kw["type"] = f.type or str
            if f.choices:
                kw["choices"] = f.choices
            if f.metavar:
                kw["metavar"] = f.metavar
        parser.add_argument(f.option, **kw)


def apply_flags(data: dict, ns: argparse.Namespace, flags: Iterable[Flag], environ: Mapping[str, str] = os.environ) -> dict:
    """Environment, then flags, over `data` (a config mapping read from YAML); returns data."""
    for f in flags:
        value = getattr(ns, f.dest, None) if f.option else None
        if value is None and f.env and environ.get(f.env):
            value = environ[f.env]
        if value is not None:
            set_path(data, f.path, value)
    return data


def apply_sets(data: dict, items: Iterable[str] | None) -> dict:
    """`--set a.b.c=VALUE` items over data; VALUE is read as YAML (8, true, [1, 2], text)."""
    for item in items or ():
        path, sep, raw = item.partition("=")
        if not sep or not path.strip():
            raise ConfigFileError(f"--set {item!r}: expected PATH=VALUE, e.g. frontend.router.kv.overlap_weight=8")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigFileError(f"--set {item!r}: {exc}") from None
        set_path(data, path.strip(), value)
    return data


def _walk(model: type[BaseModel], prefix: str) -> Iterable[tuple[str, FieldInfo, type[BaseModel] | None]]:
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        try:
            sub = _submodel(info)
        except KeyError:
            sub = None
        yield path, info, sub
        if sub is not None:
            yield from _walk(sub, path + ".")


def reference_markdown(roots: Mapping[str, type[BaseModel]]) -> str:
    """docs/configuration.md: every section and field of each root model, with type, default and description."""
    lines = ["# Configuration reference", "",
             "Generated from the config models (`kvyard config reference`); do not edit by hand. Each command builds its",
             "config from these defaults, then its `--config` YAML file, then the environment, then its flags, then",
             "`--set PATH=VALUE` items (for any field below, e.g. `--set frontend.router.kv.overlap_weight=8`).", ""]
    for title, model in roots.items():
        lines += [f"## {title}", "", (model.__doc__ or "").strip().splitlines()[0], ""]
        rows = ["| key | type | default | description |", "|---|---|---|---|"]
        for path, info, sub in _walk(model, ""):
            if sub is not None:
                rows.append(f"| **{path}** | section | | {info.description or ''} |")
                continue
            default = info.get_default(call_default_factory=True)
            shown = "" if default is None else f"`{_fmt(default)}`"
            rows.append(f"| `{path}` | {_type_name(info.annotation)} | {shown} | {info.description or ''} |")
        lines += rows + [""]
    return "\n".join(lines)


def _type_name(ann: Any) -> str:
    text = getattr(ann, "__name__", None) if isinstance(ann, type) else None
    text = text or str(ann).replace("typing.", "").replace("pathlib.", "").replace("workers.types.", "")
    return text.replace("|", "or")
