"""The reward-term registry (stapo.rewards.terms): the built-in terms, a user term, one composition."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stapo.rewards import REWARD_TERMS, RewardTerm, build_reward_term, register_reward_term, reward_penalty


class _Rows:
    """What a term reads of a Rollout: ``real_mask`` (B, T) and ``episodes`` (None: single-turn)."""

    def __init__(self, lengths, episodes=None):
        self.real_mask = torch.arange(8)[None, :] < torch.tensor(lengths)[:, None]
        self.episodes = episodes


def test_builtin_terms_are_registered_with_their_parameters():
    infos = {i.name: i for i in REWARD_TERMS.describe()}
    assert {"overlong", "tool"} <= set(infos)
    assert infos["overlong"].params == {"max_response_length": dataclasses.MISSING, "buffer": 0, "penalty": 1.0}
    assert infos["tool"].params == {"error_penalty": 0.0, "call_budget": 0, "call_penalty": 0.0}
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['budget'\] for reward term 'tool'; valid "
                                         r"parameters: error_penalty=0.0, call_budget=0, call_penalty=0.0"):
        build_reward_term("tool", budget=2)
    with pytest.raises(ValueError, match=r"unknown reward term 'length'; choose one of \[.*'overlong', 'tool'"):
        build_reward_term("length")


def test_terms_compose_into_one_penalty_and_their_sums(monkeypatch):
    monkeypatch.setitem(REWARD_TERMS, "test_short", None)  # registered for this test only (undone after)

    @register_reward_term("test_short")
    class ShortPenalty(RewardTerm):
        """-cost for a response shorter than min_length tokens."""

        min_length: int = 3
        cost: float = 0.5
        metric = "short_penalty_sum"

        def __call__(self, rollout):
            return (rollout.real_mask.sum(dim=1) < self.min_length).float() * -self.cost

    assert dataclasses.is_dataclass(ShortPenalty)
    rows = _Rows([2, 5, 8])
    # overlong: L_max 8, buffer 4: ramp from 4 tokens on, (4 - |y|) / 4: 0, -0.25, -1; short: -0.5, 0, 0
    terms = [build_reward_term("overlong", max_response_length=8, buffer=4), build_reward_term("test_short")]
    total, sums = reward_penalty(rows, terms)
    assert total.tolist() == [-0.5, -0.25, -1.0]
    assert sums == {"overlong_penalty_sum": -1.25, "short_penalty_sum": -0.5}
    assert reward_penalty(rows, [])[0].tolist() == [0.0, 0.0, 0.0]
