"""Rollout-trainer mismatch: how far the sampler's token logprobs are from the trainer's (docs/losses.md,
"Off-policy corrections"); a weight sync that silently failed shows up here first.
"""

from __future__ import annotations

import torch

from stapo.losses.corrections import check_pair
from stapo.losses.reduce import masked_mean

__all__ = ["mismatch_sums"]


@torch.no_grad()
def mismatch_sums(sampling_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor,
                  mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """0-dim fp32 sums over the valid tokens of ``mask`` (0 with none); ``mismatch_abs_max`` reduces with max."""
    check_pair("sampling_logprobs", sampling_logprobs, "trainer_logprobs", trainer_logprobs, mask)
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    # where BEFORE arithmetic: padding may hold anything (inf, NaN) and must not leak into a sum
    d = torch.where(mask, trainer_logprobs.float() - sampling_logprobs.float(), zero)  # (B, T)
    abs_d = d.abs()
    rows = mask.any(dim=1)  # (B,)

    def ppl_sum(logprobs: torch.Tensor) -> torch.Tensor:  # sum over rows of exp(-mean_t log pi)
        return torch.where(rows, (-masked_mean(logprobs.float(), mask, dim=1)).exp(), zero).sum()

    return {
        "mismatch_abs_sum": abs_d.sum(),
        "mismatch_abs_max": abs_d.max() if abs_d.numel() else zero,
        "mismatch_k3_sum": torch.where(mask, d.exp() - d - 1.0, zero).sum(),
        "mismatch_k1_sum": -d.sum(),
        "mismatch_tokens": mask.sum().float(),
        "rollout_ppl_sum": ppl_sum(sampling_logprobs),
        "training_ppl_sum": ppl_sum(trainer_logprobs),
        "mismatch_seqs": rows.sum().float(),
    }

