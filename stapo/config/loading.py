"""Strict construction of nested config dataclasses from plain dicts (YAML) and dotted overrides.

An unknown key is an error naming the closest valid key; values are coerced to the field's type (YAML reads
``1e-6`` as a string) or rejected with the field named.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Union

import yaml


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names it."""


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the
    last one: a section written twice would lose every key of its first half without a word)."""

    def construct_mapping(self, node, deep=False):
        first: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, str) and key in first:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice (lines {first[key]} and {key_node.start_mark.line + 1}): "
                                "the second would replace the first; merge them into one", key_node.start_mark)
            first.setdefault(key, key_node.start_mark.line + 1)
        return super().construct_mapping(node, deep)


def load_yaml(text: str, where: str):
    """``text`` parsed strictly; ConfigError ``"WHERE, line L, column C: cause"`` on any YAML error."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        since = f" ({context} started at line {start.line + 1})" if context and start is not None else ""
        raise ConfigError(f"{where}{at}: invalid YAML: {getattr(exc, 'problem', None) or exc}{since}") from None


def apply_overrides(data: dict, overrides) -> dict:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = nxt
        node[parts[-1]] = load_yaml(raw, f"override {item!r}") if raw.strip() else ""
    return data


def _closest(name: str, valid: list[str], prefix: str) -> str:
    match = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {prefix + match[0]!r}?" if match else ""
    return f"{hint} (valid keys under {prefix.rstrip('.') or 'the top level'}: {', '.join(valid)})"


def build_dataclass(cls, data: Any, prefix: str = ""):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    # a removed key -> (its old default, what replaces it): at that default (as a run directory's config.yaml
    # written before holds it) there is nothing to carry over; any other value is an error naming the new key
    # (the message shows the value only where it says so: a removed secret is never echoed)
    removed = getattr(cls, "REMOVED_KEYS", {})
    for key in data:
        if key in removed and data[key] != removed[key][0]:
            message = removed[key][1].format(value=data[key])
            raise ConfigError(f"{prefix}{key}{'' if message.startswith('=') else ' '}{message}")
        if key not in names and key not in removed:
            raise ConfigError(f"unknown config key {prefix + str(key)!r}{_closest(str(key), names, prefix)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = build_dataclass(tp, data[f.name] or {}, prefix=f"{prefix}{f.name}.")
        else:
            kwargs[f.name] = _coerce(data[f.name], tp, prefix + f.name)
    return cls(**kwargs)


def coerce_params(cls, params: dict, prefix: str) -> dict:
    """``params`` (a mask's or tool's keyword parameters from the config) with each value coerced to the
    type of ``cls``'s field of that name, as config fields are (``mask.params.tau_p=2e-3``: YAML reads a
    string); names ``cls`` lacks are left for its builder to report."""
    hints = typing.get_type_hints(cls)
    return {k: _coerce(v, hints[k], f"{prefix}.{k}") if k in hints else v for k, v in params.items()}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if tp is list or origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r} (write it as [{value}])")
        return list(value)
    if tp is dict or origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            number = float(value) if isinstance(value, str) else value
        except ValueError:
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
        if float(number) != int(number):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return int(number)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)  # YAML reads "1e-6" as a string: accept it
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    return value
