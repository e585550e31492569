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
    """What an alarm does: ``warn`` logs it; ``stop`` checkpoints and exits with status 3 (the same command
    resumes); ``rollback`` restores a checkpoint from before the onset with a lower lr (docs/health.md)."""
    monitors: list = field(default_factory=lambda: list(BUILTIN_MONITORS))
    """Active monitors, by registered name (docs/health.md; ``--import FILE`` registers your own); ``[]`` turns
    monitoring off."""
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
