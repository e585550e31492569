"""Code that runs INSIDE vLLM's worker: weight loading and reseeding over `collective_rpc`.

`VLLMEngine` passes ``worker_extension_cls=WORKER_EXTENSION`` to `vllm.LLM`; vLLM mixes
`StapoWorkerExtension` into its GPU worker class, wherever that worker lives, and
``llm.collective_rpc("stapo_load_weights", args=(payload,))`` calls the method on it:

* worker in this process (external launcher, or ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the call
  is a plain function call, so the payload is the bucket itself, tensors on the GPU, no copy;
* worker in vLLM's engine-core process (vLLM's default for a standalone `LLM`): the arguments
  cross a ZMQ socket through vLLM's msgpack encoder (vllm/v1/serial_utils.py), which decodes
  utility-call arguments without type information, so a tensor would arrive as a bare
  ``[dtype, shape, buffer-index]`` list. `pack_bucket` therefore turns a bucket into msgpack-native
  values only (str, int, list, bytes): one flat byte string per bucket, one RPC per bucket, no
  pickle, no function objects (so no ``VLLM_ALLOW_INSECURE_SERIALIZATION``).

vLLM imports this module by its qualified name inside its worker; it imports torch only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["WORKER_EXTENSION", "StapoWorkerExtension", "pack_bucket", "unpack_bucket"]

WORKER_EXTENSION = "stapo.rollout.vllm_worker.StapoWorkerExtension"
_ALIGN = 16  # byte offset alignment of every tensor in a packed bucket (any dtype can view it)


def pack_bucket(bucket: Sequence[tuple[str, torch.Tensor]]) -> dict:
    """``[(name, tensor)]`` -> ``{"names", "dtypes", "shapes", "offsets", "data"}`` with msgpack-native
    values: the tensors' bytes concatenated (16-byte aligned) into one ``bytes`` on the CPU."""
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
    if not parts:
        data = b""
    else:  # concatenate on the tensors' device, then ONE device-to-host copy per bucket
        devices = {p.device for p in parts}
        device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        data = torch.cat([p.to(device) for p in parts]).cpu().numpy().tobytes()
    return {"names": names, "dtypes": dtypes, "shapes": shapes, "offsets": offsets, "data": data}


def unpack_bucket(packed: dict, device: torch.device | str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """Inverse of `pack_bucket`: ``[(name, tensor)]`` on ``device`` (one host-to-device copy)."""
    missing = [k for k in ("names", "dtypes", "shapes", "offsets", "data") if k not in packed]
    if missing:
        raise ValueError(f"packed weight bucket lacks {missing}")
    names, dtypes, shapes, offsets = packed["names"], packed["dtypes"], packed["shapes"], packed["offsets"]
    if not len(names) == len(dtypes) == len(shapes) == len(offsets):
        raise ValueError("packed weight bucket: names, dtypes, shapes and offsets differ in length")
    if not names:
        return []
    raw = torch.frombuffer(bytearray(packed["data"]), dtype=torch.uint8).to(device)  # (nbytes,)
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


class StapoWorkerExtension:
    """Mixed into vLLM's GPU worker (``self`` is the worker: ``model_runner``, ``device``).

    Method names carry a ``stapo_`` prefix: vLLM refuses an extension whose attributes collide
    with the worker's own.
    """

    def stapo_load_weights(self, payload) -> int:
        """Load one bucket: a packed dict (`pack_bucket`) or, in-process, ``[(name, tensor)]``.

        vLLM's model ``load_weights`` maps HF names onto its fused layers (q/k/v -> qkv_proj) and
        its tensor-parallel shards. Returns the number of tensors received."""
        weights = unpack_bucket(payload, self.device) if isinstance(payload, dict) else list(payload)
        self.model_runner.get_model().load_weights(weights)
        return len(weights)

    def stapo_reseed(self, seed: int) -> None:
        """Reseed the worker's torch RNGs (CPU and CUDA): vLLM samples requests without their own
        seed from the default CUDA generator, in one batched draw."""
        torch.manual_seed(int(seed))
