"""stapo: Spurious-Token-Aware Policy Optimization for RL of LLMs on verifiable math rewards.

Public entry points (see docs/index.md):

    from stapo import STAPOTrainer, STAPOConfig

The trainer pulls in DeepSpeed and transformers, so it is imported on first use only:
``import stapo.losses`` stays light on any CPU box.
"""

from stapo.registry import lazy_attributes

__version__ = "0.1.0"

__all__ = ["STAPOConfig", "STAPOTrainer", "__version__"]

__getattr__ = lazy_attributes("stapo", {"stapo.config": ["STAPOConfig"], "stapo.trainer": ["STAPOTrainer"]})
