"""Run configuration: nested dataclasses, strict YAML loading, dotted ``key=value`` overrides (docs/configuration.md).

Defaults are the paper's (Table 6 / App. D).

May import: ``stapo.servers`` and ``stapo.rollout`` (for validation), the registries of ``stapo.losses``,
``stapo.rewards``, ``stapo.tools`` and ``stapo.health``, ``stapo.data``, and the rest below them
(docs/index.md, "Layout").
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from stapo.config.health_section import HealthConfig
from stapo.config.loading import ConfigError, apply_overrides, build_dataclass, load_yaml
from stapo.config.rollout_sections import RolloutConfig, ToolsConfig
from stapo.config.sections import (DataConfig, InspectConfig, LoggingConfig, LoraConfig, LossConfig, MaskConfig,
                                   ModelConfig, OptimConfig, RewardConfig, TinyConfig, TrainerConfig, ZeroConfig)
from stapo.config.validation import validate

log = logging.getLogger("stapo.config")

__all__ = ["STAPOConfig", "ConfigError", "DataConfig", "HealthConfig", "InspectConfig", "LoggingConfig",
           "LoraConfig", "LossConfig", "MaskConfig", "ModelConfig", "OptimConfig", "RewardConfig", "RolloutConfig", "TinyConfig",
           "ToolsConfig", "TrainerConfig", "ZeroConfig", "validate"]


@dataclass
class STAPOConfig:
    """The whole run: one section per pipeline stage (docs/configuration.md)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    tiny: TinyConfig = field(default_factory=TinyConfig)
    """Built-in tiny demo model (used when ``model.path`` is ``builtin:tiny``)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and answers."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling of G responses per prompt."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rule-based verifiable reward, +1 / -1 (paper §2.1)."""
    mask: MaskConfig = field(default_factory=MaskConfig)
    """Which tokens contribute to the loss (STAPO's S2T mechanism and the baselines)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Clipped surrogate and advantages."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop sizes, checkpoints, output."""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """DeepSpeed ZeRO communication settings (bucket sizes, persistence, overlap)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metric sinks."""
    inspect: InspectConfig = field(default_factory=InspectConfig)
    """Spurious-token recording."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """Training-health monitors and what an alarm does (docs/health.md)."""

    def __post_init__(self) -> None:
        validate(self)

    # ---- derived sizes (properties, never stored) -------------------------------------------
    @property
    def num_mini_batches(self) -> int:
        """Optimizer steps per iteration (paper: 256 / 64 = 4)."""
        return self.trainer.train_batch_size // self.trainer.mini_batch_size

    @property
    def rollout_correction(self) -> dict:
        """The off-policy correction's flat settings (``stapo.losses.RolloutCorrection``'s arguments):
        ``loss.rollout_*`` with ``rollout_is: auto`` (token IS when ``rollout.max_staleness >= 1``, off in
        lock-step) resolved."""
        lo = self.loss
        level = lo.rollout_is
        if level == "auto":
            level = "token" if self.rollout.max_staleness >= 1 else None
        return {"rollout_is": level, "rollout_is_threshold": lo.rollout_is_threshold,
                "rollout_is_batch_normalize": lo.rollout_is_batch_normalize, "rollout_rs": lo.rollout_rs,
                "rollout_rs_threshold": lo.rollout_rs_threshold}

    # ---- loading / saving -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict | None, overrides: list[str] | tuple[str, ...] = ()) -> "STAPOConfig":
        """``data`` (a recipe's mapping), then the dotted ``overrides`` on top of it.

        Overriding ``mask.name`` drops the recipe's ``mask.params`` the overrides do not set again: they belonged to
        its own mask (docs/custom_masks.md).
        """
        base = copy.deepcopy(dict(data or {}))
        merged = apply_overrides(copy.deepcopy(base), overrides)
        _drop_params_of_replaced_mask(base, apply_overrides({}, overrides), merged)
        return build_dataclass(cls, merged)

    @classmethod
    def from_yaml(cls, path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> "STAPOConfig":
        """Load ``path`` (None: all defaults) strictly, then apply dotted ``key=value`` overrides.

        A file must name ``model.path`` (or an override must): the defaults under it are the paper's sizes, which on
        the built-in tiny model make a run nobody meant (docs/configuration.md)."""
        if path is None:
            return cls.from_dict({}, overrides)
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        data = load_yaml(path.read_text(encoding="utf-8"), str(path))
        if not isinstance(data, (dict, type(None))):
            raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
        cfg = cls.from_dict(data, overrides)
        if "path" not in ((data or {}).get("model") or {}) and not any(o.startswith("model.path=") for o in overrides):
            what = "is empty" if not data else "sets no model.path"
            raise ConfigError(f"{path} {what}: a config file is read on top of stapo's defaults, the paper's sizes "
                              "(256 prompts x 8 per step, 15k-token responses), not a demo's; start from a recipe "
                              "(`stapo recipes` lists them) and change what differs, or set model.path")
        return cfg

    def to_dict(self) -> dict:
        """Every field as plain data."""
        return dataclasses.asdict(self)

    def to_yaml(self, path: str | Path | None = None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text


def _drop_params_of_replaced_mask(base: dict, layer: dict, merged: dict) -> None:
    """When ``layer`` names a different mask than ``base``, keep only the params ``layer`` sets."""
    base_mask, layer_mask = base.get("mask") or {}, layer.get("mask") or {}
    if not (isinstance(base_mask, dict) and isinstance(layer_mask, dict) and "name" in layer_mask):
        return  # (a mask that is not a mapping is reported by build_dataclass)
    old_name = base_mask.get("name", MaskConfig.name)
    base_params = base_mask.get("params") or {}
    if layer_mask["name"] == old_name or not isinstance(base_params, dict):
        return
    given = layer_mask.get("params") if isinstance(layer_mask.get("params"), dict) else {}
    dropped = sorted(k for k in base_params if k not in given)
    if not dropped:
        return
    params = merged["mask"].get("params") or {}
    if isinstance(params, dict):
        merged["mask"]["params"] = {k: v for k, v in params.items() if k not in dropped}
    log.info("mask.name=%s replaces %r: dropped the mask.params %s that were set for %r "
             "(set them again with the new name to keep them)", layer_mask["name"], old_name, dropped, old_name)
