"""The GPU memory the training side lets go of before a colocated vLLM maps it (docs/gpu.md)."""

from __future__ import annotations

import torch

__all__ = ["release_cached_memory"]


def release_cached_memory() -> None:
    """Hand the caching allocator's unused blocks back to the GPU for a colocated vLLM (it empties that cache
    only when it sleeps)."""
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()
