"""Console view of a training run: a rich progress bar on a TTY, plain lines anywhere else.

Split from the metric sinks (:mod:`stapo.telemetry.metrics`) so what is written to disk and what is
shown on screen change independently. Plain mode prints at most one line every
``plain_interval_s`` seconds (plus the first and last step) and no control characters, so
redirected logs and CI output stay readable.
"""

from __future__ import annotations

import math
import time
from typing import Any, TextIO

# (key, label, format) shown on the progress bar / plain log lines, in this order.
SHOWN = (("reward_mean", "reward", "num"), ("accuracy", "acc", "num"),
         ("entropy_mean", "entropy", "num"), ("silenced_frac", "silenced", "pct"),
         ("time_step", "step_time", "sec"))


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

    def show_step(self, step: int, row: dict[str, Any]) -> None:
        """One step's metrics (non-finite values already restored to floats)."""
        if not self._progress:
            return
        if self._tty:
            bar, task = self._progress_bar()
            bar.update(task, completed=step, stats=step_summary(row))
            return
        now = time.monotonic()
        last = self.total_steps is not None and step >= self.total_steps
        if now - self._last_plain >= self._plain_interval_s or last:
            self._last_plain = now
            total = f"/{self.total_steps}" if self.total_steps else ""
            self.print(f"step {step}{total} | {step_summary(row)}")

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
