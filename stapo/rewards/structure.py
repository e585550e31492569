"""Composite answers (tuples, intervals, sets, matrices; docs/rewards.md, step 3.3): one tree for the cheap check
and the sympy worker, so both share one definition of "same tuple / set / interval".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from stapo.rewards.normalize import strip_simple_lhs

_OPEN, _CLOSE = "([{", ")]}"
_MATRIX_RE = re.compile(r"^[(\[]?\\begin\{([pbvBV]?matrix|array)\}(?:\{[lcr|]*\})?(.*)\\end\{\1\}[)\]]?$", re.S)
# a < x \leq b  ->  the interval (a, b]  (also 0 < f(x) < 1)
_CHAIN_RE = re.compile(r"^([^<>]+?)(<|\\leq)([A-Za-z](?:_\{?\w+\}?)?(?:\([A-Za-z]\))?)(<|\\leq)([^<>]+)$")
_MAX_ITEMS = 64


@dataclass(frozen=True)
class Answer:
    """One parsed answer. ``kind``: scalar | set | seq | matrix."""

    kind: str
    text: str = ""  # scalar only
    items: tuple["Answer", ...] = ()
    brackets: str = ""  # seq only, e.g. "[)"


def split_top(s: str, sep: str) -> list[str]:
    """Split ``s`` at ``sep`` outside any (), [], {} (mixed types count alike: ``[0,1)``)."""
    parts, depth, start, i, n = [], 0, 0, 0, len(s)
    while i < n:
        ch = s[i]
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth = max(depth - 1, 0)
        elif depth == 0 and s.startswith(sep, i):
            parts.append(s[start:i])
            i += len(sep)
            start = i
            continue
        i += 1
    parts.append(s[start:])
    return parts


def _closes_at_end(s: str) -> bool:
    """True if the bracket opened at s[0] closes at the last character."""
    depth = 0
    for i, ch in enumerate(s):
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
            if depth == 0:
                return i == len(s) - 1
    return False


def _list(parts: list[str], depth: int) -> Answer:
    items = tuple(parse_structure(p, depth + 1) for p in parts[:_MAX_ITEMS] if p)
    return Answer("set", items=items)


def parse_structure(s: str, depth: int = 0) -> Answer:
    """Parse a normalized (whitespace-free) answer into an ``Answer`` tree."""
    if depth > 6 or not s:
        return Answer("scalar", text=s)
    chain = _CHAIN_RE.match(s)
    if chain and "\\leq" not in chain.group(1) + chain.group(5):
        low, high = chain.group(1), chain.group(5)
        brackets = ("[" if chain.group(2) == "\\leq" else "(") + ("]" if chain.group(4) == "\\leq" else ")")
        return Answer("seq", items=(parse_structure(low, depth + 1), parse_structure(high, depth + 1)),
                      brackets=brackets)
    m = _MATRIX_RE.match(s)
    if m:
        rows = [r for r in m.group(2).split("\\\\") if r]
        return Answer("matrix", items=tuple(
            Answer("seq", items=tuple(parse_structure(c, depth + 1) for c in r.split("&")), brackets="[]")
            for r in rows[:_MAX_ITEMS]))
    for sep in ("\\cup", ";", ","):
        parts = split_top(s, sep)
        if len(parts) > 1:
            return _list(parts, depth)
    if s.startswith("\\{") and s.endswith("\\}"):
        return _list(split_top(s[2:-2], ","), depth)
    if s[0] in "([{" and s[-1] in ")]}" and _closes_at_end(s):
        parts = split_top(s[1:-1], ",")
        if s[0] == "{" and s[-1] == "}":
            return _list(parts, depth)
        if len(parts) > 1:
            return Answer("seq", items=tuple(parse_structure(p, depth + 1) for p in parts[:_MAX_ITEMS]),
                          brackets=s[0] + s[-1])
        if s[0] == "(" and s[-1] == ")":  # redundant parentheses: (C), (\frac{1}{3})
            return parse_structure(s[1:-1], depth + 1)
    pm = split_top(s, "\\pm")
    if len(pm) == 2:
        a, b = pm
        plus, minus = (f"{a}+{b}", f"{a}-({b})") if a else (b, f"-({b})")
        return Answer("set", items=(Answer("scalar", text=plus), Answer("scalar", text=minus)))
    stripped = strip_simple_lhs(s)
    if stripped != s:
        return parse_structure(stripped, depth + 1)
    return Answer("scalar", text=s)


class Undecided(Exception):
    """Raised by a cheap scalar comparison that needs sympy to decide."""


ScalarEq = Callable[[str, str], bool]


def match(a: Answer, b: Answer, scalar_eq: ScalarEq) -> bool:
    """Structural equivalence of two answers, scalars compared with ``scalar_eq``."""
    if a.kind == "set" and len(a.items) == 1 and b.kind != "set":
        return match(a.items[0], b, scalar_eq)
    if b.kind == "set" and len(b.items) == 1 and a.kind != "set":
        return match(a, b.items[0], scalar_eq)
    if a.kind != b.kind or (a.kind != "set" and len(a.items) != len(b.items)):
        return False
    if a.kind == "scalar":
        return scalar_eq(a.text, b.text)
    if a.kind == "seq" and a.brackets != b.brackets:
        return False
    if a.kind in ("seq", "matrix"):
        return all(match(x, y, scalar_eq) for x, y in zip(a.items, b.items))
    return _match_unordered(list(a.items), list(b.items), scalar_eq)


def _match_unordered(xs: list[Answer], ys: list[Answer], scalar_eq: ScalarEq) -> bool:
    """Set equality: every x equals some y and every y equals some x (duplicates collapse)."""
    return (all(any(match(x, y, scalar_eq) for y in ys) for x in xs)
            and all(any(match(x, y, scalar_eq) for x in xs) for y in ys))
