"""Exact gradient accumulation: the step sees ``Σ_ranks Σ_micro ∇loss`` (docs/distributed.md).

Micro-batch losses are already normalized by the GLOBAL kept-token count (Eq. 1), so DeepSpeed's
``1/gradient_accumulation_steps`` and ZeRO's data-parallel averaging are undone here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stapo.distributed.process_group import get_world_size


@dataclass(frozen=True)
class StepResult:
    """Outcome of one optimizer step: ``grad_norm`` is the global norm *before* clipping."""

    applied: bool
    grad_norm: float


def _dp_world_size(engine) -> int:
    return int(getattr(engine, "dp_world_size", None) or get_world_size())


def backward_sum(engine, loss: torch.Tensor, *, last: bool) -> None:
    """Accumulate ``∇loss`` unscaled: ``loss * dp_world_size`` cancels ZeRO's averaging over ranks,
    ``scale_wrt_gas=False`` the ``1/gradient_accumulation_steps``; ``last`` marks the boundary."""
    if loss.dim() != 0:
        raise ValueError(f"backward_sum expects a scalar loss, got shape {tuple(loss.shape)}")
    if not loss.requires_grad:
        # ZeRO-3 reduce-scatters inside backward: a rank that skips it deadlocks the others.
        raise ValueError("backward_sum: loss does not require grad; keep it attached to the graph "
                         "(e.g. 0 * surrogate for an empty keep-set) so every rank runs backward")
    engine.set_gradient_accumulation_boundary(last)
    engine.backward(loss * _dp_world_size(engine), scale_wrt_gas=False)
    # ZeRO-3 accumulates (rather than copies) micro-batch gradients once its micro_step_id advances, which
    # engine.forward does; a loss from calling the module directly skips that, so advance it here (a second
    # call is a no-op). Without it only the last micro-batch's gradient survives (tests/trainer/test_exactness.py).
    if hasattr(engine.optimizer, "clear_backward_seen_flag"):
        engine.optimizer.clear_backward_seen_flag()
    if not last:
        engine.step()  # not a boundary: only counts the micro-step


def optimizer_step(engine) -> StepResult:
    """Clip, step AdamW and the lr schedule; a non-finite grad norm skips all three (and clears the grads)."""
    skipped_before = engine.skipped_steps
    engine.step()
    applied = engine.skipped_steps == skipped_before
    norm = engine.get_global_grad_norm()  # DeepSpeed sets inf on a skipped step
    norm = math.inf if not applied else (float(norm) if norm is not None else math.nan)
    return StepResult(applied=applied, grad_norm=norm)


class GradientAccumulation:
    """One optimizer step over exactly ``num_micro_batches`` backwards; holds the count, not the engine."""

    def __init__(self, engine, num_micro_batches: int) -> None:
        if num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
        self.engine, self.total, self.done = engine, num_micro_batches, 0

    def backward(self, loss: torch.Tensor) -> None:
        if self.done == self.total:
            raise RuntimeError(f"backward called again after the last of {self.total} micro-batches; "
                               "call step() first")
        self.done += 1
        backward_sum(self.engine, loss, last=self.done == self.total)

    def step(self) -> StepResult:
        if self.done != self.total:
            raise RuntimeError(f"step called after {self.done} of {self.total} micro-batch backwards")
        self.done = 0
        return optimizer_step(self.engine)
