"""Which settings make a run a different experiment, for resuming (docs/distributed.md, "Resuming").

Resuming with another value of an experiment key would continue one experiment under another's name, so the
trainer refuses, naming the keys; run settings (speed, cadence, logging, servers) may change.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["EXPERIMENT_KEYS", "RUN_SETTINGS", "ConfigChanges", "config_changes", "is_experiment_key", "listed_in"]

#: Keys (or whole sections, ``section.``) that define the experiment: the model and its adapters, the data,
#: the reward, the mask, the loss and its corrections, the optimizer, the batch geometry and the seed.
EXPERIMENT_KEYS = (
    "model.path", "model.dtype", "model.lora.enabled", "model.lora.rank", "model.lora.alpha", "model.lora.dropout",
    "model.lora.target_modules", "tiny.",
    "data.source", "data.preset", "data.split", "data.prompt_field", "data.answer_field", "data.instruction",
    "data.max_prompt_length", "data.num_builtin_problems",
    "reward.", "mask.", "optim.",
    "loss.clip_low", "loss.clip_high", "loss.clip_c", "loss.agg", "loss.advantage_scale", "loss.advantage_eps",
    "loss.kl_coef", "loss.log_ratio_clamp", "loss.rollout_is", "loss.rollout_is_threshold",
    "loss.rollout_is_batch_normalize", "loss.rollout_rs", "loss.rollout_rs_threshold", "loss.mask_truncated",
    "loss.entropy_coef",
    "trainer.seed", "trainer.train_batch_size", "trainer.mini_batch_size",
    "rollout.group_size", "rollout.temperature", "rollout.top_p", "rollout.top_k", "rollout.max_response_length",
    "rollout.dynamic_sampling", "rollout.max_sampling_rounds", "rollout.max_staleness", "rollout.partial",
    "rollout.tools.enabled", "rollout.tools.names", "rollout.tools.parser", "rollout.tools.max_turns",
    "rollout.tools.stateful", "rollout.tools.timeout_s", "rollout.tools.max_output_chars", "rollout.tools.params",
)
#: Keys that may change between sessions of one run (``tests/test_experiment.py`` checks that every config
#: key is in exactly one of the two lists, so a new field needs a decision).
RUN_SETTINGS = (
    "model.gradient_checkpointing", "model.compile_layers", "model.trust_remote_code", "model.attn_implementation",
    "model.lora.export_merged", "data.eval_source", "data.eval_size", "loss.chunk_size",
    "trainer.output_dir", "trainer.total_steps", "trainer.micro_batch_size", "trainer.packing",
    "trainer.max_tokens_per_micro_batch", "trainer.max_tokens_per_stats_micro_batch", "trainer.zero_stage",
    "trainer.offload", "trainer.save_every", "trainer.keep_last", "trainer.resume", "trainer.max_consecutive_skips",
    "trainer.eval_every", "trainer.export_hf", "trainer.collective_timeout_minutes",
    "rollout.engine", "rollout.mode", "rollout.server.", "rollout.gpu_memory_utilization",
    "rollout.tensor_parallel_size", "rollout.sleep_level", "rollout.offload_training_state",
    "rollout.max_batch_size", "rollout.sync_bucket_mb", "rollout.producer_close_timeout_s", "rollout.tools.max_workers",
    "rollout.tools.eval_without_tools", "zero.", "logging.", "inspect.", "health.",
)


_NOT_COMPARED = ("trainer.resume", "trainer.output_dir")  # how this session finds the run, not what it is


def listed_in(key: str, entries: tuple[str, ...]) -> list[str]:
    """The entries that name ``key``: itself, or a prefix ending in ``.`` (a section) or ``_`` (a family)."""
    return [e for e in entries if key == e or (e.endswith((".", "_")) and key.startswith(e))]


def is_experiment_key(key: str) -> bool:
    """Everything but a listed run setting: a key nobody classified yet counts as the experiment (refused)."""
    return not listed_in(key, RUN_SETTINGS)


def flat_keys(data: dict, prefix: str = "") -> dict[str, Any]:
    """``{"section.key": value}`` of a config's ``to_dict()`` (``mask.params`` and other dict fields whole)."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key not in ("params",):
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@dataclasses.dataclass(frozen=True)
class ConfigChanges:
    """How the config of a resumed run differs from its checkpoint's: ``"key: old -> new"`` lines."""

    experiment: tuple[str, ...]  # refused unless trainer.resume=force
    settings: tuple[str, ...]  # allowed, logged


def config_changes(saved: dict, now: dict, step: int) -> ConfigChanges:
    """The differences between a checkpoint's config (``saved``, taken at ``step``) and this run's (both
    ``to_dict()``); keys one side lacks (a config from another stapo version) are not compared."""
    old, new = flat_keys(saved), flat_keys(now)
    experiment, settings = [], []
    for key in (k for k in new if k in old and old[k] != new[k] and k not in _NOT_COMPARED):
        line = f"{key}: {_short(old[key])} -> {_short(new[key])}"
        ends_early = key == "trainer.total_steps" and new[key] < step
        (experiment if is_experiment_key(key) or ends_early else settings).append(
            line + (f" (below the checkpoint's step {step})" if ends_early else ""))
    return ConfigChanges(tuple(experiment), tuple(settings))


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
