"""PNG plots of training curves from ``metrics.jsonl`` (docs/algorithm.md; paper Fig. 3 / Fig. 5).

matplotlib's object API (a ``Figure`` rendered by Agg), not pyplot: no display, no global backend switch, safe in
headless jobs and threads.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from stapo.run_dir import read_metrics

if TYPE_CHECKING:  # the figure takes a timeline; drawing one needs no torch
    from stapo.health.timeline import Timeline

# One panel per entry; a tuple puts several series in one panel.
DEFAULT_KEYS: tuple[str | tuple[str, ...], ...] = (
    "reward_mean", ("eval_accuracy", "eval_no_tools_accuracy"), "response_length_mean", "entropy_mean",
    ("silenced_frac", "spurious_frac"), ("tool_calls_mean", "eval_tool_calls_mean"),  # tool keys: TIR runs only
)
_PERCENT_KEYS = ("silenced_frac", "spurious_frac", "keep_frac", "accuracy", "eval_accuracy", "eval_no_tools_accuracy",
                 "response_clip_ratio", "clip_frac_low", "clip_frac_high", "zero_std_group_frac")


def new_figure(n_panels: int, *, panel_size: tuple[float, float] = (4.5, 3.2),
               max_cols: int = 4) -> tuple[Figure, list]:
    """A Figure with ``n_panels`` axes on a grid (shared by the inspector's figures)."""
    cols = max(1, min(n_panels, max_cols))
    rows = math.ceil(n_panels / cols)
    fig = Figure(figsize=(panel_size[0] * cols, panel_size[1] * rows), layout="constrained")
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n_panels)]
    return fig, axes


def save_figure(fig: Figure, out_png: str | Path, dpi: int = 120) -> Path:
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        # token texts of a byte-level vocabulary include scripts and control bytes the default font
        # lacks; matplotlib draws a box for them, which is the right display, so its warning is noise
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from font", category=UserWarning)
        fig.savefig(out_png, dpi=dpi, format="png")
    return out_png


def series(rows: Sequence[Mapping], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over ``rows``, skipping rows without it or with non-finite values."""
    steps, values = [], []
    for row in rows:
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(int(row["step"]))
            values.append(float(v))
    return steps, values


def _draw(ax, steps: list[int], values: list[float], label: str, n_rows: int) -> None:
    sparse = len(steps) < max(2, n_rows // 2)  # eval-style metric: show the points
    ax.plot(steps, values, label=label, marker="o" if sparse else None,
            markersize=4, linewidth=1.2)


def finish_axes(ax, title: str, keys: tuple[str, ...]) -> None:
    """Title, step axis and grid; a percent axis when every key is a fraction (shared with the inspector)."""
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if all(k in _PERCENT_KEYS for k in keys):
        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))


def plot_training_curves(metrics_jsonl: str | Path, out_png: str | Path,
                         keys: Sequence[str | tuple[str, ...]] = DEFAULT_KEYS) -> Path:
    """One PNG, one subplot per key group with data; keys absent from the run are skipped.

    Raises ``ValueError`` only when none of ``keys`` has a finite value in the file.
    """
    rows = read_metrics(metrics_jsonl)
    panels = []
    for group in ((k,) if isinstance(k, str) else tuple(k) for k in keys):
        data = [(k, *series(rows, k)) for k in group]
        data = [d for d in data if d[1]]
        if data:
            panels.append((group, data))
    if not panels:
        present = sorted({k for r in rows for k in r})
        raise ValueError(f"{metrics_jsonl}: none of {list(keys)} has data; keys present: {present}")
    fig, axes = new_figure(len(panels))
    for ax, (group, data) in zip(axes, panels):
        for key, steps, values in data:
            _draw(ax, steps, values, key, len(rows))
        if len(data) > 1:
            ax.legend(fontsize=8)
        finish_axes(ax, " / ".join(k for k, *_ in data), group)
    return save_figure(fig, out_png)


def plot_comparison(runs: Mapping[str, str | Path], out_png: str | Path,
                    keys: Sequence[str] = ("reward_mean", "entropy_mean", "eval_accuracy",
                                           "silenced_frac"), *, smooth: int = 1) -> Path:
    """Side-by-side ablation curves, one subplot per key (skipped where no run has it), one line per run (paper
    Fig. 3/5); ``runs``: label -> ``metrics.jsonl`` or run dir; ``smooth`` > 1: a trailing moving average."""
    if not runs:
        raise ValueError("plot_comparison needs at least one run")
    if smooth < 1:
        raise ValueError(f"smooth must be >= 1, got {smooth}")
    loaded = {label: read_metrics(path) for label, path in runs.items()}
    present = [k for k in keys if any(series(rows, k)[0] for rows in loaded.values())]
    if not present:
        raise ValueError(f"none of {list(keys)} has data in runs {list(runs)}")
    fig, axes = new_figure(len(present))
    for ax, key in zip(axes, present):
        for label, rows in loaded.items():
            steps, values = series(rows, key)
            if steps:
                _draw(ax, steps, moving_average(values, smooth), label, len(rows))
        ax.legend(fontsize=8)
        finish_axes(ax, key, (key,))
    return save_figure(fig, out_png)


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` points (the first points average what exists)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_health(timeline: Timeline, out_png: str | Path) -> Path:
    """``stapo health``'s figure (docs/health.md): held-out and training accuracy, entropy, and one panel per
    monitor with values (its statistic and threshold); alarms as red lines, each rollback's failed stretch
    shaded from the restored checkpoint to the rollback."""
    steps = [int(r["step"]) for r in timeline.steps]
    monitors = [m for m in timeline.monitors if timeline.series(m)]
    fig, axes = new_figure(2 + len(monitors), panel_size=(4.2, 2.8))
    acc = axes[0]
    if timeline.evals:
        acc.plot(*zip(*timeline.evals), marker="o", markersize=3, label="held-out")
    acc.plot(steps, [r.get("accuracy", math.nan) for r in timeline.steps], linewidth=0.8, alpha=0.7,
             label="training (sampled)")
    acc.legend(fontsize=7)
    finish_axes(acc, "accuracy", ("accuracy",))
    axes[1].plot(steps, [r["entropy_mean"] for r in timeline.steps], linewidth=1.0)
    finish_axes(axes[1], "entropy_mean", ("entropy_mean",))
    for ax, name in zip(axes[2:], monitors):
        spec = timeline.monitors[name]
        ax.plot(*zip(*timeline.series(name)), linewidth=1.0)
        ax.axhline(spec["threshold"], color="tab:red", linewidth=0.8, linestyle="--")
        finish_axes(ax, f"{name} ({'>' if spec['fires'] == 'above' else '<'} {spec['threshold']:g})", (name,))
    for ax in axes:
        for alarm in timeline.alarms():
            ax.axvline(alarm["step"], color="tab:red", linewidth=0.8, linestyle=":")
        for rollback in timeline.rollbacks():
            ax.axvspan(rollback["restored_step"], rollback["step"], color="tab:purple", alpha=0.15)
    return save_figure(fig, out_png)
