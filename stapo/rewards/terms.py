"""Reward terms: penalties added to the scorer's score; advantages come from the rewards, accuracy from the
scores (docs/grpo_options.md, "Reward terms"). A term reads a rollout through its attributes (this package sits
below ``stapo.rollout``) with tensor methods only, so importing ``stapo.rewards`` stays torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stapo.registry import Registry

__all__ = ["REWARD_TERMS", "RewardTerm", "OverlongPenalty", "ToolShaping", "register_reward_term",
           "build_reward_term", "overlong_penalty", "reward_penalty"]


class RewardTerm:
    """Base class of reward terms: ``term(rollout)`` is a ``(B,)`` fp32 penalty (<= 0); a subclass's
    dataclass fields are its parameters."""

    metric = ""  # the per-rank sum's name in the step's sums (a class attribute)

    def __call__(self, rollout):
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(rollout)")


REWARD_TERMS = Registry("reward term", base=RewardTerm)
register_reward_term = REWARD_TERMS.register  # class decorator: a RewardTerm subclass under a name
build_reward_term = REWARD_TERMS.build  # an instance; an unknown parameter is an error naming the valid ones


def overlong_penalty(lengths, max_length: int, buffer: int, penalty: float = 1.0):
    """``(B,)`` fp32 penalty (<= 0) for ``lengths`` ``(B,)``: a linear ramp from 0 to ``-penalty`` over the
    last ``buffer`` tokens before ``max_length`` (DAPO Eq. 13; docs/grpo_options.md, "Overlong shaping")."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if not 0 <= buffer <= max_length:
        raise ValueError(f"buffer (reward.overlong_buffer) must be in [0, max_length={max_length}], got {buffer}")
    if penalty < 0:
        raise ValueError(f"penalty (reward.overlong_penalty) must be >= 0, got {penalty}")
    lengths = lengths.float()
    if buffer == 0:
        return lengths * 0.0
    return ((max_length - buffer) - lengths).div(buffer).clamp(-1.0, 0.0).mul(penalty)


@register_reward_term("overlong")
@dataclass(frozen=True)
class OverlongPenalty(RewardTerm):
    """DAPO's soft overlong punishment (Eq. 13): a ramp to -penalty over the last buffer tokens."""

    max_response_length: int
    buffer: int = 0
    penalty: float = 1.0
    metric = "overlong_penalty_sum"

    def __call__(self, rollout):
        lengths = rollout.real_mask.sum(dim=1)  # policy + context tokens
        return overlong_penalty(lengths, self.max_response_length, self.buffer, self.penalty)


@register_reward_term("tool")
@dataclass(frozen=True)
class ToolShaping(RewardTerm):
    """Tool shaping: error_penalty per tool error, call_penalty per call beyond call_budget (docs/tir.md)."""

    error_penalty: float = 0.0
    call_budget: int = 0
    call_penalty: float = 0.0
    metric = "tool_penalty_sum"

    def __call__(self, rollout):
        e = rollout.episodes
        if e is None:  # single-turn rows
            return rollout.real_mask.sum(dim=1).float() * 0.0
        extra = (e.tool_calls - self.call_budget).clamp(min=0)
        return -(self.error_penalty * e.tool_errors.float() + self.call_penalty * extra.float())


def reward_penalty(rollout, terms: Sequence[RewardTerm]) -> tuple[object, dict[str, float]]:
    """``(B,)`` sum of the ``terms``' penalties on ``rollout`` (what is added to the scores), and each
    term's sum under its ``metric`` (per rank, reduced with the step's)."""
    total, sums = rollout.real_mask.sum(dim=1).float() * 0.0, {}
    for term in terms:
        penalty = term(rollout)
        total = total + penalty
        sums[term.metric] = float(penalty.sum())
    return total, sums
