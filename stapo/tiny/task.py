"""Synthetic arithmetic task for the tiny-model demo (docs/demo.md): chained integer expressions with a
left-to-right chain of thought ending in the paper's answer format, ``"47+38=85. 85-12=73. \\boxed{73}"``.
"""

from __future__ import annotations

import operator
import random
from dataclasses import dataclass

from stapo.data import PAPER_INSTRUCTION

#: The paper's prompt instruction (paper §5.1, docs/rollout.md); the data loader appends it to every question.
CHAT_INSTRUCTION = PAPER_INSTRUCTION

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclass(frozen=True)
class ArithmeticProblem:
    """One task instance: ``question`` for the prompt, ``answer`` for the verifier, ``solution``
    (a CoT ending in ``\\boxed{answer}``) for the supervised warm start."""

    question: str
    answer: str
    solution: str


def make_problem(operands: list[int], ops: list[str]) -> ArithmeticProblem:
    """The problem ``operands[0] ops[0] operands[1] ...``, evaluated left to right (not by operator
    precedence: keep ``*`` out of mixed chains where the two should agree)."""
    if len(operands) != len(ops) + 1 or not ops:
        raise ValueError(f"need len(operands) == len(ops) + 1 >= 2, got {len(operands)} and {len(ops)}")
    bad = [op for op in ops if op not in _OPS]
    if bad:
        raise ValueError(f"unknown operator(s) {bad}; valid operators are {list(_OPS)}")
    expr = str(operands[0]) + "".join(f"{op}{x}" for op, x in zip(ops, operands[1:]))
    steps, acc = [], operands[0]
    for op, x in zip(ops, operands[1:]):
        new = _OPS[op](acc, x)
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
    """``n`` random problems, deterministic for ``seed`` (its own ``random.Random``). The defaults give three
    chained steps a ~0.8M-parameter model learns partly in a short warm start; the demo uses five (``tiny.terms``).
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
