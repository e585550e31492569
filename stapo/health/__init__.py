"""stapo.health: see a collapse coming from the step metrics (docs/health.md); what an alarm does is the
trainer's (``stapo.trainer.recovery``).

May import: torch, ``stapo.registry`` and ``stapo.run_dir`` only (docs/index.md, "Layout").
"""

from stapo.health import builtin_monitors  # noqa: F401  (registers the built-ins)
from stapo.health.monitors import (MONITORS, Monitor, Window, build_monitor, monitor_params, register_monitor,
                                   robust_z)
from stapo.health.token_stats import control_token_sums, repeated_ngram_tokens
from stapo.health.watch import Alarm, HealthWatch, metric_key

BUILTIN_MONITORS: tuple[str, ...] = tuple(MONITORS)

__all__ = ["MONITORS", "BUILTIN_MONITORS", "Alarm", "HealthWatch", "Monitor", "Window", "build_monitor",
           "control_token_sums", "metric_key", "monitor_params", "register_monitor", "repeated_ngram_tokens",
           "robust_z"]
