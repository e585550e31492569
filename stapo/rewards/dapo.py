"""``dapo`` mode: DAPO's rule-based verifier, reproduced exactly (paper §5: "the rule-based verifier from
DAPO without modification"): verl ``math_dapo.py`` at 00a10a8, and ``dapo_boxed`` its revision bf48903
(docs/rewards.md, "Modes"; checked against ``conformance/dapo_reference_probes.jsonl``).
"""

from __future__ import annotations

import re
from typing import Optional

TAIL_CHARS = 300
_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Minerva (Lewkowycz et al., 2022, appendix D) substitutions and removed expressions.
SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
REMOVED_EXPRESSIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}",
    "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
_REGEX_STEPS = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),  # keep the first $...$ span
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),  # \sqrt3 -> \sqrt{3}
)


def minerva_normalize(answer: str) -> str:
    """Minerva / DAPO normalization of one final answer string."""
    answer = answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        answer = answer.replace(expr, "")
    for pattern, repl in _REGEX_STEPS:
        answer = pattern.sub(repl, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def _last_boxed_content(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{`` with balanced braces (verl's boxed fallback)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("\\boxed{") : i]
    return None


def dapo_extract(response: str, boxed_fallback: bool = False) -> Optional[str]:
    """Normalized last ``Answer:`` line within the final 300 characters, else (``boxed_fallback``, verl
    bf48903) the last ``\\boxed{}`` there; None if absent."""
    window = response[-TAIL_CHARS:]
    matches = _ANSWER_RE.findall(window)
    if matches:
        return minerva_normalize(matches[-1])
    boxed = _last_boxed_content(window) if boxed_fallback else None
    return minerva_normalize(boxed) if boxed is not None else None


def dapo_verify(response: object, ground_truth: object, boxed_fallback: bool = False) -> bool:
    """DAPO verdict: exact match of normalized strings (an absent answer never matches)."""
    if not isinstance(response, str) or not isinstance(ground_truth, str):
        return False
    pred = dapo_extract(response, boxed_fallback)
    return pred is not None and pred == minerva_normalize(ground_truth)
