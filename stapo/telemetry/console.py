"""Console view of a training run: a rich progress bar on a TTY, plain lines (at most one every
``plain_interval_s``, no control characters) anywhere else, with an ETA from this session's steps.
"""

from __future__ import annotations

import math
import time
from typing import Any, TextIO

# (key, label, format) shown on the progress bar / plain log lines, in this order.
SHOWN = (("reward_mean", "reward", "num"), ("accuracy", "acc", "num"),
         ("entropy_mean", "entropy", "num"), ("silenced_frac", "silenced", "pct"),
         ("time_step", "step_time", "sec"),
         ("eval_accuracy", "held-out acc", "num"), ("eval_response_length_mean", "held-out length", "num"))


def format_value(kind: str, value: Any) -> str:
    """``num`` (4 significant digits), ``pct`` (percent, 3 decimals) or ``sec`` (2 decimals)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return str(value)
    if kind == "pct":
        return f"{100 * value:.3f}%"
    if kind == "sec":
        return f"{value:.2f}s"
    return f"{value:.4g}"


def step_summary(row: dict[str, Any]) -> str:
    """``reward 0.5 | acc 0.75 | ...`` for the keys of :data:`SHOWN` present in ``row``."""
    return " | ".join(f"{label} {format_value(kind, row[key])}" for key, label, kind in SHOWN if key in row)


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    whole = max(0, int(round(seconds)))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


class StepClock:
    """ETA from the wall time of the steps seen so far (the first one counted from its ``time_step``)."""

    def __init__(self) -> None:
        self._origin: tuple[int, float] | None = None  # (step before the first timed one, its start)

    def eta(self, step: int, total: int | None, row: dict[str, Any], now: float) -> float | None:
        if self._origin is None and "time_step" in row:
            self._origin = (step - 1, now - float(row["time_step"]))
        if self._origin is None or total is None or step >= total or step <= self._origin[0]:
            return None
        first, start = self._origin
        return (now - start) / (step - first) * (total - step)


class ConsoleView:
    """Step lines / progress bar and sample completions on ``stream`` (rank 0 only)."""

    def __init__(self, stream: TextIO, *, progress: bool = True, total_steps: int | None = None,
                 plain_interval_s: float = 10.0) -> None:
        self._stream = stream
        self._progress = progress
        self.total_steps = total_steps
        self._plain_interval_s = plain_interval_s
        self._tty = bool(getattr(stream, "isatty", lambda: False)())
        self._bar = None  # (rich Progress, task id) once started
        self._console = None
        self._last_plain = -math.inf
        self._clock = StepClock()

    def show_step(self, step: int, row: dict[str, Any]) -> None:
        """One step's metrics (non-finite values already restored to floats); an evaluation always
        gets its line."""
        if not self._progress:
            return
        now = time.monotonic()
        eta = self._clock.eta(step, self.total_steps, row, now)
        evaluated = "eval_accuracy" in row
        if self._tty:
            bar, task = self._progress_bar()
            bar.update(task, completed=step, stats=step_summary(row))
            if evaluated:
                self.print(self._line(step, row, None))
            return
        last = self.total_steps is not None and step >= self.total_steps
        if now - self._last_plain >= self._plain_interval_s or last or evaluated:
            if "time_step" in row:  # an evaluation alone (before training) does not hold back step 1
                self._last_plain = now
            self.print(self._line(step, row, eta))

    def _line(self, step: int, row: dict[str, Any], eta: float | None) -> str:
        total = f"/{self.total_steps}" if self.total_steps else ""
        return " | ".join([f"step {step}{total}", step_summary(row)] +
                          ([f"eta {format_duration(eta)}"] if eta is not None else []))

    def show_sample(self, step: int, sample: dict[str, Any]) -> None:
        self.print(self._render_sample(step, sample))

    def close(self) -> None:
        if self._bar is not None:
            self._bar[0].stop()

    def print(self, text: str) -> None:
        if self._tty:
            self._rich_console().print(text, highlight=False)  # above a live bar
        else:
            print(text, file=self._stream, flush=True)

    def _progress_bar(self):
        if self._bar is None:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeRemainingColumn)

            bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                           TimeRemainingColumn(), TextColumn("{task.fields[stats]}"),
                           console=self._rich_console())
            task = bar.add_task("train", total=self.total_steps, stats="")
            bar.start()
            self._bar = (bar, task)
        return self._bar

    def _rich_console(self):
        if self._console is None:
            from rich.console import Console

            self._console = Console(file=self._stream, force_terminal=True)
        return self._console

    def _render_sample(self, step: int, sample: dict[str, Any]) -> str:
        """Rich markup on a TTY (silenced tokens highlighted), ``[[token]]`` brackets otherwise."""
        if self._tty:
            from rich.markup import escape
        else:
            escape = str
        if "tokens" in sample:
            silenced = sample.get("silenced", [False] * len(sample["tokens"]))
            mark = "[bold black on yellow]{}[/]" if self._tty else "[[{}]]"
            response = "".join(mark.format(escape(t)) if s else escape(t)
                               for t, s in zip(sample["tokens"], silenced))
        else:
            response = escape(str(sample["response"]))
        head = (f"sample @ step {step} | reward {sample['reward']} | "
                f"ground truth {sample['ground_truth']}")
        return f"{escape(head)}\nprompt: {escape(str(sample['prompt']))}\nresponse: {response}"
