"""Value checks of a :class:`stapo.config.STAPOConfig` with messages that name the field.

Types and unknown keys are checked while loading (``stapo.config.loading``); this module checks values and
their relations.
"""

from __future__ import annotations

import functools
import math

from stapo.config.health_section import ON_ALARM
from stapo.config.loading import ConfigError, coerce_params
from stapo.losses.surrogate import AGG_MODES
from stapo.rewards.modes import REWARD_MODES
from stapo.rewards.user_function import parse_function_spec

_CHOICES = {
    "model.dtype": ("auto", "bf16", "fp32"),
    "model.attn_implementation": ("auto", "sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"),
    "tiny.task": ("arithmetic", "tir"),
    "rollout.mode": ("colocated", "server"),
    "rollout.server.sync": ("full", "delta"),
    "mask.stats_source": ("fresh", "old"),
    "inspect.record_minibatches": ("first", "all"),
    "reward.mode": REWARD_MODES,  # the registry itself: modes registered later are valid too
    "loss.agg": AGG_MODES,
    "loss.advantage_scale": ("group", "none"),
    "trainer.zero_stage": (0, 1, 2, 3),
    "health.on_alarm": ON_ALARM,
}
#: field -> the lowest value it may take: "FIELD must be >= LOW, got VALUE"
_AT_LEAST = {
    "rollout.max_response_length": 1, "rollout.sync_bucket_mb": 1, "rollout.tensor_parallel_size": 1,
    "rollout.max_sampling_rounds": 1, "rollout.max_staleness": 0,
    "rollout.tools.max_turns": 1, "rollout.tools.max_output_chars": 1, "rollout.tools.max_workers": 1,
    "rollout.server.request_timeout_per_token_s": 0, "rollout.server.request_retries": 0,
    "rollout.server.sync_retries": 0,
    "optim.warmup_steps": 0, "optim.weight_decay": 0,
    "loss.kl_coef": 0, "loss.advantage_eps": 0, "loss.chunk_size": 1,
    "trainer.total_steps": 1, "trainer.train_batch_size": 1, "trainer.mini_batch_size": 1,
    "trainer.micro_batch_size": 1, "trainer.keep_last": 1, "trainer.save_every": 0,
    "trainer.max_consecutive_skips": 1, "trainer.collective_timeout_minutes": 1,
    "data.max_prompt_length": 1, "tiny.warm_start_steps": 0, "tiny.terms": 2,
    "zero.param_persistence_threshold": 0, "zero.prefetch_bucket_size": 0, "zero.max_live_parameters": 0,
    "zero.max_reuse_distance": 0, "zero.reduce_bucket_size": 1,
    "model.lora.rank": 1, "reward.overlong_penalty": 0, "reward.tool_call_budget": 0,
    "health.patience": 1, "health.keep_healthy": 1, "health.max_rollbacks": 1,
}
#: fields that must be > 0: "FIELD must be > 0, got VALUE"
_POSITIVE = (
    "rollout.temperature", "rollout.producer_close_timeout_s", "rollout.tools.timeout_s",
    "rollout.server.request_timeout_s", "rollout.server.down_after_s", "rollout.server.health_interval_s",
    "rollout.server.health_timeout_s", "rollout.server.sync_timeout_s", "rollout.server.sync_join_timeout_s",
    "optim.lr", "optim.grad_clip", "reward.timeout_s", "model.lora.alpha",
)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _field(cfg, dotted: str):
    return functools.reduce(getattr, dotted.split("."), cfg)


