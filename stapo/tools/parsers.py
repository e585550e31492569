"""Tool-call parsers, one per format, registered by name: ``qwen3`` (its chat template's ``<tool_call>``
blocks) and ``python_block`` (ToRA's fenced ```python blocks); docs/tools.md, "Tool-call parsers".
``parse`` never raises: a malformed turn is a ``ParsedTurn.error`` the policy reads as its tool result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from stapo.registry import Registry
from stapo.tools.base import ToolCall

__all__ = ["ParsedTurn", "ToolCallParser", "Qwen3Parser", "PythonBlockParser", "PARSERS", "register_tool_parser",
           "build_tool_parser", "available_tool_parsers", "describe_tool_parsers"]


@dataclass(frozen=True)
class ParsedTurn:
    """The calls of one turn in order, or ``error`` (then ``calls`` is empty and the episode
    loop returns ``error`` to the policy as a failed tool result)."""

    calls: list[ToolCall]
    error: Optional[str] = None

    @property
    def final(self) -> bool:
        """True for a turn without calls and without a malformed one: the policy's answer."""
        return not self.calls and self.error is None


@dataclass
class ToolCallParser:
    """Base class of parsers; fields are their parameters."""

    tools: tuple[str, ...] = ()  # names the policy may call; () = any (the episode loop checks)
    max_calls: int = 8  # more calls in one turn is an error
    max_chars: int = 100_000  # a call's text longer than this is an error (before decoding its JSON)

    stop = ()  # strings that end a turn holding a call (a class attribute, overridden per format)
    control = ()  # the format's tags (class attribute); those that are single tokens are counted (docs/health.md)
    # an inline format's ``render_results(texts) -> str`` writes the results into the turn itself; None: the
    # chat template renders them as ``tool`` messages (stapo.rollout.tool_turns)
    render_results = None

    def __post_init__(self):
        self.tools = tuple(self.tools)

    def parse(self, text: str) -> ParsedTurn:
        raise NotImplementedError(f"{type(self).__name__} must implement parse(text)")

    def _checked(self, calls: list[ToolCall]) -> ParsedTurn:
        """The turn, or an error for too many calls or a name outside ``tools``."""
        if len(calls) > self.max_calls:
            return ParsedTurn([], f"too many tool calls in one turn: {len(calls)} (the limit is {self.max_calls})")
        for call in calls:
            if self.tools and call.name not in self.tools:
                return ParsedTurn([], f"unknown tool {call.name!r}; available tools: {', '.join(self.tools)}")
        return ParsedTurn(calls)


PARSERS = Registry("tool parser", base=ToolCallParser)
register_tool_parser = PARSERS.register  # class decorator: a ToolCallParser subclass under a name
available_tool_parsers = PARSERS.names  # sorted names accepted by build_tool_parser
describe_tool_parsers = PARSERS.describe  # RegistryEntry(name, summary, params, obj) per parser (obj.stop)
build_tool_parser = PARSERS.build  # an instance (``tools=("python",)`` restricts the names)


# ---- Qwen3 ---------------------------------------------------------------------------------------

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@register_tool_parser("qwen3")
class Qwen3Parser(ToolCallParser):
    """Qwen3's <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks (its chat template)."""

    stop = (CLOSE,)
    control = (OPEN, CLOSE)

    def parse(self, text: str) -> ParsedTurn:
        calls, pos = [], 0
        while True:
            start, close = text.find(OPEN, pos), text.find(CLOSE, pos)
            if start < 0:
                if close >= 0:
                    return ParsedTurn([], f"{CLOSE} without a {OPEN} before it")
                return self._checked(calls)
            if 0 <= close < start:
                return ParsedTurn([], f"{CLOSE} without a {OPEN} before it")
            if close < 0:
                return ParsedTurn([], f"unclosed {OPEN}: the call must end with {CLOSE}")
            body = text[start + len(OPEN):close]
            if OPEN in body:
                return ParsedTurn([], f"nested {OPEN}: each call is one {OPEN}...{CLOSE} block")
            call, error = self._call(body, text[start:close + len(CLOSE)])
            if error is not None:
                return ParsedTurn([], error)
            calls.append(call)
            if len(calls) > self.max_calls:
                return self._checked(calls)
            pos = close + len(CLOSE)

    def _call(self, body: str, raw: str) -> tuple[Optional[ToolCall], Optional[str]]:
        if len(body) > self.max_chars:
            return None, f"tool call too long: {len(body)} characters (the limit is {self.max_chars})"
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested thousands deep
            return None, f"tool call is not valid JSON ({_reason(exc)}); write {{\"name\": ..., \"arguments\": {{...}}}}"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None, 'tool call must be a JSON object with a string "name" and an object "arguments"'
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):  # the template writes string arguments verbatim
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError) as exc:
                return None, f'"arguments" of {obj["name"]!r} is a string that is not a JSON object ({_reason(exc)})'
        if not isinstance(arguments, dict):
            return None, f'"arguments" of {obj["name"]!r} must be a JSON object, got {type(arguments).__name__}'
        return ToolCall(obj["name"], arguments, raw), None


def _reason(exc: Exception) -> str:
    return "nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(":")[0]


# ---- fenced python blocks ----------------------------------------------------------------------------

FENCE, PY_OPEN, OUTPUT = "```", "```python", "```output"


@register_tool_parser("python_block")
class PythonBlockParser(ToolCallParser):
    """Fenced ```python blocks, each a call of the python tool; the turn stops at ```output (ToRA)."""

    stop = (OUTPUT,)

    def parse(self, text: str) -> ParsedTurn:
        calls, pos = [], 0
        while True:
            start = text.find(PY_OPEN, pos)
            if start < 0:
                return self._checked(calls)
            line_end = text.find("\n", start)
            if line_end < 0 or text[start + len(PY_OPEN):line_end].strip():  # "```python3", "```pythonic"
                if line_end < 0:
                    return ParsedTurn([], "unclosed ```python block: the code starts on the next line")
                pos = line_end
                continue
            close = text.find("\n" + FENCE, line_end)
            if close < 0:
                return ParsedTurn([], "unclosed ```python block: end the code with ``` on its own line")
            code = text[line_end + 1:close]
            end = close + 1 + len(FENCE)
            if len(code) > self.max_chars:
                return ParsedTurn([], f"python block too long: {len(code)} characters (the limit is {self.max_chars})")
            calls.append(ToolCall("python", {"code": code}, text[start:end]))
            if len(calls) > self.max_calls:
                return self._checked(calls)
            pos = end

    def render_results(self, texts: list[str]) -> str:
        """Each result inline, in the turn, and the block's closing fence (ToRA)."""
        return "".join(f"\n{t}\n```\n" for t in texts)
