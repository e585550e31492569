"""Agreement of stapo's math verifier with Math-Verify's own test verdicts.

    python bench/verifier_conformance.py [--cases PATH] [--timeout 5]

Reads ``conformance/math_verify_cases.jsonl`` (270 gold/pred/expected rows from the
Math-Verify v0.8.0 test suite). Rows whose upstream config extracts expressions only
(``match_types == ["expr"]``) hold two bare answers, compared directly; all other rows hold
two texts, from which stapo extracts the final answer first (``extract_answer``). Prints
the agreement and a Markdown table of every disagreement.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from stapo.rewards import MathVerifier, extract_answer

DEFAULT_CASES = Path(__file__).resolve().parents[1] / "tests" / "rewards" / "conformance" / "math_verify_cases.jsonl"


def load_cases(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def is_answer_row(row: dict) -> bool:
    """Upstream expression-only extraction: gold and pred are bare answers, not texts."""
    return row["config"].get("match_types") == ["expr"]


def row_answers(row: dict, lenient: bool) -> tuple:
    """(pred, gold) final answers of one row, as stapo extracts them.

    strict: bare-answer rows are taken as answers; texts need a final-answer marker (the
    reward's rule). lenient: every string goes through ``extract_answer(lenient=True)``.
    """
    if is_answer_row(row) and not lenient:
        return row["pred"], row["gold"]
    return tuple(extract_answer(row[k], tail_chars=None, lenient=lenient) for k in ("pred", "gold"))


def short(text: object, width: int = 60) -> str:
    text = repr(text) if not isinstance(text, str) else text
    text = text.replace("\n", "\\n").replace("|", "\\|")
    return text if len(text) <= width else "…" + text[-width:]


def evaluate(verifier: MathVerifier, rows: list[dict], lenient: bool) -> tuple[list, list, float]:
    pairs = [row_answers(r, lenient) for r in rows]
    start = time.perf_counter()
    verdicts = verifier.equivalent([p for p, _ in pairs], [g for _, g in pairs])
    return pairs, verdicts, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES)
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args(argv)
    if not args.cases.exists():
        print(f"conformance file not found: {args.cases}", file=sys.stderr)
        return 2
    rows = load_cases(args.cases)
    expected = [bool(r["expected"]) for r in rows]
    print(f"## stapo vs Math-Verify test verdicts ({args.cases.name}, {len(rows)} rows)\n")
    print("| extraction | agree | agreement | wall time |\n|---|---:|---:|---:|")
    with MathVerifier(timeout_s=args.timeout) as verifier:
        for lenient in (False, True):
            pairs, verdicts, elapsed = evaluate(verifier, rows, lenient)
            n_agree = sum(v == e for v, e in zip(verdicts, expected))
            name = "lenient (Math-Verify fallbacks)" if lenient else "strict (reward default)"
            print(f"| {name} | {n_agree} | {100 * n_agree / len(rows):.1f}% | {elapsed:.2f} s |")
    print("\n### Disagreements (lenient extraction)\n")
    print("| # | source | expected | stapo | gold answer | pred answer | note |")
    print("|---:|---|---|---|---|---|---|")
    for i, (row, verdict, (pred, gold)) in enumerate(zip(rows, verdicts, pairs)):
        if verdict != bool(row["expected"]):
            note = "upstream note" if row.get("note") else ""
            print(f"| {i} | {row['source'].split(':')[-1]} | {row['expected']} | {verdict} | "
                  f"{short(gold, 40)} | {short(pred, 40)} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
