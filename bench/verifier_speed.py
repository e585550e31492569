"""Verifier throughput and accuracy: stapo vs Math-Verify (target: >= 10x on RL workloads; docs/benchmarks.md).

    pip install math-verify            # benchmark-only dependency
    python bench/verifier_speed.py [--n 2000] [--repeats 3] [--smoke]

(a) RL workload: ``--n`` synthetic long responses (2-6 kB of reasoning, then a ``\\boxed{}``
    answer) against integer and simple-fraction ground truths, about half of them wrong, the
    right ones often written differently (``\\dfrac{6}{8}`` for ``3/4``, ``0.75``, ``12.0``).
    The known truth is how each response was generated.
(b) the Math-Verify conformance set (270 rows), agreement with its expected verdicts.

Both verifiers do everything per item (extract from the response, parse the ground truth,
compare). stapo runs its batch API (``MathVerifier.score``) as the trainer does; Math-Verify
runs ``verify(parse(gold), parse(response))`` per item, as its README shows. Best of
``--repeats`` runs; one process, one thread of control for both.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from fractions import Fraction
from pathlib import Path

from stapo.rewards import MathVerifier, extract_answer

CASES = Path(__file__).resolve().parents[1] / "tests" / "rewards" / "conformance" / "math_verify_cases.jsonl"
FILLER = [
    "Let $x$ be the number of apples, so $3x + 5 = {a}$. ",
    "We compute $\\frac{{{a}}}{{{b}}}$ and simplify step by step. ",
    "By the Pythagorean theorem, $a^2 + b^2 = c^2$, hence $c = \\sqrt{{{a}}}$. ",
    "Wait, let me double-check: {a} + {b} = {c}. ",
    "Substituting back gives \\[ y = {a}x^2 - {b}x + {c}. \\] ",
    "The sum over $k$ from 1 to {a} is $\\sum_{{k=1}}^{{{a}}} k = {c}$. ",
    "Hmm, that doesn't look right. Let's reconsider the case $n = {b}$. ",
]


def _truth_and_spellings(rng: random.Random) -> tuple[str, Fraction, list[str]]:
    if rng.random() < 0.6:
        v = rng.randint(-50, 2000)
        return str(v), Fraction(v), [str(v), f"{v}.0", f"{v}", f"x = {v}"]
    p, q = rng.randint(1, 40), rng.randint(2, 40)
    v = Fraction(p, q)
    if v.denominator == 1:
        return str(v.numerator), v, [str(v.numerator)]
    gt = rng.choice([f"{v.numerator}/{v.denominator}", f"\\frac{{{v.numerator}}}{{{v.denominator}}}"])
    k = rng.randint(2, 4)
    spellings = [f"\\frac{{{v.numerator}}}{{{v.denominator}}}", f"\\dfrac{{{v.numerator * k}}}{{{v.denominator * k}}}",
                 f"{v.numerator}/{v.denominator}"]
    if 10**6 % v.denominator == 0:
        spellings.append(str(float(v)))
    return gt, v, spellings


def _wrong(rng: random.Random, v: Fraction) -> str:
    w = v + rng.choice([1, -1, 2, Fraction(1, 2), 10])
    return str(w.numerator) if w.denominator == 1 else f"\\frac{{{w.numerator}}}{{{w.denominator}}}"


def rl_workload(n: int, seed: int = 0) -> tuple[list[str], list[str], list[bool]]:
    """Synthetic (responses, ground truths, truth) for an RL step."""
    rng = random.Random(seed)
    responses, answers, truth = [], [], []
    for _ in range(n):
        gt, value, spellings = _truth_and_spellings(rng)
        correct = rng.random() < 0.5
        shown = rng.choice(spellings) if correct else _wrong(rng, value)
        body = "".join(rng.choice(FILLER).format(a=rng.randint(2, 99), b=rng.randint(2, 99), c=rng.randint(2, 999))
                       for _ in range(rng.randint(25, 70)))
        responses.append(f"{body}\nTherefore, the final answer is $\\boxed{{{shown}}}$.")
        answers.append(gt)
        truth.append(correct)
    return responses, answers, truth


def time_best(fn, repeats: int) -> tuple[float, list]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def math_verify_fn(golds: list[str], preds: list[str]):
    from math_verify import parse, verify  # benchmark-only dependency

    def run() -> list[bool]:
        return [bool(verify(parse(g), parse(p))) for g, p in zip(golds, preds)]
    return run


def row(name: str, n: int, t_stapo: float, t_mv: float, acc_stapo: float, acc_mv: float) -> str:
    return (f"| {name} | {n} | {n / t_stapo:,.0f} | {n / t_mv:,.0f} | {t_mv / t_stapo:.1f}x | "
            f"{100 * acc_stapo:.1f}% | {100 * acc_mv:.1f}% |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny run, stapo only (for tests)")
    args = parser.parse_args(argv)
    n = 20 if args.smoke else args.n
    responses, answers, truth = rl_workload(n)
    lines = ["| workload | items | stapo answers/s | Math-Verify answers/s | speed-up | stapo accuracy | "
             "Math-Verify accuracy |", "|---|---:|---:|---:|---:|---:|---:|"]
    with MathVerifier() as verifier:
        t_s, scores = time_best(lambda: verifier.score(responses, answers), args.repeats)
        acc_s = sum((s > 0) == t for s, t in zip(scores, truth)) / n
        if args.smoke:
            print(f"stapo: {n / t_s:,.0f} answers/s, accuracy {100 * acc_s:.1f}%")
            return 0
        t_m, verdicts = time_best(math_verify_fn([f"${a}$" for a in answers], responses), args.repeats)
        acc_m = sum(v == t for v, t in zip(verdicts, truth)) / n
        lines.append(row("(a) RL: long responses, int/fraction answers", n, t_s, t_m, acc_s, acc_m))
        if CASES.exists():
            rows = [json.loads(x) for x in CASES.read_text(encoding="utf-8").splitlines() if x.strip()]
            expected = [bool(r["expected"]) for r in rows]

            def stapo_conf() -> list[bool]:
                preds = [extract_answer(r["pred"], tail_chars=None, lenient=True) for r in rows]
                golds = [extract_answer(r["gold"], tail_chars=None, lenient=True) for r in rows]
                return verifier.equivalent(preds, golds)

            t_s2, v_s = time_best(stapo_conf, args.repeats)
            t_m2, v_m = time_best(math_verify_fn([r["gold"] for r in rows], [r["pred"] for r in rows]), args.repeats)
            agree = lambda vs: sum(v == e for v, e in zip(vs, expected)) / len(rows)  # noqa: E731
            lines.append(row("(b) Math-Verify conformance set (agreement)", len(rows), t_s2, t_m2,
                             agree(v_s), agree(v_m)))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
