"""Group-relative advantages (paper Eq. 2; docs/losses.md, "Group advantages").

``scale="group"`` (GRPO / STAPO): ``(R_i - mean_g R) / (std_g R + eps)`` with the unbiased std, as GRPO and
verl; ``scale="none"`` (Dr.GRPO): ``R_i - mean_g R``. A group of equal rewards gets exactly 0 (never NaN).
"""

from __future__ import annotations

import torch

__all__ = ["group_advantages"]

_SCALES = ("group", "none")


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-6
) -> torch.Tensor:
    """Advantages ``(N,)`` (fp32, fp64 for fp64 rewards) for consecutive groups of ``group_size`` rewards."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2 (a group needs a baseline), got {group_size!r}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"number of rewards ({rewards.numel()}) is not a multiple of group_size ({group_size})"
        )
    if scale not in _SCALES:
        raise ValueError(f"scale must be one of {_SCALES}, got {scale!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")

    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r = rewards.to(dtype).view(-1, group_size)  # (N/G, G)
    centered = r - r.mean(dim=1, keepdim=True)  # (N/G, G)
    # Exact equality, not a tolerance: any spread at all is a real signal (R is usually +-1).
    constant = (r == r[:, :1]).all(dim=1, keepdim=True)  # (N/G, 1)
    if scale == "group":
        std = r.std(dim=1, keepdim=True, unbiased=True)  # (N/G, 1)
        centered = centered / (std + eps)
    return torch.where(constant, torch.zeros_like(centered), centered).reshape(-1)  # (N,)