def validate(cfg) -> None:
    """Value checks of ``cfg`` (a ``STAPOConfig``) with messages that name the field (docs/configuration.md)."""
    for dotted, choices in _CHOICES.items():
        value = _field(cfg, dotted)
        _check(value in choices, f"{dotted} must be one of {list(choices)}, got {value!r}")
    for dotted, low in _AT_LEAST.items():
        value = _field(cfg, dotted)
        _check(value >= low, f"{dotted} must be >= {low}, got {value}")
    for dotted in _POSITIVE:
        value = _field(cfg, dotted)
        _check(value > 0, f"{dotted} must be > 0, got {value}")
    r, t, lo = cfg.rollout, cfg.trainer, cfg.loss
    _check(r.group_size >= 2, f"rollout.group_size (G) must be >= 2 for group advantages, got {r.group_size}")
    _check(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1], got {r.top_p}")
    _check(0 < r.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization must be in (0, 1]")
    _check(0 <= lo.clip_low < 1, f"loss.clip_low (epsilon_low) must be in [0, 1), got {lo.clip_low}")
    _check(lo.clip_high >= 0, f"loss.clip_high (epsilon_high) must be >= 0, got {lo.clip_high}")
    _check(lo.clip_c is None or lo.clip_c > 1, f"loss.clip_c (dual clip) must be > 1 or null, got {lo.clip_c}")
    _check(t.train_batch_size % t.mini_batch_size == 0,
           f"trainer.mini_batch_size ({t.mini_batch_size}) must divide trainer.train_batch_size "
           f"({t.train_batch_size})")
    _check(not (t.zero_stage == 0 and cfg.model.dtype == "bf16"),
           "trainer.zero_stage 0 with model.dtype bf16 would add each step's micro-batch gradients in bf16; "
           "use trainer.zero_stage 1 (fp32 accumulation; on one GPU it partitions nothing) or model.dtype fp32")
    for name in ("max_tokens_per_micro_batch", "max_tokens_per_stats_micro_batch"):
        _check(getattr(t, name) >= 0, f"trainer.{name} must be >= 0 (0: count rows), got {getattr(t, name)}")
    _check(0.0 <= cfg.tiny.warm_start_bare_fraction < 1.0,
           f"tiny.warm_start_bare_fraction must be in [0, 1), got {cfg.tiny.warm_start_bare_fraction}")
    z = cfg.zero
    _check(z.max_live_parameters >= z.prefetch_bucket_size,
           f"zero.max_live_parameters ({z.max_live_parameters}) must be >= zero.prefetch_bucket_size "
           f"({z.prefetch_bucket_size}): prefetched parameters count as live")
    from stapo.rollout.registry import engine_choices  # the live registry: user-registered engines count
    _check(r.engine in engine_choices(), f"rollout.engine must be one of {list(engine_choices())}, got {r.engine!r}")
    _check(r.sleep_level in (1, 2), f"rollout.sleep_level must be 1 or 2, got {r.sleep_level}")
    _check_correction(cfg)
    rw = cfg.reward
    _check_rollout_servers(r)
    _check_tools(cfg.rollout.tools, cfg.tiny)
    _check(not (r.tools.enabled and r.tensor_parallel_size > 1),
           f"rollout.tools needs rollout.tensor_parallel_size 1 (got {r.tensor_parallel_size}): the ranks of a "
           "tensor-parallel group generate together, but each rank's episodes end after their own number of turns")
    _check_offload_training_state(cfg)
    _check(0 <= rw.overlong_buffer <= r.max_response_length,
           f"reward.overlong_buffer must be in [0, rollout.max_response_length={r.max_response_length}], "
           f"got {rw.overlong_buffer}")
    for name in ("tool_error_penalty", "tool_call_penalty"):
        value = getattr(rw, name)
        _check(math.isfinite(value) and value >= 0, f"reward.{name} must be finite and >= 0, got {value}")
    _check(math.isfinite(rw.failure_value), f"reward.failure_value must be finite, got {rw.failure_value}")
    _check(rw.mode != "function" or bool(rw.function),
           "reward.mode 'function' needs reward.function ('pkg.module:callable' or 'path/to/file.py:callable')")
    _check(not rw.function or rw.mode in ("math", "function"),
           f"reward.function replaces the verifier: leave reward.mode at 'math' or set 'function', got {rw.mode!r}")
    if rw.function:
        _check_function_spec(rw.function)
    _check(math.isfinite(lo.entropy_coef), f"loss.entropy_coef must be finite, got {lo.entropy_coef}")
    _check_mask(cfg.mask)
    _validate_lora(cfg.model.lora)
    _check_data(cfg.data)
    _check_health(cfg)


def _check_data(data) -> None:
    """``data.preset`` names a preset, for a dataset source (the built-in task has no columns to map)."""
    from stapo.data import PRESETS

    if data.preset is None:
        return
    _check(data.preset in PRESETS, f"data.preset: unknown preset {data.preset!r}; known: {', '.join(PRESETS)} (or null)")
    _check(not data.source.startswith("builtin:"),
           f"data.preset {data.preset} maps the columns of a dataset, but data.source is {data.source}: set "
           f"data.source={PRESETS[data.preset].hf_name} (or a local copy of it)")


def _check_correction(cfg) -> None:
    """``loss.rollout_*``: settings that build a ``RolloutCorrection`` (its message names the setting)."""
    from stapo.losses.corrections import RolloutCorrection

    lo = cfg.loss
    _check(lo.rollout_is in ("auto", "token", "sequence", None),
           f"loss.rollout_is must be one of ['auto', 'token', 'sequence', null], got {lo.rollout_is!r}")
    try:
        RolloutCorrection(**cfg.rollout_correction)
    except ValueError as err:
        _check(False, f"loss.{err}")


def _check_health(cfg) -> None:
    """``health``: sizes, the monitors and their parameters (the live registry: ``--import``-ed monitors
    count), and what a rollback needs (docs/health.md)."""
    from stapo.health import build_monitor

    h = cfg.health
    _check(h.window >= 3, f"health.window must be >= 3 (a median needs a few earlier steps), got {h.window}")
    _check(0 <= h.warmup <= h.window, f"health.warmup must be in [0, health.window={h.window}], got {h.warmup}")
    _check(0 < h.rollback_lr_scale <= 1, f"health.rollback_lr_scale must be in (0, 1], got {h.rollback_lr_scale}")
    stray = sorted(set(h.params) - set(h.monitors))
    _check(not stray, f"health.params sets {stray}: not an active monitor (add it to health.monitors)")
    for name, params in h.params.items():
        _check(isinstance(params, dict), f"health.params.{name} must be a mapping of parameters, e.g. "
               f"{{{name}: {{z: 8}}}}, got {params!r}")
    for name in h.monitors:
        try:
            build_monitor(name, **h.params.get(name, {}))
        except ValueError as err:
            _check(False, f"health.monitors: {err}")
    if h.on_alarm == "rollback":
        _check(cfg.trainer.save_every > 0, "health.on_alarm=rollback restores a checkpoint saved during the run: "
               "set trainer.save_every > 0 (checkpoints every N steps)")
        _check(cfg.rollout.max_staleness == 0,
               f"health.on_alarm=rollback needs rollout.max_staleness=0 (got {cfg.rollout.max_staleness}): batches "
               "generated ahead by the failing policy would be trained after the rollback; use warn or stop")


def _check_mask(mask) -> None:
    """``mask.name`` / ``mask.params`` build a mask from the live registry; the params are coerced to the
    mask's field types first (``mask.params.tau_p=2e-3`` arrives as a string)."""
    from stapo.losses.masks import available_masks, build_mask, mask_class  # user masks registered by now count

    _check(mask.name in available_masks(),
           f"mask.name: unknown mask {mask.name!r}; available: {', '.join(available_masks())}")
    mask.params = coerce_params(mask_class(mask.name), mask.params, "mask.params")  # a ConfigError names the key
    try:
        build_mask(mask.name, **mask.params)
    except (TypeError, ValueError) as exc:
        _check(False, f"mask.params: {exc}")


def _validate_lora(lora) -> None:
    _check(0 <= lora.dropout < 1, f"model.lora.dropout must be in [0, 1), got {lora.dropout}")
    modules = lora.target_modules
    _check(isinstance(modules, list) and len(modules) > 0 and all(isinstance(m, str) and m for m in modules),
           f"model.lora.target_modules must be a non-empty list of module names, got {modules!r}")
    from stapo.config.sections import LoraConfig

    changed = [f"model.lora.{k}" for k, v in vars(lora).items() if k != "enabled" and v != getattr(LoraConfig(), k)]
    _check(lora.enabled or not changed, f"{', '.join(changed)} set with model.lora.enabled false: the adapters' "
                                        "settings do nothing without them; set model.lora.enabled=true, or leave "
                                        "them out (full fine-tuning)")


def _check_function_spec(spec: str) -> None:
    """``reward.function`` is well formed (the file itself is checked when scoring starts)."""
    try:
        parse_function_spec(spec, check_file=False)
    except ValueError as exc:
        _check(False, str(exc))


def _check_tools(tools, tiny) -> None:
    """``rollout.tools`` (docs/tir.md) and the tiny TIR demo's knobs."""
    _check(0.0 <= tiny.warm_start_tool_fraction <= 1.0,
           f"tiny.warm_start_tool_fraction must be in [0, 1], got {tiny.warm_start_tool_fraction}")
    _check(isinstance(tools.params, dict) and all(isinstance(v, dict) for v in tools.params.values()),
           f"rollout.tools.params must map tool names to parameter dicts, got {tools.params!r}")
    if not tools.enabled:
        return
    from stapo.tools import available_tool_parsers, available_tools  # user tools registered by now count

    _check(tools.parser in available_tool_parsers(),
           f"rollout.tools.parser: unknown parser {tools.parser!r}; available: {', '.join(available_tool_parsers())}")
    _check(len(tools.names) > 0, "rollout.tools.names must list at least one tool, e.g. rollout.tools.names=[python]")
    unlisted = sorted(set(tools.params) - set(tools.names))
    _check(not unlisted, f"rollout.tools.params has tools that rollout.tools.names does not list: {unlisted}")
    for name in tools.names:
        _check(name in available_tools(), f"rollout.tools: unknown tool {name!r}; available: "
                                          f"{', '.join(available_tools())} (stapo tools lists them)")
        _check_tool_params(tools, name)


def _check_tool_params(tools, name: str) -> None:
    """The tool builds with what training gives it (``ToolsConfig.settings_of``, as stapo.trainer.tool_setup)."""
    from stapo.tools import build_tool

    try:
        build_tool(name, **tools.settings_of(name)[0])
    except (TypeError, ValueError) as exc:
        _check(False, f"rollout.tools.params.{name}: {exc}")


def _check_offload_training_state(cfg) -> None:
    """``rollout.offload_training_state`` moves ZeRO state aside while a colocated vLLM generates."""
    if not cfg.rollout.offload_training_state:
        return
    name, r, t = "rollout.offload_training_state", cfg.rollout, cfg.trainer
    _check(r.mode == "colocated", f"{name} is for colocated engines: with rollout.mode=server vLLM has devices "
                                  "of its own")
    _check(t.zero_stage >= 1, f"{name} needs trainer.zero_stage >= 1: stage 0 keeps no ZeRO state to move")
    _check(not t.offload, f"{name} and trainer.offload: ZeRO-Offload keeps the optimizer state on the host "
                          "already; use one of them")
    _check(not cfg.model.lora.enabled, f"{name} has nothing worth moving with model.lora.enabled: the adapters' "
                                       "state is small and the frozen base weights are not optimizer state")


def _check_rollout_servers(r) -> None:
    """``rollout.mode`` / ``rollout.server`` / ``max_staleness`` (docs/rollout.md, "Rollout servers")."""
    from stapo.servers.client import parse_address
    from stapo.sync.weight_group import MAX_JOIN_TIMEOUT_S

    s = r.server
    _check(isinstance(s.addresses, list), f"rollout.server.addresses must be a list of host:port, got {s.addresses!r}")
    if r.mode == "server":
        _check(bool(s.addresses), "rollout.mode=server needs rollout.server.addresses: the host:port of every "
                                  "`stapo serve MODEL`, e.g. rollout.server.addresses=[127.0.0.1:8000]")
    for address in s.addresses:
        try:
            parse_address(address)
        except ValueError as err:
            _check(False, f"rollout.server.addresses: {err}")
    _check(s.token_file is None or s.token_file.strip() != "",
           "rollout.server.token_file must name a file (or be unset: STAPO_SERVER_TOKEN, then stapo serve's default "
           "file, is read)")
    _check(s.sync_join_timeout_s <= MAX_JOIN_TIMEOUT_S,
           f"rollout.server.sync_join_timeout_s must be <= {MAX_JOIN_TIMEOUT_S:g}, got {s.sync_join_timeout_s}: a "
           "server waits no longer for the trainer's go")
    _check(s.sync == "full" or r.mode == "server",
           "rollout.server.sync=delta needs rollout.mode=server: a colocated engine loads the weights from the "
           "trainer's own memory, nothing crosses a network")
    _check(r.max_staleness == 0 or r.mode == "server",
           f"rollout.max_staleness={r.max_staleness} (asynchronous training) needs rollout.mode=server: a "
           "colocated engine shares the trainer's devices, so generation cannot overlap the update")
    _check(not r.partial or (r.mode == "server" and r.max_staleness >= 1),
           "rollout.partial (partial rollouts across weight syncs) needs rollout.mode=server and "
           "rollout.max_staleness >= 1: in lock-step nothing is generated during a sync")
    _check(r.max_staleness == 0 or not r.dynamic_sampling,
           "rollout.dynamic_sampling needs rollout.max_staleness=0: its extra rounds are agreed across ranks after "
           "a batch is scored, so a batch the producer generates ahead could not know which iteration it fills "
           "(nor its staleness bound or resume point; docs/grpo_options.md)")
