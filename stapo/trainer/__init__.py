"""The training loop: ``STAPOTrainer`` (Algorithm 1, imported on first use) and what only it uses.

May import: every folder below it (``stapo.sync``, ``stapo.telemetry``, ``stapo.inspect``,
``stapo.distributed``, ``stapo.config``, ...; docs/index.md, "Layout"); only ``stapo.cli`` imports it.
"""

from stapo.registry import lazy_attributes

__all__ = ["STAPOTrainer", "TrainingAborted"]

__getattr__ = lazy_attributes("stapo.trainer", {"stapo.trainer.trainer": __all__})
