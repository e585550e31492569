"""Dynamic sampling: DAPO's "filter groups" (DAPO paper §3.2; off by default, as in the STAPO paper).

Groups whose G rewards are all equal (advantage 0, Eq. 2) are dropped and more generated; the ranks agree on
each round through one small all-gather. docs/grpo_options.md has the rules and why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stapo.rollout.batch import Rollout

__all__ = ["DynamicSamplingStats", "InformativeBatch", "collect_informative", "informative_groups"]

log = logging.getLogger("stapo.trainer")


@dataclass(frozen=True)
class DynamicSamplingStats:
    """What the sampling loop did; every count is over ALL ranks and equal on every rank."""

    rounds: int  # generation rounds run
    groups_kept: int  # informative groups in the returned batch
    groups_dropped: int  # groups with all-equal rewards, dropped
    groups_surplus: int  # informative groups generated beyond what was kept
    capped: bool  # max_rounds was reached before every rank had target_groups

    def metrics(self) -> dict[str, float]:
        """Step metrics; already global, so add them AFTER the per-rank sums are reduced."""
        return {"sampling_rounds": float(self.rounds), "groups_kept": float(self.groups_kept),
                "groups_dropped": float(self.groups_dropped), "groups_surplus": float(self.groups_surplus),
                "sampling_capped": float(self.capped)}


@dataclass(frozen=True)
class InformativeBatch:
    """This rank's kept groups: ``rollout`` (P*G rows), ``rewards`` (P*G,), ``prompts`` (P)."""

    rollout: Rollout
    rewards: torch.Tensor
    prompts: list
    stats: DynamicSamplingStats


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(P,)`` bool: True where the group's rewards are not all equal (nonzero advantages)."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be (P * group_size,) with group_size={group_size}, got {tuple(rewards.shape)}")
    groups = rewards.view(-1, group_size)  # (P, G)
    return (groups != groups[:, :1]).any(dim=1)


def collect_informative(draw: Callable[[int], Sequence[Any]],
                        generate: Callable[[Sequence[Any], int], Rollout],
                        score: Callable[[Rollout, Sequence[Any]], torch.Tensor],
                        group_size: int, target_groups: int, max_rounds: int,
                        gather: Callable[[Any], list[Any]] = lambda value: [value],
                        multiple_of: int = 1) -> InformativeBatch:
    """Generate until this rank holds ``target_groups`` informative groups (``round`` goes into each round's seed);
    when capped, a multiple of ``multiple_of`` groups is kept."""
    if group_size < 1 or target_groups < 1 or max_rounds < 1 or multiple_of < 1:
        raise ValueError(f"need group_size, target_groups, max_rounds, multiple_of >= 1, got {group_size}, "
                         f"{target_groups}, {max_rounds}, {multiple_of}")
    parts, reward_parts, prompts_kept = [], [], []
    kept = dropped = rounds = 0
    counts: list = []
    first: tuple | None = None  # round 0's (rollout, rewards, prompts)
    while rounds < max_rounds:
        prompts = list(draw(rounds))
        rollout = generate(prompts, rounds)
        rewards = torch.as_tensor(score(rollout, prompts), dtype=torch.float32).reshape(-1)
        rounds += 1
        if len(rollout) != len(prompts) * group_size or rewards.numel() != len(rollout):
            raise ValueError(f"round {rounds}: {len(prompts)} prompts x G={group_size} should give "
                             f"{len(prompts) * group_size} rows; got {len(rollout)} rows, {rewards.numel()} rewards")
        first = first or (rollout, rewards, prompts)
        ok = informative_groups(rewards, group_size)  # (P,)
        rows = ok.repeat_interleave(group_size)  # (P*G,)
        if ok.any():
            parts.append(rollout.select(rows))
            reward_parts.append(rewards[rows])
            prompts_kept += [p for p, keep in zip(prompts, ok.tolist()) if keep]
        kept, dropped = kept + int(ok.sum()), dropped + int((~ok).sum())
        counts = gather((kept, dropped))
        if min(k for k, _ in counts) >= target_groups:
            break
    fill = min(target_groups, min(k for k, _ in counts))
    capped = fill < target_groups
    if capped:
        fill -= fill % multiple_of
        log.warning("dynamic sampling: %d rounds (rollout.max_sampling_rounds) gave %s informative groups per "
                    "rank, fewer than %d; training on %d groups per rank", rounds, [k for k, _ in counts],
                    target_groups, fill)
    world = len(counts)
    stats = DynamicSamplingStats(rounds=rounds, groups_kept=fill * world, groups_dropped=sum(d for _, d in counts),
                                 groups_surplus=sum(k for k, _ in counts) - fill * world, capped=capped)
    if fill == 0:  # nothing to keep anywhere: train on round 0 as plain GRPO would (A = 0 there)
        return InformativeBatch(first[0], first[1], first[2], stats)
    rows = slice(0, fill * group_size)
    return InformativeBatch(Rollout.concat(parts).select(rows), torch.cat(reward_parts)[rows],
                            prompts_kept[:fill], stats)
