"""Code that runs INSIDE vLLM's worker: the weight-update session over `collective_rpc`.

`VLLMEngine` passes ``worker_extension_cls=WORKER_EXTENSION`` to `vllm.LLM`; vLLM mixes
`StapoWorkerExtension` into its GPU worker class, wherever that worker lives, and
``llm.collective_rpc("stapo_load_weights", args=(payload,))`` calls the method on it
(`StapoWorkerExtension` explains the begin / buckets / finish session):

* worker in this process (external launcher, or ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the call
  is a plain function call, so the payload is the bucket itself, tensors on the GPU, no copy;
* worker in vLLM's engine-core process (vLLM's default for a standalone `LLM`): the arguments
  cross a ZMQ socket through vLLM's msgpack encoder (vllm/v1/serial_utils.py), which decodes
  utility-call arguments without type information, so a tensor would arrive as a bare
  ``[dtype, shape, buffer-index]`` list. `pack_bucket` therefore turns a bucket into msgpack-native
  values only (str, int, list, bytes): one flat byte string per bucket, one RPC per bucket, no
  pickle, no function objects (so no ``VLLM_ALLOW_INSECURE_SERIALIZATION``).

vLLM imports this module by its qualified name inside its worker; at import it needs torch only.
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


def reprocess_tied_layers(model: torch.nn.Module) -> int:
    """Re-derive what every layer that shares a parameter computed from it at load time.

    vLLM's layerwise reload processes a tied parameter only through the layer that loads it (a
    documented limitation of vllm/model_executor/model_loader/reload): with tied embeddings,
    Qwen3's ``lm_head`` shares ``embed_tokens.weight`` but receives nothing, so it keeps what its
    ``process_weights_after_loading`` built at start-up — on vLLM's CPU build a prepacked GEMM copy
    of the OLD weights, which made every synced policy sample through the initial output layer.
    (On CUDA that step does nothing for embeddings, so this costs nothing there.) Returns the number
    of layers reprocessed."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    shared = {id(m): m for mods in owners.values() if len(mods) > 1 for m in mods}
    count = 0
    for module in shared.values():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
            count += 1
    return count


class StapoWorkerExtension:
    """Mixed into vLLM's worker (``self`` is the worker: ``model_runner``, ``device``, ``vllm_config``).

    A weight sync is ONE update session: `stapo_begin_weight_update`, `stapo_load_weights` once per
    bucket, `stapo_finish_weight_update`. The session is vLLM's layerwise reload (what its own
    ``reload_weights`` and weight-transfer engines run for checkpoint-format weights): begin puts every
    layer's parameters back into checkpoint format and buffers what arrives; a layer is processed
    into its kernel format (fused q/k/v and gate/up, the CPU backend's repacked linears) and copied
    into the running model's tensors once ALL its weights have arrived, and finish processes the
    rest. So a bucket may end in the middle of a fused layer, and the same code path serves the GPU
    and the CPU build. Method names carry a ``stapo_`` prefix: vLLM refuses an extension whose
    attributes collide with the worker's own.
    """

    def _stapo_model(self):
        return self.model_runner.get_model()

    def stapo_begin_weight_update(self) -> None:
        """Start a session: layers wait for their full set of weights before they are processed."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if getattr(self, "_stapo_updating", False):
            raise RuntimeError("a weight update session is already open (finish it first)")
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self._stapo_model())
        self._stapo_updating = True

    def stapo_load_weights(self, payload) -> int:
        """Load one bucket: a packed dict (`pack_bucket`) or, in-process, ``[(name, tensor)]``.

        vLLM's model ``load_weights`` maps HF names onto its fused layers (q/k/v -> qkv_proj).
        Returns the number of tensors received."""
        from vllm.config import set_current_vllm_config

        if not getattr(self, "_stapo_updating", False):
            raise RuntimeError("stapo_load_weights outside a weight update session")
        weights = unpack_bucket(payload, self.device) if isinstance(payload, dict) else list(payload)
        with set_current_vllm_config(self.vllm_config):
            self._stapo_model().load_weights(weights)
        return len(weights)

    def stapo_finish_weight_update(self) -> None:
        """Process the layers still waiting (attention, anything not fully loaded) and close the session."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not getattr(self, "_stapo_updating", False):
            raise RuntimeError("stapo_finish_weight_update without a matching begin")
        try:
            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(self._stapo_model(), self.model_runner.model_config)
                reprocess_tied_layers(self._stapo_model())
        finally:
            self._stapo_updating = False
