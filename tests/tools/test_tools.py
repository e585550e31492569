"""The tool contract: registry, schema, argument checks, error results, output cap, and run_tool_calls
(order, concurrency, sessions in order, a stuck call reported without holding up the batch)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from stapo.tools import (Tool, ToolCall, ToolError, ToolResult, available_tools, build_tool, describe_tools,
                         register_tool, run_tool_calls, tool_params)


@register_tool("test_echo")
class Echo(Tool):
    """Echo the text back, after an optional sleep."""

    description = "Echo text."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}, "sleep": {"type": "number"}},
                  "required": ["text"]}

    def run(self, arguments, session):
        time.sleep(arguments.get("sleep", 0))
        if session is not None:
            session.log.append(arguments["text"])
        if arguments["text"] == "fail":
            raise ToolError("it failed", total_chars=None)
        if arguments["text"] == "bug":
            raise KeyError("oops")
        return arguments["text"]


class Log:
    def __init__(self):
        self.log = []

    def close(self):
        pass


def call(text, sleep=0.0):
    return ToolCall("test_echo", {"text": text, "sleep": sleep}, text)


def test_registry_and_schema():
    assert {"python", "calculator", "test_echo"} <= set(available_tools())
    echo = build_tool("test_echo", timeout_s=2.0)
    assert echo.name == "test_echo" and echo.timeout_s == 2.0 and echo.open_session() is None
    assert echo.schema() == {"type": "function", "function": {"name": "test_echo", "description": "Echo text.",
                                                               "parameters": Echo.parameters}}
    assert tool_params("test_echo") == {"timeout_s": 10.0, "max_output_chars": 2000}
    info = next(i for i in describe_tools() if i.name == "test_echo")
    assert info.summary == "Echo the text back, after an optional sleep." and info.obj.parameters is Echo.parameters
    with pytest.raises(ValueError, match=r"unknown tool 'shell'; choose one of \[.*'calculator'.*'python'"):
        build_tool("shell")
    with pytest.raises(ValueError, match="unknown parameter.*'timeout'.*valid parameters: timeout_s=10.0"):
        build_tool("test_echo", timeout=1)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        build_tool("test_echo", timeout_s=0)
    with pytest.raises(ValueError, match="already registered"):
        register_tool("calculator")(type("Other", (Tool,), {}))
    with pytest.raises(TypeError, match="needs a Tool subclass"):
        register_tool("not_a_tool")(object)


def test_a_call_never_raises():
    echo = build_tool("test_echo", max_output_chars=40)
    assert echo({"text": "hi"}).text == "hi" and not echo({"text": "hi"}).error
    assert echo({"text": "fail"}).text == "it failed" and echo({"text": "fail"}).error
    assert echo({"text": "bug"}).text == "test_echo failed: KeyError: 'oops'" and echo({"text": "bug"}).error
    assert echo({"text": 5}).error and echo(None).error and echo({}).error
    cut = build_tool("test_echo", max_output_chars=10)({"text": "0123456789ABC"})  # 13 > 10: cut, an error
    assert cut.text == "01234\n[output cut: 13 characters, the limit is 10; the middle is left out]\n89ABC" and cut.error
    assert echo({"text": "x"}).seconds >= 0


def test_results_in_order_and_concurrent():
    echo = build_tool("test_echo")
    jobs = [(echo, call(str(i), sleep=0.3 - 0.05 * i), None) for i in range(6)]
    start = time.monotonic()
    results = run_tool_calls(jobs, max_workers=6)
    elapsed = time.monotonic() - start
    assert [r.text for r in results] == [str(i) for i in range(6)]
    # not one by one, which takes at least the sum of the calls' own wall times (1.05 s of sleeps): a bound
    # measured on the calls themselves, where a fixed 0.9 s left a busy machine's thread starts 0.6 s
    assert elapsed < sum(r.seconds for r in results), (elapsed, [r.seconds for r in results])
    assert run_tool_calls([]) == []
    with pytest.raises(ValueError, match="max_workers"):
        run_tool_calls(jobs, max_workers=0)


def test_calls_sharing_a_session_run_in_their_order():
    echo, a, b = build_tool("test_echo"), Log(), Log()
    jobs = [(echo, call("a1", 0.2), a), (echo, call("b1"), b), (echo, call("a2"), a), (echo, call("a3", 0.05), a),
            (echo, call("b2"), b)]
    results = run_tool_calls(jobs, max_workers=8)
    assert [r.text for r in results] == ["a1", "b1", "a2", "a3", "b2"]
    assert a.log == ["a1", "a2", "a3"] and b.log == ["b1", "b2"]


def test_a_stuck_call_is_reported_and_the_batch_moves_on():
    echo, session = build_tool("test_echo", timeout_s=0.2), Log()  # deadline_s = 1.2 s
    jobs = [(echo, call("stuck", 5.0), session), (echo, call("after", 0), session),
            (echo, call("free1"), None), (echo, call("free2"), None)]
    start = time.monotonic()
    results = run_tool_calls(jobs, max_workers=1)  # the stuck call holds the only worker: a new one takes over
    elapsed = time.monotonic() - start
    assert results[0] == ToolResult("test_echo: timed out after 1.2 s", True, results[0].seconds)
    assert results[1].error and "an earlier call of this session timed out" in results[1].text
    assert [r.text for r in results[2:]] == ["free1", "free2"]
    assert 1.2 <= elapsed < 5.0  # reported at its deadline (1.2 s), not after its 5 s sleep; the rest is slack
    assert session.log == []  # the later call of the stuck session never ran
    assert sum(t.name == "stapo-tool-call" and t.daemon for t in threading.enumerate()) >= 1  # left behind, daemon


def test_import_is_light():
    """``import stapo.tools`` needs the standard library only: the episode loop and the sandbox pay nothing."""
    heavy = ("torch", "transformers", "sympy", "numpy", "stapo.trainer", "stapo.rollout", "stapo.rewards")
    code = "import sys, stapo.tools; print(','.join(m for m in %r if m in sys.modules))" % (heavy,)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", f"stapo.tools pulled in: {out.stdout.strip()}"
