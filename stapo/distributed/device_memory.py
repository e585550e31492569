"""The GPU memory the training side lets go of before a colocated vLLM maps it (docs/gpu.md)."""

from __future__ import annotations

import torch

__all__ = ["release_cached_memory"]


def release_cached_memory() -> None:
    """Return the blocks PyTorch's caching allocator holds but does not use (freed gathers, activations,
    offloaded training state) to the GPU, so a colocated vLLM can map them when it starts or wakes
    (vLLM empties that cache only when it sleeps). No-op without CUDA."""
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()
