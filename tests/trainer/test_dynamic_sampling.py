"""Dynamic sampling (DAPO filter groups): constant groups are dropped and the batch refills to the
target, ranks agree on the round count, the round cap trims to what every rank can fill, and the
sampler's state covers the extra draws (exact resume)."""

from __future__ import annotations

import logging

import pytest
import torch

from stapo.data import PromptSampler
from stapo.rollout.batch import Rollout, left_pad, right_pad
from stapo.trainer.dynamic_sampling import collect_informative, informative_groups

G = 2
CONSTANT = {0, 2, 3, 6}  # prompts whose G samples all get reward +1 (advantage 0)


def generate(prompts, round_index) -> Rollout:
    """Prompt p -> G rows; response j of prompt p is the token list [p, j] (traceable)."""
    rows = [[100 + p] for p in prompts for _ in range(G)]
    responses = [[p, j] for p in prompts for j in range(G)]
    prompt_ids, prompt_mask = left_pad(rows, 0)
    response_ids = right_pad(responses, 0, torch.long)
    mask = torch.ones(response_ids.shape, dtype=torch.bool)
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=mask,
                   sampling_logprobs=torch.zeros(response_ids.shape), finish_reason=["stop"] * len(rows),
                   response_text=[f"p{p}s{j}@r{round_index}" for p, j in responses],
                   group_index=torch.arange(len(rows)) // G, group_size=G, pad_token_id=0)


def score(rollout, prompts) -> torch.Tensor:
    """+1 for every sample of a CONSTANT prompt; +1, -1 for the samples of the others."""
    return torch.tensor([1.0 if p in CONSTANT or j == 0 else -1.0 for p in prompts for j in range(G)])


def listed(batches):
    return lambda r: batches[r]


def test_informative_groups_is_per_group_not_per_row():
    # groups (1, 1) | (1, -1) | (-1, -1) | (0.5, 0.5): only the second has a nonzero std
    rewards = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 0.5, 0.5])
    assert informative_groups(rewards, 2).tolist() == [False, True, False, False]
    with pytest.raises(ValueError, match="group_size=3"):
        informative_groups(rewards, 3)


def test_constant_groups_are_dropped_and_the_batch_refills():
    # round 0 draws 0-3: only prompt 1 is informative (1 < 3); round 1 draws 4-7: 4, 5, 7 are
    # informative -> 4 >= 3, stop. Keep the first 3 in draw order: 1, 4, 5; 7 is surplus.
    batch = collect_informative(listed([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]), generate, score,
                                group_size=G, target_groups=3, max_rounds=3)
    assert batch.prompts == [1, 4, 5]
    assert batch.rollout.response_ids[:, 0].tolist() == [1, 1, 4, 4, 5, 5]
    assert batch.rollout.response_text == ["p1s0@r0", "p1s1@r0", "p4s0@r1", "p4s1@r1", "p5s0@r1", "p5s1@r1"]
    assert batch.rewards.tolist() == [1.0, -1.0] * 3
    # groups stay consecutive and distinct (concat offsets the second round's group ids)
    assert batch.rollout.group_index.view(3, G).unique(dim=1).numel() == 3
    s = batch.stats
    assert (s.rounds, s.groups_kept, s.groups_dropped, s.groups_surplus, s.capped) == (2, 3, 4, 1, False)
    assert s.metrics() == {"sampling_rounds": 2.0, "groups_kept": 3.0, "groups_dropped": 4.0,
                           "groups_surplus": 1.0, "sampling_capped": 0.0}


def test_round_cap_trains_on_what_every_rank_can_fill(caplog):
    draws = listed([[0, 1, 2, 3], [4, 5, 6, 7]])
    with caplog.at_level(logging.WARNING, logger="stapo.trainer"):
        batch = collect_informative(draws, generate, score, group_size=G, target_groups=5, max_rounds=2)
    # 2 rounds give 1 + 3 = 4 informative groups < 5: capped, all 4 kept
    assert batch.prompts == [1, 4, 5, 7] and len(batch.rollout) == 4 * G
    assert (batch.stats.rounds, batch.stats.groups_kept, batch.stats.capped) == (2, 4, True)
    assert "rollout.max_sampling_rounds" in caplog.text and "[4]" in caplog.text
    # multiple_of=3 (one mini-batch = 3 groups per rank): 4 -> 3 groups, so mini-batches stay full
    batch = collect_informative(draws, generate, score, group_size=G, target_groups=5, max_rounds=2, multiple_of=3)
    assert batch.prompts == [1, 4, 5] and batch.stats.groups_surplus == 1


