"""User reward functions, per item or batched (docs/grpo_options.md): ``reward.function_batched`` is explicit,
as a signature cannot tell the forms apart. Loaded inside the reward workers; the parent only parses the spec.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["call_function", "load_function", "parse_function_spec"]


def parse_function_spec(spec: str, check_file: bool = True) -> tuple[str, str, str]:
    """``spec`` -> ``(kind, target, attribute)``, kind ``"file"`` (target an absolute path) or
    ``"module"``; ValueError naming ``reward.function`` when malformed or the file is missing."""
    target, sep, attr = str(spec).rpartition(":")
    if not sep or not target.strip() or not attr.strip():
        raise ValueError(f"reward.function must look like 'pkg.module:callable' or 'path/to/file.py:callable', "
                         f"got {spec!r}")
    target, attr = target.strip(), attr.strip()
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser().resolve()
        if check_file and not path.is_file():
            raise ValueError(f"reward.function {spec!r}: no such file: {path}")
        return "file", str(path), attr
    if not all(part.isidentifier() for part in target.split(".")):
        raise ValueError(f"reward.function {spec!r}: {target!r} is not a module path (pkg.module) or a .py file")
    return "module", target, attr


def load_function(spec: str) -> Callable[..., Any]:
    """Import the module or file of ``spec`` and return its callable (dotted attributes allowed)."""
    kind, target, attr = parse_function_spec(spec)
    if kind == "file":
        path = Path(target)
        sys.path.insert(0, str(path.parent))  # the file's own sibling imports
        name = f"stapo_reward_fn_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{target} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{target}:{attr} is a {type(obj).__name__}, not a callable")
    _check_signature(obj, f"{target}:{attr}")
    return obj


def _check_signature(fn: Callable[..., Any], name: str) -> None:
    """Both call forms pass two positional arguments (then dataset columns by keyword): fail at load,
    not on the first batch."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: the first call will tell
        return
    params = signature.parameters.values()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise TypeError(f"{name}{signature} cannot be called as fn(response, ground_truth, **fields) "
                        "(batched: fn(responses, ground_truths, **columns))")


def accepted_fields(fn: Callable[..., Any], names: Sequence[str]) -> list[str]:
    """The extra column names ``fn`` can take as keywords: all with ``**kwargs``, else those it names."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: pass nothing extra
        return []
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return list(names)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return [n for n in names if n in named]


def _number(value: Any, where: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{where} returned {value!r:.80}, not a number") from None
    if not math.isfinite(number):
        raise ValueError(f"{where} returned a non-finite reward {number}")
    return number


def call_function(fn: Callable[..., Any], batched: bool, payload: list) -> Any:
    """Run one task: per item ``[response, ground_truth, fields]`` -> float; batched
    ``[responses, ground_truths, fields_per_row]`` -> list of floats (validated here, in the worker)."""
    if not batched:
        response, ground_truth, fields = payload
        extra = {k: fields[k] for k in accepted_fields(fn, list(fields))}
        return _number(fn(response, ground_truth, **extra), "the reward function")
    responses, ground_truths, rows = payload
    names = list(dict.fromkeys(k for row in rows for k in row))  # union of columns, first-seen order
    columns = {k: [row.get(k) for row in rows] for k in accepted_fields(fn, names)}
    values = fn(list(responses), list(ground_truths), **columns)
    count = len(values) if hasattr(values, "__len__") else repr(values)[:80]
    if count != len(responses):
        raise ValueError(f"the batched reward function returned {count} values for {len(responses)} responses")
    return [_number(v, "the batched reward function") for v in values]
