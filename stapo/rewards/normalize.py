"""Answer normalization (Minerva / DAPO style, extended; docs/rewards.md, step 2): one string per answer, so the
cheap comparison decides most items. Linear-time regexes only: model output is untrusted.
"""

from __future__ import annotations

import re
import unicodedata

# Units and filler words dropped after a number ("34 cm", "125 miles", "5 dollars").
UNIT_WORDS = (
    "square units|square feet|square inches|square meters|square centimeters|sq units|units|unit|"
    "cm|mm|km|meters|meter|metres|centimeters|kilometers|inches|inch|feet|foot|ft|yards|yd|"
    "miles|mile|mph|kmh|hours|hour|hrs|hr|minutes|minute|min|seconds|second|sec|days|day|weeks|"
    "years|year|degrees|degree|deg|radians|dollars|dollar|cents|cent|pounds|lbs|lb|ounces|oz|"
    "grams|gram|kg|liters|liter|ml|points|ways|students|people|times"
)
# One-letter units ("5 m", "3 s") only after a space: "5m" may be 5 times m.
_UNIT_TAIL_RE = re.compile(
    rf"(?<=[\d}}.)])(?:\s*(?:{UNIT_WORDS})|\s+(?:m|s|h|g|l|in))(?:\^\{{?[23]\}}?|²|³)?\s*$", re.I)
_TEXT_TAIL_RE = re.compile(r"(?<=\S)\s*\\(?:text|mbox|textnormal|mathrm|textrm)\{\s*[A-Za-z][A-Za-z .]*\}"
                           r"(?:\^\{?[23]\}?)?\s*$")
# "5 apples", "12 square units": a number followed only by words is the number.
_NUMBER_WORDS_RE = re.compile(r"^(-?[\d.,/]+)\s+[A-Za-z]{3,}(?:\s+[A-Za-z]+){0,4}$")
_TEXT_WRAP_RE = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox|operatorname"
                           r"|mathsf)\s*\{([^{}]*)\}")
_SPACING_RE = re.compile(r"\\(?:displaystyle|left|right|big|Big|bigg|Bigg)(?![A-Za-z])|\\[!,;:> ]|\\q?quad|~")
_FRAC_SHORT_RE = re.compile(r"\\frac\s*(\d|[A-Za-z])\s*(\d|[A-Za-z]|\{)")
_FRAC_SHORT2_RE = re.compile(r"\\frac\{([^{}]*)\}(\d|[A-Za-z])")
_SQRT_SHORT_RE = re.compile(r"\\sqrt\s*(\d|[A-Za-z](?![A-Za-z]))")
_DEGREE_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree|°")
_PERCENT_RE = re.compile(r"\\?%|\s*\bpercent(?:age)?\b|\s*\bpct\b")
# 1,000 -> 1000, but never inside a tuple/interval: (12,102) is a pair of numbers.
_THOUSANDS_RE = re.compile(r"(?<![\d.,(\[{])([1-9]\d{0,2})((?:,\d{3})+)(?![\d,)\]}])")
_LIST_WORD_RE = re.compile(r"(?<=[)\]])\s*(?:or|and)\s*(?=[(\[])|\s+(?:and|or)\s+|,\s*(?:and|or)\s+")
_DOUBLE_BACKSLASH_RE = re.compile(r"(?<!\\)\\\\(?=[A-Za-z])")  # "\\frac" (escaped twice) -> "\frac"
_IN_PREFIX_RE = re.compile(r"^[A-Za-z]\s*\\in(?![A-Za-z])")
_LEADING_WORD_RE = re.compile(r"^(?:the answer is|answer is|it is|is)\s*", re.I)
_SUBSCRIPT_RE = re.compile(r"_\{[^{}]*\}|_\w")
# A left-hand side that names the answer: x, x_1, f(x), (p,q), |AB|, A:B, \frac{NO}{BO}.
_NAME_LHS_RE = re.compile(r"^[A-Za-z\\{}():|,'\s]+$")
_RELATION_RE = re.compile(r"\\(le|ge|ne)(?:qq|q)?(?![A-Za-z])")
_PLAIN_NUMBER_RE = re.compile(r"^\s*-?\d{1,300}(?:\.\d{1,300})?\s*$")
_UNICODE = {"−": "-", "–": "-", "—": "-", "×": "\\times", "·": "\\cdot", "÷": "\\div", "π": "\\pi",
            "∞": "\\infty", "√": "\\sqrt", "≤": "\\le", "≥": "\\ge", "≠": "\\ne", "∪": "\\cup", "±": "\\pm"}
