"""Parameter names as the Hugging Face checkpoint names them, whatever wraps the module (used by the
weight sync and the LoRA export, so it lives below both)."""

from __future__ import annotations

__all__ = ["hf_name"]

_WRAPPER_PREFIXES = ("module", "_orig_mod")  # DeepSpeedEngine / DDP, torch.compile


def hf_name(name: str) -> str:
    """Strip wrapper prefixes: ``module.model.norm.weight`` → ``model.norm.weight``."""
    parts = name.split(".")
    while len(parts) > 1 and parts[0] in _WRAPPER_PREFIXES:
        parts = parts[1:]
    return ".".join(parts)
