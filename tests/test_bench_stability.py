"""The stability study runner in its shortened mode: 2 runs x 2 steps, resumable, rows and report."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "stability.py"
sys.path.insert(0, str(ROOT / "bench"))

from _stability_report import balanced_seeds, render, summary_table  # noqa: E402


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

    # --inspect: a rerun recording every mini-batch (2 steps x 2) reproduces the (resumed) run exactly
    log = _stability("--smoke", "--inspect", "stapo_seed0_lr0.0002", "--out", str(out))
    rerun = out / "inspect_reruns" / "stapo_seed0_lr0.0002"
    assert "the rerun reproduced all" in log and (rerun / "inspect" / "index.md").is_file()
    assert sorted(p.name for p in (rerun / "token_records").iterdir()) == [
        "step_000001.pt", "step_000001_mb1.pt", "step_000002.pt", "step_000002_mb1.pt"]
    lines = metrics.read_text().splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if '"loss"' in line)  # step 1's row (event rows come between)
    lines[first] = lines[first].replace('"grad_norm": ', '"grad_norm": 1', 1)
    metrics.write_text("".join(lines))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--inspect", "stapo_seed0_lr0.0002", "--out",
                           str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "does not reproduce" in proc.stderr and "steps [1]" in proc.stderr


def test_report_marks_runs_without_metrics_pending(tmp_path):
    results, doc, figure = tmp_path / "results.jsonl", tmp_path / "doc.md", tmp_path / "fig.png"
    _stability("--report", "--masks", "none", "stapo", "--seeds", "0", "1", "--out", str(tmp_path / "empty"),
               "--results", str(results), "--doc", str(doc), "--figure", str(figure))
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["mask"], r["seed"], r["status"]) for r in rows] == [
        ("none", 0, "pending"), ("stapo", 0, "pending"), ("none", 1, "pending"), ("stapo", 1, "pending")]
    assert "0 of 4 runs finished" in doc.read_text() and doc.read_text().count("pending (0 steps)") == 4


def _row(mask, seed, status="done", curve=(), grad=1.0):
    row = {"run": f"{mask}_seed{seed}_lr0.0002", "mask": mask, "seed": seed, "lr": 2e-4, "status": status,
           "steps_done": 20 if status != "pending" else 7}
    if status == "pending":
        return row
    peak = max(a for _, a in curve)
    return {**row, "eval_curve": [list(c) for c in curve], "peak_acc": peak, "peak_step": 0, "final_acc": curve[-1][1],
            "drop": peak - curve[-1][1], "collapsed": peak - curve[-1][1] >= 0.1, "grad_norm_max": grad,
            "grad_norm_p95": grad / 2, "entropy_curve": [[1, 0.5], [20, 0.25]], "silenced_frac": 0.0,
            "spurious_frac": 2e-5, "top_grad": {"records": 2, "signed_tokens": 400, "s2t_tokens": 2,
                                                            "top_tokens": 4, "top_s2t": 1}, "wall_s": 60.0}


def test_summary_pairs_seeds_every_mask_has_finished():
    rows = [_row("none", 0, curve=[(0, 0.5), (10, 0.8), (20, 0.6)], grad=3.0),
            _row("stapo", 0, curve=[(0, 0.5), (10, 0.9), (20, 0.85)], grad=2.0),
            _row("none", 1, curve=[(0, 0.5), (10, 0.7), (20, 0.7)], grad=1.0),
            _row("stapo", 1, status="pending")]
    assert balanced_seeds(rows) == {2e-4: [0]}
    table = summary_table(rows).splitlines()
    # seed 1 is left out until stapo has it: none 50 -> 80 -> 60 (a 20-point drop: collapsed; +10 over its
    # start), stapo 50 -> 90 -> 85
    assert table[2] == ("| 0.0002 | `none` | 0 (of 2) | 50.0 | 80.0 | 60.0 | 10.0 | 20.0 | 1 / 1 | 3.00 | 0.0000 "
                        "| 0.0020 | 1 / 4 (all: 0.500%) |")
    assert table[3].startswith("| 0.0002 | `stapo` | 0 (of 2) | 50.0 | 90.0 | 85.0 | 35.0 | 5.0 | 0 / 1 | 2.00 |")
    rows[3] = _row("stapo", 1, curve=[(0, 0.5), (10, 0.7), (20, 0.7)])
    table = summary_table(rows).splitlines()
    # none: peak (80 + 70) / 2 = 75, s.e. = stdev(80, 70) / sqrt(2) = 7.07 / 1.414 = 5.0; final 65 ± 5
    # (+15 ± 5 over the start of 50); drop 10 ± 10
    assert table[2].startswith("| 0.0002 | `none` | 0, 1 (of 2) | 50.0 ± 0.0 | 75.0 ± 5.0 | 65.0 ± 5.0 | 15.0 ± 5.0 "
                               "| 10.0 ± 10.0 | 1 / 2 |")
    block = render(rows, "r.jsonl", "f.png", 10.0)
    assert "4 of 4 runs finished" in block and block.count("\n| 0.0002 | `") == 6  # 2 summary + 4 run rows
