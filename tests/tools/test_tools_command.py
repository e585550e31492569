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


def test_stapo_tools_shows_the_values_training_uses(capsys):
    """The parameters a tool gets in training come from ``rollout.tools.*`` (python's own defaults say
    ``stateful=False`` and the calculator's ``timeout_s=5.0``); a per-tool param that replaces one of them is
    a note, as the trainer logs it."""
    assert main(["tools", "rollout.tools.timeout_s=30", "rollout.tools.params={calculator: {timeout_s: 2}}"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    params = {lines[i - 2].split()[0]: line for i, line in enumerate(lines) if line.strip().startswith("params: ")}
    assert params["calculator"].strip().startswith("params: timeout_s=2, max_output_chars=2000")
    assert params["python"].strip().startswith("params: timeout_s=30.0, max_output_chars=2000") and \
        "stateful=True" in params["python"]
    assert "note: rollout.tools.params.calculator.timeout_s=2 replaces rollout.tools.timeout_s=30.0 for calculator" \
        in out
    assert out.startswith("tools with the values training uses (rollout.tools.*; off in this config):")
    assert main(["tools", "tiny_tir"]) == 0 and "(rollout.tools.*; on in this config)" in capsys.readouterr().out


def test_the_trainer_logs_a_tool_param_that_replaces_a_shared_limit(caplog):
    from stapo.config import STAPOConfig
    from stapo.trainer.tool_setup import build_tools

    cfg = STAPOConfig.from_yaml(None, ["rollout.tools.enabled=true", "rollout.tools.names=[python, calculator]",
                                       "rollout.tools.params={python: {timeout_s: 30, memory_mb: 512}}"])
    with caplog.at_level("INFO", logger="stapo.trainer"):
        tools = build_tools(cfg, note=True)
    assert tools["python"].timeout_s == 30 and tools["calculator"].timeout_s == 10.0 and tools["python"].stateful
    assert caplog.messages == ["rollout.tools.params.python.timeout_s=30 replaces rollout.tools.timeout_s=10.0 for python"]
