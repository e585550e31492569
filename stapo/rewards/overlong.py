"""DAPO's soft overlong punishment (DAPO paper, Eq. 13), added to the verifier's score.

With ``L_max = rollout.max_response_length``, ``L_cache = reward.overlong_buffer`` and
``c = reward.overlong_penalty``::

    R_length(y) = 0                                   if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache * c   if L_max - L_cache < |y| <= L_max
                = -c                                  if |y| > L_max

i.e. ``clamp(((L_max - L_cache) - |y|) / L_cache, -1, 0) * c``: a linear ramp from 0 to ``-c`` over
the last ``L_cache`` tokens. ``L_cache = 0`` turns it off. Tensor methods only, so importing
``stapo.rewards`` stays torch-free (docs/grpo_options.md).
"""

from __future__ import annotations

__all__ = ["overlong_penalty"]


def overlong_penalty(lengths, max_length: int, buffer: int, penalty: float = 1.0):
    """``(B,)`` fp32 length penalty (<= 0) for response ``lengths`` ``(B,)`` (a torch tensor)."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if not 0 <= buffer <= max_length:
        raise ValueError(f"buffer (reward.overlong_buffer) must be in [0, max_length={max_length}], got {buffer}")
    if penalty < 0:
        raise ValueError(f"penalty (reward.overlong_penalty) must be >= 0, got {penalty}")
    lengths = lengths.float()
    if buffer == 0:
        return lengths * 0.0
    return ((max_length - buffer) - lengths).div(buffer).clamp(-1.0, 0.0).mul(penalty)
