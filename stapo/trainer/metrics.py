"""Metric sinks for training runs: JSONL (always), TensorBoard and W&B (optional), console.

DESIGN.md §6: every step the trainer logs one flat ``dict[str, float]``. ``metrics.jsonl`` is the
source of truth (plots, the inspector and resumption read it); each line is flushed and fsync'd so a
killed run loses at most the line being written, and :meth:`MetricsLogger.truncate_after` drops the
steps a resumed checkpoint does not contain. Only the main process writes anything.

THE list of per-step keys (:data:`STEP_METRIC_KEYS`; a trainer test checks every one is logged):

- ``step``, ``epoch``
- ``reward_mean``, ``reward_std``, ``accuracy`` (fraction of responses with reward > 0)
- ``response_length_mean``, ``response_length_max``, ``response_clip_ratio`` (fraction truncated at
  the max response length)
- ``entropy_mean`` (mean over valid response tokens)
- ``silenced_frac`` (silenced / valid tokens under the active mask), ``spurious_frac`` (fraction of
  valid tokens meeting STAPO's criterion ``A > 0 ∧ p < τ_p ∧ H < τ_h`` at the active mask's ``tau_p`` /
  ``entropy_quantile`` (the paper's defaults for a mask without them),
  whatever mask is active), ``keep_frac``, ``mask_tau_h`` (the active mask's entropy threshold; NaN
  for a mask without one), ``probe_tau_h`` (the S2T probe's)
- ``clip_frac_low``, ``clip_frac_high``, ``approx_kl``, ``loss``, ``grad_norm``, ``lr``
- ``zero_std_group_frac`` (groups whose rewards are all equal, hence A = 0), ``skipped_updates`` (mini-batch
  updates skipped this step for a non-finite loss or gradient norm), ``skipped_steps`` (steps skipped
  so far, cumulative)
- ``time_rollout``, ``time_reward``, ``time_stats``, ``time_update``, ``time_sync``, ``time_step``
  (seconds), ``tokens_per_s``, ``sync_mb`` (MiB pushed into each rank's rollout engine by the weight sync)

Optional (:data:`OPTIONAL_METRIC_KEYS`): ``eval_accuracy``, ``eval_reward_mean`` (eval steps only);
``kl`` (k3 KL to the reference policy over kept tokens, only when ``loss.kl_coef > 0``).

Non-finite values (a skipped step's loss) are stored as the strings ``"NaN"``, ``"Infinity"``,
``"-Infinity"`` so every line stays valid JSON; :func:`read_metrics` turns them back into floats.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

STEP_METRIC_KEYS: tuple[str, ...] = (
    "step", "epoch",
    "reward_mean", "reward_std", "accuracy",
    "response_length_mean", "response_length_max", "response_clip_ratio",
    "entropy_mean", "silenced_frac", "spurious_frac", "keep_frac", "mask_tau_h", "probe_tau_h",
    "clip_frac_low", "clip_frac_high", "approx_kl", "loss", "grad_norm", "lr",
    "zero_std_group_frac", "skipped_updates", "skipped_steps",
    "time_rollout", "time_reward", "time_stats", "time_update", "time_sync", "time_step", "sync_mb",
    "tokens_per_s",
)
OPTIONAL_METRIC_KEYS: tuple[str, ...] = ("eval_accuracy", "eval_reward_mean", "kl")

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"

logger = logging.getLogger(__name__)

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# (key, label, format) shown on the progress bar / plain log lines, in this order.
_SHOWN = (("reward_mean", "reward", "num"), ("accuracy", "acc", "num"),
          ("entropy_mean", "entropy", "num"), ("silenced_frac", "silenced", "pct"),
          ("time_step", "step_time", "sec"))


def _json_value(key: str, value: Any) -> Any:
    """One metric value as a JSON-safe scalar; tensors/numpy scalars via ``.item()``."""
    if hasattr(value, "item"):
        try:
            value = value.item()
        except (RuntimeError, ValueError) as err:  # a tensor/array of several elements
            raise TypeError(f"metric {key!r} is not a scalar ({err})") from err
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    raise TypeError(f"metric {key!r} has unsupported type {type(value).__name__}; "
                    "log numbers (int/float), bool, str or None")


def _restore(record: dict[str, Any]) -> dict[str, Any]:
    return {k: (_NONFINITE[v] if isinstance(v, str) and v in _NONFINITE else v)
            for k, v in record.items()}


def _fmt(kind: str, value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return str(value)
    if kind == "pct":
        return f"{100 * value:.3f}%"
    if kind == "sec":
        return f"{value:.2f}s"
    return f"{value:.4g}"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` (or of a run dir's), non-finite strings restored to floats.

    A truncated last line (the run was killed mid-write) is skipped with a warning; a corrupt line
    anywhere else raises ``ValueError`` naming the file and line number.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    lines = path.read_text(encoding="utf-8").split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(_restore(json.loads(line)))
        except json.JSONDecodeError as err:
            if i == len(lines) - 1:  # no trailing newline: the line being written when killed
                logger.warning("%s: ignoring truncated last line %d", path, i + 1)
                continue
            raise ValueError(f"{path}: line {i + 1} is not valid JSON ({err})") from err
    return rows


def _truncate_jsonl(path: Path, step: int) -> int:
    """Rewrite ``path`` atomically without rows whose step > ``step``; returns the rows dropped."""
    rows = read_metrics(path)
    kept = [r for r in rows if r.get("step", -1) <= step]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in kept:
            f.write(json.dumps({k: v if isinstance(v, list) else _json_value(k, v)
                                for k, v in row.items()}, allow_nan=False,
                               ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(rows) - len(kept)


class MetricsLogger:
    """Per-step metric sinks for the main process (JSONL, TensorBoard, W&B, console).

    ``stream`` (default ``sys.stdout``) decides the console mode: a TTY gets a rich progress bar,
    anything else gets a plain line at most every ``plain_interval_s`` seconds (and on the first and
    last step) without control characters. Non-main processes construct the object and log into
    it like the main one, but nothing is written, opened or printed.
    """

    def __init__(self, output_dir: str | Path, *, is_main: bool, tensorboard: bool = True,
                 wandb: dict | None = None, total_steps: int | None = None,
                 progress: bool = True, stream: TextIO | None = None,
                 plain_interval_s: float = 10.0) -> None:
        self.output_dir = Path(output_dir)
        self.is_main = is_main
        self.total_steps = total_steps
        self._tb_enabled = tensorboard
        self._stream = stream if stream is not None else sys.stdout
        self._progress_enabled = progress
        self._plain_interval_s = plain_interval_s
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._file: TextIO | None = None
        self._tb = None
        self._purge_step: int | None = None
        self._wandb = None
        self._bar = None  # (rich Progress, task id) once started
        self._console = None
        self._last_plain = -math.inf
        self._closed = False
        if is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self._repair_tail(self.output_dir / METRICS_FILE)
            self._file = open(self.output_dir / METRICS_FILE, "a", encoding="utf-8")
            if wandb is not None:
                self._init_wandb(wandb)

    # ---------------------------------------------------------------- sinks
    @staticmethod
    def _repair_tail(path: Path) -> None:
        """Drop a partial last line (killed mid-write) so appended lines stay parseable."""
        if not path.exists() or path.stat().st_size == 0:
            return
        data = path.read_bytes()
        if data.endswith(b"\n"):
            return
        cut = data.rfind(b"\n") + 1  # 0 when the only line is partial
        logger.warning("%s: dropping a truncated last line (%d bytes)", path, len(data) - cut)
        with open(path, "r+b") as f:
            f.truncate(cut)

    def _init_wandb(self, cfg: dict) -> None:
        try:
            import wandb
        except ImportError:
            logger.warning("wandb config given but wandb is not installed; W&B logging is off "
                           "(pip install wandb)")
            return
        cfg = dict(cfg)
        cfg.setdefault("dir", str(self.output_dir))
        self._wandb = wandb
        self._wandb_run = wandb.init(**cfg)

    def _tensorboard(self):
        if self._tb is None and self._tb_enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter  # lazy: pulls in tensorboard
            except ImportError:
                logger.warning("tensorboard is not installed; TensorBoard logging is off")
                self._tb_enabled = False
                return None
            self._tb = SummaryWriter(str(self.output_dir / "tensorboard"),
                                     purge_step=self._purge_step)
        return self._tb

    # ---------------------------------------------------------------- API
    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one step: a JSON line ``{"step": step, **metrics}`` + TB/W&B scalars + console."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log() called after close()")
        if "step" in metrics and metrics["step"] != step:
            raise ValueError(f"metrics['step']={metrics['step']!r} disagrees with step={step}")
        row = {"step": int(step)}
        row.update({k: _json_value(k, v) for k, v in metrics.items() if k != "step"})
        if not self.is_main:
            return
        self._write_line(self._file, row)
        numeric = {k: v for k, v in _restore(row).items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        tb = self._tensorboard()
        if tb is not None:
            for key, value in numeric.items():
                tb.add_scalar(key, value, global_step=step)
            tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        self._show(step, row)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Append samples to ``samples.jsonl``; print the first with silenced tokens marked.

        Each sample has ``prompt``, ``response``, ``reward``, ``ground_truth`` and optionally
        ``tokens: list[str]`` with ``silenced: list[bool]`` of the same length.
        """
        for i, s in enumerate(samples):
            missing = {"prompt", "response", "reward", "ground_truth"} - s.keys()
            if missing:
                raise ValueError(f"sample {i} misses keys {sorted(missing)}")
            if len(s.get("tokens", ())) != len(s.get("silenced", s.get("tokens", ()))):
                raise ValueError(f"sample {i}: tokens and silenced have different lengths")
        if not self.is_main or not samples:
            return
        with open(self.output_dir / SAMPLES_FILE, "a", encoding="utf-8") as f:
            for s in samples:
                row = {k: (v if isinstance(v, list) else _json_value(k, v)) for k, v in s.items()}
                self._write_line(f, {"step": int(step), **row})
        self._print(self._render_sample(step, samples[0]))

    def truncate_after(self, step: int) -> int:
        """Drop lines with step > ``step`` (resume); returns how many metric lines were dropped.

        ``samples.jsonl`` is cut the same way; TensorBoard events after ``step`` are purged by the
        next writer (``purge_step``).
        """
        self._purge_step = step + 1
        if not self.is_main:
            return 0
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._file.close()
        dropped = _truncate_jsonl(self.output_dir / METRICS_FILE, step)
        if (self.output_dir / SAMPLES_FILE).exists():
            _truncate_jsonl(self.output_dir / SAMPLES_FILE, step)
        self._file = open(self.output_dir / METRICS_FILE, "a", encoding="utf-8")
        return dropped

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar[0].stop()
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb_run.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- console
    @staticmethod
    def _write_line(f: TextIO, row: dict[str, Any]) -> None:
        f.write(json.dumps(row, allow_nan=False, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())

    def _summary(self, row: dict[str, Any]) -> str:
        return " | ".join(f"{label} {_fmt(kind, _restore(row)[key])}"
                          for key, label, kind in _SHOWN if key in row)

    def _show(self, step: int, row: dict[str, Any]) -> None:
        if not self._progress_enabled:
            return
        if self._tty:
            bar, task = self._progress_bar()
            bar.update(task, completed=step, stats=self._summary(row))
            return
        now = time.monotonic()
        last = self.total_steps is not None and step >= self.total_steps
        if now - self._last_plain >= self._plain_interval_s or last:
            self._last_plain = now
            total = f"/{self.total_steps}" if self.total_steps else ""
            self._print(f"step {step}{total} | {self._summary(row)}")

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

    def _print(self, text: str) -> None:
        if self._tty:
            self._rich_console().print(text, highlight=False)  # above a live bar
        else:
            print(text, file=self._stream, flush=True)

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
