"""loss.mask_truncated: rows that hit the length limit leave the loss and its normalizer."""

import pytest
import torch

from stapo.losses import clipped_surrogate_loss, truncated_keep, truncated_rows


def test_truncated_rows_and_keep():
    truncated = truncated_rows(["stop", "length", "stop"])
    assert truncated.tolist() == [False, True, False]
    response_mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    keep = truncated_keep(response_mask, truncated)
    assert keep.tolist() == [[True, True, False], [False, False, False], [True, False, False]]
    assert truncated_rows([]).shape == (0,)


def test_truncated_tokens_leave_numerator_and_denominator():
    # ratio 1, A = (1, 2, 3) per row -> per-token loss -A. Lengths 2, 3, 1; row 1 is truncated.
    response_mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    logprobs, adv = torch.zeros(3, 3), torch.tensor([1.0, 2.0, 3.0])
    plain, _ = clipped_surrogate_loss(logprobs, logprobs, adv, response_mask)
    assert plain.item() == pytest.approx((-1 * 2 - 2 * 3 - 3 * 1) / 6)  # -11/6
    keep = response_mask & truncated_keep(response_mask, torch.tensor([False, True, False]))
    loss, m = clipped_surrogate_loss(logprobs, logprobs, adv, keep)
    assert loss.item() == pytest.approx((-1 * 2 - 3 * 1) / 3)  # -5/3: 3 kept tokens
    assert m["kept_tokens"].item() == 3


def test_bad_shapes_name_the_argument():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="truncated must be a bool"):
        truncated_keep(mask, torch.tensor([True]))
    with pytest.raises(ValueError, match="response_mask must be a bool"):
        truncated_keep(mask.long(), torch.tensor([True, False]))
