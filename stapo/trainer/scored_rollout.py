"""Algorithm 1 lines 4-5, the one place that decides an iteration's rewards: ``rewards = scores + penalty``
of the reward terms (docs/grpo_options.md, "Reward terms"); advantages use ``rewards``, accuracy ``scores``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from stapo.rewards import RewardTerm, reward_penalty
from stapo.rollout import Rollout
from stapo.trainer.dynamic_sampling import collect_informative


@dataclass(frozen=True)
class ScoredRollout:
    """This rank's responses of one iteration with their rewards."""

    rollout: Rollout
    scores: torch.Tensor  # (B,) fp32, the scorer's (accuracy counts scores > 0)
    rewards: torch.Tensor  # (B,) fp32, scores + the reward terms' penalties: what the advantages see
    sums: dict[str, float] = field(default_factory=dict)  # per-rank sums, reduced with the step's
    sampling: dict[str, float] = field(default_factory=dict)  # dynamic-sampling metrics, already global
    epoch: int = 0  # the prompt sampler's epoch of this iteration's draw


def score_rollout(scorer, rollout: Rollout, examples: Sequence, terms: Sequence[RewardTerm]) -> ScoredRollout:
    """Scores, shaped rewards and their sums for one generated batch (``examples``: its prompts). The
    scorer reads each row's answer (an episode's last policy turn, `Rollout.answer_text`)."""
    g = rollout.group_size
    row_fields = [dict(e.fields) for e in examples for _ in range(g)]  # extra dataset columns, per row
    scores = torch.tensor(scorer(rollout.answer_text, rollout.ground_truth, row_fields), dtype=torch.float32)
    penalty, penalty_sums = reward_penalty(rollout, terms)
    sums = {"reward_failures": float(getattr(scorer, "failures", 0)), **penalty_sums}
    return ScoredRollout(rollout, scores, scores + penalty, sums)


def collect_scored_rollout(draw: Callable[[], list], generate: Callable[[list, int], Rollout], scorer,
                           terms: Sequence[RewardTerm], timer, *, group_size: int, dynamic: bool = False,
                           target_groups: int = 0, max_rounds: int = 1, multiple_of: int = 1,
                           gather: Callable[[object], list] = lambda value: [value]) -> ScoredRollout:
    """One iteration's scored rollout; with ``dynamic`` only informative groups (trainer.dynamic_sampling)."""
    if not dynamic:
        examples = draw()
        with timer("rollout"):
            rollout = generate(examples, 0)
        with timer("reward"):
            return score_rollout(scorer, rollout, examples, terms)
    failures = [0.0]

    def timed_generate(examples, round_index):
        with timer("rollout"):
            return generate(examples, round_index)

    def timed_score(rollout, examples):
        with timer("reward"):
            scored = score_rollout(scorer, rollout, examples, terms)
        failures[0] += scored.sums["reward_failures"]
        return scored.rewards

    kept = collect_informative(lambda _round: draw(), timed_generate, timed_score, group_size=group_size,
                               target_groups=target_groups, max_rounds=max_rounds, gather=gather,
                               multiple_of=multiple_of)
    penalty, penalty_sums = reward_penalty(kept.rollout, terms)
    sums = {"reward_failures": failures[0], **penalty_sums}
    return ScoredRollout(kept.rollout, kept.rewards - penalty, kept.rewards, sums, kept.stats.metrics())
