"""DAPO's soft overlong punishment (Eq. 13) at and around the buffer edges."""

import pytest
import torch

from stapo.rewards import overlong_penalty


def test_penalty_ramps_linearly_over_the_buffer():
    # L_max = 20, L_cache = 5: free up to 15 tokens, then -(|y| - 15) / 5, -1 from 20 on.
    lengths = torch.tensor([0, 15, 16, 18, 19, 20, 21])
    got = overlong_penalty(lengths, max_length=20, buffer=5, penalty=1.0)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.2, -0.6, -0.8, -1.0, -1.0])
    # the max penalty scales the ramp: (15 - 18) / 5 * 0.5 = -0.3
    half = overlong_penalty(lengths, max_length=20, buffer=5, penalty=0.5)
    assert half.tolist() == pytest.approx([0.0, 0.0, -0.1, -0.3, -0.4, -0.5, -0.5])


def test_zero_buffer_is_off_and_full_buffer_penalizes_every_token():
    lengths = torch.tensor([1, 10, 20])
    assert overlong_penalty(lengths, max_length=20, buffer=0).tolist() == [0.0, 0.0, 0.0]
    # L_cache = L_max: -|y| / 20
    assert overlong_penalty(lengths, max_length=20, buffer=20).tolist() == pytest.approx([-0.05, -0.5, -1.0])


def test_bad_values_name_the_field():
    lengths = torch.tensor([3])
    with pytest.raises(ValueError, match="overlong_buffer"):
        overlong_penalty(lengths, max_length=20, buffer=21)
    with pytest.raises(ValueError, match="overlong_penalty"):
        overlong_penalty(lengths, max_length=20, buffer=5, penalty=-1.0)
