"""DeepSpeed engine: AdamW, warm-up-then-constant lr, global-norm clipping (ZeRO 0-3; docs/distributed.md).

A non-finite grad norm makes DeepSpeed skip the optimizer and the lr schedule, in bf16 and fp32 too;
:mod:`stapo.distributed.accumulation` reads that as ``StepResult.applied=False``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from stapo.distributed import zero3_trace
from stapo.distributed.process_group import comm_device, get_world_size


def warmup_factor(step: int, warmup_steps: int) -> float:
    """lr factor of 0-based step ``step``: ``(step + 1) / warmup_steps`` up to 1 (paper Table 6: 10 steps); the
    first step is not zero-lr, which in RL would waste a rollout. ``warmup_steps=4``: 0.25, 0.5, 0.75, 1, 1, ..."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


@dataclass(frozen=True)
class ZeroTuning:
    """ZeRO communication settings (the ``zero:`` config section, docs/distributed.md); ``None`` leaves
    DeepSpeed's default. Stage-3 fields apply only at ``zero_stage=3``, the others at stages 1-3."""

    param_persistence_threshold: int | None = None  # stage 3: tensors below this stay whole
    prefetch_bucket_size: int | None = None  # stage 3: elements gathered ahead of use
    max_live_parameters: int | None = None  # stage 3: gathered elements held before releasing
    max_reuse_distance: int | None = None  # stage 3: keep a parameter reused within this distance
    reduce_bucket_size: int | None = None  # gradient elements reduced together
    overlap_comm: bool | None = None  # reduce on a side stream during backward
    contiguous_gradients: bool | None = None  # gradients into one contiguous buffer


# our name -> (DeepSpeed ``zero_optimization`` key, lowest stage it applies to)
_ZERO_KEYS = {
    "param_persistence_threshold": ("stage3_param_persistence_threshold", 3),
    "prefetch_bucket_size": ("stage3_prefetch_bucket_size", 3),
    "max_live_parameters": ("stage3_max_live_parameters", 3),
    "max_reuse_distance": ("stage3_max_reuse_distance", 3),
    "reduce_bucket_size": ("reduce_bucket_size", 1),
    "overlap_comm": ("overlap_comm", 1),
    "contiguous_gradients": ("contiguous_gradients", 1),
}


def _zero_keys(zero_tuning: ZeroTuning | None, zero_stage: int) -> dict[str, Any]:
    """The ``zero_optimization`` keys of ``zero_tuning`` that apply at ``zero_stage`` (None: none)."""
    keys = {}
    for name, (key, min_stage) in _ZERO_KEYS.items():
        value = getattr(zero_tuning, name) if zero_tuning is not None else None
        if value is not None and zero_stage >= min_stage:
            keys[key] = value
    return keys


def deepspeed_config(
    *,
    grad_accum_steps: int,
    micro_batch_size: int,
    grad_clip: float,
    zero_stage: int,
    bf16: bool,
    offload: bool,
    zero_tuning: ZeroTuning | None = None,
) -> dict[str, Any]:
    """The DeepSpeed JSON config for our flat arguments (pure; exposed for logging and tests)."""
    zero: dict[str, Any] = {"stage": zero_stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    zero.update(_zero_keys(zero_tuning, zero_stage))
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "gradient_clipping": grad_clip,
        "bf16": {"enabled": bf16},
        "zero_optimization": zero,
        "steps_per_print": 2**62,  # our metrics sinks do the logging
        "wall_clock_breakdown": False,
    }
    if bf16:  # see BF16_NEEDS_STAGE: DeepSpeed's default accumulates in the model's dtype
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        if zero_stage == 1:  # the fp32 sum is all-reduced once per step: not rounded back to bf16 for it
            config["communication_data_type"] = "fp32"
    return config


# docs/distributed.md, "bf16 gradients accumulate in fp32": DeepSpeed's stage 0 cannot accumulate in fp32.
BF16_NEEDS_STAGE = ("bf16 weights need trainer.zero_stage >= 1: DeepSpeed's stage 0 adds the micro-batch "
                    "gradients of a step in bf16; stage 1 accumulates them in fp32 (on one GPU it partitions "
                    "nothing)")


