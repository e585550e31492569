"""Metric sinks for training runs: JSONL (always), TensorBoard and W&B (optional), console.

Every step the trainer logs one flat ``dict[str, float]`` (docs/algorithm.md, "Metrics that follow
the paper"). ``metrics.jsonl`` is the source of truth (plots, the inspector and resumption read it
with :func:`stapo.run_dir.read_metrics`); each line is flushed and fsync'd so a killed run loses at
most the line being written, and :meth:`MetricsLogger.truncate_after` drops the steps a resumed
checkpoint does not contain. Only the main process writes anything; the console view is
:mod:`stapo.telemetry.console`.

THE list of per-step keys (:data:`STEP_METRIC_KEYS`; a trainer test checks every one is logged):

- ``step``, ``epoch``
- ``reward_mean``, ``reward_std`` (of the rewards the advantages see, penalty included),
  ``accuracy`` (fraction of responses the scorer gave > 0)
- ``response_length_mean``, ``response_length_max``, ``response_clip_ratio`` (fraction truncated at
  the max response length), ``overlong_penalty_mean`` (DAPO's soft overlong penalty per response, 0
  unless ``reward.overlong_buffer``), ``reward_failures`` (responses whose scorer hung or raised and
  scored ``reward.failure_value``), ``repetition_frac`` (response tokens that close a 4-gram already seen
  in the same response: loops)
- ``entropy_mean`` (mean over valid response tokens)
- ``silenced_frac`` (silenced / valid tokens under the active mask), ``spurious_frac`` (fraction of
  valid tokens meeting STAPO's criterion ``A > 0 ∧ p < τ_p ∧ H < τ_h`` at the active mask's ``tau_p`` /
  ``entropy_quantile`` (the paper's defaults for a mask without them),
  whatever mask is active), ``keep_frac``, ``mask_tau_h`` (the active mask's entropy threshold; NaN
  for a mask without one), ``probe_tau_h`` (the S2T probe's)
- ``upweighted_frac``, ``downweighted_frac`` (valid tokens a weighting mask gave a weight > 1 / in
  (0, 1); 0 for a plain mask), ``weight_mean`` (mean token weight over valid tokens: ``keep_frac`` for
  a plain mask)
- ``clip_frac_low``, ``clip_frac_high``, ``approx_kl``, ``loss``, ``grad_norm``, ``lr``
- ``mismatch_logp_abs_mean``, ``mismatch_logp_abs_max``, ``mismatch_kl`` (rollout engine vs trainer:
  |log pi_sampler - log pi_old| over valid response tokens, its max, and the k3 estimate of
  KL(sampler || trainer); the trainer's theta_old recompute, so ~1e-6 in fp32 with the HF engine),
  ``mismatch_kl_k1`` (the k1 estimate of the same KL, mean of log pi_sampler - log pi_old; may be < 0),
  ``rollout_ppl``, ``training_ppl`` (mean over responses of exp(-mean token log-prob) under the sampler
  and under theta_old; verl's names)
- ``rejected_frac``, ``rejected_seq_frac`` (valid tokens / responses with a token that the off-policy
  correction's rejection, ``loss.rollout_rs``, took out of the loss; 0 without it; counted apart from
  ``silenced_frac``, the mask's)
- ``zero_std_group_frac`` (groups whose rewards are all equal, hence A = 0), ``skipped_updates`` (mini-batch
  updates skipped this step for a non-finite loss or gradient norm), ``skipped_steps`` (steps skipped
  so far, cumulative)
- ``time_rollout``, ``time_reward``, ``time_stats``, ``time_update``, ``time_sync``, ``time_step``
  (seconds, rank 0's), ``time_rollout_max``, ``time_rollout_min`` (the slowest and fastest rank's
  generation: the next collective waits for the slowest), ``tokens_per_s``, ``sync_mb`` (MiB pushed into
  each rank's rollout engine by the weight sync)
- ``tokens_per_s_rollout`` (generated tokens), ``tokens_per_s_stats`` (real tokens of the no-grad
  passes), ``tokens_per_s_update`` (real tokens of the update), over all ranks

Optional (:data:`OPTIONAL_METRIC_KEYS`): ``eval_accuracy``, ``eval_reward_mean``,
``eval_response_length_mean`` (greedy response tokens; eval steps only);
``kl`` (k3 KL to the reference policy over kept tokens, only when ``loss.kl_coef > 0``);
with importance weights (``loss.rollout_is``, docs/losses.md "Off-policy corrections"): ``rollout_is_mean``,
``rollout_is_max`` (of the untruncated ratios pi_old / pi_sampler over valid tokens; sequence level: the
row's product on each of its tokens), ``rollout_is_eff_sample_size`` (ESS of the applied weights,
(sum w)^2 / (n sum w^2), before batch normalization; 1 when all are equal), ``rollout_is_clipped_frac``
(valid tokens whose weight the threshold truncated or zeroed);
``mask_gate`` (a gated weighting mask's gate, e.g. STARE's: 1 on, 0 off, the mean over the step's
mini-batches; only for such a mask);
``mfu_stats``, ``mfu_update`` (model FLOPs utilization of the phase on a GPU whose peak is known,
stapo.telemetry.mfu; absent on CPU); ``entropy_bonus`` (``loss.entropy_coef`` x mean entropy of kept
tokens, subtracted from the loss; only when ``loss.entropy_coef != 0``); with ``rollout.dynamic_sampling``: ``sampling_rounds``,
``groups_kept`` (informative groups trained on, all ranks), ``groups_dropped`` (all-equal-reward
groups dropped), ``groups_surplus`` (informative groups generated beyond the batch),
``sampling_capped`` (1 when ``rollout.max_sampling_rounds`` ended the search short); with
``rollout.mode: server``: ``policy_staleness`` (optimizer iterations between the policy that sampled the
step's oldest token and the one it trains: 0 in lock-step, at most ``rollout.max_staleness``),
``policy_staleness_mean`` (the same lag averaged over the step's response tokens: with
``rollout.partial`` a response continued after a sync has younger tokens than its first ones),
``generation_s`` (wall seconds the step's batch took to generate; asynchronous, it ran during earlier
updates and ``time_rollout`` is only the trainer's wait for it), ``sync_sent_mb`` (MiB the step's weight sync
broadcast into the servers, each receiving it once: ``sync_mb`` with ``rollout.sync: full``, less with
``delta``); with ``rollout.sync: delta``: ``sync_changed_frac`` (fraction of the synced elements that changed
since the servers' copy; NaN when the sync had no copy to compare with, e.g. after a failed one); with
``rollout.partial``: ``partial_interrupted`` (response segments a weight sync cut, all ranks; they went on
with the new weights); with ``rollout.tools`` (multi-turn episodes, docs/tir.md): ``turns_mean`` (policy
turns per episode), ``tool_calls_mean``,
``tool_errors_mean`` (per episode), ``tool_error_frac`` (errors / calls), ``context_token_frac`` (context
tokens / all response tokens: what the model read but did not write), ``tool_penalty_mean`` (the tool
shaping per episode, 0 unless configured), ``time_tools`` (seconds the episode loop waited for tools, part
of ``time_rollout``, mean over ranks), ``control_token_frac``, ``control_token_prob`` (the call format's
single-token tags, e.g. ``<tool_call>``: their share of the policy's tokens and the mean sampling probability
of those emitted, NaN when none was; only for a format whose tags are single tokens), and at evaluation
``eval_tool_calls_mean``; with
``rollout.tools.eval_without_tools``: ``eval_no_tools_accuracy``, ``eval_no_tools_reward_mean``,
``eval_no_tools_response_length_mean`` (the held-out prompts offering no tools, one turn each).

Health (docs/health.md): ``health_<monitor>``, each active monitor's statistic (from the step its window
is warm). Besides step rows the file holds **event rows** (:meth:`MetricsLogger.log_event`: ``step``,
``event`` and the event's fields, no step metrics): ``health`` (the monitors and their thresholds, at the
start of each session), ``alarm`` (a monitor past its threshold for ``health.patience`` steps, with the
action taken), ``rollback`` and ``stop``.

Non-finite values (a skipped step's loss) are stored as the strings ``"NaN"``, ``"Infinity"``,
``"-Infinity"`` so every line stays valid JSON; :func:`stapo.run_dir.read_metrics` turns them back
into floats.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from stapo.run_dir import METRICS_FILE, SAMPLES_FILE, TENSORBOARD_DIR, read_metrics, restore_nonfinite
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
    "time_rollout", "time_reward", "time_stats", "time_update", "time_sync", "time_step",
    "time_rollout_max", "time_rollout_min",
    "tokens_per_s_rollout", "tokens_per_s_stats", "tokens_per_s_update", "tokens_per_s", "mfu_stats", "mfu_update",
    "generation_s", "time_tools",
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
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in kept:
            f.write(json.dumps({k: v if isinstance(v, (list, dict)) else _json_value(k, v)
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
        """Append an event row ``{"step": step, "event": event, **fields}`` (health alarms and actions) to
        metrics.jsonl only: it is not a step's metrics (no TensorBoard scalar, no progress line)."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log_event() called after close()")
        row = {k: v if isinstance(v, (list, dict)) else _json_value(k, v) for k, v in fields.items()}
        if self.is_main:
            self._write_line(self._file, {"step": int(step), "event": event, **row})

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
        self._console.show_sample(step, samples[0])

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
