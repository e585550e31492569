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
  pickle, no function objects (so no ``VLLM_ALLOW_INSECURE_SERIALIZATION``);
* worker behind a vLLM SERVER (``rollout.mode: server``, `stapo.rollout.server_engine`): vLLM's
  ``/collective_rpc`` route passes JSON strings only, so the trainer sends each bucket's layout as
  JSON and its bytes by ``broadcast`` over a process group the worker joins for the session
  (`stapo_join_weight_group`: gloo on CPU, NCCL on GPUs), as vLLM's RLHF examples do.

vLLM imports this module by its qualified name inside its worker; at import it needs torch only.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Sequence

import torch

__all__ = ["WORKER_EXTENSION", "StapoWorkerExtension", "GroupSpec", "pack_bucket", "pack_bucket_tensor",
           "unpack_bucket", "unpack_tensors"]

WORKER_EXTENSION = "stapo.rollout.vllm_worker.StapoWorkerExtension"
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


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """Where and how a server's workers join the trainer's weight-transfer group for one session.

    Rank 0 is the trainer (the broadcast's source, hosting the TCPStore at ``host:port``); a server's
    workers take ranks ``rank_offset + worker rank``. JSON-able: it crosses vLLM's ``/collective_rpc``.
    """

    host: str
    port: int
    world_size: int
    rank_offset: int = 0
    backend: str = "gloo"  # gloo (CPU tensors) or nccl (GPU tensors)
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"weight-transfer backend must be gloo or nccl, got {self.backend!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "GroupSpec":
        return cls(**json.loads(text))

    def connect(self, rank: int, store=None):
        """This process's member of the group (a torch ``ProcessGroupGloo`` / ``ProcessGroupNCCL``);
        rank 0 passes the store it hosts, the others connect to it."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout_s)
        if store is None:
            store = dist.TCPStore(self.host, self.port, None, False, timeout=timeout)
        if self.backend == "nccl":
            return dist.ProcessGroupNCCL(store, rank, self.world_size)
        return dist.ProcessGroupGloo(store, rank, self.world_size, timeout)


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
        if not getattr(self, "_stapo_updating", False):
            raise RuntimeError("stapo_load_weights outside a weight update session")
        weights = unpack_bucket(payload, self.device) if isinstance(payload, dict) else list(payload)
        return self._stapo_load(weights)

    def _stapo_load(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        from vllm.config import set_current_vllm_config

        if not getattr(self, "_stapo_updating", False):
            raise RuntimeError("weights received outside a weight update session")
        with set_current_vllm_config(self.vllm_config):
            self._stapo_model().load_weights(weights)
        return len(weights)

    def stapo_finish_weight_update(self, version: str | int | None = None) -> None:
        """Process the layers still waiting (attention, anything not fully loaded) and close the session;
        ``version`` (the trainer's policy version) is what `stapo_policy_version` reports afterwards."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not getattr(self, "_stapo_updating", False):
            raise RuntimeError("stapo_finish_weight_update without a matching begin")
        try:
            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(self._stapo_model(), self.model_runner.model_config)
                reprocess_tied_layers(self._stapo_model())
            if version is not None:
                self._stapo_version = int(version)
        finally:
            self._stapo_updating = False
            self._stapo_group = None  # a server session's process group ends with the session

    # ---- a vLLM server's side of a sync (rollout.mode: server) ---------------------------------
    def stapo_policy_version(self) -> int | None:
        """The trainer's policy version these weights are (None: the weights the server started with)."""
        return getattr(self, "_stapo_version", None)

    def stapo_join_weight_group(self, spec: str) -> int:
        """Join the trainer's weight-transfer group of this session (``spec``: a `GroupSpec` as JSON) and
        begin the update session; returns this worker's rank in the group."""
        group = GroupSpec.from_json(spec)
        rank = group.rank_offset + int(getattr(self, "rank", 0))
        self._stapo_group = group.connect(rank)
        self._stapo_group_device = "cuda" if group.backend == "nccl" else "cpu"
        self.stapo_begin_weight_update()
        return rank

    def stapo_receive_bucket(self, layout: str) -> int:
        """Receive one bucket by broadcast from the trainer (its layout as JSON) and load it."""
        group = getattr(self, "_stapo_group", None)
        if group is None:
            raise RuntimeError("stapo_receive_bucket before stapo_join_weight_group")
        spec = json.loads(layout)
        raw = torch.empty(int(spec["nbytes"]), dtype=torch.uint8, device=self._stapo_group_device)
        group.broadcast(raw, 0).wait()
        return self._stapo_load(unpack_tensors(spec, raw.to(self.device)))
