"""Tools the policy calls during an episode, the sandbox they run in, and the parsers that find the
calls in its text (docs/tools.md).

The contract the episode loop uses::

    from stapo.tools import build_tool, build_tool_parser, run_tool_calls

    parser = build_tool_parser("qwen3", tools=("python", "calculator"))  # or "python_block"
    tools = {"python": build_tool("python", stateful=True, timeout_s=10), "calculator": build_tool("calculator")}
    session = tools["python"].open_session()        # one per episode (None for a stateless tool)
    turn = parser.parse(text)                        # ParsedTurn(calls, error); text ends with parser.stop
    if turn.error: ...                               # return turn.error to the policy as a failed tool result
    results = run_tool_calls([(tools[c.name], c, session) for c in turn.calls])   # ToolResult(text, error, seconds)
    session.close()                                  # at the episode's end

* ``ToolCall(name, arguments, text)``: one call as the policy wrote it; ``ToolResult(text, error,
  seconds)``: its output, capped at the tool's ``max_output_chars`` (cut output is an error).
* ``Tool``: a dataclass whose fields are its parameters (``timeout_s``, ``max_output_chars``, ...);
  ``schema()`` is the entry a chat template renders in its tool list; ``tool(arguments, session)``
  never raises for bad input (an error result instead); ``open_session()`` gives a stateful tool's
  per-episode state (``close()`` it). Add one with ``@register_tool("name")``; ``stapo tools`` lists them.
* ``ToolCallParser``: ``stop`` (strings that end a turn holding a call) and ``parse(text)``; register
  one with ``@register_tool_parser("name")``.
* ``run_tool_calls(jobs)``: ``(tool, call, session)`` jobs run concurrently (bounded), results in order.

Built in: ``python`` (code in a fresh, limited, isolated process; ``sandbox.py``; or a remote
SandboxFusion service), ``calculator`` (exact arithmetic, no code execution).

May import: ``stapo.registry`` and the standard library (docs/index.md, "Layout").
"""

from stapo.tools.base import (TOOLS, Tool, ToolCall, ToolError, ToolResult, ToolSession, available_tools,
                              build_tool, describe_tools, register_tool, tool_params)
from stapo.tools.calculator import Calculator
from stapo.tools.python_tool import PythonSession, PythonTool, sandbox_report
from stapo.tools.parsers import (PARSERS, ParsedTurn, PythonBlockParser, Qwen3Parser, ToolCallParser, available_tool_parsers,
                                 build_tool_parser, describe_tool_parsers, register_tool_parser)
from stapo.tools.run import run_tool_calls

__all__ = ["PARSERS", "TOOLS", "Calculator", "ParsedTurn", "PythonBlockParser", "PythonSession", "PythonTool", "Qwen3Parser", "Tool",
           "ToolCall", "ToolCallParser", "ToolError", "ToolResult", "ToolSession", "available_tool_parsers",
           "available_tools", "build_tool", "build_tool_parser", "describe_tool_parsers", "describe_tools",
           "register_tool", "register_tool_parser", "run_tool_calls", "sandbox_report", "tool_params"]
