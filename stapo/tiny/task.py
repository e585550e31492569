"""Synthetic arithmetic task for the tiny-model demo.

Problems are chained integer expressions such as ``"Compute 47+38-12."``. The solution is a short
chain of thought that evaluates left to right, one partial result per step, and ends with the
paper's answer format ``\\boxed{<answer>}`` (STAPO §2.1: the verifier reads the last ``\\boxed{}``),
e.g. ``"47+38=85. 85-12=73. \\boxed{73}"``. Difficulty knobs (operand digits, number of terms,
operators) let the demo pick a task that a few-M-parameter model learns partly in a short warm
start and improves on with RL.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from stapo.data import PAPER_INSTRUCTION

#: The paper's prompt instruction (paper §5.1, docs/rollout.md); the data loader appends it to every question.
CHAT_INSTRUCTION = PAPER_INSTRUCTION

_OPS = ("+", "-", "*")


@dataclass(frozen=True)
class ArithmeticProblem:
    """One task instance: ``question`` for the prompt, ``answer`` for the verifier, ``solution``
    (a CoT ending in ``\\boxed{answer}``) for the supervised warm start."""

    question: str
    answer: str
    solution: str


def _apply(op: str, a: int, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


def make_problem(operands: list[int], ops: list[str]) -> ArithmeticProblem:
    """Build the problem for ``operands[0] ops[0] operands[1] ...`` evaluated left to right.

    Left-to-right evaluation (not operator precedence) is part of the task definition, and the
    question states it implicitly by the step-by-step solution; keep ``*`` out of mixed chains
    if you want standard precedence to agree.
    """
    if len(operands) != len(ops) + 1 or not ops:
        raise ValueError(f"need len(operands) == len(ops) + 1 >= 2, got {len(operands)} and {len(ops)}")
    bad = [op for op in ops if op not in _OPS]
    if bad:
        raise ValueError(f"unknown operator(s) {bad}; valid operators are {list(_OPS)}")
    expr = str(operands[0]) + "".join(f"{op}{x}" for op, x in zip(ops, operands[1:]))
    steps, acc = [], operands[0]
    for op, x in zip(ops, operands[1:]):
        new = _apply(op, acc, x)
        steps.append(f"{acc}{op}{x}={new}.")
        acc = new
    answer = str(acc)
    solution = " ".join(steps) + f" \\boxed{{{answer}}}"
    return ArithmeticProblem(question=f"Compute {expr}.", answer=answer, solution=solution)


def arithmetic_problems(
    n: int,
    seed: int,
    *,
    digits: int = 1,
    terms: int = 4,
    ops: tuple[str, ...] | str = ("+", "-"),
    min_digits: int = 1,
) -> list[ArithmeticProblem]:
    """``n`` random problems, deterministic for ``seed`` (its own ``random.Random``, no global RNG).

    The defaults (one-digit operands, four terms, ``+``/``-``: three chained steps such as
    ``"7+5=12. 12-3=9. 9+8=17. \\boxed{17}"``) give a task a ~0.8M-parameter model learns partly
    in a few hundred warm-start steps; errors compound over the steps. The README demo uses five
    terms (``tiny.terms``, four steps; see ``stapo.tiny.warmstart`` and docs/demo.md).

    Args:
        digits: maximum number of digits per operand (operands drawn uniformly from
            ``[10**(min_digits-1), 10**digits - 1]``; ``min_digits=1`` allows 0..9 too).
        terms: number of operands in the chain (>= 2).
        ops: operators to draw from (``"+"``, ``"-"``, ``"*"``), one uniformly per step.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if terms < 2:
        raise ValueError(f"terms must be >= 2, got {terms}")
    if not 1 <= min_digits <= digits:
        raise ValueError(f"need 1 <= min_digits <= digits, got min_digits={min_digits}, digits={digits}")
    ops = tuple(ops)
    if not ops or any(op not in _OPS for op in ops):
        raise ValueError(f"ops must be a non-empty subset of {list(_OPS)}, got {list(ops)}")
    lo = 0 if min_digits == 1 else 10 ** (min_digits - 1)
    hi = 10**digits - 1
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        operands = [rng.randint(lo, hi) for _ in range(terms)]
        chosen = [rng.choice(ops) for _ in range(terms - 1)]
        out.append(make_problem(operands, chosen))
    return out
