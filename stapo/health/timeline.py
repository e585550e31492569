"""A run's health timeline from its metrics.jsonl (``stapo health RUN_DIR``, docs/health.md); reads only the
run directory, so it works on a running run too (a line being written is skipped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from stapo.health.watch import metric_key
from stapo.run_dir import METRICS_FILE, read_metrics

__all__ = ["Timeline", "read_timeline", "render_timeline"]


@dataclass
class Timeline:
    """The step rows, the held-out evaluations, the event rows and the monitors (threshold, direction)."""

    steps: list[dict]
    evals: list[tuple[int, float]]
    events: list[dict]
    monitors: dict[str, dict] = field(default_factory=dict)

    def series(self, monitor: str) -> list[tuple[int, float]]:
        """``(step, statistic)`` of a monitor over the run (steps it could judge)."""
        key = metric_key(monitor)
        return [(int(r["step"]), r[key]) for r in self.steps if isinstance(r.get(key), (int, float))]

    def past(self, monitor: str, value: float) -> bool:
        spec = self.monitors[monitor]
        return value > spec["threshold"] if spec["fires"] == "above" else value < spec["threshold"]

    def rollbacks(self) -> list[dict]:
        return [e for e in self.events if e["event"] == "rollback"]

    def alarms(self) -> list[dict]:
        return [e for e in self.events if e["event"] == "alarm"]


def read_timeline(run_dir: str | Path) -> Timeline:
    """The run's timeline; ValueError when the directory has no metrics.jsonl yet."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"{run_dir} has no {METRICS_FILE} (not a run directory, or the run has not logged a step)")
    rows = read_metrics(path)
    events = [r for r in rows if "event" in r]
    headers = [e for e in events if e["event"] == "health"]
    monitors = dict(headers[-1]["monitors"]) if headers else {}
    evals = {int(r["step"]): r["eval_accuracy"] for r in rows if "eval_accuracy" in r}  # the final eval repeats
    steps = [r for r in rows if "entropy_mean" in r and "event" not in r]
    return Timeline(steps, sorted(evals.items()), [e for e in events if e["event"] != "health"], monitors)


def render_timeline(tl: Timeline, every: int = 10) -> str:
    """The timeline as text: a row every ``every`` steps and at every event, then one line per monitor."""
    by_step = {int(r["step"]): r for r in tl.steps}
    evals, marks = dict(tl.evals), {}
    for e in tl.events:
        marks.setdefault(int(e["step"]), []).append(_describe(e))
    shown = sorted({0, *(s for s in by_step if s % every == 0), *marks, *evals, *(list(by_step)[-1:])})
    lines = [f"{'step':>6}  {'held-out':>8}  {'train acc':>9}  {'entropy':>8}  past threshold / events",
             f"{'':->6}  {'':->8}  {'':->9}  {'':->8}  {'':->24}"]
    for step in shown:
        row = by_step.get(step, {})
        past = [f"{m} {row[metric_key(m)]:.3g}" for m in tl.monitors
                if isinstance(row.get(metric_key(m)), (int, float)) and tl.past(m, row[metric_key(m)])]
        notes = "; ".join(past + marks.get(step, []))
        lines.append(f"{step:>6}  {_pct(evals.get(step)):>8}  {_pct(row.get('accuracy')):>9}  "
                     f"{_num(row.get('entropy_mean')):>8}  {notes}")
    lines += ["", f"monitors (statistic vs threshold; steps past it; alarms){'' if tl.monitors else ': none logged'}"]
    for name, spec in tl.monitors.items():
        values = tl.series(name)
        alarms = [int(a["step"]) for a in tl.alarms() if a["monitor"] == name]
        sign = ">" if spec["fires"] == "above" else "<"
        if not values:
            lines.append(f"  {name:<20} {sign} {spec['threshold']:<8g} no value (the run does not log its metrics)")
            continue
        worst = (max if spec["fires"] == "above" else min)(values, key=lambda sv: sv[1])
        over = sum(tl.past(name, v) for _, v in values)
        lines.append(f"  {name:<20} {sign} {spec['threshold']:<8g} {'max' if sign == '>' else 'min'} "
                     f"{worst[1]:.3g} at step {worst[0]}; {over} step(s) past; alarms at {alarms or 'none'}")
    return "\n".join(lines)


def _describe(e: dict) -> str:
    if e["event"] == "alarm":
        return f"ALARM {e['monitor']} (onset {e['onset']}) -> {e['action']}"
    if e["event"] == "rollback":
        return f"ROLLBACK to step {e['restored_step']}, lr {e['lr']:.3g}"
    return e["event"].upper()


def _pct(value) -> str:
    return "" if not isinstance(value, (int, float)) or math.isnan(value) else f"{100 * value:.1f}%"


def _num(value) -> str:
    return "" if not isinstance(value, (int, float)) or math.isnan(value) else f"{value:.4f}"
