"""examples/custom_weighting.py (shown verbatim in docs/custom_masks.md) registers a working weighting
strategy: exact weights on hand-built stats, and the weighted loss they give."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from stapo.cli.common import load_user_modules
from stapo.losses import TokenStats, build_mask, clipped_surrogate_loss, describe_masks

ROOT = Path(__file__).resolve().parents[1]


def test_the_weighting_example_weighs_and_trains_the_loss():
    load_user_modules([str(ROOT / "examples" / "custom_weighting.py")])
    assert "soft_negatives" in {info.name for info in describe_masks()}
    logprobs = torch.log(torch.tensor([[0.5, 0.01, 0.2], [0.5, 0.01, 0.02]]))
    stats = TokenStats(logprobs, torch.zeros(2, 3), torch.tensor([1.0, -1.0]),
                       torch.tensor([[True, True, True], [True, True, False]]))
    result = build_mask("soft_negatives", floor=0.05).apply(stats)
    # A > 0 row: weight 1; A < 0 row: min(1, p / 0.05) = 1, 0.2, and 0 on padding
    torch.testing.assert_close(result.weights, torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.2, 0.0]]))
    assert result.downweighted.tolist() == [[False] * 3, [False, True, False]]
    loss, _ = clipped_surrogate_loss(logprobs, logprobs, stats.advantages, result.keep, weights=result.weights)
    # ratio 1: -(1 + 1 + 1) + (1 + 0.2) over 5 kept tokens
    assert loss.item() == pytest.approx((-3.0 + 1.2) / 5)
    assert math.isclose(build_mask("soft_negatives").floor, 0.05)
