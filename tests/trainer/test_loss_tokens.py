"""``stapo.trainer.update.loss_tokens``: the one place that composes the mask and the off-policy correction
into the loss's keep and token weights (docs/losses.md, "How they enter the loss"), hand-computed."""

from __future__ import annotations

import torch

from stapo.losses import CorrectionResult
from stapo.trainer.update import loss_tokens

T, F = True, False


def test_keep_is_mask_and_not_rejected_and_the_weight_is_mask_times_is():
    trainable = torch.tensor([[T, T, T, T, F]])  # the last token is padding (or loss.mask_truncated)
    keep = torch.tensor([[T, T, T, T, F]])
    mask_weights = torch.tensor([[2.0, 0.0, 1.0, 0.5, 0.0]])  # 0: the mask silenced token 1
    correction = CorrectionResult(weights=torch.tensor([[0.5, 3.0, 0.0, 4.0, 9.0]]),  # 0: IcePop's band
                                  rejected=torch.tensor([[F, F, F, T, F]]))  # token 3 rejected
    trainable, keep, weights = loss_tokens(trainable, keep, mask_weights, correction)
    assert trainable.tolist() == [[T, T, T, F, F]]  # rejected: out of the normalizer too
    assert keep.tolist() == [[T, F, T, F, F]]  # silenced and rejected leave; the IS zero (token 2) stays
    assert torch.where(keep, weights, 0.0).tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]  # 2 x 0.5, -, 1 x 0


def test_one_side_alone_is_passed_through_unchanged():
    trainable = keep = torch.tensor([[T, T, F]])
    mask_weights, is_weights = torch.tensor([[1.0, 1.3, 0.0]]), torch.tensor([[0.7, 2.0, 1.0]])
    no_rejection = torch.zeros(1, 3, dtype=torch.bool)
    assert loss_tokens(trainable, keep, mask_weights, None)[2] is mask_weights
    assert loss_tokens(trainable, keep, None, CorrectionResult(is_weights, no_rejection))[2] is is_weights
    assert loss_tokens(trainable, keep, None, CorrectionResult(None, no_rejection))[2] is None
