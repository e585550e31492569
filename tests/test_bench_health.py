"""The training-health study runner in its smoke mode: a warn run that raises an alarm, its rollback twin
that rolls back and finishes, and the report from the rows alone (docs/health.md)."""

import json
import re
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
    # the twin rule, from the rows: one run through the alarm's step, then the restored run differs
    assert len(warn["trace"]) == 5 and rollback["same_as_twin_through"] == 4
    text = doc.read_text()
    assert text.startswith("prose\n<!-- BEGIN health -->") and text.endswith("<!-- END health -->\nmore prose\n")
    assert "| `response_length` |" in text and "4 → 2, 0.0001" in text and figure.stat().st_size > 5_000
    assert "| steps 1–4 (alarm 4) |" in text


def _bench(module: str):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return __import__(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_a_study_stays_on_the_commit_it_started_on(tmp_path):
    checkout_commit, pin_commit = _bench("health").checkout_commit, _bench("health").pin_commit
    commit = checkout_commit()
    assert commit == "unknown" or len(commit.split("+")[0]) == 40
    pin_commit(tmp_path, "a" * 40)
    assert (tmp_path / "COMMIT").read_text() == "a" * 40 + "\n"
    pin_commit(tmp_path, "a" * 40)  # the same commit: runs go on
    with pytest.raises(SystemExit, match=f"made at {'a' * 40}, this checkout is {'b' * 40}"):
        pin_commit(tmp_path, "b" * 40)
    with pytest.raises(SystemExit, match="this checkout is unknown"):
        pin_commit(tmp_path, "unknown")


def _row(run, commit, **fields):
    return {"run": run.name, "arm": run.arm, "mask": run.mask, "seed": run.seed, "lr": run.lr, "status": "done",
            "commit": commit, "eval_curve": [[0, 0.5], [10, 0.6]], "peak_acc": 0.6, "peak_step": 10,
            "final_acc": 0.6, "drop_step": None, "steps_done": 10, "alarms": [], "rollbacks": [], "wall_s": 60.0,
            "cpu_s": 60.0, **fields}


def test_the_record_outlives_the_run_directories(tmp_path, capsys):
    """A machine's /tmp goes, docs/health/results.jsonl stays: a recorded run is not made again, the report
    keeps its row, and records of another commit are refused, not mixed in."""
    health = _bench("health")
    commit = health.checkout_commit()
    grid = health.study_grid((0,), ("none",), (health.UNSTABLE_LR,))
    warn, rollback = grid
    results = tmp_path / "results.jsonl"
    alarm = {"step": 2, "monitor": "reward_drop", "onset": 2}
    rows = [_row(warn, commit, alarms=[{**alarm, "action": "warn"}],
                 trace=[[0.5, 1.0, 2.0], [0.25, 1.0, 2.0], [0.125, 1.0, 2.0]]),
            _row(rollback, commit, alarms=[{**alarm, "action": "rollback"}],
                 rollbacks=[{"step": 2, "restored_step": 1, "onset": 2, "lr": 1e-4}],
                 trace=[[0.5, 1.0, 2.0], [0.25, 1.0, 2.0], [0.125, 1.0, 2.5]])]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))

    out = tmp_path / "study"  # a new machine: no run directory, no pin
    health.run_study(grid, out, ROOT / "no-recipe.yaml", [], 2, None, results)  # would fail if it trained
    log = capsys.readouterr().err
    assert log.count("recorded in results.jsonl, not rerun") == 2

    doc, figure = tmp_path / "doc.md", tmp_path / "fig.png"
    doc.write_text("<!-- BEGIN health -->\n<!-- END health -->\n")
    health.write_report(grid, out, results, doc, figure, None)
    kept = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["status"] for r in kept] == ["done", "done"] and kept[1]["same_as_twin_through"] == 2
    assert "2 of 2 runs finished" in doc.read_text() and "| steps 1–2 (alarm 2) |" in doc.read_text()

    (out / "COMMIT").write_text("b" * 40 + "\n")  # a study dir of another commit
    with pytest.raises(SystemExit, match=f"made at {re.escape(commit)}; these runs are at {'b' * 40}.*--results NEW"):
        health.write_report(grid, out, results, doc, figure, None)


def test_the_twin_check_compares_the_first_logged_steps():
    report = _bench("_health_report")
    steps = [{"step": 1, "loss": 0.5, "grad_norm": 1.0, "entropy_mean": 2.0},
             {"step": 2, "loss": 0.25, "grad_norm": 1.5, "entropy_mean": 2.0},
             {"step": 2, "loss": 9.0, "grad_norm": 9.0, "entropy_mean": 9.0},  # step 2 redone: counts once
             {"step": 4, "loss": 1.0, "grad_norm": 1.0, "entropy_mean": 1.0}]  # after a gap: not in the trace
    assert report.step_trace(steps) == [[0.5, 1.0, 2.0], [0.25, 1.5, 2.0]]
    a, b = [[0.5, 1.0, 2.0], [0.25, 1.5, 2.0]], [[0.5, 1.0, 2.0], [0.25, 1.5, 2.1]]
    assert report.same_as_twin_through({"trace": a}, {"trace": b}) == 1  # the entropy alone differs at step 2
    assert report.same_as_twin_through({"trace": a[:1]}, {"trace": b}) == 1
    assert report.same_as_twin_through({}, {"trace": b}) is None
    alarm = [{"step": 3, "monitor": "reward_drop", "onset": 3, "action": "rollback"}]
    assert report._twin_cell({"status": "done", "alarms": alarm, "same_as_twin_through": 2,
                              "steps_done": 9}) == "**differs from step 3** (alarm 3)"
    assert report._twin_cell({"status": "done", "alarms": alarm, "same_as_twin_through": 3,
                              "steps_done": 9}) == "steps 1–3 (alarm 3)"
