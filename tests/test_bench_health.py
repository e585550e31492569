"""The training-health study runner in its smoke mode: a warn run that raises an alarm, its rollback twin
that rolls back and finishes, and the report from the rows alone (docs/health.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "health.py"


def _health(*args):
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


@pytest.mark.slow
def test_health_smoke_runs_both_arms_and_reports(tmp_path):
    out = tmp_path / "study"
    log = _health("--smoke", "--out", str(out))
    assert "grid: 2 runs (1 warn, the rest rollback), 2 at a time" in log
    assert "none_seed0_lr0.0002_rollback: done" in log  # its twin raised an alarm: it ran
    log = _health("--smoke", "--out", str(out))  # nothing is rerun
    assert log.count("finished earlier, not rerun") == 2

    results, doc, figure = tmp_path / "results.jsonl", tmp_path / "doc.md", tmp_path / "fig.png"
    doc.write_text("prose\n<!-- BEGIN health -->\nold\n<!-- END health -->\nmore prose\n")
    _health("--smoke", "--report", "--out", str(out), "--results", str(results), "--doc", str(doc),
            "--figure", str(figure))
    warn, rollback = [json.loads(line) for line in results.read_text().splitlines()]
    assert (warn["status"], rollback["status"]) == ("done", "done")
    # the smoke's monitor judges from step 4 on (3 earlier values) and fires at once: warn logs it, the other
    # arm restores step_2 (healthy: step 3 was quiet) and goes on to step 5 at half the lr
    assert [(a["monitor"], a["step"], a["action"]) for a in warn["alarms"]] == [("response_length", 4, "warn")]
    assert rollback["rollbacks"] == [{"step": 4, "restored_step": 2, "onset": 4, "lr": pytest.approx(1e-4)}]
    assert warn["replay"]["response_length|default|1"] == [4, 4] and "rollback" not in rollback.get("replay", {})
    assert [s for s, _ in warn["eval_curve"]] == [s for s, _ in rollback["eval_curve"]] == [0, 1, 2, 3, 4, 5]
    text = doc.read_text()
    assert text.startswith("prose\n<!-- BEGIN health -->") and text.endswith("<!-- END health -->\nmore prose\n")
    assert "| `response_length` |" in text and "4 → 2, 0.0001" in text and figure.stat().st_size > 5_000


def test_a_study_stays_on_the_commit_it_started_on(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from health import checkout_commit, pin_commit
    finally:
        sys.path.remove(str(ROOT / "bench"))
    commit = checkout_commit()
    assert commit == "unknown" or len(commit.split("+")[0]) == 40
    pin_commit(tmp_path, "a" * 40)
    assert (tmp_path / "COMMIT").read_text() == "a" * 40 + "\n"
    pin_commit(tmp_path, "a" * 40)  # the same commit: runs go on
    with pytest.raises(SystemExit, match=f"made at {'a' * 40}, this checkout is {'b' * 40}"):
        pin_commit(tmp_path, "b" * 40)
    with pytest.raises(SystemExit, match="this checkout is unknown"):
        pin_commit(tmp_path, "unknown")
