"""`RolloutEngine`: what the trainer needs from a generator (paper Algorithm 1, lines 1-2).

An engine holds its OWN copy of the policy weights (never the ZeRO-3-sharded training module): the
trainer gathers the training weights in buckets and pushes them with `load_weights` before each
rollout (docs/distributed.md, "Weight sync"), all buckets of one sync inside one `weight_update`
session, then calls `generate`. `sleep` / `wake` let a colocated
GPU engine release its memory while the trainer runs the optimizer steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch

from stapo.rollout.batch import Rollout
from stapo.rollout.sampling import SamplingParams

__all__ = ["RolloutEngine", "check_prompts", "release_cached_memory"]


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates G samples per prompt and accepts fresh weights."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams) -> Rollout:
        """Sample `n` responses for each prompt (token ids); rows are grouped per prompt."""
        ...

    def weight_update(self) -> AbstractContextManager:
        """One weight sync: a context in which `load_weights` is called once per bucket. The engine
        may defer processing until the block ends (vLLM processes a fused layer once complete)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket of full (gathered) tensors, keyed by HF parameter names, into the engine.

        Called repeatedly inside `weight_update`, one bucket at a time; a bucket may end in the middle
        of a layer; names not in the model raise an error."""
        ...

    def sleep(self) -> None:
        """Release accelerator memory until `wake` (no-op where meaningless)."""
        ...

    def wake(self) -> None:
        """Undo `sleep` (no-op where meaningless)."""
        ...


def check_prompts(prompt_ids: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """Validate `generate`'s inputs; returns the prompts as plain int lists."""
    if n < 1:
        raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
    try:
        prompts = [[int(t) for t in p] for p in prompt_ids]
    except (TypeError, ValueError) as err:
        raise TypeError("prompt_ids must be a sequence of token-id sequences (not text, not a tokenizer "
                        f"BatchEncoding): {err}") from err
    if not prompts:
        raise ValueError("generate() got no prompts")
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise ValueError(f"prompts {empty[:10]} are empty; every prompt needs at least one token")
    return prompts


def release_cached_memory() -> None:
    """Return the blocks PyTorch's caching allocator holds but does not use (freed gathers, activations,
    offloaded training state) to the GPU, so a colocated vLLM can map them when it starts or wakes
    (vLLM empties that cache only when it sleeps). No-op without CUDA."""
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()
