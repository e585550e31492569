"""This process's global RNG states (Python, NumPy, torch, CUDA): what a checkpoint keeps per rank and what the
colocated vLLM engine puts back after its worker draws from them (docs/distributed.md, "Resuming")."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng_state", "restore_rng_state"]


def capture_rng_state(*, start_cuda: bool = True) -> dict[str, Any]:
    """``start_cuda=False`` leaves the CUDA states out while CUDA is not initialized (reading them would start it)."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and (start_cuda or torch.cuda.is_initialized()):
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
