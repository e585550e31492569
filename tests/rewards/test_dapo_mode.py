"""``dapo`` / ``dapo_boxed`` modes reproduce DAPO's verifier (verl math_dapo.py @ 00a10a8 / bf48903)."""

import json
from pathlib import Path

import pytest

from stapo.rewards import MathVerifier, math_reward
from stapo.rewards.dapo import dapo_extract, minerva_normalize

PROBES = Path(__file__).parent / "conformance" / "dapo_reference_probes.jsonl"


def load_probes():
    with open(PROBES, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_dapo_mode_matches_reference_scores_on_every_probe():
    probes = load_probes()
    assert len(probes) >= 40
    with MathVerifier(mode="dapo") as verifier:
        scores = verifier.score([p["solution_str"] for p in probes], [p["ground_truth"] for p in probes])
    mismatches = [(p["purpose"], s, p["score_verl_00a10a8"])
                  for p, s in zip(probes, scores) if s != p["score_verl_00a10a8"]]
    assert mismatches == []


def test_dapo_boxed_mode_matches_the_later_verl_revision_on_every_probe():
    probes = load_probes()
    with MathVerifier(mode="dapo_boxed") as verifier:
        scores = verifier.score([p["solution_str"] for p in probes], [p["ground_truth"] for p in probes])
    assert scores == [p["score_verl_bf48903"] for p in probes]
    # the columns differ exactly where only a box carries the answer
    assert any(p["score_verl_bf48903"] != p["score_verl_00a10a8"] for p in probes)


def test_dapo_extraction_matches_reference_preds():
    for p in load_probes():
        pred = dapo_extract(p["solution_str"])
        assert (pred if pred is not None else "[INVALID]") == p["pred_verl_00a10a8"], p["purpose"]
        pred = dapo_extract(p["solution_str"], boxed_fallback=True)
        assert (pred if pred is not None else "[INVALID]") == p["pred_verl_bf48903"], p["purpose"]


@pytest.mark.parametrize("response, gt, expected", [
    ("Answer: 34", "34", 1.0),
    ("Answer: 34.", "34", -1.0),              # bare trailing period survives Minerva normalization
    ("so \\boxed{34}", "34", -1.0),           # no \boxed fallback in the original verifier
    ("Answer: 0.5", "\\frac{1}{2}", -1.0),    # exact string match only
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0),
    ("Answer: 1, 2", "12", 1.0),              # Minerva collapses "1,2" to 12 (math mode does not)
])
def test_dapo_mode_examples(response, gt, expected):
    assert math_reward(response, gt, mode="dapo") == expected


def test_dapo_boxed_mode_falls_back_to_the_last_box():
    assert math_reward("so \\boxed{34}", "34", mode="dapo_boxed") == 1.0
    assert math_reward("Answer: 35\n\\boxed{34}", "34", mode="dapo_boxed") == -1.0  # Answer line first


def test_dapo_mode_only_reads_the_last_300_characters():
    response = "Answer: 34\n" + "more reasoning " * 30  # 450 chars after the Answer line
    assert math_reward(response, "34", mode="dapo") == -1.0
    assert math_reward(response, "34", mode="math") == 1.0  # math mode reads a longer tail


def test_minerva_normalize_examples():
    assert minerva_normalize("x = 34 cm") == "34"
    assert minerva_normalize("1,000") == "1000"
    assert minerva_normalize("\\text{34}") == "34"
