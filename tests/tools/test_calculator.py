"""calculator: exact values by hand, and every non-arithmetic or oversized input an error, fast."""

from __future__ import annotations

import time

import pytest

from stapo.tools import build_tool


@pytest.fixture(scope="module")
def calc():
    return build_tool("calculator")


@pytest.mark.parametrize("expression, value", [
    ("123456 * 789", "97406784"),
    ("(123456 * 789) / 3", "32468928"),  # 97406784 / 3 = 32468928 exactly
    ("1/3 + 1/6", "1/2"),  # 2/6 + 1/6 = 3/6
    ("0.1 + 0.2", "3/10"),  # decimal literals are exact: 1/10 + 2/10
    ("2 ** -3", "1/8"),
    ("(-2) ** 3 - -1", "-7"),
    ("7 // 2 + 7 % 2", "4"),  # 3 + 1
    ("-7 // 2", "-4"),  # floor, as Python
    ("(2/3) ** 2 * 9", "4"),  # 4/9 * 9
    ("1.5 * 4", "6"),  # 3/2 * 4 = 6, an integer
    ("  ((((5))))  ", "5"),
    ("10 ** 999 // 10 ** 998", "10"),
])
def test_exact_values(calc, expression, value):
    result = calc({"expression": expression})
    assert (result.text, result.error) == (value, False)


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('id')", "not allowed in an arithmetic expression: Call"),
    ("open('/etc/passwd').read()", "not allowed"),
    ("x + 1", "not allowed in an arithmetic expression: Name"),
    ("(1).__class__", "not allowed in an arithmetic expression: Attribute"),
    ("'a' * 3", "not allowed in an arithmetic expression: str"),
    ("[1, 2][0]", "not allowed"),
    ("lambda: 1", "not allowed"),
    ("1 if 1 else 2", "not allowed"),
    ("1 < 2", "not allowed"),
    ("1j * 1j", "not allowed in an arithmetic expression: complex"),
    ("2 ^ 10", "write a ** b"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("2 ** 0.5", "only integer exponents"),
    ("1 +", "not an arithmetic expression"),
    ("import os", "not an arithmetic expression"),
    ("10 ** 1000", "result too large: more than 1000 digits"),
    ("(10 ** 999) * 10", "result too large"),
    ("1 / 10 ** 1000", "result too large"),
])
def test_everything_else_is_an_error(calc, expression, message):
    result = calc({"expression": expression})
    assert result.error and message in result.text, result


def test_huge_work_is_refused_before_it_is_done(calc):
    start = time.monotonic()
    for expression in ("9 ** 9 ** 9", "2 ** 10 ** 100", "(10 ** 999) ** (10 ** 999)", "(1/3) ** 10 ** 9",
                       "(" * 10_000 + "1" + ")" * 10_000, "-" * 100_000 + "1", "1" * 2000):
        result = calc({"expression": expression})
        assert result.error, expression
    assert time.monotonic() - start < 2.0  # each refused from its operands' size, not computed
    assert calc({"expression": "1 ** 10 ** 999"}).text == "1"  # a power of 1 costs nothing: allowed
    assert calc({"expression": "(-1) ** (10 ** 999 + 1)"}).text == "-1"


def test_bad_arguments_and_parameters(calc):
    assert calc({"expr": "1"}).text == "calculator: missing required argument(s) ['expression']; arguments: ['expression']"
    assert "unknown argument(s) ['extra']" in calc({"expression": "1", "extra": 1}).text
    assert "must be of type string, got int" in calc({"expression": 1}).text
    assert "arguments must be a JSON object, got list" in calc(["1"]).text
    assert build_tool("calculator", max_digits=3)({"expression": "999 + 1"}).text == "result too large: more than 3 digits"
    with pytest.raises(ValueError, match="max_digits"):
        build_tool("calculator", max_digits=0)
