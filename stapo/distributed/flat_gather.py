"""One all-gather for a bucket of ZeRO-3 partitioned parameters (the weight sync).

Relies on DeepSpeed 0.19's layout (``_partition_param``): rank ``r`` holds ``[r*P, (r+1)*P)``,
``P = ceil(ds_numel / world)``, so a parameter is its rank slices concatenated and cut to ``ds_numel``.
"""

from __future__ import annotations

from dataclasses import dataclass

import contextlib

import torch
import torch.distributed as dist

from stapo.distributed.process_group import comm_device

_ALIGN = 16  # bytes: every dtype view of a slot in the flat row starts aligned


@dataclass(frozen=True)
class PartitionSlot:
    """Where one ZeRO-3 parameter's partition sits in each rank's flat byte row."""

    offset: int  # bytes from the start of the row; a multiple of _ALIGN
    part_numel: int  # elements per rank, P = ceil(numel / world) (DeepSpeed's padded layout)
    numel: int  # unpartitioned elements (ds_numel)
    shape: torch.Size  # unpartitioned shape (ds_shape)
    dtype: torch.dtype


def flat_layout(params: list[torch.nn.Parameter]) -> tuple[list[PartitionSlot], int]:
    """Slots of ZeRO-3 ``params`` in one flat row, and the row length in bytes (aligned)."""
    slots, offset = [], 0
    for param in params:
        part_numel = int(param.ds_tensor.ds_numel)
        slots.append(PartitionSlot(offset, part_numel, int(param.ds_numel), param.ds_shape,
                                   param.dtype))
        offset += _aligned(part_numel * param.element_size())
    return slots, offset


def pack_partitions(parts: list[torch.Tensor], slots: list[PartitionSlot],
                    row: torch.Tensor) -> torch.Tensor:
    """This rank's flat byte ``row``: partition ``i`` at ``slots[i].offset`` (gaps never read back)."""
    for part, slot in zip(parts, slots):
        nbytes = slot.part_numel * part.element_size()
        dest = row[slot.offset:slot.offset + nbytes].view(slot.dtype)  # (P,)
        dest.copy_(part.reshape(-1)[:slot.part_numel])
    return row


def unpack_partitions(rows: torch.Tensor, slots: list[PartitionSlot]) -> list[torch.Tensor]:
    """Full tensors (each owning its storage) from gathered rows ``(world, row_bytes)`` uint8."""
    world = rows.shape[0]
    out = []
    for slot in slots:
        full = torch.empty(world * slot.part_numel, dtype=slot.dtype, device=rows.device)
        nbytes = slot.part_numel * slot.dtype.itemsize
        full.view(world, slot.part_numel).copy_(rows[:, slot.offset:slot.offset + nbytes]
                                                .view(slot.dtype))  # (world, P)
        out.append(full[:slot.numel].view(slot.shape))
    return out


class GatherBuffers:
    """Send/receive byte buffers reused by the buckets of one sync, allocated once for the largest."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, key: str, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = self._bufs[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _all_gather_rows(row: torch.Tensor, flat: torch.Tensor, group) -> torch.Tensor:
    """ONE collective: all ranks' ``row`` into ``flat`` (world * row_bytes,) → (world, row)."""
    world = dist.get_world_size(group)
    if world == 1:
        return flat.view(1, -1).copy_(row)
    # concatenated output form: gloo refuses the stacked (world, row_bytes) one
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    try:
        gather_single(flat, row, group=group)
    except (NotImplementedError, RuntimeError) as err:  # a backend without single-tensor gather
        if "support" not in str(err).lower():
            raise
        dist.all_gather(list(flat.chunk(world)), row, group=group)
    return flat.view(world, -1)


def gather_partitioned(params: list[torch.nn.Parameter],
                       buffers: GatherBuffers | None = None) -> list[torch.Tensor]:
    """Full tensors of ZeRO-3 ``params`` of one process group with ONE all-gather; collective (same params,
    same order on every rank)."""
    if not params:
        return []
    group = params[0].ds_process_group
    if any(p.ds_process_group is not group for p in params):
        raise ValueError("gather_partitioned: parameters belong to different process groups")
    slots, row_bytes = flat_layout(params)
    world = dist.get_world_size(group)
    for param, slot in zip(params, slots):
        if slot.part_numel * world < slot.numel or param.ds_tensor.numel() < slot.part_numel:
            raise ValueError(f"gather_partitioned: parameter ds_id={param.ds_id} has partitions of "
                             f"{slot.part_numel} elements ({param.ds_tensor.numel()} stored) on "
                             f"{world} ranks for {slot.numel} elements: not DeepSpeed's layout")
    device = params[0].ds_tensor.device
    device = comm_device(group) if device.type == "cpu" else device  # offloaded partitions: NCCL needs CUDA
    if len(params) == 1:  # no packing: gather straight into the full tensor, as DeepSpeed does
        slot, part = slots[0], params[0].ds_tensor.reshape(-1)[:slots[0].part_numel].to(device)
        full = torch.empty(world * slot.part_numel, dtype=slot.dtype, device=device)
        _all_gather_rows(part.view(torch.uint8), full.view(torch.uint8), group)
        return [full[:slot.numel].view(slot.shape)]
    buffers = buffers or GatherBuffers()
    row = pack_partitions([p.ds_tensor for p in params], slots,
                          buffers.get("send", row_bytes, device))
    rows = _all_gather_rows(row, buffers.get("recv", world * row_bytes, device), group)
    return unpack_partitions(rows, slots)


def gathered(params: list[torch.nn.Parameter]):
    """All-gather ZeRO-3 ``params`` for the ``with`` body (read-only, DeepSpeed's gather); no-op for plain ones."""
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
