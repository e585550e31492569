"""The byte format of a weight bucket: its tensors in ONE flat uint8 buffer plus a JSON layout, for every path a
bucket travels (vLLM's msgpack RPC: `pack_bucket`; a broadcast into servers: `pack_bucket_tensor`). Offsets are
16-byte aligned, so any dtype views its slice in place. Needs torch only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["pack_bucket", "pack_bucket_tensor", "unpack_bucket", "unpack_tensors"]

_ALIGN = 16  # byte offset alignment of every tensor in a packed bucket (any dtype can view it)


def pack_bucket_tensor(bucket: Sequence[tuple[str, torch.Tensor]]) -> tuple[dict, torch.Tensor]:
    """``[(name, tensor)]`` -> ``(layout, flat)``: ``layout`` = ``{"names", "dtypes", "shapes", "offsets",
    "nbytes"}`` (JSON/msgpack-native), ``flat`` = every tensor's bytes concatenated (16-byte aligned) into
    one uint8 tensor on the tensors' device (the CPU when they are spread over devices)."""
    names, dtypes, shapes, offsets, parts = [], [], [], [], []
    size = 0
    for name, tensor in bucket:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # (nbytes,)
        pad = -size % _ALIGN
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=flat.device))
            size += pad
        names.append(str(name))
        dtypes.append(str(tensor.dtype).removeprefix("torch."))
        shapes.append(list(tensor.shape))
        offsets.append(size)
        parts.append(flat)
        size += flat.numel()
    devices = {p.device for p in parts}
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    data = torch.cat([p.to(device) for p in parts]) if parts else torch.zeros(0, dtype=torch.uint8)
    return {"names": names, "dtypes": dtypes, "shapes": shapes, "offsets": offsets, "nbytes": size}, data


def pack_bucket(bucket: Sequence[tuple[str, torch.Tensor]]) -> dict:
    """``[(name, tensor)]`` -> the layout of `pack_bucket_tensor` plus ``"data"``: its bytes as one
    ``bytes`` (ONE device-to-host copy per bucket), for vLLM's msgpack RPC."""
    layout, data = pack_bucket_tensor(bucket)
    layout.pop("nbytes")  # the byte string's length
    return {**layout, "data": data.cpu().numpy().tobytes() if data.numel() else b""}


def unpack_tensors(layout: dict, raw: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `pack_bucket_tensor`: views ``[(name, tensor)]`` into the flat uint8 tensor ``raw``."""
    missing = [k for k in ("names", "dtypes", "shapes", "offsets") if k not in layout]
    if missing:
        raise ValueError(f"packed weight bucket lacks {missing}")
    names, dtypes, shapes, offsets = layout["names"], layout["dtypes"], layout["shapes"], layout["offsets"]
    if not len(names) == len(dtypes) == len(shapes) == len(offsets):
        raise ValueError("packed weight bucket: names, dtypes, shapes and offsets differ in length")
    out = []
    for name, dtype_name, shape, offset in zip(names, dtypes, shapes, offsets):
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"weight {name!r}: unknown dtype {dtype_name!r}")
        numel = 1
        for dim in shape:
            numel *= int(dim)
        nbytes = numel * dtype.itemsize
        if offset + nbytes > raw.numel():
            raise ValueError(f"weight {name!r}: bytes [{offset}, {offset + nbytes}) lie outside the "
                             f"{raw.numel()}-byte bucket")
        out.append((name, raw[offset:offset + nbytes].view(dtype).view(tuple(shape))))
    return out


def unpack_bucket(packed: dict, device: torch.device | str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """Inverse of `pack_bucket`: ``[(name, tensor)]`` on ``device`` (one host-to-device copy)."""
    if "data" not in packed:
        raise ValueError("packed weight bucket lacks ['data']")
    if not packed.get("names"):
        return []
    raw = torch.frombuffer(bytearray(packed["data"]), dtype=torch.uint8).to(device)  # (nbytes,)
    return unpack_tensors(packed, raw)
