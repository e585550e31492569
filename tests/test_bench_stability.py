"""The stability study runner in its shortened mode: 2 runs x 2 steps, resumable, rows and report."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "stability.py"


def _stability(*args):
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def _timings(out):
    return [json.loads(line) for line in (out / "timings.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_stability_smoke_runs_resumes_and_reports(tmp_path):
    out = tmp_path / "study"
    log = _stability("--smoke", "--out", str(out))
    assert "grid: 2 runs, 0 already finished, 2 to run" in log
    assert [t["run"] for t in _timings(out)] == ["none_seed0_lr0.0002", "stapo_seed0_lr0.0002"]

    # a second invocation reruns nothing; a run whose final eval line is lost continues from its checkpoint
    metrics = out / "stapo_seed0_lr0.0002" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:-1]))
    log = _stability("--smoke", "--out", str(out))
    assert "none_seed0_lr0.0002: finished earlier, not rerun" in log
    timings = _timings(out)
    assert [t["run"] for t in timings] == ["none_seed0_lr0.0002", "stapo_seed0_lr0.0002", "stapo_seed0_lr0.0002"]
    assert timings[2]["resumed_from_step"] == 2 and timings[2]["ok"]
    assert metrics.read_text().splitlines()[:-1] == [line.rstrip("\n") for line in lines[:-1]]

    results, doc, figure = tmp_path / "results.jsonl", tmp_path / "doc.md", tmp_path / "fig.png"
    doc.write_text("hand-written prose\n<!-- BEGIN stability -->\nold\n<!-- END stability -->\nmore prose\n")
    _stability("--smoke", "--report", "--out", str(out), "--results", str(results), "--doc", str(doc),
               "--figure", str(figure))
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["mask"], r["status"]) for r in rows] == [("none", "done"), ("stapo", "done")]
    for row in rows:
        assert [s for s, _ in row["eval_curve"]] == [0, 1, 2]  # trainer.eval_every=1 in the smoke mode
        assert [s for s, _ in row["entropy_curve"]] == [1, 2]
        assert row["peak_acc"] - row["final_acc"] == pytest.approx(row["drop"]) and row["drop"] >= 0
        assert row["grad_norm_max"] >= row["grad_norm_p95"] >= 0
        assert row["top_grad"]["records"] == 2  # inspect.record_every=1: steps 1 and 2
        assert 0 <= row["top_grad"]["top_s2t"] <= row["top_grad"]["top_tokens"] <= row["top_grad"]["signed_tokens"]
    assert rows[0]["silenced_frac"] == 0.0  # none silences nothing
    assert rows[1]["attempts"] == 2
    text = doc.read_text()
    assert text.startswith("hand-written prose\n<!-- BEGIN stability -->") and text.endswith("-->\nmore prose\n")
    assert "old" not in text and "2 of 2 runs finished" in text and text.count("| 0.0002 | `") == 4
    assert figure.stat().st_size > 10_000


def test_report_marks_runs_without_metrics_pending(tmp_path):
    results, doc, figure = tmp_path / "results.jsonl", tmp_path / "doc.md", tmp_path / "fig.png"
    _stability("--report", "--masks", "none", "stapo", "--seeds", "0", "1", "--out", str(tmp_path / "empty"),
               "--results", str(results), "--doc", str(doc), "--figure", str(figure))
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["mask"], r["seed"], r["status"]) for r in rows] == [
        ("none", 0, "pending"), ("stapo", 0, "pending"), ("none", 1, "pending"), ("stapo", 1, "pending")]
    assert "0 of 4 runs finished" in doc.read_text() and doc.read_text().count("pending (0 steps)") == 4
