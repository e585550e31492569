"""Final-answer extraction: the last ``\\boxed{}``, else an ``Answer:`` line, else "final answer is"
(docs/rewards.md, "`math` mode, step by step"). Only the last ``tail_chars`` characters are scanned:
answers sit at the end, and scanning 50 kB of reasoning would dominate the reward's cost.
"""

from __future__ import annotations

import re
from typing import Optional

DEFAULT_TAIL_CHARS = 4000

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# "Answer:" opening a line (after optional markdown/"Final"), not "my answer: ..." mid-sentence.
_ANSWER_LINE_RE = re.compile(r"(?im)^[ \t>*#_]*(?:final\s+)?answer\s*\**\s*[:：]\**([^\n]*)")
_FINAL_ANSWER_RE = re.compile(r"(?i)final\s+answer\s+is\s*:?\s*([^\n]*)")
_STATES_VALUE_RE = re.compile(r"\s*(?:\$|\\[(\[]|-?\d)")  # "$10,455$", "\(x\)", "-3": a value, not prose
_WHOLE_MATH_RE = re.compile(r"^\s*(?:\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\])\s*\.?\s*$", re.S)
# "I hope it is correct." and similar tails after the Minerva sentence.
_SENTENCE_END_RE = re.compile(r"\.\s|\.$|\s+I hope\b")
# What may separate the boxes of one multi-part answer: spaces, commas, $, \\, \( \[, \quad, "and".
_JOIN_GAP_RE = re.compile(r"^(?:\s|[,;$.&]|\\\\|\\[()\[\]]|\\q?quad|\\[ ,;]"
                          r"|\\text\{\s*(?:and|or|,)\s*\}|\band\b|\bor\b)*$")
_MATH_SPAN_RE = re.compile(r"(?<!\\)\$\$(.+?)(?<!\\)\$\$|\\\[(.+?)\\\]|\\\((.+?)\\\)"  # $$..$$ \[..\] \(..\)
                           r"|(?<!\\)\$((?:[^$\n]|(?<=\\)\$)+?)(?<!\\)\$", re.S)  # $..$ on one line
_NUMBER_RE = re.compile(r"(?<![A-Za-z\d])(?:-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?"
                        r"|-?\.\d+)(?!\d)")
_WORDS_RE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")


def balanced_group(text: str, start: int, open_ch: str = "{", close_ch: str = "}") -> Optional[int]:
    """Index just past the group opened at ``text[start] == open_ch``; None if unbalanced."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]  # escaped braces (\{ \}) are set delimiters, not groups
        if ch == open_ch and (i == 0 or text[i - 1] != "\\"):
            depth += 1
        elif ch == close_ch and (i == 0 or text[i - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _box_at(text: str, m: re.Match) -> Optional[tuple[int, int, str]]:
    """(start, end, content) of the box whose command ``m`` matched; None if unfinished."""
    i = m.end()
    while i < len(text) and text[i] in " \t":
        i += 1
    if i < len(text) and text[i] == "{":
        end = balanced_group(text, i)
        return None if end is None else (m.start(), end, text[i + 1 : end - 1])
    if i > m.end():  # "\boxed 5": the token up to whitespace or a math delimiter
        tok = re.match(r"[^\s$]+", text[i:])
        if tok:
            return m.start(), i + tok.end(), tok.group(0).rstrip(".,")
    return None


def _last_boxed(text: str) -> Optional[tuple[int, str]]:
    """(start, content) of the final boxed answer, boxes joined by commas or "and" read as one (docs/rewards.md);
    None if absent or cut off. Backwards from the last box: unclosed boxes cost one scan, not one each."""
    commands = list(_BOX_RE.finditer(text))
    last = _box_at(text, commands[-1]) if commands else None
    if last is None:
        return None  # no box, or the final one never closed: no boxed answer
    run = [last]
    for m in reversed(commands[:-1]):
        prev = _box_at(text, m)
        if prev is None or prev[1] > run[0][0] or not _JOIN_GAP_RE.match(text[prev[1] : run[0][0]]):
            break
        run.insert(0, prev)
    return run[0][0], ",".join(content for _, _, content in run)


def _strip_math_delims(ans: str) -> str:
    ans = ans.strip().strip("*").strip()
    m = _WHOLE_MATH_RE.match(ans)
    if m:
        ans = next(g for g in m.groups() if g is not None)
    return ans.strip()


def _final_answer_sentence(content: str) -> str:
    content = content.strip()
    if content.startswith("$"):  # "$34$. I hope ..." -> the math span
        end = content.find("$", 2 if content.startswith("$$") else 1)
        if end > 0:
            return content[: end + (2 if content.startswith("$$") else 1)]
    m = _SENTENCE_END_RE.search(content)
    return content[: m.start()] if m else content


def _last_math_or_number(text: str) -> Optional[str]:
    """The last math span of ``text``, else its last number (Math-Verify-style fallback)."""
    spans = list(_MATH_SPAN_RE.finditer(text))
    numbers = list(_NUMBER_RE.finditer(text))
    if spans and (not numbers or spans[-1].end() >= numbers[-1].end()):
        return next(g for g in spans[-1].groups() if g is not None)
    return numbers[-1].group(0) if numbers else None


def _answer_from_sentence(content: str) -> str:
    """``Answer: The volume is $120$.`` -> ``120``; a bare ``Answer: 2x+1`` is kept whole."""
    content = _final_answer_sentence(content)
    outside_math = _MATH_SPAN_RE.sub(" ", content)
    if len(_WORDS_RE.findall(outside_math)) >= 2:
        return _last_math_or_number(content) or content
    return content


def _marked_answer(text: str) -> Optional[str]:
    """Box, else ``Answer:`` line, else "final answer is". A later ``Answer:`` line, or a later
    "final answer is <math or number>", overrides the box (a draft, or quoted from the question);
    "... my final answer is correct" does not."""
    boxed = _last_boxed(text)
    line = final = None
    if "nswer" in text or "NSWER" in text:  # skip two case-insensitive scans of the tail
        lines = list(_ANSWER_LINE_RE.finditer(text))
        line = lines[-1] if lines else None
        finals = list(_FINAL_ANSWER_RE.finditer(text))
        final = finals[-1] if finals else None
    after_box = (lambda m: m is not None and (boxed is None or m.start() > boxed[0]))
    if after_box(line):
        return _answer_from_sentence(line.group(1))
    if after_box(final) and (boxed is None or _STATES_VALUE_RE.match(final.group(1))):
        return _answer_from_sentence(final.group(1))
    return boxed[1] if boxed is not None else None


def extract_answer(text: object, tail_chars: Optional[int] = DEFAULT_TAIL_CHARS,
                   lenient: bool = False) -> Optional[str]:
    """The final answer written in ``text`` (LaTeX, unnormalized), or None. ``lenient=True`` adds
    Math-Verify's fallbacks (conformance benchmark only: the reward needs a stated final answer)."""
    if not isinstance(text, str) or not text:
        return None
    if tail_chars is not None and tail_chars > 0 and len(text) > tail_chars:
        text = text[-tail_chars:]
    raw = _marked_answer(text)
    if raw is None:
        if _WHOLE_MATH_RE.match(text):
            raw = text
        elif lenient:
            short = len(text) <= 80 and not _WORDS_RE.search(_MATH_SPAN_RE.sub(" ", text))
            raw = text if short else _last_math_or_number(text)
        if raw is None:
            return None
    inner = _last_boxed(raw)  # "Answer: $\boxed{34}$" -> 34
    if inner is not None:
        raw = inner[1]
    ans = _strip_math_delims(raw)
    return ans or None
