"""Cheap, in-process comparison: normalized strings, then exact ``Fraction`` numbers, never a relative
tolerance (``123460`` is not ``123456``; docs/rewards.md, step 3). ``Undecided`` sends the rest to sympy.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

from stapo.rewards.structure import Undecided, match, parse_structure

ROUNDED_DECIMALS = 6
MAX_NUMBER_CHARS = 400  # longer digit strings are not parsed as numbers (int() limits, DoS)
MAX_ANSWER_CHARS = 1000  # longer answers are only ever compared as exact strings

_DEC_RE = re.compile(r"^([+-]?)(\d*)(?:\.(\d*))?$")
_FRAC_RE = re.compile(r"^([+-]?)\\frac\{([+-]?[\d.]+)\}\{([+-]?[\d.]+)\}$")
_SLASH_RE = re.compile(r"^([+-]?)([\d.]+)/([\d.]+)$")
_WORD_RE = re.compile(r"^[A-Za-z]{2,}$")
_LETTER_RUN_RE = re.compile(r"(?<!\\)(?<![A-Za-z])[A-Za-z]{3,}")


def parse_decimal(s: str) -> Optional[Fraction]:
    """``-3.50`` -> Fraction(-7, 2); None unless ``s`` is a plain decimal literal."""
    m = _DEC_RE.match(s)
    if not m or not (m.group(2) or m.group(3)) or len(s) > MAX_NUMBER_CHARS:
        return None
    return Fraction(s)


def parse_number(s: str) -> Optional[Fraction]:
    """Exact value of a decimal, ``a/b`` or ``\\frac{a}{b}`` literal; None otherwise."""
    value = parse_decimal(s)
    if value is not None:
        return value
    m = _FRAC_RE.match(s) or _SLASH_RE.match(s)
    if not m:
        return None
    num, den = parse_decimal(m.group(2)), parse_decimal(m.group(3))
    if num is None or den is None or den == 0:
        return None
    value = num / den
    return -value if m.group(1) == "-" else value


def decimal_places(s: str) -> int:
    """Fractional digits of a plain decimal literal (0 for anything else)."""
    m = _DEC_RE.match(s)
    return len(m.group(3) or "") if m else 0


def rounded_match(dec_text: str, dec: Fraction, value: Fraction) -> bool:
    """A long decimal printout equals ``value`` to within one unit of its last digit."""
    places = decimal_places(dec_text)
    return places >= ROUNDED_DECIMALS and abs(dec - value) <= Fraction(1, 10**places)


def cheap_scalar_eq(a: str, b: str) -> bool:
    """String, then exact-number comparison; raises ``Undecided`` if sympy is needed."""
    if a == b:
        return True
    if not a or not b:
        return False
    na, nb = parse_number(a), parse_number(b)
    if na is not None and nb is not None:
        return na == nb or rounded_match(a, na, nb) or rounded_match(b, nb, na)
    if _WORD_RE.match(a) and _WORD_RE.match(b):
        return a.lower() == b.lower()  # "Even" vs "even"; never multiply letters of words
    if _LETTER_RUN_RE.search(a) or _LETTER_RUN_RE.search(b):
        return False  # words, not algebra: sympy would read "odd" as o*d*d
    if len(a) > MAX_ANSWER_CHARS or len(b) > MAX_ANSWER_CHARS:
        return False
    raise Undecided


def cheap_verdict(pred: str, gt: str) -> Optional[bool]:
    """Verdict on two normalized answers without sympy; None when sympy must decide."""
    if pred == gt:
        return bool(pred)
    if not pred or not gt:
        return False
    if len(pred) > MAX_ANSWER_CHARS or len(gt) > MAX_ANSWER_CHARS:
        return False
    num_pred, num_gt = parse_number(pred), parse_number(gt)
    if num_pred is not None and num_gt is not None:  # fast path: two plain numbers
        return num_pred == num_gt or rounded_match(pred, num_pred, num_gt) or rounded_match(gt, num_gt, num_pred)
    try:
        return match(parse_structure(pred), parse_structure(gt), cheap_scalar_eq)
    except Undecided:
        return None
