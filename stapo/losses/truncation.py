"""Truncated responses out of the loss (``loss.mask_truncated``; DAPO's overlong filtering, §3.4).

:func:`truncated_keep` is ANDed into ``keep`` BEFORE the normalizer is counted, so a cut response's tokens leave
numerator and denominator like silenced ones (docs/grpo_options.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["truncated_keep", "truncated_rows"]


def truncated_rows(finish_reason: Sequence[str]) -> torch.Tensor:
    """``(B,)`` bool: True where the engine stopped at the length limit (``"length"``)."""
    return torch.tensor([reason == "length" for reason in finish_reason], dtype=torch.bool)


def truncated_keep(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` bool: ``response_mask`` with every token of a truncated row set to False."""
    if response_mask.dim() != 2 or response_mask.dtype != torch.bool:
        raise ValueError(f"response_mask must be a bool (B, T) tensor, got {response_mask.dtype} "
                         f"{tuple(response_mask.shape)}")
    if truncated.shape != response_mask.shape[:1] or truncated.dtype != torch.bool:
        raise ValueError(f"truncated must be a bool (B,) = ({response_mask.shape[0]},) tensor, got "
                         f"{truncated.dtype} {tuple(truncated.shape)}")
    return response_mask & ~truncated.to(response_mask.device)[:, None]
