"""The one shape of stapo's registries (reward modes, rollout engines): a name -> object table
filled by a decorator, whose errors list the valid names.

    ENGINES = Registry("rollout engine")

    @ENGINES.register("hf")
    def build_hf(...): ...

Registering the same object again (or an object of the same module and qualified name, as when a
notebook cell is re-run) replaces it; a different object under a taken name raises. The token-mask
registry (``stapo.losses.masks``) follows the same rules and also turns classes into dataclasses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["Registry"]


def _qualname(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


class Registry(dict):
    """``name -> object`` for one concept; ``what`` names it in error messages."""

    def __init__(self, what: str, items: Iterable = ()) -> None:
        super().__init__(items)
        self.what = what

    def register(self, name: str, *, reserved: tuple[str, ...] = ()) -> Callable[[T], T]:
        """Decorator: make the decorated object available under ``name``."""
        if not isinstance(name, str) or not name or name in reserved:
            other = f" other than {', '.join(map(repr, reserved))}" if reserved else ""
            raise ValueError(f"{self.what} name must be a non-empty string{other}, got {name!r}")

        def decorate(obj: T) -> T:
            old = self.get(name)
            if old is not None and old is not obj and _qualname(old) != _qualname(obj):
                raise ValueError(f"{self.what} {name!r} is already registered to {_qualname(old)}")
            self[name] = obj
            return obj

        return decorate

    def lookup(self, name: str, choices: Iterable[str] | None = None):
        """The object registered as ``name``; a ValueError listing ``choices`` (default: the names) else."""
        if name not in self:
            valid = list(choices) if choices is not None else sorted(self)
            raise ValueError(f"unknown {self.what} {name!r}; choose one of {valid}")
        return self[name]

    def copy(self) -> "Registry":
        return Registry(self.what, self.items())
