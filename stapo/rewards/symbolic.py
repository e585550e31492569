"""Symbolic equivalence with sympy (docs/rewards.md, step 3.4). Runs ONLY inside the verifier's worker
processes (``pool.py``); sympy is imported lazily so that ``import stapo.rewards`` stays light.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Optional

from stapo.rewards.compare import cheap_scalar_eq, decimal_places, parse_decimal, parse_number, ROUNDED_DECIMALS
from stapo.rewards.latex import ALLOWED_CALLS, screen, to_python
from stapo.rewards.structure import Undecided, match, parse_structure

_REL_RE = re.compile(r"\\leq|\\geq|\\neq|<=|>=|!=|\\lt|\\gt|<|>")
_FLIP = {"<": ">", ">": "<", "<=": ">=", ">=": "<=", "!=": "!="}
_REL_CANON = {"\\leq": "<=", "\\geq": ">=", "\\neq": "!=", "\\lt": "<", "\\gt": ">"}


@lru_cache(maxsize=1)
def _namespace() -> dict[str, Any]:
    import sympy

    names = ["Symbol", "Integer", "Float", "Rational", "pi", "oo", "E", *sorted(ALLOWED_CALLS)]  # what screen lets by
    ns: dict[str, Any] = {name: getattr(sympy, name) for name in names}
    ns["__builtins__"] = {}  # parse_expr eval()s its own generated code: no builtins in reach
    return ns


def to_sympy(latex: str) -> Optional[Any]:
    """sympy expression of one scalar LaTeX answer, or None (unsupported / screened out)."""
    from sympy.parsing.sympy_parser import auto_number, auto_symbol, parse_expr, rationalize

    py = to_python(latex)
    if py is None or not screen(py):
        return None
    try:
        return parse_expr(py, local_dict={}, global_dict=dict(_namespace()),
                          transformations=(auto_symbol, auto_number, rationalize))
    except Exception:  # noqa: BLE001 - any parse failure means "not comparable"
        return None


# Rational sample points for the fast numeric rejection of unequal expressions.
_SAMPLES = ((7, 5), (3, 11), (13, 7))


def _numerically_nonzero(diff: Any) -> bool:
    """True if ``diff`` is clearly nonzero at some sample point (then simplify is skipped)."""
    import sympy

    symbols = sorted(diff.free_symbols, key=str)
    for k, (p, q) in enumerate(_SAMPLES):
        point = {s: sympy.Rational(p + i * k, q + i) for i, s in enumerate(symbols)}
        value = sympy.N(diff.subs(point), 30)
        if value.is_comparable and abs(value) > sympy.Float(10) ** -12:
            return True
    return False


def _is_zero(diff: Any) -> bool:
    import sympy

    if diff == 0:
        return True
    if not diff.free_symbols:
        value = sympy.N(diff, 50)
        if value.is_number and value.is_finite is not False and value.is_comparable:
            return abs(value) < sympy.Float(10) ** -40
    elif _numerically_nonzero(diff):
        return False
    return sympy.simplify(diff) == 0


def _rounded(dec_text: str, other: Any) -> bool:
    """Long decimal printout vs an exact constant (``4.1231056256`` vs ``\\sqrt{17}``)."""
    import sympy

    dec = parse_decimal(dec_text)
    places = decimal_places(dec_text)
    if dec is None or places < ROUNDED_DECIMALS or other.free_symbols:
        return False
    value = sympy.N(other, places + 10)
    return value.is_comparable and abs(value - sympy.Rational(dec)) <= sympy.Rational(1, 10**places)


def _relation(s: str) -> Optional[tuple[str, Any]]:
    """``a <op> b`` -> (op, a-b) with op in <, <=, !=, =; None if not exactly one relation."""
    rels = _REL_RE.findall(s)
    if len(rels) > 1 or (rels and "=" in _REL_RE.sub("", s)) or (not rels and s.count("=") != 1):
        return None
    op = _REL_CANON.get(rels[0], rels[0]) if rels else "="
    lhs, rhs = (_REL_RE.split(s) if rels else s.split("="))
    a, b = to_sympy(lhs), to_sympy(rhs)
    if a is None or b is None:
        return None
    if op in (">", ">="):
        return _FLIP[op], b - a
    return op, a - b


def _relations_equal(a: str, b: str) -> bool:
    import sympy

    ra, rb = _relation(a), _relation(b)
    if ra is None or rb is None:
        return False
    (op_a, ea), (op_b, eb) = ra, rb
    if eb == 0:
        return False
    ratio = sympy.simplify(ea / eb)
    if ratio.free_symbols or ratio == 0 or not ratio.is_comparable:
        return False
    if op_a == op_b:
        return op_a in ("=", "!=") or bool(ratio > 0)
    # x > 5 written as 5 < x normalizes to the same op already; opposite ops need ratio < 0.
    return {op_a, op_b} in ({"<", ">"}, {"<=", ">="}) and bool(ratio < 0)


def symbolic_scalar_eq(a: str, b: str) -> bool:
    """Scalar equivalence with sympy; never raises (an error is a mismatch)."""
    try:
        return cheap_scalar_eq(a, b)
    except Undecided:
        pass
    try:
        if "=" in a or "=" in b or _REL_RE.search(a) or _REL_RE.search(b):
            return _relations_equal(a, b)
        ea, eb = to_sympy(a), to_sympy(b)
        if ea is None or eb is None:
            return False
        if parse_number(a) is not None and _rounded(a, eb):
            return True
        if parse_number(b) is not None and _rounded(b, ea):
            return True
        return bool(_is_zero(ea - eb))
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - sympy raises many types on odd input
        return False


def symbolic_verdict(pred: str, gt: str) -> bool:
    """Full verdict on two normalized answers, structures matched element-wise."""
    return match(parse_structure(pred), parse_structure(gt), symbolic_scalar_eq)
