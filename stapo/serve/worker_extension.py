"""Code that runs INSIDE vLLM's worker: the weight-update session over `collective_rpc` (docs/rollout.md).

A bucket from vLLM's engine-core process arrives as one `pack_bucket` byte string: its msgpack decodes arguments
without type information (no tensors, no pickle). vLLM imports this module by name; at import it needs torch only.
"""

from __future__ import annotations

import torch

from stapo.serve.staging import ServerWorkerMixin
from stapo.sync.bucket_format import unpack_bucket

__all__ = ["WORKER_EXTENSION", "StapoWorkerExtension", "reprocess_tied_layers"]

WORKER_EXTENSION = "stapo.serve.worker_extension.StapoWorkerExtension"


def reprocess_tied_layers(model: torch.nn.Module) -> int:
    """Re-derive what every layer that shares a parameter built from it at load time; returns their number.

    vLLM's layerwise reload processes a tied parameter only through the layer that loads it, so Qwen3's tied
    ``lm_head`` kept the CPU build's prepacked GEMM copy of the OLD weights (docs/rollout.md, "`VLLMEngine`")."""
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
    """Mixed into vLLM's worker (``self``: ``model_runner``, ``device``, ``vllm_config``). A sync is ONE session
    of vLLM's layerwise reload — begin, `stapo_load_weights` per bucket, finish — so a bucket may end inside
    a fused layer, on GPU and CPU alike. The ``stapo_`` prefix: vLLM refuses attributes that collide with the
    worker's."""

    def _stapo_model(self):
        return self.model_runner.get_model()

    def stapo_begin_weight_update(self) -> None:
        """Start a session: a layer is processed once its full set of weights arrived."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if getattr(self, "_stapo_updating", False):
            raise RuntimeError("a weight update session is already open (finish it first)")
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self._stapo_model())
        self._stapo_updating = True

    def stapo_load_weights(self, payload) -> int:
        """Load one bucket (a `pack_bucket` dict or, in-process, ``[(name, tensor)]``); returns its tensor count."""
        if not getattr(self, "_stapo_updating", False):
            raise RuntimeError("stapo_load_weights outside a weight update session")
        weights = unpack_bucket(payload, self.device) if isinstance(payload, dict) else list(payload)
        return self._stapo_load(weights)

    def _stapo_load(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):  # callers: inside a session (begun, checked)
            self._stapo_model().load_weights(weights)
        return len(weights)

    def stapo_finish_weight_update(self, version: str | int | None = None) -> None:
        """Process the layers still waiting and close the session; ``version``: what `stapo_policy_version`
        reports afterwards."""
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
