"""The tool contract: ``ToolCall``, ``ToolResult``, the ``Tool`` base class and the tool registry
(docs/tools.md, "The contract"). Every failure becomes an error result: hostile or malformed calls are the
policy's mistakes, not the trainer's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Protocol

from stapo.registry import Registry

__all__ = ["ToolCall", "ToolResult", "ToolError", "ToolSession", "Tool", "TOOLS", "register_tool",
           "build_tool", "available_tools", "tool_params", "describe_tools", "cap_text"]


@dataclass(frozen=True)
class ToolCall:
    """One call as the parser read it from the policy's turn."""

    name: str  # the tool's registered name
    arguments: dict  # JSON object of the arguments
    text: str  # the call exactly as the policy wrote it (e.g. "<tool_call>...</tool_call>")


@dataclass(frozen=True)
class ToolResult:
    """What one call returns to the policy."""

    text: str  # the tool's output (or error message), already capped at the tool's max_output_chars
    error: bool  # True: the call failed (bad arguments, exception, a limit hit, output cut)
    seconds: float  # wall time of the call


class ToolError(Exception):
    """Raised by ``Tool.run``: the message is returned to the policy as an error result.
    ``total_chars``: the length of the whole output when the message holds only its start and end."""

    def __init__(self, message: str, total_chars: Optional[int] = None):
        super().__init__(message)
        self.total_chars = total_chars


class ToolSession(Protocol):
    """State of a stateful tool across the calls of one episode; ``close()`` releases it."""

    def close(self) -> None: ...


@dataclass
class Tool:
    """Base class of tools. Subclasses set ``description`` and ``parameters`` (class attributes,
    unannotated) and implement ``run``; their dataclass fields are their parameters and limits."""

    description: ClassVar[str] = ""
    parameters: ClassVar[dict] = {"type": "object", "properties": {}}  # JSON schema of the arguments
    name: ClassVar[str] = ""  # set by @register_tool

    timeout_s: float = 10.0  # wall-clock limit of one call
    max_output_chars: int = 2000  # longer output is cut (and the call is an error)

    def __post_init__(self):
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"{type(self).__name__}.timeout_s must be > 0, got {self.timeout_s!r}")
        if not (isinstance(self.max_output_chars, int) and self.max_output_chars >= 1):
            raise ValueError(f"{type(self).__name__}.max_output_chars must be an int >= 1, got "
                             f"{self.max_output_chars!r}")

    def schema(self) -> dict:
        """The entry a chat template renders in its tool list (OpenAI's function format)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def open_session(self) -> Optional[ToolSession]:
        """A session holding state across one episode's calls; None for a stateless tool."""
        return None

    @property
    def deadline_s(self) -> float:
        """How long ``run_tool_calls`` waits for one call before it reports a timeout (a tool that
        kills its own work, like ``python``, allows for its start-up on top of ``timeout_s``)."""
        return self.timeout_s + 1.0

    def run(self, arguments: dict, session: Optional[ToolSession]) -> str:
        raise NotImplementedError(f"{type(self).__name__} must implement run(arguments, session)")

    def __call__(self, arguments: Any, session: Optional[ToolSession] = None) -> ToolResult:
        start = time.monotonic()
        problem = check_arguments(self.name or type(self).__name__, self.parameters, arguments)
        if problem is not None:
            return ToolResult(problem, True, time.monotonic() - start)
        error, total = False, None
        try:
            text = self.run(arguments, session)
        except ToolError as exc:
            text, error, total = str(exc), True, exc.total_chars
        except Exception as exc:  # noqa: BLE001 - a tool's bug or a hostile input: an error result, never a crash
            text, error = f"{self.name} failed: {type(exc).__name__}: {exc}", True
        text, cut = cap_text(str(text), self.max_output_chars, total)
        return ToolResult(text, error or cut, time.monotonic() - start)


def cap_text(text: str, limit: int, total: Optional[int] = None) -> tuple[str, bool]:
    """``(text, False)``, or, when it is longer than ``limit`` (or ``total``, the length of an output
    of which ``text`` holds the start and the end, is), its first and last ``limit / 2``
    characters around a note, and True. The end is kept: that is where a traceback says what went wrong."""
    total = max(len(text), total or 0)
    if total <= limit:
        return text, False
    head, tail = text[:limit // 2], text[len(text) - (limit - limit // 2):]
    return f"{head}\n[output cut: {total} characters, the limit is {limit}; the middle is left out]\n{tail}", True


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict,
               "array": list, "null": type(None)}


def check_arguments(tool: str, schema: dict, arguments: Any) -> Optional[str]:
    """None, or the message telling the policy what is wrong with ``arguments`` (the schema's
    object, required, property types and additionalProperties; no deeper JSON-schema rules)."""
    if not isinstance(arguments, dict):
        return f"{tool}: arguments must be a JSON object, got {type(arguments).__name__}"
    properties = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        return f"{tool}: missing required argument(s) {missing}; arguments: {sorted(properties)}"
    if schema.get("additionalProperties", True) is False:
        unknown = sorted(set(arguments) - set(properties))
        if unknown:
            return f"{tool}: unknown argument(s) {unknown}; arguments: {sorted(properties)}"
    for key, value in arguments.items():
        kind = properties.get(key, {}).get("type")
        ok = kind not in _JSON_TYPES or (isinstance(value, _JSON_TYPES[kind])
                                         and not (kind in ("integer", "number") and isinstance(value, bool)))
        if not ok:
            return f"{tool}: argument {key!r} must be of type {kind}, got {type(value).__name__}"
    return None


# ---- the registry -------------------------------------------------------------------------------

TOOLS = Registry("tool", base=Tool)
available_tools = TOOLS.names  # sorted names accepted by build_tool
tool_params = TOOLS.params  # parameters with their defaults (dataclasses.MISSING if required)
build_tool = TOOLS.build  # an instance; an unknown parameter is an error naming the valid ones
describe_tools = TOOLS.describe  # RegistryEntry(name, summary, params, obj) per tool, for `stapo tools`


def register_tool(name: str):
    """Class decorator: make a ``Tool`` subclass buildable as ``build_tool(name, ...)`` and callable
    by the policy under ``name`` (the class becomes a dataclass if it is not one already)."""
    register = TOOLS.register(name)

    def decorate(cls):
        cls = register(cls)
        cls.name = name
        return cls

    return decorate
