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
* worker behind a vLLM SERVER (``rollout.mode: server``, `stapo.servers.engine`): vLLM's
  ``/collective_rpc`` route passes JSON strings only, so the trainer sends each bucket's layout as
  JSON and its bytes by ``broadcast`` over a process group the worker joins for the session
  (gloo on CPU, NCCL on GPUs), as vLLM's RLHF examples do; the server stages them and loads them at
  the commit (`stapo.serve.staging`, mixed in here).

vLLM imports this module by its qualified name inside its worker; at import it needs torch only.
"""

from __future__ import annotations

import torch

from stapo.serve.staging import ServerWorkerMixin
from stapo.sync.bucket_format import unpack_bucket

__all__ = ["WORKER_EXTENSION", "StapoWorkerExtension", "reprocess_tied_layers"]

WORKER_EXTENSION = "stapo.serve.worker_extension.StapoWorkerExtension"


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


class StapoWorkerExtension(ServerWorkerMixin):
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

    def stapo_policy_version(self) -> int | None:
        """The trainer's policy version these weights are (None: the weights the server started with)."""
        return getattr(self, "_stapo_version", None)
