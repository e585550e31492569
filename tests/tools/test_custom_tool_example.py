"""examples/custom_tool.py (shown verbatim in docs/tools.md) registers a working tool: exact answers,
its error for bad input, called through the parser and run_tool_calls as the episode loop does."""

from __future__ import annotations

from pathlib import Path

from stapo.cli.common import load_user_modules
from stapo.tools import ToolCall, build_tool, build_tool_parser, run_tool_calls

ROOT = Path(__file__).resolve().parents[2]


def test_the_custom_tool_example_factors():
    load_user_modules([str(ROOT / "examples" / "custom_tool.py")])
    tool = build_tool("prime_factors")
    assert tool({"n": 360}).text == "2^3 * 3^2 * 5"  # 360 = 8 * 9 * 5
    assert tool({"n": 999_983 * 2}).text == "2 * 999983"  # 999983: the largest prime below 10^6
    assert tool({"n": 2**39}).text == "2^39"
    assert tool({"n": 1}).error and "between 2 and 1000000000000" in tool({"n": 1}).text
    assert tool({"n": "360"}).error  # the schema says integer
    assert build_tool("prime_factors", max_n=100)({"n": 101}).error
    turn = build_tool_parser("qwen3", tools=("prime_factors",)).parse(
        '<tool_call>\n{"name": "prime_factors", "arguments": {"n": 84}}\n</tool_call>')
    assert [r.text for r in run_tool_calls([(tool, c, None) for c in turn.calls])] == ["2^2 * 3 * 7"]
