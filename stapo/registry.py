"""The one registry mechanism: a ``name -> object`` table filled by a decorator, for token masks, tools,
tool-call parsers, rejection statistics, reward terms, reward modes and rollout engines.

    TERMS = Registry("reward term", base=RewardTerm)

    @TERMS.register("tool")
    class ToolShaping(RewardTerm):           # becomes a dataclass: its fields are its parameters
        error_penalty: float = 0.0

    TERMS.build("tool", error_penalty=0.5)   # an unknown parameter: one error naming it and the valid ones
    TERMS.params("tool")                     # {"error_penalty": 0.0} (dataclasses.MISSING if required)
    TERMS.describe()                         # [RegistryEntry(name, summary, params, obj)], by name

A plain callable registers as it is (no parameters through ``build``). Registering an object of the same
module and qualified name again (a re-run notebook cell) replaces it; another object under a taken name raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import import_module
from typing import Any, Optional, TypeVar

T = TypeVar("T")

__all__ = ["Registry", "RegistryEntry", "lazy_attributes"]


def _qualname(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


@dataclass(frozen=True)
class RegistryEntry:
    """One registered object, for listings such as ``stapo masks`` and ``stapo tools``."""

    name: str
    summary: str  # first line of the object's docstring
    params: dict[str, Any]  # parameter -> default (dataclasses.MISSING if required)
    obj: Any  # the registered class or callable


class Registry(dict):
    """``name -> object`` for one concept; ``what`` names it in error messages, ``base`` (optional) is
    the class every entry subclasses, ``listing(registry)`` (optional) phrases the valid names."""

    def __init__(self, what: str, items: Iterable = (), *, base: Optional[type] = None,
                 listing: Optional[Callable[["Registry"], str]] = None) -> None:
        super().__init__(items)
        self.what, self.base, self.listing = what, base, listing

    def register(self, name: str, *, reserved: tuple[str, ...] = ()) -> Callable[[T], T]:
        """Decorator: make the decorated object available under ``name``."""
        if not isinstance(name, str) or not name or name in reserved:
            other = f" other than {', '.join(map(repr, reserved))}" if reserved else ""
            raise ValueError(f"{self.what} name must be a non-empty string{other}, got {name!r}")

        def decorate(obj: T) -> T:
            if self.base is not None:
                if not (isinstance(obj, type) and issubclass(obj, self.base)):
                    raise TypeError(f"{self.what} {name!r} needs a {self.base.__name__} subclass, got {obj!r}")
                if "__dataclass_fields__" not in obj.__dict__:
                    obj = dataclass(obj)
            old = self.get(name)
            if old is not None and old is not obj and _qualname(old) != _qualname(obj):
                raise ValueError(f"{self.what} {name!r} is already registered to {_qualname(old)}; "
                                 f"pick another name for {_qualname(obj)}")
            self[name] = obj
            return obj

        return decorate

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self)

    def lookup(self, name: str, choices: Iterable[str] | None = None):
        """The object registered as ``name``; a ValueError listing ``choices`` (default: the names) else."""
        if name not in self:
            if self.listing is not None and choices is None:
                raise ValueError(f"unknown {self.what} {name!r}; {self.listing(self)}")
            raise ValueError(f"unknown {self.what} {name!r}; choose one of {list(choices or self.names())}")
        return self[name]

    def name_of(self, obj) -> str | None:
        """The name ``obj`` (an instance or the registered class itself) is registered under, or None."""
        cls = obj if isinstance(obj, type) else type(obj)
        return next((name for name, registered in self.items() if registered is cls), None)

    def params(self, name: str) -> dict[str, Any]:
        """Parameters of ``name`` with their defaults (``dataclasses.MISSING`` if required); ``{}`` for a
        registered callable that is not a dataclass."""
        obj = self.lookup(name)
        if not dataclasses.is_dataclass(obj):
            return {}
        return {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                for f in dataclasses.fields(obj) if f.init}

    def build(self, name: str, **params: Any):
        """An instance of ``name`` built with ``params`` (which the class validates); a parameter it does
        not have is a ValueError naming it and the valid ones."""
        obj, valid = self.lookup(name), self.params(name)
        unknown = sorted(set(params) - set(valid))
        if unknown:
            listed = ", ".join(k if v is dataclasses.MISSING else f"{k}={v!r}" for k, v in valid.items())
            raise ValueError(f"unknown parameter(s) {unknown} for {self.what} {name!r}; "
                             f"valid parameters: {listed or '(none)'}")
        return obj(**params)

    def describe(self) -> list[RegistryEntry]:
        """Every entry with its one-line summary and parameters, by name."""
        return [RegistryEntry(name, (self[name].__doc__ or "").strip().split("\n")[0], self.params(name), self[name])
                for name in self.names()]

    def copy(self) -> "Registry":
        return Registry(self.what, self.items(), base=self.base, listing=self.listing)


def lazy_attributes(package: str, modules: dict[str, Iterable[str]]) -> Callable[[str], Any]:
    """A package's ``__getattr__`` (PEP 562) that imports each name's module on first use, so the package stays
    light to import (DeepSpeed, transformers, matplotlib load only with a name that needs them)."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(where[name]), name)

    return __getattr__
