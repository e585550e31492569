"""Algorithm 1 lines 4-5: sample G responses per prompt and score them.

One place decides what the rewards of an iteration are:

* the scorer (the math verifier, a ``reward.mode`` from the registry, or ``reward.function`` in
  killable workers) gives ``scores``; the dataset row's extra columns reach it as ``row_fields``;
* DAPO's soft overlong punishment (``reward.overlong_buffer``) and, for tool-integrated episodes, the
  tool shaping of ``rollout.tools`` (``error_penalty``, ``call_penalty`` beyond ``call_budget``) are
  added: ``rewards = scores + penalty`` (docs/grpo_options.md, docs/tir.md); advantages are built from
  ``rewards``, accuracy from ``scores``;
* with ``rollout.dynamic_sampling`` (DAPO's filter groups) groups whose rewards are all equal are
  dropped and more prompts drawn (:mod:`stapo.trainer.dynamic_sampling`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from stapo.rewards import overlong_penalty
from stapo.rollout import Rollout
from stapo.trainer.dynamic_sampling import collect_informative


@dataclass(frozen=True)
class ScoredRollout:
    """This rank's responses of one iteration with their rewards."""

    rollout: Rollout
    scores: torch.Tensor  # (B,) fp32, the scorer's (accuracy counts scores > 0)
    rewards: torch.Tensor  # (B,) fp32, scores + overlong penalty: what the advantages see
    sums: dict[str, float] = field(default_factory=dict)  # per-rank sums, reduced with the step's
    sampling: dict[str, float] = field(default_factory=dict)  # dynamic-sampling metrics, already global
    epoch: int = 0  # the prompt sampler's epoch of this iteration's draw


@dataclass(frozen=True)
class RewardShaping:
    """Flat reward settings (built from ``reward.*``, ``rollout.max_response_length`` and the shaping
    of ``rollout.tools``)."""

    max_response_length: int
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    tool_error_penalty: float = 0.0
    call_budget: int = 0
    call_penalty: float = 0.0

    def penalty(self, rollout: Rollout) -> torch.Tensor:
        """(B,) DAPO soft overlong punishment (0 everywhere when the buffer is 0). An episode's length is
        its policy and context tokens: what ``max_response_length`` bounds (docs/tir.md)."""
        lengths = rollout.real_mask.sum(dim=1)
        return overlong_penalty(lengths, self.max_response_length, self.overlong_buffer, self.overlong_penalty)

    def tool_penalty(self, rollout: Rollout) -> torch.Tensor:
        """(B,) tool shaping (<= 0): ``tool_error_penalty`` per tool error and ``call_penalty`` per call
        beyond ``call_budget``; 0 for single-turn rows and with both penalties off."""
        if rollout.episodes is None:
            return torch.zeros(len(rollout))
        e = rollout.episodes
        extra = (e.tool_calls - self.call_budget).clamp(min=0)
        return -(self.tool_error_penalty * e.tool_errors.float() + self.call_penalty * extra.float())

    def total(self, rollout: Rollout) -> tuple[torch.Tensor, dict[str, float]]:
        """(B,) everything added to the scores, and its parts' sums (metrics)."""
        overlong, tool = self.penalty(rollout), self.tool_penalty(rollout)
        sums = {"overlong_penalty_sum": float(overlong.sum())}
        if rollout.episodes is not None:
            sums["tool_penalty_sum"] = float(tool.sum())
        return overlong + tool, sums


def score_rollout(scorer, rollout: Rollout, examples: Sequence, shaping: RewardShaping) -> ScoredRollout:
    """Scores, shaped rewards and their sums for one generated batch (``examples``: its prompts). The
    scorer reads each row's answer (an episode's last policy turn, `Rollout.answer_text`)."""
    g = rollout.group_size
    row_fields = [dict(e.fields) for e in examples for _ in range(g)]  # extra dataset columns, per row
    scores = torch.tensor(scorer(rollout.answer_text, rollout.ground_truth, row_fields), dtype=torch.float32)
    penalty, penalty_sums = shaping.total(rollout)
    sums = {"reward_failures": float(getattr(scorer, "failures", 0)), **penalty_sums}
    return ScoredRollout(rollout, scores, scores + penalty, sums)


def collect_scored_rollout(draw: Callable[[], list], generate: Callable[[list, int], Rollout], scorer,
                           shaping: RewardShaping, timer, *, group_size: int, dynamic: bool = False,
                           target_groups: int = 0, max_rounds: int = 1, multiple_of: int = 1,
                           gather: Callable[[object], list] = lambda value: [value]) -> ScoredRollout:
    """One iteration's scored rollout; with ``dynamic`` only informative groups (see module doc).

    ``draw()`` gives this rank's next prompts, ``generate(prompts, round)`` their responses (``round``
    enters the sampling seed), ``timer`` the step's phase timer, ``gather`` an all-gather of a small
    value over ranks (ranks agree on the dynamic-sampling rounds).
    """
    if not dynamic:
        examples = draw()
        with timer("rollout"):
            rollout = generate(examples, 0)
        with timer("reward"):
            return score_rollout(scorer, rollout, examples, shaping)
    failures = [0.0]

    def timed_generate(examples, round_index):
        with timer("rollout"):
            return generate(examples, round_index)

    def timed_score(rollout, examples):
        with timer("reward"):
            scored = score_rollout(scorer, rollout, examples, shaping)
        failures[0] += scored.sums["reward_failures"]
        return scored.rewards

    kept = collect_informative(lambda _round: draw(), timed_generate, timed_score, group_size=group_size,
                               target_groups=target_groups, max_rounds=max_rounds, gather=gather,
                               multiple_of=multiple_of)
    penalty, penalty_sums = shaping.total(kept.rollout)
    sums = {"reward_failures": failures[0], **penalty_sums}
    return ScoredRollout(kept.rollout, kept.rewards - penalty, kept.rewards, sums, kept.stats.metrics())