def test_nothing_informative_falls_back_to_round_zero_whole():
    # no rank can keep a group: the step trains on round 0 as plain GRPO would (all advantages 0)
    batch = collect_informative(listed([[0, 2, 3, 6]]), generate, score, group_size=G, target_groups=2,
                                max_rounds=1)
    assert len(batch.rollout) == 4 * G and batch.rewards.numel() == 4 * G and batch.prompts == [0, 2, 3, 6]
    assert (batch.stats.groups_kept, batch.stats.groups_dropped, batch.stats.capped) == (0, 4, True)


def test_ranks_run_the_same_rounds_and_keep_equal_group_counts():
    """This rank is full after round 0; a scripted second rank is not, so this rank draws again."""
    other_rank = iter([(1, 3), (3, 5)])  # (kept, dropped) of rank 1 after rounds 0 and 1
    gathered = []

    def gather(mine):
        gathered.append(mine)
        return [mine, next(other_rank)]

    draws = listed([[1, 4, 5, 0], [7, 9, 2, 3]])
    batch = collect_informative(draws, generate, score, group_size=G, target_groups=3, max_rounds=3, gather=gather)
    # rank 0: round 0 keeps 1, 4, 5 (3 = target) but rank 1 has 1 -> round 1 (7, 9 kept, 2, 3 dropped);
    # after round 1 rank 1 has 3 -> stop. Rank 0 keeps exactly 3; its 2 extra groups are surplus.
    assert gathered == [(3, 1), (5, 3)]
    assert batch.prompts == [1, 4, 5]
    s = batch.stats
    assert (s.rounds, s.groups_kept, s.groups_dropped, s.groups_surplus) == (2, 6, 3 + 5, 5 + 3 - 6)
    # capped with 2 ranks: every rank keeps the minimum
    other_rank = iter([(1, 3)])
    batch = collect_informative(draws, generate, score, group_size=G, target_groups=3, max_rounds=1,
                                gather=lambda mine: [mine, next(other_rank)])
    assert batch.prompts == [1] and batch.stats.groups_kept == 2 and batch.stats.capped


def test_sampler_state_covers_the_extra_draws():
    sampler = PromptSampler(num_examples=12, batch_size=4, seed=3)
    world, rank = 2, 1

    def draw(round_index):  # the trainer's pattern: this rank's contiguous share of the global batch
        indices = sampler.next_batch()
        share = len(indices) // world
        return indices[rank * share:(rank + 1) * share]

    never_enough = lambda mine: [mine, (0, 0)]  # noqa: E731 - rank 0 never fills: all 3 rounds run
    batch = collect_informative(draw, generate, score, group_size=G, target_groups=2, max_rounds=3,
                                gather=never_enough)
    assert batch.stats.rounds == 3
    reference = PromptSampler(num_examples=12, batch_size=4, seed=3)
    for _ in range(3):
        reference.next_batch()
    assert sampler.state_dict() == reference.state_dict()  # 3 draws: 12 examples, epoch 0 exhausted
    resumed = PromptSampler(num_examples=12, batch_size=4, seed=3)
    resumed.load_state_dict(sampler.state_dict())
    assert resumed.next_batch() == sampler.next_batch()  # the next step continues identically


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="max_rounds"):
        collect_informative(listed([[1]]), generate, score, group_size=G, target_groups=1, max_rounds=0)
    with pytest.raises(ValueError, match="should give 4 rows"):
        collect_informative(listed([[1, 4]]), lambda p, r: generate(p[:1], r), score, group_size=G,
                            target_groups=1, max_rounds=1)
