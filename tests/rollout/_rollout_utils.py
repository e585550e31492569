"""Test helper: logprobs of a rollout's response tokens from one teacher-forced forward pass."""

from __future__ import annotations

import torch

from stapo.rollout import Rollout
from stapo.rollout.sampling import processed_logprobs
from stapo.distributed.policy import PolicyInputs


def teacher_forced_logits(model, rollout: Rollout, grad: bool = False) -> torch.Tensor:
    """(B, T, V) logits that predict each response token, from the trainer's padded inputs builder."""
    inputs = PolicyInputs.from_parts(rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids,
                                     rollout.response_mask)
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                       position_ids=inputs.position_ids).logits
    start, t_len = inputs.prompt_length - 1, rollout.response_ids.shape[1]
    assert inputs.response_ids.shape[1] == t_len  # rollouts are padded to their longest response
    return logits[:, start: start + t_len]  # column Lp-1+t predicts response token t


def teacher_forced(model, rollout: Rollout, temperature=1.0, top_k=-1, top_p=1.0, grad: bool = False) -> torch.Tensor:
    """(B, T) processed logprobs of the response tokens under one teacher-forced forward."""
    pred = teacher_forced_logits(model, rollout, grad)
    dist = processed_logprobs(pred.flatten(0, 1), temperature, top_k, top_p).view_as(pred)
    return dist.gather(-1, rollout.response_ids.unsqueeze(-1)).squeeze(-1)


def assert_matches_teacher_forced(model, rollout: Rollout, atol: float = 1e-4, **kw) -> None:
    """Sampling logprobs equal the teacher-forced ones on valid tokens and are 0 on padding."""
    ref = teacher_forced(model, rollout, **kw)
    valid = rollout.response_mask
    torch.testing.assert_close(rollout.sampling_logprobs[valid], ref[valid], atol=atol, rtol=1e-4)
    assert (rollout.sampling_logprobs[~valid] == 0).all()
