"""What the commands share: one-line user errors, ``--import`` of user modules, recipes by name, and
reading ``CONFIG [key=value ...]`` into a :class:`~stapo.config.STAPOConfig`."""

from __future__ import annotations

import difflib
import importlib.resources
import importlib.util
import re
import sys
import traceback
from pathlib import Path

from stapo.config import STAPOConfig

TINY_RECIPE = "tiny_cpu.yaml"
_DOTTED_KEY = re.compile(r"^[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)+$")  # section.key, not a file name


class UserError(Exception):
    """A mistake in what the user asked for; printed as one line."""


def builtin_recipe(name: str = TINY_RECIPE) -> Path:
    return Path(str(importlib.resources.files("stapo") / "recipes" / name))


def recipe_dirs() -> list[Path]:
    """Where recipes are found by name: the built-in ones, then a source checkout's ``examples/recipes/``."""
    checkout = Path(__file__).resolve().parents[2] / "examples" / "recipes"
    return [Path(str(importlib.resources.files("stapo") / "recipes"))] + ([checkout] if checkout.is_dir() else [])


def recipes() -> dict[str, Path]:
    """``{name: file}`` of every recipe :func:`recipe_dirs` holds; a built-in one wins over a same-named copy."""
    found: dict[str, Path] = {}
    for folder in recipe_dirs():
        for path in sorted(folder.glob("*.yaml")):
            found.setdefault(path.stem, path)
    return found


def load_user_modules(paths: list[str]) -> None:
    """``--import my_masks.py``: user masks and tools, before the config is resolved (errors: one line)."""
    for path in paths:
        file = Path(path)
        if not file.is_file():
            raise UserError(f"--import: no such file: {file}")
        spec = importlib.util.spec_from_file_location(file.stem, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[file.stem] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # whatever the user's module raises: its file and line, not a traceback
            sys.modules.pop(file.stem, None)
            line = exc.lineno if isinstance(exc, SyntaxError) else next(
                (f.lineno for f in reversed(traceback.extract_tb(exc.__traceback__))
                 if Path(f.filename).resolve() == file.resolve()), None)
            message = exc.msg if isinstance(exc, SyntaxError) else str(exc)
            raise UserError(f"--import {file}{f', line {line}' if line else ''}: {type(exc).__name__}: "
                            f"{message}") from exc


def load_config(config: str | None, overrides: list[str]) -> STAPOConfig:
    """``CONFIG [key=value ...]``: a YAML file or a recipe's name; none is the built-in tiny recipe."""
    overrides = list(overrides)
    if config and "=" in config and not Path(config).exists():  # `stapo train key=value ...`
        config, overrides = None, [config, *overrides]
    if config is None:
        return STAPOConfig.from_yaml(builtin_recipe(), overrides=overrides)
    if not Path(config).exists():
        known = recipes()
        if config.removesuffix(".yaml") in known:
            return STAPOConfig.from_yaml(known[config.removesuffix(".yaml")], overrides=overrides)
        if _DOTTED_KEY.match(config) and Path(config).suffix not in (".yaml", ".yml"):  # `stapo train trainer.seed`
            raise UserError(f"{config!r} is neither a config file nor an override: an override needs a value, "
                            f"e.g. {config}=VALUE")
        close = difflib.get_close_matches(config.removesuffix(".yaml"), known, n=1)
        raise UserError(f"config file not found: {config}, nor a recipe of that name"
                        + (f"; did you mean {close[0]!r}?" if close else "") + " (`stapo recipes` lists them)")
    return STAPOConfig.from_yaml(Path(config), overrides=overrides)
