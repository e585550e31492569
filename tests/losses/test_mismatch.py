"""Rollout-trainer mismatch sums (stapo.losses.mismatch), hand-computed."""

import math

import pytest
import torch

from stapo.losses import mismatch_sums


def test_mismatch_sums_by_hand():
    sampler = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, 0.0, 0.0]])
    trainer = torch.tensor([[-1.5, -1.0, -0.5], [-0.75, 9.0, float("nan")]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    m = mismatch_sums(sampler, trainer, mask)
    # d = trainer - sampler on valid tokens: [-0.5, 1.0, 0.0, -0.5]; padding (9.0, NaN) ignored
    torch.testing.assert_close(m["mismatch_abs_sum"], torch.tensor(2.0))  # 0.5 + 1 + 0 + 0.5
    torch.testing.assert_close(m["mismatch_abs_max"], torch.tensor(1.0))
    # k3 = exp(d) - d - 1: 2 * (e^-0.5 + 0.5 - 1) + (e - 2) + 0
    k3 = 2 * (math.exp(-0.5) - 0.5) + (math.e - 2.0)
    torch.testing.assert_close(m["mismatch_k3_sum"], torch.tensor(k3))
    assert m["mismatch_tokens"].item() == 4.0
    assert all(v.dim() == 0 for v in m.values())


def test_mismatch_sums_empty_mask_and_errors():
    x = torch.zeros(2, 3)
    m = mismatch_sums(x, x + 1.0, torch.zeros(2, 3, dtype=torch.bool))
    assert all(v.item() == 0.0 for v in m.values())
    with pytest.raises(ValueError, match="same"):
        mismatch_sums(x, torch.zeros(2, 2), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        mismatch_sums(x, x, torch.ones(2, 3))

