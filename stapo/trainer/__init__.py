"""The training loop: ``STAPOTrainer`` (Algorithm 1) and what only it uses.

The iteration (trainer.py), the update and its micro-batches, scored rollouts and dynamic
sampling, checkpoints, token recording, the preflight shared with ``--dry-run``, and components
(the one place that turns the config into arguments). ``STAPOTrainer`` is imported on first use,
so submodules import cheaply.

May import: every folder below it (``stapo.sync``, ``stapo.telemetry``, ``stapo.inspect``,
``stapo.distributed``, ``stapo.config``, ...; docs/index.md, "Layout"); only ``stapo.cli`` imports it.
"""

from importlib import import_module

__all__ = ["STAPOTrainer", "TrainingAborted"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(import_module("stapo.trainer.trainer"), name)
    raise AttributeError(f"module 'stapo.trainer' has no attribute {name!r}")
