"""`stapo tools`: every registered tool with its arguments and limits, what the python sandbox gets on
this machine, the parsers with their stop strings, and user tools from --import."""

from __future__ import annotations

from pathlib import Path

from stapo.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_stapo_tools_lists_tools_sandbox_and_parsers(capsys):
    assert main(["tools", "--import", str(ROOT / "examples" / "custom_tool.py")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name in ("calculator", "python", "prime_factors", "python_block", "qwen3"):
        assert any(line.startswith(name + " ") for line in lines), name
    assert "arguments: code (string, required)" in out and "arguments: n (integer, required)" in out
    assert "timeout_s=10.0, max_output_chars=2000, cpu_time_s=10.0, memory_mb=1024, max_processes=16" in out
    assert "max_n=1000000000000" in out
    assert "stop: '</tool_call>'" in out and "stop: '```output'" in out
    sandbox = next(line for line in lines if line.startswith("python sandbox on this machine: "))
    assert "uid" in sandbox  # what isolation this machine gives (or the line saying which parts it lacks)
    assert main(["tools", "--import", "no_such_tools.py"]) == 2
    assert "no such file" in capsys.readouterr().err
