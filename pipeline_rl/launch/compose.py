"""Composes pipeline_rl/conf/*.yaml with Hydra-style overrides into a validated RunConfig (in well under a second).

    cfg = compose(["inference=vllm", "trainer.learning_rate=3e-4", "actor.num_actors=2"])

Rules: pipeline_rl/conf/base.yaml holds the defaults and a `defaults:` map of groups; `group=name` picks
pipeline_rl/conf/<group>/<name>.yaml; groups are merged into the base in the order of that map; then every
`dotted.key=value` override is applied (value parsed as YAML: numbers, booleans, lists, null; a field
that takes strings only gets the text as typed, so `trainer.mixed_precision=no` is "no", not False). The
result is validated once into RunConfig; every error names the key, the allowed values and the fix.
"""

from __future__ import annotations

import copy
import difflib
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from pipeline_rl.config import RunConfig
from pipeline_rl.paths import CONF_DIR


class ConfigError(ValueError):
    """A bad config value or override; the message says which key and what would be accepted."""


def _load_yaml(path: Path) -> dict:
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping at top level")
    return data


def _deep_merge(base: dict, update: dict) -> dict:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def group_options(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def _schema_model(model: type[BaseModel], path: list[str]) -> type[BaseModel] | None:
    """The config model at a dotted path of the schema, or None if the path leaves the schema."""
    for part in path:
        annotation = getattr(model.model_fields.get(part), "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _schema_keys(model: type[BaseModel], path: list[str]) -> list[str] | None:
    """Field names at a dotted path of the schema, or None if the path leaves the schema."""
    found = _schema_model(model, path)
    return None if found is None else sorted(found.model_fields)


def _takes_only_strings(model: type[BaseModel], path: list[str]) -> bool:
    """Whether the field at a dotted path accepts strings only (and maybe None)."""
    parent = _schema_model(model, path[:-1])
    field = None if parent is None else parent.model_fields.get(path[-1])
    return field is not None and _only_strings(field.annotation)


def _only_strings(annotation: Any) -> bool:
    """str or Path, a Literal of strings, or a union of those (None allowed: `null` stays None)."""
    if annotation in (str, Path, type(None)):
        return True
    args = get_args(annotation)
    if get_origin(annotation) is Literal:
        return all(isinstance(arg, str) for arg in args)
    return bool(args) and get_origin(annotation) in (Union, types.UnionType) and all(map(_only_strings, args))


def _set_dotted(data: dict, key: str, raw: str) -> None:
    parts = key.split(".")
    known = _schema_keys(RunConfig, parts[:-1])
    if known is not None and parts[-1] not in known:
        hint = difflib.get_close_matches(parts[-1], known, n=1)
        where = ".".join(parts[:-1]) or "the top level"
        raise ConfigError(
            f"unknown key '{key}'"
            + (f" — did you mean '{'.'.join(parts[:-1] + hint)}'?" if hint else "")
            + f" Keys of {where}: {', '.join(known)}"
        )
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse the value of '{key}': {e}") from None
    if value is not None and not isinstance(value, str) and _takes_only_strings(RunConfig, parts):
        # YAML reads no/yes/on/off as booleans, 2024 or 1.5 as numbers, an ISO date as a date: a string
        # field gets what was typed (trainer.mixed_precision=no, a model_path named 2024).
        value = raw
    node = data
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def _format_validation(error: ValidationError) -> str:
    lines = []
    for err in error.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(config)"
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            parent = [str(p) for p in err["loc"][:-1]]
            known = _schema_keys(RunConfig, parent) or []
            message = f"unknown key; keys here: {', '.join(known)}"
        got = err.get("input")
        shown = (
            f" (got {got!r})"
            if got is not None and not isinstance(got, dict) and err["type"] != "extra_forbidden"
            else ""
        )
        lines.append(f"  {key}: {message}{shown}")
    return "invalid configuration:\n" + "\n".join(lines)


def compose_dict(overrides: list[str], conf_dir: Path = CONF_DIR) -> dict[str, Any]:
    """The merged (not yet validated) configuration."""
    base = _load_yaml(conf_dir / "base.yaml")
    defaults: dict[str, str] = dict(base.pop("defaults", {}) or {})
    dotted: list[tuple[str, str]] = []
    for override in overrides:
        if "=" not in override:
            raise ConfigError(
                f"override '{override}' is not key=value (e.g. trainer.learning_rate=3e-4 or inference=vllm)"
            )
        key, value = override.split("=", 1)
        key = key.strip().lstrip("+")
        if key in defaults:
            if value not in group_options(key, conf_dir):
                raise ConfigError(
                    f"{key}={value!r} is not a known {key}; allowed values: {', '.join(group_options(key, conf_dir))}"
                )
            defaults[key] = value
        else:
            dotted.append((key, value))
    merged: dict[str, Any] = {}
    for group, choice in defaults.items():
        path = conf_dir / group / f"{choice}.yaml"
        if not path.exists():
            raise ConfigError(
                f"{group}={choice!r} is not a known {group}; allowed values: {', '.join(group_options(group, conf_dir))}"
            )
        _deep_merge(merged, _load_yaml(path))
    merged = _deep_merge(base, merged)
    for key, value in dotted:
        _set_dotted(merged, key, value)
    merged["_groups"] = defaults
    return merged


def compose(overrides: list[str], conf_dir: Path = CONF_DIR) -> RunConfig:
    """Merged and validated configuration; raises ConfigError with a readable message."""
    data = compose_dict(overrides, conf_dir)
    data.pop("_groups", None)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(e)) from None
