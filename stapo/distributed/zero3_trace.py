"""One ZeRO-3 parameter trace per pass kind, so every pass prefetches (docs/distributed.md, "ZeRO-3 prefetch").

DeepSpeed's stage-3 coordinator (0.19.8) keeps ONE trace per engine and prefetches only from a complete one;
the stats pass and the update would invalidate each other's. Prefetching changes when a parameter is gathered,
never its value.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

#: pass kinds of the trainer: the no-grad stats (and token-record) passes, the update, the KL reference
NO_GRAD, UPDATE, REFERENCE = "no_grad", "update", "reference"

#: root module -> (its engine's DeepSpeedZeRoOffload, {pass kind: coordinator, created on first use})
_TRACES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _new_coordinator(offload):
    """A fresh coordinator with the settings DeepSpeedZeRoOffload.__init__ gave the engine's own."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    stream_attr = "_DeepSpeedZeRoOffload__allgather_stream"  # private; set in __init__ since 0.6
    if not hasattr(offload, stream_attr):
        raise RuntimeError(f"this DeepSpeed's DeepSpeedZeRoOffload has no {stream_attr}; stapo's per-pass "
                           "ZeRO-3 traces (stapo.distributed.zero3_trace) were written against 0.19.8")
    return PartitionedParameterCoordinator(
        prefetch_bucket_sz=offload._prefetch_bucket_sz,
        max_reuse_distance_in_numel=offload._max_reuse_distance_in_numel,
        max_available_parameters_in_numel=offload._max_available_parameters_in_numel,
        allgather_stream=getattr(offload, stream_attr),
        inflight_param_registry=offload.module.ds_inflight_param_registry,
        prefetch_nvme=offload.offload_device == OffloadDeviceEnum.nvme,
        timers=offload.timers,
        zero_quantized_weights=offload.zero_quantized_weights,
        zero_quantized_nontrainable_weights=offload.zero_quantized_nontrainable_weights,
        fast_sharding_for_leaf_module=offload.fast_sharding_for_leaf_module,
        log_trace_cache_warnings=offload.log_trace_cache_warnings,
    )


def zero3_offload(engine):
    """The engine's ``DeepSpeedZeRoOffload`` (stage 3 only; None otherwise)."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    optimizer = getattr(engine, "optimizer", None)
    if isinstance(optimizer, DeepSpeedZeRoOffload):
        return optimizer
    return getattr(optimizer, "parameter_offload", None)


def register(engine) -> None:
    """Give the ZeRO-3 ``engine`` one trace per pass kind (no-op below stage 3)."""
    offload = zero3_offload(engine)
    if offload is not None:
        _TRACES[engine.module] = (offload, {})


def unregister(module: torch.nn.Module) -> None:
    """Back to DeepSpeed's single trace for ``module`` (benchmarks and tests compare both)."""
    _TRACES.pop(module, None)


@contextlib.contextmanager
def pass_kind(module: torch.nn.Module, kind: str) -> Iterator[None]:
    """Run the passes of ``module`` (``engine.module``) in the body on the trace kept for ``kind``; a no-op
    for an unregistered module; the innermost scope applies."""
    if module not in _TRACES:
        yield
        return
    offload, coordinators = _TRACES[module]
    if kind not in coordinators:
        coordinators[kind] = _new_coordinator(offload)
    previous, offload.param_coordinator = offload.param_coordinator, coordinators[kind]
    try:
        yield
    finally:
        offload.param_coordinator = previous
