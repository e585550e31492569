"""Weight sync ZeRO-3 → rollout engine, one all-gather per bucket (Algorithm 1 line 3; docs/distributed.md,
"Weight sync").

Gathering one parameter at a time (TRL, OpenRLHF) pays one collective per tensor; a bucket up to ``bucket_bytes``
takes ONE (``stapo.distributed.flat_gather``), at a peak of about (2 + 1/world) × ``bucket_bytes``
(``bench/weight_sync.py``). Gathers are collective: every rank iterates the same buckets.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol

import torch

from stapo.distributed.flat_gather import GatherBuffers, gather_partitioned, gathered
from stapo.distributed.lora import AdapterMerge
from stapo.distributed.names import hf_name
from stapo.sync.weight_delta import TransferStats

DEFAULT_BUCKET_BYTES = 256 * 2**20  # 256 MiB

Bucket = list[tuple[str, torch.Tensor]]


class WeightConsumer(Protocol):
    """The rollout-engine side of a sync (``RolloutEngine.weight_update`` / ``load_weights`` / ``last_sync``)."""

    last_sync: object  # what the engine's last sync did (``.transfer``: the bytes it sent), or None

    def weight_update(self, version: int | None = None) -> contextlib.AbstractContextManager: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...


@dataclass(frozen=True)
class SyncStats:
    """What one :func:`sync_weights` moved (dense bytes) and took; ``transfer``: what the engine put on the wire,
    when it says (rollout servers, on rank 0)."""

    num_buckets: int
    num_tensors: int
    num_bytes: int
    seconds: float
    transfer: TransferStats | None = None


def full_numel(param: torch.Tensor) -> int:
    """Unpartitioned element count (ZeRO-3 params keep it in ``ds_numel``)."""
    return int(getattr(param, "ds_numel", param.numel()))


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Greedy, order-preserving grouping of byte sizes into buckets of ≤ ``bucket_bytes`` (a larger tensor gets
    its own). E.g. sizes [4, 4, 8, 2], budget 8 → [[0, 1], [2], [3]]."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, size in enumerate(sizes):
        if current and used + size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(index)
        used += size
    if current:
        buckets.append(current)
    return buckets


def _route(param: torch.nn.Parameter) -> str:
    """``local`` (plain or already gathered), ``flat`` (our gather) or ``deepspeed`` (fallback)."""
    if not hasattr(param, "ds_id") or param.ds_status.name == "AVAILABLE":
        return "local"
    part = getattr(param, "ds_tensor", None)
    plain_partition = (part is not None and not hasattr(part, "ds_quant_scale")
                       and getattr(part, "final_location", None) is None)  # not NVMe-swapped
    return "flat" if plain_partition and param.ds_status.name == "NOT_AVAILABLE" else "deepspeed"


@contextlib.contextmanager
def _full_tensors(params: list[torch.nn.Parameter], copy: bool,
                  buffers: GatherBuffers) -> Iterator[list[torch.Tensor]]:
    """Full tensors of ``params`` (in order), valid in the ``with`` body; one collective per
    process group for the partitioned ones (one in total for a DeepSpeed model)."""
    routes = [_route(p) for p in params]
    out: list[torch.Tensor | None] = [None] * len(params)
    by_group: dict[int, list[int]] = {}
    for i, route in enumerate(routes):
        if route == "flat":
            by_group.setdefault(id(params[i].ds_process_group), []).append(i)
    for indices in by_group.values():  # rebuilt tensors own their storage: never copied again
        group_params = [params[i] for i in indices]
        for i, full in zip(indices, gather_partitioned(group_params, buffers)):
            out[i] = full
    with gathered([p for p, r in zip(params, routes) if r == "deepspeed"]):
        for i, route in enumerate(routes):
            if route != "flat":
                tensor = params[i].detach()
                out[i] = tensor.clone() if copy else tensor
        yield out


def _persistent_buffers(model: torch.nn.Module) -> Bucket:
    """Buffers that belong in a state dict (ZeRO-3 never partitions buffers)."""
    out = []
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                full = f"{module_name}.{name}" if module_name else name
                out.append((hf_name(full), buf.detach().clone()))
    return out


def iter_weight_buckets(
    model: torch.nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, copy: bool = True
) -> Iterator[Bucket]:
    """Yield ``[(hf_name, full_tensor), ...]`` buckets covering every parameter once (LoRA: adapters merged).
    ``copy=False``: some tensors alias live parameters, valid only until the next bucket."""
    named = list(model.named_parameters())
    names = [hf_name(n) for n, _ in named]
    sizes = [full_numel(p) * p.element_size() for _, p in named]
    merge = AdapterMerge.of(model, hf_name)  # LoRA policy: merged base weights, adapters gathered with them
    units = merge.units(names) if merge is not None else [[i] for i in range(len(named))]
    gather_buffers = GatherBuffers()  # this iteration's; freed with the generator
    for unit_ids in plan_buckets([sum(sizes[i] for i in u) for u in units], bucket_bytes):
        indices = [i for u in unit_ids for i in units[u]]
        with _full_tensors([named[i][1] for i in indices], copy, gather_buffers) as tensors:
            bucket = [(names[i], t) for i, t in zip(indices, tensors)]
            del tensors
            yield merge(bucket) if merge is not None else bucket
        del bucket  # only the caller may hold the previous bucket while the next is gathered
    buffers = _persistent_buffers(model)
    if buffers:
        yield merge(buffers) if merge is not None else buffers


def iter_weights_per_param(model: torch.nn.Module, *, copy: bool = True) -> Iterator[Bucket]:
    """Baseline: one gather (one collective) per parameter, each yielded as a 1-tensor bucket."""
    for name, param in model.named_parameters():
        with gathered([param]):
            tensor = param.detach()
            yield [(hf_name(name), tensor.clone() if copy else tensor)]
    buffers = _persistent_buffers(model)
    if buffers:
        yield buffers


def sync_weights(
    model: torch.nn.Module, engine_like: WeightConsumer, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
    version: int | None = None,
) -> SyncStats:
    """Push the current weights into ``engine_like``, one bucket per `load_weights`, inside ONE `weight_update`
    session (``version``: what the engine holds afterwards). On every rank: the gathers are collective."""
    start = time.perf_counter()
    num_buckets = num_tensors = num_bytes = 0
    with engine_like.weight_update(version):
        for bucket in iter_weight_buckets(model, bucket_bytes, copy=False):
            engine_like.load_weights(bucket)
            num_buckets += 1
            num_tensors += len(bucket)
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            del bucket  # let the next gather reuse its memory
    transfer = None if engine_like.last_sync is None else engine_like.last_sync.transfer
    return SyncStats(num_buckets, num_tensors, num_bytes, time.perf_counter() - start, transfer)


class StateDictConsumer:
    """A ``load_weights`` target that copies into a module's parameters and buffers (a tied alias: either name),
    checking the whole bucket's names and shapes before it copies anything (`HFEngine`, tests, benchmarks)."""

    last_sync = None

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._targets = dict(model.named_parameters(remove_duplicate=False))
        self._targets.update(model.named_buffers(remove_duplicate=False))

    def weight_update(self, version: int | None = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        bucket, model = list(weights), type(self.model).__name__
        unknown = [name for name, _ in bucket if name not in self._targets]
        if unknown:
            more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
            raise KeyError(f"load_weights: {unknown[0]!r}{more} is not a parameter or buffer of {model}; it has e.g. "
                           f"{list(self._targets)[:3]}")
        for name, tensor in bucket:
            if tuple(tensor.shape) != tuple(self._targets[name].shape):
                raise ValueError(f"load_weights: {name} has shape {tuple(tensor.shape)}, {model} expects "
                                 f"{tuple(self._targets[name].shape)}")
        for name, tensor in bucket:
            self._targets[name].copy_(tensor)
