"""`stapo health RUN_DIR` on a run written the way the trainer writes it (MetricsLogger rows, the watch's
statistics, the recovery's events), still going (a half-written last line) and finished."""

from __future__ import annotations

import io

import pytest

from stapo.cli import main
from stapo.health import HealthWatch, build_monitor
from stapo.health.timeline import read_timeline, render_timeline
from stapo.telemetry.metrics import MetricsLogger


@pytest.fixture
def run_dir(tmp_path):
    """12 steps: grad_norm spikes from step 8 (onset), an alarm at 10, a rollback to step 4; evals every 4."""
    watch = HealthWatch([build_monitor("grad_norm"), build_monitor("tool_calls")], window=10, warmup=3, patience=3)
    with MetricsLogger(tmp_path, is_main=True, tensorboard=False, stream=io.StringIO()) as log:
        log.log(0, {"eval_accuracy": 0.5})
        log.log_event(1, "health", {"on_alarm": "rollback", "patience": 3, "monitors": watch.thresholds()})
        for step in range(1, 13):
            row = {"accuracy": 0.4, "entropy_mean": 0.1, "loss": 0.0, "grad_norm": 9.0 if 8 <= step <= 10 else 1.0}
            values, alarms = watch.observe(step, row)
            log.log(step, {**row, **values, **({"eval_accuracy": 0.6 - 0.01 * step} if step % 4 == 0 else {})})
            for alarm in alarms:
                log.log_event(step, "alarm", {"monitor": alarm.monitor, "value": alarm.value, "onset": alarm.onset,
                                              "threshold": alarm.threshold, "fires": alarm.fires, "action": "rollback"})
                log.log_event(step, "rollback", {"restored_step": 4, "onset": alarm.onset, "lr": 5e-5,
                                                 "monitors": [alarm.monitor], "rollbacks": 1, "skipped_batches": 6})
    return tmp_path


def test_the_timeline_marks_the_monitor_the_alarm_and_the_rollback(run_dir):
    tl = read_timeline(run_dir)
    assert [e["event"] for e in tl.events] == ["alarm", "rollback"] and tl.evals[0] == (0, 0.5)
    assert set(tl.monitors) == {"grad_norm", "tool_calls"} and tl.series("tool_calls") == []
    text = render_timeline(tl, every=4)
    lines = {line.split()[0]: line for line in text.splitlines() if line.strip()[:1].isdigit()}
    assert sorted(map(int, lines)) == [0, 4, 8, 10, 12]  # every 4 steps, the evaluations and the event at 10
    assert "grad_norm 80" in lines["8"]  # (9 - 1) / (0.1 x the median 1): MAD 0, the floor and "ALARM grad_norm (onset 8) -> rollback" in lines["10"]
    assert "ROLLBACK to step 4, lr 5e-05" in lines["10"] and "56.0%" in lines["4"] and "40.0%" in lines["4"]
    assert "grad_norm            > 6        max 80 at step 8; 3 step(s) past; alarms at [10]" in text
    assert "tool_calls           > 6        no value" in text


def test_stapo_health_writes_the_figure_and_reads_a_run_still_going(run_dir, capsys):
    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 13, "accuracy": 0.')  # the trainer is writing step 13
    assert main(["health", str(run_dir), "--every", "6"]) == 0
    out = capsys.readouterr().out
    assert "ROLLBACK to step 4" in out and f"figure: {run_dir / 'health.png'}" in out
    assert (run_dir / "health.png").stat().st_size > 10_000


def test_bad_run_directories_are_one_line(tmp_path, capsys):
    assert main(["health", str(tmp_path / "nope")]) == 2
    assert main(["health", str(tmp_path)]) == 2
    assert main(["health", str(tmp_path), "--every", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and "no such run directory" in err[0] and "has no metrics.jsonl" in err[1]
    assert "--every must be >= 1" in err[2]
