"""Token selections that are global over the mini-batch on all ranks (docs/losses.md, "Token weights").

Picks are made in ONE global order (rank order, then row-major), so they do not depend on the split (the
released STARE and Clip-Cov code pick per micro-batch and rank).
"""

from __future__ import annotations

import torch

from stapo.losses.reduce import all_gather_variable, rank

__all__ = ["global_top_k", "global_random_pick", "rank_offset", "top_ratio_count"]


def top_ratio_count(n: int, ratio: float) -> int:
    """``max(1, ceil(ratio * n))`` as STARE's released code computes it, ``int(ratio * n + 0.999999)``: the
    float error of ``ratio * n`` adds no token (0.07 * 100 gives 7, not 8)."""
    if n <= 0:
        return 0
    return min(n, max(1, int(ratio * n + 0.999999)))


def rank_offset(local_count: int, device=None, group=None) -> tuple[int, int]:
    """``(offset, total)``: how many items the lower ranks hold, and all ranks together."""
    counts = all_gather_variable(torch.tensor([local_count], dtype=torch.long, device=device), group)
    me = rank(group)
    return int(counts[:me].sum()), int(counts.sum())


def _local_picks(candidates: torch.Tensor, picked_local: torch.Tensor) -> torch.Tensor:
    """Bool ``(B, T)``: the candidates (row-major order) whose local index is in ``picked_local``."""
    out = torch.zeros_like(candidates)
    positions = candidates.reshape(-1).nonzero().squeeze(1)  # row-major, as values[candidates]
    out.reshape(-1)[positions[picked_local]] = True
    return out


def global_top_k(values: torch.Tensor, candidates: torch.Tensor, ratio: float, group=None) -> torch.Tensor:
    """Bool ``(B, T)``: the ``top_ratio_count(n, ratio)`` candidates of largest ``values``, with ``n``
    the candidates of all ranks; ties at the k-th value go to the first in the global order."""
    local = values.detach()[candidates]  # (n_local,) row-major
    everyone = all_gather_variable(local, group)
    k = top_ratio_count(everyone.numel(), ratio)
    if k == 0:
        return torch.zeros_like(candidates)
    kth = everyone.sort(descending=True).values[k - 1]  # the k-th largest value
    ties_needed = k - int((everyone > kth).sum())  # >= 1
    local_ties = local == kth
    offset, _ = rank_offset(int(local_ties.sum()), local.device, group)
    tie_order = offset + torch.cumsum(local_ties.long(), 0) - 1  # global index among the ties
    picked = (local > kth) | (local_ties & (tie_order < ties_needed))
    return _local_picks(candidates, picked.nonzero().squeeze(1))


def global_random_pick(candidates: torch.Tensor, count: int, seed: int, group=None) -> torch.Tensor:
    """Bool ``(B, T)``: ``min(count, n)`` of the ``n`` candidates of all ranks, uniformly at random
    from ``torch.randperm(n)`` under a generator seeded with ``seed`` (the same on every rank)."""
    local_n = int(candidates.sum())
    offset, total = rank_offset(local_n, candidates.device, group)
    if total == 0 or count <= 0:
        return torch.zeros_like(candidates)
    generator = torch.Generator().manual_seed(int(seed))
    chosen = torch.randperm(total, generator=generator)[:count]  # global indices, CPU
    mine = chosen[(chosen >= offset) & (chosen < offset + local_n)] - offset
    return _local_picks(candidates, mine.to(candidates.device))
