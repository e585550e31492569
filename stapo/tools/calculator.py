"""``calculator``: exact arithmetic on one expression, without code execution (docs/tools.md): an ``ast``
walk over ``int`` and ``Fraction``, never ``eval``, with work bounded before it is done (``9**9**9``
costs nothing).
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Union

from stapo.tools.base import Tool, ToolError, ToolSession, register_tool

__all__ = ["Calculator", "evaluate"]

Number = Union[int, Fraction]
_LOG10_2 = math.log10(2)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def evaluate(expression: str, max_digits: int = 1000, max_chars: int = 1000) -> Number:
    """The exact value of ``expression``; ``ToolError`` saying what is not allowed or too big."""
    if len(expression) > max_chars:
        raise ToolError(f"expression too long: {len(expression)} characters (the limit is {max_chars})")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ToolError(f"not an arithmetic expression: {type(exc).__name__}: {exc}") from None
    try:
        return _Evaluator(max_digits).visit(tree.body)
    except RecursionError:
        raise ToolError("expression nested too deeply") from None


class _Evaluator:
    def __init__(self, max_digits: int):
        self.max_digits, self.limit = max_digits, 10 ** max_digits

    def visit(self, node: ast.AST) -> Number:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            value = node.value if isinstance(node.value, int) else Fraction(repr(node.value))
            return self._bounded(value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            value = self.visit(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self.visit(node.left), self.visit(node.right)
            return self._bounded(self._binary(node.op, left, right))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
            raise ToolError("'^' is not a power here: write a ** b")
        what = type(node.value).__name__ if isinstance(node, ast.Constant) else type(node).__name__
        raise ToolError(f"not allowed in an arithmetic expression: {what} "
                        f"(only numbers, parentheses and + - * / // % **)")

    def _binary(self, op: ast.operator, left: Number, right: Number) -> Number:
        if isinstance(op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ToolError("division by zero")
        if isinstance(op, ast.Pow):
            return self._power(left, right)
        result = _BINARY[type(op)](left, right)
        if isinstance(op, ast.Div) and isinstance(left, int) and isinstance(right, int):
            result = Fraction(left, right)  # exact, not a float
        return result

    def _power(self, base: Number, exponent: Number) -> Number:
        if Fraction(exponent).denominator != 1:
            raise ToolError("only integer exponents are exact; use a rational power of a perfect power instead")
        exponent = int(exponent)
        if base == 0 and exponent < 0:
            raise ToolError("division by zero (0 to a negative power)")
        q = Fraction(base)
        log2_lower = max(abs(q.numerator).bit_length(), q.denominator.bit_length()) - 1  # <= log2 of the larger
        if abs(base) != 1 and log2_lower * abs(exponent) > self.max_digits / _LOG10_2:  # refused before computing
            raise ToolError(f"result too large: more than {self.max_digits} digits")
        return Fraction(base) ** exponent if exponent < 0 else base ** exponent

    def _bounded(self, value: Number) -> Number:
        if isinstance(value, Fraction) and value.denominator == 1:
            value = value.numerator
        q = Fraction(value)
        if abs(q.numerator) >= self.limit or q.denominator >= self.limit:
            raise ToolError(f"result too large: more than {self.max_digits} digits")
        return value


def format_number(value: Number) -> str:
    return str(value) if isinstance(value, int) else f"{value.numerator}/{value.denominator}"


@register_tool("calculator")
@dataclass
class Calculator(Tool):
    """Exact arithmetic on one expression (integers and fractions; + - * / // % ** and parentheses)."""

    description = ("Evaluate an arithmetic expression exactly. Supports integers, decimals, parentheses and "
                   "+ - * / // % ** (integer exponents). Returns an integer or a fraction p/q.")
    parameters = {"type": "object",
                  "properties": {"expression": {"type": "string", "description": "e.g. (123456 * 789) / 3"}},
                  "required": ["expression"], "additionalProperties": False}

    timeout_s: float = 5.0
    max_digits: int = 1000  # digits of any value's numerator or denominator
    max_chars: int = 1000  # length of the expression

    def __post_init__(self):
        super().__post_init__()
        if self.max_digits < 1 or self.max_chars < 1:
            raise ValueError(f"calculator: max_digits and max_chars must be >= 1, got {self.max_digits}, "
                             f"{self.max_chars}")

    def run(self, arguments: dict, session: Optional[ToolSession]) -> str:
        return format_number(evaluate(arguments["expression"], self.max_digits, self.max_chars))
