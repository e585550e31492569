"""Tool-call parsers on well-formed, malformed and adversarial turns: calls or an error, never an exception."""

from __future__ import annotations

import json
import random
import time

import pytest

from stapo.tools import ParsedTurn, ToolCall, available_tool_parsers, build_tool_parser


def qwen3_call(name: str, arguments) -> str:
    """One call as Qwen3's chat template renders an assistant message's tool_calls entry:
    '<tool_call>\\n{"name": "' + name + '", "arguments": ' + (arguments | tojson, or a string as is) + '}\\n</tool_call>'."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


@pytest.fixture
def qwen3():
    return build_tool_parser("qwen3", tools=("python", "calculator"))


@pytest.fixture
def blocks():
    return build_tool_parser("python_block")


def test_registry_lists_both_formats_and_names_the_valid_ones():
    assert {"qwen3", "python_block"} <= set(available_tool_parsers())
    with pytest.raises(ValueError, match=r"unknown tool parser 'hermes'; choose one of \[.*'python_block'.*'qwen3'"):
        build_tool_parser("hermes")
    with pytest.raises(ValueError, match="unknown parameter"):
        build_tool_parser("qwen3", max_call=3)
    assert build_tool_parser("qwen3").stop == ("</tool_call>",)
    assert build_tool_parser("python_block").stop == ("```output",)


def test_qwen3_one_call_as_the_template_renders_it(qwen3):
    text = "I will compute it.\n" + qwen3_call("python", {"code": "print(2**10)"})
    turn = qwen3.parse(text)
    assert turn == ParsedTurn([ToolCall("python", {"code": "print(2**10)"}, text[len("I will compute it.\n"):])])
    assert not turn.final


def test_qwen3_several_calls_in_one_turn_in_order(qwen3):
    # the template joins a message's calls with "\n" (and puts "\n" after non-empty content)
    text = "Two checks.\n" + "\n".join([qwen3_call("calculator", {"expression": "7*6"}),
                                         qwen3_call("python", {"code": "x = 'é ✓'\nprint(x)"}),
                                         qwen3_call("calculator", "{\"expression\": \"1/3\"}")])  # a string, as is
    turn = qwen3.parse(text)
    assert turn.error is None
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("calculator", {"expression": "7*6"}), ("python", {"code": "x = 'é ✓'\nprint(x)"}),
        ("calculator", {"expression": "1/3"})]
    assert "".join(c.text for c in turn.calls) == text[len("Two checks.\n"):].replace("\n<tool_call>", "<tool_call>")


def test_qwen3_turn_without_a_call_is_final(qwen3):
    turn = qwen3.parse("The answer is \\boxed{42}.")
    assert turn == ParsedTurn([]) and turn.final


@pytest.mark.parametrize("text, message", [
    ('<tool_call>\n{"name": "python", "arguments": {"code": "1"}}', "unclosed <tool_call>"),
    ('{"name": "python"}\n</tool_call>', "</tool_call> without a <tool_call>"),
    ('<tool_call><tool_call>{"name": "python", "arguments": {}}</tool_call></tool_call>', "nested <tool_call>"),
    ('<tool_call>\n{"name": "python", "arguments": {"code": "1"}\n</tool_call>', "not valid JSON"),
    ("<tool_call>\n{'name': 'python', 'arguments': {}}\n</tool_call>", "not valid JSON"),
    ('<tool_call>["python", {"code": "1"}]</tool_call>', 'a string "name"'),
    ('<tool_call>{"arguments": {"code": "1"}}</tool_call>', 'a string "name"'),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', 'a string "name"'),
    ('<tool_call>{"name": "python", "arguments": ["print(1)"]}</tool_call>', "must be a JSON object, got list"),
    ('<tool_call>{"name": "python", "arguments": 7}</tool_call>', "must be a JSON object, got int"),
    ('<tool_call>{"name": "python", "arguments": "print(1)"}</tool_call>', "is a string that is not a JSON object"),
    ('<tool_call>{"name": "python", "arguments": "[1]"}</tool_call>', "must be a JSON object, got list"),
    ('<tool_call>{"name": "shell", "arguments": {"cmd": "rm -rf /"}}</tool_call>',
     "unknown tool 'shell'; available tools: python, calculator"),
    ("<tool_call>" + "[" * 100_000 + "</tool_call>", "nested too deeply"),
    ("<tool_call></tool_call>", "not valid JSON"),
])
def test_qwen3_malformed_calls_are_errors_for_the_policy(qwen3, text, message):
    turn = qwen3.parse(text)
    assert turn.calls == [] and turn.error is not None and message in turn.error, turn
    assert not turn.final


def test_qwen3_too_many_and_too_long_calls(qwen3):
    many = "\n".join(qwen3_call("calculator", {"expression": str(i)}) for i in range(9))
    assert "too many tool calls in one turn: 9 (the limit is 8)" in qwen3.parse(many).error
    assert len(qwen3.parse("\n".join(many.split("\n")[:-3])).calls) == 8
    huge = qwen3_call("python", {"code": "x" * 200_000})
    assert "tool call too long" in qwen3.parse(huge).error
    assert build_tool_parser("qwen3", max_chars=300_000).parse(huge).calls[0].arguments["code"] == "x" * 200_000


def test_qwen3_any_tool_name_when_no_list_is_given():
    turn = build_tool_parser("qwen3").parse(qwen3_call("my_tool", {}))
    assert turn.calls[0].name == "my_tool" and turn.error is None


def test_python_block_calls(blocks):
    text = "Let me check.\n```python\nprint(6 * 7)\n```\n```output"
    turn = blocks.parse(text)
    assert turn == ParsedTurn([ToolCall("python", {"code": "print(6 * 7)"}, "```python\nprint(6 * 7)\n```")])
    two = "```python\na = 1\n```\nthen\n```python\nprint(a)\n```\n```output"
    assert [c.arguments["code"] for c in blocks.parse(two).calls] == ["a = 1", "print(a)"]
    assert blocks.parse("no code, \\boxed{3}").final
    assert blocks.parse("```\nnot python\n```\n```text\nx\n```").final  # other fences are not calls
    assert blocks.parse("```python3\nprint(1)\n```").final  # only a ```python fence line is a call


@pytest.mark.parametrize("text, message", [
    ("```python\nprint(1)", "unclosed ```python block"),
    ("```python", "unclosed ```python block"),
    ("```python\n" + "x = 1\n" * 20_000 + "```", "python block too long"),
])
def test_python_block_malformed(blocks, text, message):
    turn = blocks.parse(text)
    assert turn.calls == [] and message in turn.error


def test_adversarial_text_never_raises_and_stays_fast(qwen3, blocks):
    """Random splices of tags, braces, quotes, fences and unicode: every parse returns a ParsedTurn."""
    rng = random.Random(0)
    pieces = ["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"', '"name"', ":", ",", '"arguments"', '"python"',
              "```python\n", "\n```", "```output", "\\", "\\u0000", "\ud800", "é", "\n", "null", "1e999", " "]
    start = time.monotonic()
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 60)))
        for parser in (qwen3, blocks):
            turn = parser.parse(text)
            assert isinstance(turn, ParsedTurn) and (turn.error is None or not turn.calls)
    many_tags = "<tool_call>" * 200_000 + "</tool_call>" * 200_000  # 4.6 MB
    assert "nested" in qwen3.parse(many_tags).error
    assert blocks.parse("```python\n" * 100_000).final is False
    assert time.monotonic() - start < 10, "parsing must stay linear in the text"
