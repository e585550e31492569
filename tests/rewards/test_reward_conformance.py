"""Agreement with Math-Verify's own test verdicts stays at the documented level (>= 90%);
smoke runs of both verifier benchmarks."""

import importlib.util
from pathlib import Path

import pytest

from stapo.rewards import MathVerifier

REPO_ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).parent / "conformance" / "math_verify_cases.jsonl"


def _bench(name: str = "verifier_conformance"):
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_conformance_agreement_at_least_90_percent():
    bench = _bench()
    rows = bench.load_cases(CASES)
    with MathVerifier(timeout_s=3.0, num_workers=1) as verifier:
        _, verdicts, _ = bench.evaluate(verifier, rows, lenient=True)
    agree = sum(v == bool(r["expected"]) for v, r in zip(verdicts, rows))
    assert agree / len(rows) >= 0.90, f"{agree}/{len(rows)}"


def test_conformance_bench_smoke(capsys):
    assert _bench().main(["--cases", str(CASES), "--timeout", "3"]) == 0
    out = capsys.readouterr().out
    assert "| strict (reward default) |" in out and "### Disagreements" in out


def test_speed_bench_smoke_and_workload_truth(capsys):
    bench = _bench("verifier_speed")
    responses, answers, truth = bench.rl_workload(200, seed=1)
    assert 0.35 < sum(truth) / len(truth) < 0.65  # about half wrong, as specified
    assert all(r.rstrip().endswith("$.") and "\\boxed{" in r for r in responses)
    with MathVerifier(timeout_s=3.0, num_workers=1) as verifier:
        scores = verifier.score(responses, answers)
    assert [s > 0 for s in scores] == truth  # stapo is exact on the RL workload
    assert bench.main(["--smoke", "--repeats", "1"]) == 0
    assert "accuracy 100.0%" in capsys.readouterr().out