def _check_args(lr: float, warmup_steps: int, grad_accum_steps: int, micro_batch_size: int,
                grad_clip: float, zero_stage: int, bf16: bool) -> None:
    problems = [BF16_NEEDS_STAGE] if bf16 and zero_stage == 0 else []
    if not lr > 0:
        problems.append(f"lr must be > 0, got {lr}")
    if warmup_steps < 0:
        problems.append(f"warmup_steps must be >= 0, got {warmup_steps}")
    if grad_accum_steps < 1:
        problems.append(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
    if micro_batch_size < 1:
        problems.append(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if grad_clip < 0:
        problems.append(f"grad_clip must be >= 0 (0 disables clipping), got {grad_clip}")
    if zero_stage not in (0, 1, 2, 3):
        problems.append(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if problems:
        raise ValueError("build_engine: " + "; ".join(problems))


def _check_same_weights(model: torch.nn.Module) -> None:
    """Fail fast if ranks hold different initial weights: ZeRO-3 partitions each rank's local copy, so a
    per-rank seed would silently train a mixture."""
    import torch.distributed as dist

    named = [(n, p) for n, p in model.named_parameters() if not hasattr(p, "ds_id")]
    if get_world_size() == 1 or not named:
        return
    sums = torch.stack([p.detach().double().sum() for _, p in named]).to(comm_device())  # (P,)
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    differ = (low != high).nonzero().flatten().tolist()
    if differ:
        first = named[differ[0]][0]
        raise ValueError(f"build_engine: initial weights differ across ranks (first: {first}); seed "
                         "model creation identically on every rank or load the same checkpoint")


def build_engine(
    model: torch.nn.Module,
    *,
    lr: float,
    warmup_steps: int,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    grad_clip: float = 1.0,
    grad_accum_steps: int,
    micro_batch_size: int = 1,
    zero_stage: int = 3,
    bf16: bool,
    gradient_checkpointing: bool = False,
    compile_layers: bool = False,
    offload: bool = False,
    zero_tuning: ZeroTuning | None = None,
):
    """``model`` in a DeepSpeed engine with AdamW and the lr schedule; every rank passes identical weights.

    ``torch.optim.AdamW`` (deterministic, no JIT build), or ``DeepSpeedCPUAdam`` when ZeRO-Offload requires it.
    """
    import deepspeed

    _check_args(lr, warmup_steps, grad_accum_steps, micro_batch_size, grad_clip, zero_stage, bf16)
    _check_same_weights(model)
    if gradient_checkpointing:
        _enable_activation_checkpointing(model)
    if compile_layers:
        compile_decoder_layers(model)
    params = [p for p in model.parameters() if p.requires_grad]
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(params, lr=lr, betas=betas, eps=eps,
                                     weight_decay=weight_decay, adamw_mode=True)
    else:
        # ZeRO-1..3 and bf16 (which DeepSpeed wraps) skip a non-finite step themselves; fp32 stage 0 needs the guard
        adamw = GuardedAdamW if zero_stage == 0 and not bf16 else torch.optim.AdamW
        optimizer = adamw(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if isinstance(optimizer, GuardedAdamW):
        optimizer.max_grad_norm, grad_clip = grad_clip, 0.0  # it clips itself, from the pre-clip norm
    schedule = functools.partial(warmup_factor, warmup_steps=warmup_steps)
    config = deepspeed_config(grad_accum_steps=grad_accum_steps, micro_batch_size=micro_batch_size,
                              grad_clip=grad_clip, zero_stage=zero_stage, bf16=bf16, offload=offload,
                              zero_tuning=zero_tuning)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        config=config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
    )
    zero3_trace.register(engine)  # ZeRO-3: one parameter trace per pass kind, so every pass prefetches
    return engine


def build_reference(model: torch.nn.Module, *, zero_stage: int, bf16: bool,
                    zero_tuning: ZeroTuning | None = None) -> torch.nn.Module:
    """The frozen initial policy for the k3 KL term, partitioned like the policy under ZeRO-3 (an inference
    engine), a plain module on the policy's device otherwise; returns the module to run forwards on."""
    model.requires_grad_(False).eval()
    if zero_stage != 3:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        return model.to(device)
    import deepspeed

    zero = {"stage": 3, **_zero_keys(zero_tuning, zero_stage)}
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": bf16},
              "zero_optimization": zero, "steps_per_print": 2**62}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    zero3_trace.register(engine)
    return engine.module


class GuardedAdamW(torch.optim.AdamW):
    """AdamW that clips the global grad norm itself and skips a non-finite step, for fp32 ZeRO stage 0.

    There DeepSpeed hands the step to the bare optimizer, which would apply NaNs; this one sets what DeepSpeed
    reads from its ZeRO optimizers: ``overflow`` (a skipped step) and ``_global_grad_norm`` (before clipping).
    """

    max_grad_norm: float = 0.0
    overflow: bool = False
    _global_grad_norm: float | None = None

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
        self._global_grad_norm = float(norm)
        self.overflow = not math.isfinite(self._global_grad_norm)
        if self.overflow:
            return None
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm)
        return super().step(closure)


def current_lr(engine) -> float:
    """lr of the first param group, as used by the *next* step."""
    return float(engine.get_lr()[0])


def base_lrs(engine) -> list[float]:
    """The lr schedule's base lr of every param group (what the warm-up factor multiplies)."""
    return list(engine.lr_scheduler.base_lrs)


def set_base_lrs(engine, lrs: list[float]) -> None:
    """New base lrs from the next step on, warm-up included (the scheduler's are checkpointed)."""
    scheduler = engine.lr_scheduler
    for group, old, new in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, lrs):
        group["lr"] *= new / old
    scheduler.base_lrs = list(lrs)


def _enable_activation_checkpointing(model) -> None:
    """``activation_checkpointing_enable`` (transformers >= 5.2x), else its older alias."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ValueError(f"gradient_checkpointing=True but {type(model).__name__} has no "
                         "activation_checkpointing_enable() (expected a transformers model)")


def compile_decoder_layers(model) -> int:
    """``torch.compile`` every decoder layer in place (names and hooks unchanged, any length); returns how many.
    The embedding, the head and the root stay eager."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"model.compile_layers: {type(model).__name__} has no transformers decoder layers "
                         "(GradientCheckpointingLayer) to compile")
    for layer in layers:
        layer.compile(dynamic=True)  # every micro-batch has its own length: one graph for all lengths
    return len(layers)
