"""Extraction rules of ``extract_answer`` (docs/rewards.md): boxed, Answer line, final answer."""

import pytest

from stapo.rewards import extract_answer


@pytest.mark.parametrize("text, expected", [
    # rule 1: the last \boxed{...}, balanced braces
    (r"so the answer is \boxed{34}.", "34"),
    (r"first \boxed{1} then \boxed{2}, wait, recheck \boxed{3}", "3"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"nested \boxed{\frac{\sqrt{3}}{2}} done", r"\frac{\sqrt{3}}{2}"),
    (r"set \boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"the result is \fbox{7}", "7"),
    (r"the result is \boxed 5 and that's it", "5"),
    (r"$\boxed{x^{2}+1}$", "x^{2}+1"),
    # boxes separated only by "and"/commas/\quad are one multi-part answer
    (r"\boxed{2} and \boxed{3}", "2,3"),
    (r"\boxed{(1, 2)} \quad \text{and} \quad \boxed{(2, 1)}", "(1, 2),(2, 1)"),
    # rule 2: the last Answer: line
    ("Step 1 ...\nAnswer: 34", "34"),
    ("Answer: 34\nWait, recheck.\nAnswer: 35", "35"),
    ("> Final Answer: 12", "12"),
    ("**Answer:** $\\frac{3}{4}$", "\\frac{3}{4}"),
    ("Answer: The area is $12$ square units.", "12"),
    # a value stated after the last box overrides it (the box held an intermediate result)
    ("= \\boxed{255} So she has $10,455. Final Answer: The final answer is $10,455$. I hope it is correct.",
     "10,455"),
    # rule 3: "final answer is ..."
    ("Final Answer: The final answer is $34$. I hope it is correct.", "34"),
    ("so the final answer is 2.5.", "2.5"),
    # a response that is only a math span is its own answer
    ("$\\frac{7}{2}$", "\\frac{7}{2}"),
])
def test_extraction_rules(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text", [
    "I think it is 34",          # no marker: no answer
    r"\boxed{34",                # the final box is cut off (truncated response)
    r"\boxed{}",                 # empty box
    "",
    None,
    12,
])
def test_no_extractable_answer(text):
    assert extract_answer(text) is None


def test_answer_line_after_the_last_box_wins():
    # A box quoted from the question must not beat the model's own closing Answer line.
    text = "The problem asks whether \\boxed{12} is right. Computing...\nAnswer: 13"
    assert extract_answer(text) == "13"


@pytest.mark.parametrize("tail", [
    "\n\nTo verify the answer: we plug in 3.",   # "answer:" inside a sentence is no marker
    " so my final answer is correct.",            # "final answer is" never overrides a box
])
def test_prose_after_the_box_does_not_override_it(tail):
    assert extract_answer("\\boxed{5}" + tail) == "5"


def test_truncated_last_box_does_not_fall_back_to_a_draft():
    # The last box never closed; the earlier draft answer is not the final answer.
    assert extract_answer(r"draft \boxed{5} ... final \boxed{6") is None


def test_only_the_tail_is_scanned():
    # 34 is boxed 5,000 characters before the end; with tail_chars=4000 it is out of view.
    text = "\\boxed{34}" + "x" * 5000
    assert extract_answer(text, tail_chars=4000) is None
    assert extract_answer(text, tail_chars=None) == "34"


def test_lenient_fallbacks_only_when_asked():
    text = "Therefore $x \\geq 5$ is the solution."
    assert extract_answer(text) is None
    assert extract_answer(text, lenient=True) == "x \\geq 5"
    # last number, not glued to letters
    assert extract_answer("so it costs 1,000.99 euros", lenient=True) == "1,000.99"
    assert extract_answer("AZYUK2A", lenient=True) is None
