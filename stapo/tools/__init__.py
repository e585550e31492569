"""Tools the policy calls during an episode, the sandbox they run in, and the parsers that find the calls
in its text (docs/tools.md, "The contract").

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
