"""The training side's ZeRO state in host memory while colocated vLLM generates (``rollout.offload_training_state``;
docs/gpu.md, "Colocated memory"). Values are copied, never recomputed: training is bit-identical with and without
it. Each tensor's ``.data`` points at a pinned host buffer allocated once, so every reference stays valid.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from stapo.distributed.device_memory import release_cached_memory

__all__ = ["TrainingOffload", "offloaded"]


class TrainingOffload:
    """Moves one DeepSpeed engine's ZeRO state to host memory (`offload`) and back (`reload`)."""

    def __init__(self, engine) -> None:
        stage = engine.zero_optimization_stage()
        if stage == 0 or engine.zero_use_cpu_optimizer():  # the config refuses both (stapo/config/validation.py)
            raise ValueError(f"TrainingOffload needs a ZeRO stage >= 1 engine without ZeRO-Offload, got stage {stage}"
                             f"{' with ZeRO-Offload' if stage else ''}")
        self.engine, self.stage = engine, stage
        self.offloaded = False
        self._host: list[torch.Tensor] = []  # the host buffer of each of `_own_tensors()`, allocated once

    # ---- the two moves ------------------------------------------------------------------------
    def offload(self) -> None:
        """Every ZeRO state tensor of the engine to pinned host memory; the device memory is freed."""
        if self.offloaded:
            return
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State

        if self.stage == 3:  # DeepSpeed moves what it can with torch AdamW; the rest goes here (module docstring)
            self.engine.offload_states(include=[State.lp_params, State.lp_grads, State.contiguous_grad_buffer])
            for index, tensor in enumerate(self._own_tensors()):
                host = self._host_buffer(index, tensor)
                host.copy_(tensor)
                tensor.data = host
        else:
            self.engine.offload_states()
        self.offloaded = True
        release_cached_memory()

    def reload(self) -> None:
        """Everything `offload` moved, back on the engine's device."""
        if not self.offloaded:
            return
        self.engine.reload_states()
        if self.stage == 3:
            from deepspeed.accelerator import get_accelerator

            device = get_accelerator().current_device_name()
            for tensor in self._own_tensors():
                tensor.data = tensor.data.to(device, copy=True)
        self.offloaded = False

    @contextlib.contextmanager
    def offloaded_while(self) -> Iterator[None]:
        """The body runs with the training state on the host (generation, the engine's start)."""
        self.offload()
        try:
            yield
        finally:
            self.reload()

    # ---- ZeRO-3's fp32 partitions and AdamW moments -------------------------------------------
    def _own_tensors(self) -> list[torch.Tensor]:
        """The fp32 master partitions and every tensor of their optimizer state (ZeRO-3)."""
        zero = self.engine.optimizer
        master = list(zero.fp32_partitioned_groups_flat)
        state = zero.optimizer.state
        moments = [value for p in master for value in state.get(p, {}).values()
                   if torch.is_tensor(value) and value.dim() > 0]  # AdamW's scalar `step` stays where it is
        return master + moments

    def _host_buffer(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """The ``index``-th tensor's host buffer (the moments join after the first optimizer step)."""
        if index == len(self._host):
            self._host.append(torch.empty(0))
        host = self._host[index]
        if host.shape != tensor.shape or host.dtype != tensor.dtype:
            host = self._host[index] = torch.empty_like(tensor, device="cpu", pin_memory=torch.cuda.is_available())
        return host


def offloaded(offload: TrainingOffload | None) -> contextlib.AbstractContextManager:
    """``offload.offloaded_while()``, or nothing when the run does not offload (``None``)."""
    return offload.offloaded_while() if offload is not None else contextlib.nullcontext()
