"""The training loop: ``STAPOTrainer`` (Algorithm 1, imported on first use) and what only it uses.

May import: every folder below it (``stapo.sync``, ``stapo.telemetry``, ``stapo.inspect``,
``stapo.distributed``, ``stapo.config``, ...; docs/index.md, "Layout"); only ``stapo.cli`` imports it.
"""

from importlib import import_module

__all__ = ["STAPOTrainer", "TrainingAborted"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(import_module("stapo.trainer.trainer"), name)
    raise AttributeError(f"module 'stapo.trainer' has no attribute {name!r}")
