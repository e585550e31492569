"""From monitor statistics to alarms (docs/health.md, "Alarms and actions", "Healthy checkpoints").

The watch is plain JSON data, saved in every checkpoint, so a resumed run continues it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stapo.health.monitors import Monitor, Window

__all__ = ["Alarm", "HealthWatch", "metric_key"]


def metric_key(monitor: str) -> str:
    """The metrics.jsonl key of a monitor's statistic."""
    return f"health_{monitor}"


@dataclass(frozen=True)
class Alarm:
    """Monitor ``monitor`` was past its threshold from step ``onset`` through ``step``."""

    monitor: str
    step: int
    onset: int
    value: float
    threshold: float
    fires: str

    def describe(self) -> str:
        sign = ">" if self.fires == "above" else "<"
        return (f"health monitor {self.monitor} at step {self.step}: {self.value:.4g} {sign} {self.threshold:g} "
                f"for {self.step - self.onset + 1} steps (onset: step {self.onset})")


class HealthWatch:
    """The run's monitors over the last ``window`` steps, judging after ``warmup`` steps; ``patience``
    steps past a threshold make an alarm; the newest ``keep_healthy`` healthy checkpoints are kept."""

    def __init__(self, monitors: Sequence[Monitor], *, window: int = 50, warmup: int = 10, patience: int = 3,
                 keep_healthy: int = 1) -> None:
        self.monitors = list(monitors)
        self.reads = sorted({key for m in self.monitors for key in m.reads})
        self.window, self.warmup, self.patience, self.keep_healthy = window, warmup, patience, keep_healthy
        self.rows: list[dict[str, float]] = []
        self.streak: dict[str, int] = {}
        self.onset: dict[str, int] = {}
        self.alarmed: set[str] = set()
        self.healthy: list[int] = []
        self.candidate: int | None = None  # a checkpoint saved while quiet, healthy if the next step is quiet too
        self.rollbacks = 0

    def observe(self, step: int, metrics: Mapping[str, object]) -> tuple[dict[str, float], list[Alarm]]:
        """Step ``step``'s metrics in; ``({metric_key(monitor): statistic}, new alarms)`` out."""
        self.rows.append({k: float(v) for k in self.reads if _finite(v := metrics.get(k))})
        del self.rows[:-(self.window + 1)]  # the window, and the current step
        values, alarms = self._run(step)
        if self.candidate is not None:  # the step its weights produced is judged: healthy if nothing started
            if self.quiet:
                self._add_healthy(self.candidate)
            self.candidate = None
        return values, alarms

    def _run(self, step: int) -> tuple[dict[str, float], list[Alarm]]:
        values, alarms = {}, []
        if len(self.rows) <= self.warmup:
            return values, alarms
        window = Window(self.rows)
        for m in self.monitors:
            value = m.statistic(window)
            if value is None:  # cannot judge this step (a key the run does not log): the streak waits
                continue
            values[metric_key(m.name)] = value
            if not m.past_threshold(value):  # within bounds: the streak (and any alarm) ends
                self.streak.pop(m.name, None)
                self.onset.pop(m.name, None)
                self.alarmed.discard(m.name)
                continue
            self.streak[m.name] = self.streak.get(m.name, 0) + 1
            self.onset.setdefault(m.name, step)
            if self.streak[m.name] >= self.patience and m.name not in self.alarmed:
                self.alarmed.add(m.name)
                alarms.append(Alarm(m.name, step, self.onset[m.name], value, m.threshold, m.fires))
        return values, alarms

    @property
    def quiet(self) -> bool:
        """No monitor has a streak under way (nor an alarm that has not ended)."""
        return not self.streak and not self.alarmed

    def checkpoint_saved(self, step: int) -> None:
        """Note a checkpoint of step ``step``: a candidate when saved while the watch is quiet."""
        self.candidate = step if self.quiet else None

    def restored(self, step: int) -> None:
        """A rollback restored healthy checkpoint ``step`` (with this watch's state of then)."""
        self.candidate = None
        self._add_healthy(step)

    def _add_healthy(self, step: int) -> None:
        self.healthy = [*(s for s in self.healthy if s != step), step][-self.keep_healthy:]

    def protected(self) -> tuple[int, ...]:
        """Checkpoints pruning must spare: the healthy ones and the candidate."""
        return (*self.healthy, *(() if self.candidate is None else (self.candidate,)))

    def rollback_target(self, alarms: Sequence[Alarm]) -> int | None:
        """The newest healthy checkpoint whose step precedes the earliest onset of ``alarms``, or None."""
        onset = min(a.onset for a in alarms)
        before = [s for s in self.healthy if s + 1 < onset]
        return max(before) if before else None

    def thresholds(self) -> dict[str, dict]:
        """``{monitor: {"threshold": t, "fires": "above" | "below"}}`` (the run's header event)."""
        return {m.name: {"threshold": m.threshold, "fires": m.fires} for m in self.monitors}

    def state_dict(self) -> dict:
        return {"rows": [dict(r) for r in self.rows], "streak": dict(self.streak), "onset": dict(self.onset),
                "alarmed": sorted(self.alarmed), "healthy": list(self.healthy), "candidate": self.candidate,
                "rollbacks": self.rollbacks}

    def load_state_dict(self, state: Mapping | None) -> None:
        """Restore :meth:`state_dict`; a checkpoint from before health monitoring (None, {}) starts empty."""
        state = state or {}
        self.rows = [dict(r) for r in state.get("rows", [])][-(self.window + 1):]
        self.streak, self.onset = dict(state.get("streak", {})), dict(state.get("onset", {}))
        self.alarmed = set(state.get("alarmed", []))
        self.healthy = list(state.get("healthy", []))[-self.keep_healthy:]
        self.candidate = state.get("candidate")
        self.rollbacks = int(state.get("rollbacks", 0))


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
