"""Composes pipeline_rl/conf/*.yaml with Hydra-style overrides into a validated RunConfig (in well under a second).

    cfg = compose(["inference=vllm", "trainer.learning_rate=3e-4", "actor.num_actors=2"])

Rules: pipeline_rl/conf/base.yaml holds the defaults and a `defaults:` map of groups; `group=name` picks
pipeline_rl/conf/<group>/<name>.yaml; groups are merged into the base in the order of that map;
`recipe=name` (pipeline_rl/conf/recipe/<name>.yaml, or a YAML file of your own) then sets its values and
may choose groups in a `defaults:` map of its own (a group named on the command line still wins); then every
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

from inference_shim.engine_check import gpu_visible
from pipeline_rl.config import RunConfig
from pipeline_rl.paths import CONF_DIR
from pipeline_rl.tasks.config import RENAMED as RENAMED_TASK_KEYS


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
    if parts[0] == "task" and len(parts) == 2 and parts[1] in RENAMED_TASK_KEYS:
        raise ConfigError(
            f"task.{parts[1]} is now task.{RENAMED_TASK_KEYS[parts[1]]} (each task validates its own options)"
        )
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


MISSING_HINTS = {
    "model_path": "required: model_path=/path/to/checkpoint (a Hugging Face model directory), or a recipe that "
    "names one (recipe=demo for the CPU demo's model, which `make demo` builds)",
}


def _format_validation(error: ValidationError) -> str:
    lines = []
    for err in error.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(config)"
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing" and key in MISSING_HINTS:
            message = MISSING_HINTS[key]
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


def recipe_path(name: str, conf_dir: Path = CONF_DIR) -> Path:
    """A recipe by name (pipeline_rl/conf/recipe/NAME.yaml) or a YAML file of the user's own."""
    shipped = conf_dir / "recipe" / f"{name}.yaml"
    if shipped.is_file():
        return shipped
    own = Path(name).expanduser()
    if own.suffix in (".yaml", ".yml") and own.is_file():
        return own
    raise ConfigError(
        f"recipe={name!r} is neither a shipped recipe ({', '.join(group_options('recipe', conf_dir))}) nor a "
        "YAML file: pass one of those names, or the path of a recipe file of your own"
    )


def _check_group(group: str, choice: str, conf_dir: Path) -> None:
    if choice not in group_options(group, conf_dir):
        raise ConfigError(
            f"{group}={choice!r} is not a known {group}; allowed values: {', '.join(group_options(group, conf_dir))}"
        )


def compose_dict(overrides: list[str], conf_dir: Path = CONF_DIR) -> dict[str, Any]:
    """The merged (not yet validated) configuration: base.yaml, then its groups, then the recipe's values,
    then the dotted overrides. Group choices come from base.yaml, then the recipe's `defaults:`, then the
    command line (a group named on the command line wins over the recipe's choice)."""
    base = _load_yaml(conf_dir / "base.yaml")
    defaults: dict[str, str] = dict(base.pop("defaults", {}) or {})
    dotted: list[tuple[str, str]] = []
    chosen: dict[str, str] = {}
    recipe_name = None
    for override in overrides:
        if "=" not in override:
            raise ConfigError(
                f"override '{override}' is not key=value (e.g. trainer.learning_rate=3e-4 or inference=vllm)"
            )
        key, value = override.split("=", 1)
        key = key.strip().lstrip("+")
        if key == "recipe":
            recipe_name = value
        elif key in defaults:
            if not (key == "platform" and value == "auto"):
                _check_group(key, value, conf_dir)
            chosen[key] = value
        else:
            dotted.append((key, value))
    recipe: dict[str, Any] = {}
    if recipe_name:
        recipe = _load_yaml(recipe_path(recipe_name, conf_dir))
        for group, choice in (recipe.pop("defaults", {}) or {}).items():
            if group not in defaults:
                raise ConfigError(
                    f"recipe {recipe_name}: `defaults` names {group!r}, not a group ({', '.join(defaults)})"
                )
            _check_group(group, choice, conf_dir)
            defaults[group] = choice
    defaults.update(chosen)
    if defaults.get("platform") == "auto":
        defaults["platform"] = "gpu" if gpu_visible() else "cpu"
    merged: dict[str, Any] = {}
    for group, choice in defaults.items():
        path = conf_dir / group / f"{choice}.yaml"
        if not path.exists():
            raise ConfigError(
                f"{group}={choice!r} is not a known {group}; allowed values: {', '.join(group_options(group, conf_dir))}"
            )
        _deep_merge(merged, _load_yaml(path))
    merged = _deep_merge(base, merged)
    _deep_merge(merged, recipe)
    for key, value in dotted:
        _set_dotted(merged, key, value)
    merged["_groups"] = defaults
    if recipe_name:
        merged["_groups"]["recipe"] = recipe_name
    return merged


def override_dict(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A saved configuration (a run's config.json) with dotted key=value overrides applied; groups and
    recipes, which build a configuration from the base, are refused here."""
    data = copy.deepcopy(data)
    for override in overrides:
        key, sep, value = override.partition("=")
        key = key.strip().lstrip("+")
        if not sep or "." not in key and key not in RunConfig.model_fields:
            raise ConfigError(
                f"override '{override}': only section.key=value applies to a saved run's configuration (groups "
                "and recipes compose a new one)"
            )
        _set_dotted(data, key, value)
    return data


def compose(overrides: list[str], conf_dir: Path = CONF_DIR) -> RunConfig:
    """Merged and validated configuration; raises ConfigError with a readable message."""
    data = compose_dict(overrides, conf_dir)
    data.pop("_groups", None)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(e)) from None