_UNICODE_RE = re.compile("|".join(map(re.escape, _UNICODE)))


def _expand_frac(m: re.Match) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``; ``\\frac1{3}`` -> ``\\frac{1}{3}``."""
    den = m.group(2) if m.group(2) == "{" else "{%s}" % m.group(2)
    return "\\frac{%s}%s" % (m.group(1), den)


def _unwrap_text(s: str) -> str:
    for _ in range(8):  # nested wrappers, innermost first; bounded
        new = _TEXT_WRAP_RE.sub(lambda m: m.group(1), s)
        if new == s:
            break
        s = new
    return s


def _has_variable(s: str) -> bool:
    return re.search(r"[A-Za-z]", re.sub(r"\\[A-Za-z]+", "", s)) is not None


def strip_simple_lhs(s: str) -> str:
    """``x = 5`` -> ``5``; ``x = 5+5+1 = 11`` -> ``11``; equations like ``2x+y=1`` are kept."""
    if ("=" not in s and "\\approx" not in s) or any(op in s for op in ("<=", ">=", "!=", "\\le", "\\ge", "\\ne")):
        return s
    if "\\approx" in s:  # "x = 1/3 \approx 0.33" -> "x = 1/3"; "x \approx 11" -> "11"
        head, tail = s.split("\\approx", 1)
        s = tail if _NAME_LHS_RE.match(_SUBSCRIPT_RE.sub("", head).strip() or "0") else head
    parts = s.split("=")
    lhs = _SUBSCRIPT_RE.sub("", parts[0]).strip()
    if len(parts) >= 2 and not _has_variable(lhs) and not _has_variable(parts[-1]) and parts[-1].strip():
        return parts[-1].strip()  # arithmetic that ends in its result: "5+5+1 = 11"
    if len(parts) >= 2 and _NAME_LHS_RE.match(lhs) and not re.search(r"\\(?:cdot|times|div)", lhs) \
            and parts[-1].strip():
        return parts[-1].strip()
    return s


def normalize_answer(s: object) -> str:
    """Canonical string form of an answer (no whitespace); '' for None or non-strings."""
    if not isinstance(s, str):
        return ""
    if _PLAIN_NUMBER_RE.match(s):  # the common RL case: nothing to normalize
        return s.strip()
    s = unicodedata.normalize("NFKC", s) if not s.isascii() else s
    s = _UNICODE_RE.sub(lambda m: _UNICODE[m.group(0)], s)
    s = s.replace("\n", " ").strip()
    s = _DOUBLE_BACKSLASH_RE.sub(r"\\", s)
    s = _LEADING_WORD_RE.sub("", s)
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\[dtc]frac", r"\\frac", s)
    s = re.sub(r"\{\s*,\s*\}|,\\!\s*", "", s).replace('"', "")
    s = _SPACING_RE.sub(" ", s)
    s = _THOUSANDS_RE.sub(lambda m: m.group(1) + m.group(2).replace(",", ""), s)
    s = _TEXT_TAIL_RE.sub("", s)
    s = _unwrap_text(s)
    s = _DEGREE_RE.sub("", s)
    s = _PERCENT_RE.sub("", s)
    s = _UNIT_TAIL_RE.sub("", s.strip())
    s = _NUMBER_WORDS_RE.sub(r"\1", s)
    s = _LIST_WORD_RE.sub(",", s)
    s = _RELATION_RE.sub(r"\\\1q", s)  # \le, \leqq -> \leq; \ge -> \geq; \ne -> \neq
    s = re.sub(r"\s+", "", s)
    s = _IN_PREFIX_RE.sub("", s)
    s = _FRAC_SHORT_RE.sub(_expand_frac, s)
    s = _FRAC_SHORT2_RE.sub(lambda m: "\\frac{%s}{%s}" % (m.group(1), m.group(2)), s)
    s = _SQRT_SHORT_RE.sub(lambda m: "\\sqrt{%s}" % m.group(1), s)
    s = s.rstrip(".").rstrip("\\").rstrip()
    return strip_simple_lhs(s) if "," not in s else s
