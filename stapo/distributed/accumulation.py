"""Exact gradient accumulation over a mini-batch's micro-batches on a DeepSpeed engine.

The trainer's per-micro-batch losses are already normalized by a GLOBAL count (kept tokens of the
whole mini-batch on all ranks), so the gradient we want is the plain sum ``Σ_ranks Σ_micro ∇loss``.
DeepSpeed by default divides each backward by ``gradient_accumulation_steps`` and ZeRO's
reduce-scatter *averages* over data-parallel ranks; :func:`backward_sum` undoes both. The number of
micro-batches may differ from one mini-batch to the next (token budgets): the accumulation boundary
is set by hand (DeepSpeed's ``set_gradient_accumulation_boundary``) and counted here, not on the
engine.

    acc = GradientAccumulation(engine, len(micro_batches))
    for micro in micro_batches:
        acc.backward(loss_fn(micro))
    result = acc.step()   # StepResult(applied, grad_norm)
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
    """Accumulate ``∇loss`` so that the step sees exactly ``Σ_ranks Σ_micro ∇loss``.

    ``loss * dp_world_size`` cancels ZeRO's data-parallel averaging; ``scale_wrt_gas=False``
    cancels the ``1/gradient_accumulation_steps`` factor. ``last`` marks the accumulation boundary
    (DeepSpeed's manual boundary), so a mini-batch may have any number of micro-batches (token
    budgets). Between micro-batches ``engine.step()`` only advances the micro-step counter; the
    update itself is :func:`optimizer_step` after the last one. Prefer :class:`GradientAccumulation`,
    which also checks the count.
    """
    if loss.dim() != 0:
        raise ValueError(f"backward_sum expects a scalar loss, got shape {tuple(loss.shape)}")
    if not loss.requires_grad:
        # ZeRO-3 reduce-scatters inside backward: a rank that skips it deadlocks the others.
        raise ValueError("backward_sum: loss does not require grad; keep it attached to the graph "
                         "(e.g. 0 * surrogate for an empty keep-set) so every rank runs backward")
    engine.set_gradient_accumulation_boundary(last)
    engine.backward(loss * _dp_world_size(engine), scale_wrt_gas=False)
    # ZeRO-3 switches from copying to ACCUMULATING micro-batch gradients when its micro_step_id
    # advances, which DeepSpeed does at the start of ``engine.forward``. The update runs its forward
    # through the engine (stapo.distributed.policy.head_on_targets), but a loss computed by calling the
    # module directly would skip it, so advance it here too (a second call is a no-op); without it
    # only the last micro-batch's gradient survives (tests/trainer/test_exactness.py).
    if hasattr(engine.optimizer, "clear_backward_seen_flag"):
        engine.optimizer.clear_backward_seen_flag()
    if not last:
        engine.step()  # not a boundary: only counts the micro-step


def optimizer_step(engine) -> StepResult:
    """Clip the global grad norm, step AdamW and the lr schedule; skip on non-finite grads.

    Must follow the ``backward_sum(..., last=True)`` of a mini-batch. A skipped step leaves
    weights, optimizer moments and the lr schedule unchanged and clears the gradients.
    """
    skipped_before = engine.skipped_steps
    engine.step()
    applied = engine.skipped_steps == skipped_before
    norm = engine.get_global_grad_norm()  # DeepSpeed sets inf on a skipped step
    norm = math.inf if not applied else (float(norm) if norm is not None else math.nan)
    return StepResult(applied=applied, grad_norm=norm)


class GradientAccumulation:
    """One optimizer step over exactly ``num_micro_batches`` backwards (the mini-batch's plan).

    Holds the count itself, so nothing is parked on the DeepSpeed engine::

        acc = GradientAccumulation(engine, len(plan))
        for micro in plan:
            acc.backward(loss_of(micro))
        result = acc.step()   # StepResult(applied, grad_norm)
    """

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
