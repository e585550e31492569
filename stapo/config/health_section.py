"""The ``health`` section of :class:`stapo.config.STAPOConfig`: training-health monitors and what an alarm
does (docs/health.md). Every field carries its docstring, from which ``docs/configuration.md`` is generated."""

from __future__ import annotations

from dataclasses import dataclass, field

from stapo.health import BUILTIN_MONITORS

__all__ = ["HealthConfig", "ON_ALARM"]

ON_ALARM = ("warn", "stop", "rollback")


@dataclass
class HealthConfig:
    on_alarm: str = "warn"
    """What an alarm does: ``warn`` logs one line naming the monitor, its value and threshold; ``stop``
    saves a checkpoint and exits with status 3 (running the same command resumes); ``rollback`` restores
    the newest checkpoint saved before the anomaly's onset, multiplies the lr by ``rollback_lr_scale``,
    skips the data batches of the failed stretch and continues, at most ``max_rollbacks`` times (then
    alarms warn). Every alarm and action is an ``event`` row in metrics.jsonl and a console line."""
    monitors: list = field(default_factory=lambda: list(BUILTIN_MONITORS))
    """Active monitors, by registered name (``--import FILE`` registers your own; docs/health.md lists the
    built-ins). A monitor whose metrics the run does not log (the tool ones without ``rollout.tools``)
    stays silent; ``[]`` turns monitoring off."""
    params: dict = field(default_factory=dict)
    """Monitor parameters over their defaults, by monitor, e.g. ``{grad_norm: {z: 8}}``."""
    window: int = 50
    """Earlier steps each statistic is compared with (their median and MAD)."""
    warmup: int = 10
    """Steps before any monitor judges (its baseline needs them); at most ``window``."""
    patience: int = 3
    """Consecutive steps past a threshold that make one alarm (noise of single steps never does)."""
    keep_healthy: int = 1
    """Checkpoints saved while no monitor had a streak that are kept for a rollback, besides
    ``trainer.keep_last`` (the newest ones)."""
    rollback_lr_scale: float = 0.5
    """The lr is multiplied by this at each rollback (1: unchanged), in (0, 1]."""
    max_rollbacks: int = 3
    """Rollbacks per run at most (counted across resumes); later alarms warn."""
