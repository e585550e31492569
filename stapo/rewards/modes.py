"""The reward-mode registry: ``reward.mode`` name -> scorer builder, the one source of the config's choices,
``stapo eval --reward-mode`` and the trainer's scorer (docs/grpo_options.md, "Reward functions").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from stapo.registry import Registry
from stapo.rewards.scorers import FunctionScorer, Scorer
from stapo.rewards.verifier import MODES, MathVerifier

__all__ = ["REWARD_MODES", "available_reward_modes", "build_scorer", "register_reward_mode"]

ScorerBuilder = Callable[..., Scorer]
REWARD_MODES: Registry = Registry("reward mode")


register_reward_mode = REWARD_MODES.register  # decorator: ``builder(**options) -> Scorer`` as ``reward.mode: name``


def available_reward_modes() -> list[str]:
    return list(REWARD_MODES)


def build_scorer(mode: str, *, timeout_s: float = 5.0, function: Optional[str] = None,
                 function_batched: bool = False, failure_value: float = -1.0) -> Scorer:
    """The scorer of ``mode``; ``function`` (a ``reward.function`` spec) is required by ``function``."""
    builder = REWARD_MODES.lookup(mode, list(REWARD_MODES))
    return builder(timeout_s=timeout_s, function=function, function_batched=function_batched,
                   failure_value=failure_value)


def _verifier_mode(name: str) -> ScorerBuilder:
    def build(*, timeout_s: float = 5.0, **_) -> Scorer:
        return MathVerifier(mode=name, timeout_s=timeout_s)

    build.__qualname__ = f"MathVerifier(mode={name!r})"
    return build


for _name in MODES:
    register_reward_mode(_name)(_verifier_mode(_name))


@register_reward_mode("function")
def _function_mode(*, function: Optional[str] = None, function_batched: bool = False, timeout_s: float = 5.0,
                   failure_value: float = -1.0, **_) -> Scorer:
    if not function:
        raise ValueError("reward.mode 'function' needs reward.function ('pkg.module:callable' or 'file.py:callable')")
    return FunctionScorer(function, batched=function_batched, timeout_s=timeout_s, failure_value=failure_value)
