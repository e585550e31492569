"""Health monitors: one small pure function per warning sign, registered by name (docs/health.md,
"Monitors"). Step metrics are sums over every token of every rank, so a statistic is split-invariant.
"""

from __future__ import annotations

import inspect
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stapo.registry import Registry

__all__ = ["MONITORS", "Window", "Monitor", "register_monitor", "build_monitor", "monitor_params", "robust_z",
           "MAD_TO_SIGMA", "MIN_HISTORY"]

MONITORS = Registry("health monitor")
MAD_TO_SIGMA = 1.4826  # MAD x this = the standard deviation, for normal noise
MIN_HISTORY = 3  # a baseline needs at least this many earlier values
_FIRES = ("above", "below")


class Window:
    """The last steps' values of the monitored keys, oldest first; the last row is the current step.
    Rows hold finite numbers only (a skipped step's NaN loss is not a value)."""

    def __init__(self, rows: Sequence[Mapping[str, float]]) -> None:
        self.rows = rows

    def current(self, key: str) -> float | None:
        return self.rows[-1].get(key) if self.rows else None

    def history(self, key: str) -> list[float]:
        """``key``'s values before the current step (steps that did not log it are left out)."""
        return [row[key] for row in self.rows[:-1] if key in row]


def robust_z(window: Window, key: str, *, rel_floor: float = 0.0, abs_floor: float = 0.0) -> float | None:
    """``(x - median) / max(1.4826 MAD, rel_floor |median|, abs_floor)`` of ``key``'s current value
    against its history; None without a current value or with fewer than ``MIN_HISTORY`` earlier ones."""
    x, past = window.current(key), window.history(key)
    if x is None or len(past) < MIN_HISTORY:
        return None
    med = statistics.median(past)
    scale = max(MAD_TO_SIGMA * statistics.median(abs(v - med) for v in past), rel_floor * abs(med), abs_floor)
    if scale == 0:
        return 0.0 if x == med else math.copysign(math.inf, x - med)
    return (x - med) / scale


def register_monitor(name: str, *, reads: tuple[str, ...], threshold: str, fires: str) -> Callable:
    """Decorator: ``fn(window, **params) -> float | None`` as monitor ``name``, reading the metric keys ``reads``;
    its parameter ``threshold`` is the threshold, and it ``fires`` ``above`` or ``below`` it."""
    if fires not in _FIRES:
        raise ValueError(f"register_monitor({name!r}): fires must be one of {list(_FIRES)}, got {fires!r}")

    def decorate(fn: Callable) -> Callable:
        if threshold not in _defaults(fn):
            raise ValueError(f"register_monitor({name!r}): {fn.__name__} has no parameter {threshold!r} "
                             "with a default to be its threshold")
        fn.reads, fn.threshold_param, fn.fires = tuple(reads), threshold, fires
        return MONITORS.register(name)(fn)

    return decorate


def _defaults(fn: Callable) -> dict[str, Any]:
    """A monitor's parameters and their defaults (every argument after the window)."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def monitor_params(name: str) -> dict[str, Any]:
    """The parameters of monitor ``name`` with their defaults (ValueError listing the monitors if unknown)."""
    return _defaults(MONITORS.lookup(name))


@dataclass(frozen=True)
class Monitor:
    """A registered monitor with its parameters resolved: what :class:`HealthWatch` runs each step."""

    name: str
    fn: Callable[..., float | None]
    params: dict
    reads: tuple[str, ...]
    threshold: float
    fires: str

    def statistic(self, window: Window) -> float | None:
        value = self.fn(window, **self.params)
        return None if value is None or math.isnan(value) else float(value)

    def past_threshold(self, value: float) -> bool:
        return value > self.threshold if self.fires == "above" else value < self.threshold


def build_monitor(name: str, **params: Any) -> Monitor:
    """Monitor ``name`` with ``params`` over its defaults; a ValueError naming a parameter it does not have."""
    defaults = monitor_params(name)
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise ValueError(f"health monitor {name!r} has no parameter(s) {unknown}; its parameters: {sorted(defaults)}")
    fn = MONITORS[name]
    resolved = {**defaults, **params}
    return Monitor(name, fn, resolved, fn.reads, float(resolved[fn.threshold_param]), fn.fires)
