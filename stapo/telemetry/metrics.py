"""Metric sinks: ``metrics.jsonl`` (always; the source of truth, each line fsync'd, non-finite values as the
strings ``"NaN"``/``"Infinity"`` so every line stays JSON), TensorBoard and W&B (optional). The keys and
what each means: docs/metrics.md (a test checks it names every key listed here).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from stapo.run_dir import (METRICS_FILE, SAMPLES_FILE, TENSORBOARD_DIR, read_metrics, restore_nonfinite,
                            write_text_atomic)
from stapo.telemetry.console import ConsoleView

STEP_METRIC_KEYS: tuple[str, ...] = (
    "step", "epoch",
    "reward_mean", "reward_std", "accuracy",
    "response_length_mean", "response_length_max", "response_clip_ratio", "overlong_penalty_mean",
    "reward_failures", "repetition_frac",
    "entropy_mean", "silenced_frac", "spurious_frac", "keep_frac", "mask_tau_h", "probe_tau_h",
    "upweighted_frac", "downweighted_frac", "weight_mean",
    "clip_frac_low", "clip_frac_high", "approx_kl", "loss", "grad_norm", "lr",
    "mismatch_logp_abs_mean", "mismatch_logp_abs_max", "mismatch_kl", "mismatch_kl_k1", "rollout_ppl", "training_ppl",
    "rejected_frac", "rejected_seq_frac",
    "zero_std_group_frac", "skipped_updates", "skipped_steps",
    "time_rollout", "time_reward", "time_stats", "time_update", "time_sync", "time_step", "sync_mb",
    "time_rollout_max", "time_rollout_min",
    "tokens_per_s_rollout", "tokens_per_s_stats", "tokens_per_s_update",
    "tokens_per_s",
)
OPTIONAL_METRIC_KEYS: tuple[str, ...] = ("eval_accuracy", "eval_reward_mean", "eval_response_length_mean", "kl",
                                         "mask_gate", "entropy_bonus", "mfu_stats", "mfu_update",
                                         "sampling_rounds", "groups_kept", "groups_dropped", "groups_surplus",
                                         "sampling_capped", "policy_staleness", "policy_staleness_mean",
                                         "generation_s", "partial_interrupted", "sync_sent_mb", "sync_changed_frac",
                                         "turns_mean", "tool_calls_mean", "tool_errors_mean", "tool_error_frac",
                                         "context_token_frac", "tool_penalty_mean", "time_tools",
                                         "eval_tool_calls_mean", "eval_no_tools_accuracy",
                                         "eval_no_tools_reward_mean", "eval_no_tools_response_length_mean",
                                         "rollout_is_mean", "rollout_is_max", "rollout_is_eff_sample_size",
                                         "rollout_is_clipped_frac", "control_token_frac", "control_token_prob")
#: Metrics measured from wall time: they differ between two runs of the same training.
TIMING_METRIC_KEYS: tuple[str, ...] = (
    *(k for k in STEP_METRIC_KEYS if k.startswith(("time_", "tokens_per_s"))),
    "mfu_stats", "mfu_update", "generation_s", "time_tools",
)


def training_metrics(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row without its timings (``TIMING_METRIC_KEYS``): what reruns of one training share exactly."""
    return {k: v for k, v in row.items() if k not in TIMING_METRIC_KEYS}

logger = logging.getLogger(__name__)


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


def _truncate_jsonl(path: Path, step: int) -> int:
    """Rewrite ``path`` atomically without rows whose step > ``step``; returns the rows dropped."""
    rows = read_metrics(path)
    kept = [r for r in rows if r.get("step", -1) <= step]
    lines = [json.dumps({k: v if isinstance(v, (list, dict)) else _json_value(k, v) for k, v in row.items()},
                        allow_nan=False, ensure_ascii=False) + "\n" for row in kept]
    write_text_atomic(path, "".join(lines))
    return len(rows) - len(kept)


class MetricsLogger:
    """Per-step metric sinks (JSONL, TensorBoard, W&B, console on ``stream``); other ranks log into it too,
    and nothing is written."""

    def __init__(self, output_dir: str | Path, *, is_main: bool, tensorboard: bool = True,
                 wandb: dict | None = None, total_steps: int | None = None,
                 progress: bool = True, stream: TextIO | None = None,
                 plain_interval_s: float = 10.0) -> None:
        self.output_dir = Path(output_dir)
        self.is_main = is_main
        self.total_steps = total_steps
        self._tb_enabled = tensorboard
        self._console = ConsoleView(stream if stream is not None else sys.stdout, progress=progress,
                                    total_steps=total_steps, plain_interval_s=plain_interval_s)
        self._file: TextIO | None = None
        self._tb = None
        self._purge_step: int | None = None
        self._wandb = None
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
            self._tb = SummaryWriter(str(self.output_dir / TENSORBOARD_DIR),
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
        restored = restore_nonfinite(row)
        numeric = {k: v for k, v in restored.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        tb = self._tensorboard()
        if tb is not None:
            for key, value in numeric.items():
                tb.add_scalar(key, value, global_step=step)
            tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        self._console.show_step(step, restored)

    def log_event(self, step: int, event: str, fields: dict[str, Any]) -> None:
        """Append an event row (health alarms and actions) to metrics.jsonl only: not a step's metrics."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log_event() called after close()")
        row = {k: v if isinstance(v, (list, dict)) else _json_value(k, v) for k, v in fields.items()}
        if self.is_main:
            self._write_line(self._file, {"step": int(step), "event": event, **row})

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Append samples (``prompt``, ``response``, ``reward``, ``ground_truth``; optional ``tokens`` and
        ``silenced``) to ``samples.jsonl``; print the first with silenced tokens marked."""
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
        self._console.show_sample(step, samples[0])

    def truncate_after(self, step: int) -> int:
        """Drop lines with step > ``step`` (resume) here and in ``samples.jsonl`` (TensorBoard: ``purge_step``);
        returns how many metric lines were dropped."""
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
        self._console.close()
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

    @staticmethod
    def _write_line(f: TextIO, row: dict[str, Any]) -> None:
        f.write(json.dumps(row, allow_nan=False, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
